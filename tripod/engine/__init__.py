"""The engine: one model on one machine (scheduler, model runner, sampler, the engine process; ``Engine`` in ``engine.py``)."""
