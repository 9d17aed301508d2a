"""Engine outputs → API answers, and the text knowledge both directions share.

``generation`` (token ids → text deltas, usage, latency; the response-body helpers both APIs
build on), ``text`` (the tokenizer, chat template, detokenizer and stop strings), ``reasoning``
(the thinking split from the answer), ``tools`` (tool definitions and the parsers of the model's
tool-call syntax) and ``conversation`` (messages and tools rendered into the prompt in that same
syntax, so what the model is shown is what its answer is parsed with). None of them knows an API
surface's request models (``tripod.server.api``).
"""
