"""The data every compute backend reads, and the backend interface that reads it.

A step's work reaches the layers as one ``ForwardBatch``: flat token rows with their positions
and KV slots, the attention metadata of the backend that laid them out, and that ``Backend``
itself. A backend's ``build_batch`` makes the batch from the scheduler's items (read through the
``StepItem``/``StepReq`` protocols) and the model runner's ``BatchContext`` (device, decode mirror,
slot table).

``Backend`` lives here, beside the data it consumes, because the two name each other (a batch
carries its backend; a backend builds and attends over batches): one module keeps them free of
an import circle. The implementations (``layers/backends``) and the layers import this module;
it imports neither.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from tripod.layers.linear import Fp8Scales, Linear, StoredWeight
from tripod.layers.lora import LoraAdapter, LoraBatch
from tripod.layers.parallel import DPLayout
from tripod.layers.rotary import RotaryEmbedding
from tripod.memory.decode_mirror import DecodeMirror
from tripod.memory.kv_pool import KVPool
from tripod.memory.slot_table import SlotTable
from tripod.memory.state_pool import StatePool, StateTrace


def upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``. On a GPU through pinned memory without waiting: a
    plain copy from pageable memory waits for the stream's queued kernels, which would make a step
    laid out during the previous one's forward (engine/overlap.py) wait for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)

@dataclass(frozen=True, slots=True)
class AttnSpec:
    """One attention layer's shape and rules."""

    num_heads: int
    num_kv_heads: int
    scale: float
    window: int | None = None  # sliding window: a query at p sees keys p - window + 1 .. p
    softcap: float | None = None  # scores -> tanh(scores / cap) * cap before the softmax
    # Attention sinks (gpt-oss): a learned logit per head joining the softmax's denominator (a
    # virtual key whose value is zero), so a query may attend to "nothing".
    sinks: torch.Tensor | None = field(default=None, compare=False)


@dataclass(slots=True)
class PrefillSegment:
    """One prefill chunk of the flat batch, as torch's attention path reads it."""

    start: int  # first token of the chunk in the flat batch
    length: int  # tokens in the chunk
    prefix_len: int  # tokens before the chunk whose KV is already in the pool
    kv_slots: torch.Tensor | None  # [prefix_len + length] slots; None when prefix_len == 0
    mask: torch.Tensor | None  # [length, prefix_len + length] bool; None when prefix_len == 0
    # Keys a query sees beyond the causal rule: [length, prefix_len + length] bool, True where both
    # are tokens of one image (Gemma 3's bidirectional image spans); None: causal only.
    bidir: torch.Tensor | None = None


@dataclass(slots=True)
class ImageRows:
    """A step's image features: flat batch ``rows`` whose token embeddings are replaced by
    ``embeds`` (``[len(rows), hidden]``, one row each) before the first layer."""

    rows: torch.Tensor  # [N] long
    embeds: torch.Tensor  # [N, hidden]

    def splice(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, self.rows, self.embeds.to(x.dtype))


@dataclass(slots=True)
class StateRows:
    """A hybrid model's step over its recurrent states: the state pool and, per scheduled item,
    ``(first flat row, tokens, state slot)``. Each item's tokens continue its sequence's state."""

    pool: StatePool
    items: list[tuple[int, int, int]]
    # Verify items (speculation, jump-forward): their states after every row, kept until the
    # drafts are judged (``StateTrace.settle`` rolls a rejection back); None: no verify item.
    trace: StateTrace | None = None

    def kept_rows(self) -> KeptRows | None:
        """Where a recurrence kernel writes the per-row states of this step's traced items (the
        verify items ``trace`` wants); None: no item is traced."""
        if self.trace is None:
            return None
        rows, total = [], 0
        for _, n, slot in self.items:
            if self.trace.wants(slot):
                rows.append(total)
                total += n + 1
            else:
                rows.append(-1)
        return KeptRows(rows, total) if total else None


@dataclass(frozen=True, slots=True)
class KeptRows:
    """A kernel's per-row states of a step's traced items, in one buffer per state tensor
    ``[total, *shape]``: item ``i`` (in ``StateRows.items`` order) with ``rows[i] >= 0`` gets its
    state before its first token at row ``rows[i]`` and after its ``r``-th token at ``rows[i] + r``
    (the kernel writes them: copies of the state its own recurrence carries on). -1: not traced."""

    rows: list[int]
    total: int

    def buffer(self, state: torch.Tensor) -> torch.Tensor:
        """An empty buffer for the per-row copies of the pool's ``state`` ``[slots, *shape]``."""
        return torch.empty(self.total, *state.shape[1:], dtype=state.dtype, device=state.device)

    def put(self, states: StateRows, layer: int, buffers: list[torch.Tensor]) -> None:
        """Hand linear layer ``layer``'s filled ``buffers`` (one per state tensor) to the step's trace."""
        assert states.trace is not None
        for (_, n, slot), row in zip(states.items, self.rows, strict=True):
            if row >= 0:
                states.trace.put(layer, slot, [b[row : row + n + 1] for b in buffers])


