"""tripod: mission-critical LLM inference."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "StreamDelta", "__version__"]

if TYPE_CHECKING:
    from tripod.config import EngineConfig
    from tripod.engine.engine import Engine
    from tripod.engine.request import RequestOutput, SamplingParams, StreamDelta


def __getattr__(name: str) -> object:
    # Lazy: `import tripod` stays cheap (the CLI's --help must not import torch).
    if name == "Engine":
        from tripod.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from tripod.config import EngineConfig

        return EngineConfig
    if name in ("SamplingParams", "RequestOutput", "StreamDelta"):
        from tripod.engine import request

        return getattr(request, name)
    raise AttributeError(f"module 'tripod' has no attribute {name!r}")
