"""``/health``: what a tripod server answers, and what a router reads of any server's answer.

A tripod server answers ``Healthy`` (200) or ``Unhealthy`` (503: draining, or its engine dead). The
router probes servers that may not be tripod (vLLM answers an empty 200), so it decodes only the part
it uses, ``HealthProbe``, leniently: fields it does not know are ignored, and a body that is not
that shape means "not a tripod server" (no failover continuation), never an error.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Healthy(msgspec.Struct, kw_only=True):
    status: Literal["ok"] = "ok"
    model: str
    engine_pid: int | None
    running: int
    waiting: int
    # The router continues this server's answers on another replica when it fails
    # (tripod_failover / tripod_continuation on the OpenAI routes).
    continuation: bool = True
    # Prefill/decode disaggregation (server/api/pd.py): "prefill" | "decode" | "both".
    role: str = "both"
    # The disk tier's directory as host:DIR/<identity> (--kv-disk): replicas that report the same
    # one share it, which the router counts in its cache estimate.
    kv_tier: str | None = None


class Unhealthy(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["dead", "draining"]
    reason: str | None = None


class HealthProbe(msgspec.Struct):
    """The router's reading of a 200 ``/health``."""

    continuation: bool = False
    model: str | None = None
    role: str = "both"
    kv_tier: str | None = None


def encode(answer: Healthy | Unhealthy) -> bytes:
    return msgspec.json.encode(answer)


def probe(body: bytes) -> HealthProbe:
    """What a 200 ``/health`` body says, as far as the router uses it (defaults for anything else)."""
    try:
        return msgspec.json.decode(body, type=HealthProbe)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return HealthProbe()
