"""The OpenAI/Anthropic-compatible server: an HTTP process and an engine process joined by ZMQ.

``app`` (the HTTP shell) and ``state`` (what it holds), ``errors`` (each API's error shape),
``api/`` (one module per surface: routes and request models), ``answer/`` (engine outputs → API
answers: generation, text, reasoning, tools), ``engine_client`` (the ZMQ link to the engine
process, spawned as ``python -m tripod.engine.process``), ``launch`` (``tripod serve``),
``metrics``, ``traces``, ``console_source``. The server never imports ``tripod.engine``.
"""
