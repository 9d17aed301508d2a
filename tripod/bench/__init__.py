"""`tripod bench`: throughput-vs-interactivity benchmarks of OpenAI-compatible servers."""