@dataclass(slots=True)
class KernelMeta:
    """What the C++ attention needs: query ``t`` attends ``table[rows[t], :lens[t]]``."""

    table: torch.Tensor  # [requests, width] int32 slot ids (memory.SlotTable)
    rows: torch.Tensor  # [T] int32
    lens: torch.Tensor  # [T] int32: position + 1
    # The Triton kernels' query blocks: [NB, 2] int32 (first token, tokens) of runs of at most
    # ``block_m`` consecutive tokens of one request (None: the CPU kernels, which need none).
    blocks: torch.Tensor | None = None
    block_m: int = 1


class StepReq(Protocol):
    """What a step's batch is built from, of a request (``engine.request.Req``)."""

    prompt_ids: list[int]
    output_ids: list[int]
    slots: list[int]
    slots_version: int
    state_slot: int | None  # a hybrid model's recurrent-state slot (memory/state_pool.py)

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def adapter(self) -> LoraAdapter | None:
        """Its resident LoRA adapter (None: the base model), read for the batch's ``LoraBatch`` rows."""
        ...


class StepItem(Protocol):
    """One scheduled piece of work (``engine.scheduler.ScheduledItem``): tokens
    ``[start, start + length)`` of ``req``; ``verify``: every position predicts the next token."""

    req: StepReq
    start: int
    length: int
    verify: bool

    @property
    def samples(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What a backend's ``build_batch`` reads of the model runner, which makes it once (none of
    it changes while the runner lives): the device the batch's tensors go to, the decode mirror
    (None: decodes gather their K/V from the pool) and the slot table (None: the runner never
    runs the kernels' attention). Mirror and table are the runner's own mutable objects: a
    builder syncs them with the step's requests."""

    device: torch.device
    mirror: DecodeMirror | None = None
    table: SlotTable | None = None


@dataclass(slots=True)
class ForwardBatch:
    """Everything a forward pass needs, as tensors on the model's device, and the backend that
    computes it."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot each token's K/V is written to
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_kv_idx: torch.Tensor | None  # [num_decode, L] slots, padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, L] bool, True = attend
    # What this step computes with: the projections' prepared form, norms, activations and
    # attention (the backend that laid the batch out reads its own metadata below).
    backend: Backend
    prefills: list[PrefillSegment] = field(default_factory=list)
    # [layers, rows, len, 2, KVH, D]: decode rows in batch order (see DecodeMirror); when set,
    # decodes read it instead of gathering decode_kv_idx from the pool.
    decode_mirror: torch.Tensor | None = None
    logits_idx: torch.Tensor | None = None  # [S] flat positions whose logits are wanted
    # Jump-forward verification, right after the decodes: (flat start, first position, rows,
    # KV slots [first position + rows]). Each row is one query position attending exactly like
    # a lone decode at that position (same width, same kernel), so its numerics are those of
    # plain decoding: SDPA's result depends on how far the keys are padded.
    verifies: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    # Set when this step runs on tripod's CPU kernels (then the torch-path fields are unused).
    kernel: KernelMeta | None = None
    # (item, first flat row) of every scheduled item, whose tokens are contiguous rows: what a
    # reader of per-token outputs (the MTP proposer reads hidden states) needs to find its rows.
    item_rows: list[tuple[StepItem, int]] = field(default_factory=list)
    # Data-parallel attention: this rank's rows among the group's (layers/parallel.DPLayout).
    dp: DPLayout | None = None
    # Pipeline parallel: the step's further micro-batches (other requests), run after this one
    # so that the stages overlap; their logits rows follow this batch's. Same backend.
    micro: list[ForwardBatch] = field(default_factory=list)
    # LoRA adapters: each adapter's rows get its delta after every targeted projection; None
    # when every row runs the base model.
    lora: LoraBatch | None = None
    # Vision-language models: image features spliced over their placeholder tokens' embeddings.
    images: ImageRows | None = None
    # RoPE per row instead of by position (M-RoPE: Qwen2.5-VL's 3-D positions): (index [T] into the
    # tables, cos [T, D], sin [T, D]) in float32; every backend rotates with these when set.
    rope_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Hybrid models (linear-attention layers): each item's state slot (``layers/gated_delta.py``).
    states: StateRows | None = None

    def detached(self) -> ForwardBatch:
        """A copy for another rank of the group: no backend (``UNBOUND``: the receiving rank
        ``bind``s its own), none of what only this process reads (``item_rows``: this process's
        items; ``decode_mirror``: this process's buffer); the micro-batches likewise."""
        return dataclasses.replace(self, backend=UNBOUND, item_rows=[], decode_mirror=None,
                                   micro=[m.detached() for m in self.micro])

    def bind(self, backend: Backend) -> None:
        """Compute this batch and its micro-batches with ``backend`` (a receiving rank's own)."""
        self.backend = backend
        for m in self.micro:
            m.bind(backend)


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
    def attend(self, qkv: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        """After the QKV projection (and q/k norms): rotate Q/K, write this step's K/V into the
        pool, attend. ``qkv`` ``[T, (H + 2 KVH) * D]`` → ``[T, H * D]``."""
        raise NotImplementedError

    @abstractmethod
    def build_batch(self, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
        """Lay out a step's ``items`` for this backend, on ``ctx``'s device (syncing its decode
        mirror or slot table). Returns the batch and the sampling items in the order of the
        logits rows."""
        raise NotImplementedError

    def latent_attention(self, q: torch.Tensor, latents: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor,
                         rank: int, scale: float) -> torch.Tensor | None:
        """MLA's absorbed decode: rows ``q`` ``[B, H, rank + rope]`` over a layer's latent pool
        ``latents`` ``[S, row]``, row ``b`` attending slots ``idx[b, :lens[b]]`` → ``[B, H, rank]``.
        None: this backend has no kernel for it, and the layer runs torch's ops."""
        return None

    # Whether ``causal_conv``/``gated_delta``/``ssd_scan`` run kernels (the hybrid mixers' token
    # recurrences over the state pool's slots); False: the mixers run their torch code.
    recurrent_kernels: bool = False

    def causal_conv(self, x: torch.Tensor, window: torch.Tensor, items: list[tuple[int, int, int]],
                    weight: torch.Tensor, bias: torch.Tensor | None,
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The causal depthwise conv + SiLU of rows ``x`` ``[T, C]``, each item ``(first row,
        tokens, slot)`` continuing the window ``window[slot]`` ``[C, K - 1]`` (updated in place)
        → ``[T, C]`` float32. ``keep``: ``KeptRows.rows`` and a buffer ``[R, C, K - 1]`` that
        receives the traced items' windows before and after each row. Only where ``recurrent_kernels``."""
        raise NotImplementedError(f"the {self.name} backend has no recurrent kernels")

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor, items: list[tuple[int, int, int]],
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The gated delta rule over each item's tokens from its slot of ``state`` ``[slots, HV, DK,
        DV]`` (updated in place): ``q``/``k`` ``[T, HK, DK]`` normalized, ``v`` ``[T, HV, DV]``,
        ``decay``/``beta`` ``[T, HV]`` (``decay`` ``[T, HV, DK]``: one per key channel, KDA; the CPU
        kernels only) → ``[T, HV, DV]`` float32. ``keep``: as ``causal_conv``'s,
        the buffer ``[R, HV, DK, DV]``. Only where ``recurrent_kernels``."""
        raise NotImplementedError(f"the {self.name} backend has no recurrent kernels")

    def ssd_scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
                 state: torch.Tensor, items: list[tuple[int, int, int]],
                 keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Mamba2's recurrence over each item's tokens from its slot of ``state`` ``[slots, H, P, N]``
        (updated in place): ``x`` ``[T, H * P]``, ``b``/``c`` ``[T, G * N]``, ``dt``/``decay`` ``[T, H]``
        → ``[T, H, P]`` float32 (without ``D x``). ``keep``: as ``causal_conv``'s, the buffer
        ``[R, H, P, N]``. Only where ``recurrent_kernels``."""
        raise NotImplementedError(f"the {self.name} backend has no recurrent kernels")

    def card(self) -> dict[str, Any]:
        """What ``/v1/models`` and the engine stats report: backend, ISA level, and why."""
        out: dict[str, Any] = {"backend": self.name, "isa": self.isa}
        if self.reason:
            out["reason"] = self.reason
        return out

    @abstractmethod
    def describe(self) -> str:
        raise NotImplementedError


class UnboundBackend(Backend):
    """The backend of a batch on its way to another rank (``ForwardBatch.detached``): a backend
    holds this process's prepared kernels and cannot travel, so the receiving rank binds its own
    before computing (``ForwardBatch.bind``). Computing with this one is a bug: it raises."""

    name = "unbound"
    form = "unbound"

    def _unbound(self) -> NoReturn:
        raise RuntimeError("this batch was sent to another rank without its backend: bind one first")

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear:
        self._unbound()

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self._unbound()

    def activate(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        self._unbound()

    def attend(self, qkv: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        self._unbound()

    def build_batch(self, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
        self._unbound()

    def describe(self) -> str:
        return "unbound (a batch in transit to another rank)"


UNBOUND = UnboundBackend()
