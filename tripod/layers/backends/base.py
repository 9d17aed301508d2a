"""The interface every compute backend implements (see ``tripod.layers.backends``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tripod.layers.attention import AttnSpec, ForwardBatch
    from tripod.layers.linear import Fp8Scales, Linear, StoredWeight
    from tripod.layers.rotary import RotaryEmbedding


class StepReq(Protocol):
    """What a backend's batch builder reads of a request."""

    prompt_ids: list[int]
    output_ids: list[int]
    slots: list[int]
    slots_version: int

    @property
    def all_ids(self) -> list[int]: ...


class StepItem(Protocol):
    """One scheduled piece of work (``engine.scheduler.ScheduledItem``): tokens
    ``[start, start + length)`` of ``req``; ``verify``: every position predicts the next token."""

    req: StepReq
    start: int
    length: int
    verify: bool

    @property
    def samples(self) -> bool: ...


class Backend(ABC):
    """One way of computing a forward pass. ``form`` keys the projections a layer prepared for
    this backend (``Layer.ops[form]``); ``name``/``isa`` are what ``/v1/models`` reports."""

    name: str = "reference"
    isa: str | None = None
    form: str = "dense"
    # Whether layers hand ``attend`` RoPE cos/sin rows gathered per token (torch's path), or the
    # backend reads the rotary tables itself (the kernels).
    wants_rope_rows: bool = True
    reason: str | None = None  # why this backend and not tripod's kernels (None: nothing to say)

    @abstractmethod
    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear:
        raise NotImplementedError

    @abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of every head: ``x`` ``[T, heads, head_dim]`` (any strides) → same shape."""
        t, h, d = x.shape
        return self.norm(x.reshape(t * h, d), weight, eps).view(t, h, d)

    @abstractmethod
    def activate(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def attend(self, qkv: torch.Tensor, layer: int, pool: Any, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        """After the QKV projection (and q/k norms): rotate Q/K, write this step's K/V into the
        pool, attend. ``qkv`` ``[T, (H + 2 KVH) * D]`` → ``[T, H * D]``."""
        raise NotImplementedError

    @abstractmethod
    def build_batch(self, items: list[StepItem], ctx: Any) -> tuple[ForwardBatch, list[StepItem]]:
        """Lay out a step's ``items`` (``StepItem``) for this backend; ``ctx`` is the model
        runner (device, slot table, decode mirror). Returns the batch and the sampling items in
        the order of the logits rows."""
        raise NotImplementedError

    def card(self) -> dict[str, Any]:
        """What ``/v1/models`` and the engine stats report: backend, ISA level, and why."""
        out: dict[str, Any] = {"backend": self.name, "isa": self.isa}
        if self.reason:
            out["reason"] = self.reason
        return out

    @abstractmethod
    def describe(self) -> str:
        raise NotImplementedError
