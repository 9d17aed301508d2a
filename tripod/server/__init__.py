"""The OpenAI-compatible server: an HTTP process and an engine process joined by ZMQ."""
