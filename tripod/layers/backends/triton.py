"""The Triton kernels (``tripod.kernels.gpu``): the CUDA backend, and the same code in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``), where every CPU machine tests it.

- ``TritonBackend``: RMSNorm, SiLU·mul, fused RoPE + KV write and paged attention over the slot
  table (decode, chunked-prefill, prefix-hit and verify rows in one launch; sliding windows,
  soft-capped logits and attention sinks included); linears on cuBLAS (``F.linear``), stored
  quantized ones on the W4A16 / W8A16 / W8A8 INT8 kernels (``TritonOps.linear``).
- ``TritonLinearBackend``: the same norms and activations with torch's attention layout, for MLA
  models (whose decode rows run the Triton absorbed-MLA kernel through ``latent_attention``) and
  DeepSeek-V4's compressed attention (torch's ops).

Split-KV: the keys are cut at fixed multiples of ``split_keys``, so how a token's softmax is
reduced depends on its own length only, never on the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from tripod.kernels import gpu
from tripod.layers.activation import activate
from tripod.layers.backends.cpu import slot_table_batch
from tripod.layers.backends.reference import ReferenceBackend
from tripod.layers.batch import AttnSpec, Backend, BatchContext, ForwardBatch, StepItem, upload
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight, make_linear
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.w8a8 import W8A8_KINDS, W8A8Linear, quantize_per_token, quantize_static
from tripod.memory.kv_pool import KVPool

SPLIT_KEYS = 256  # keys per split-KV split (a multiple of every head dim's key block)


class W4A16Linear:
    """An int4 linear on the Triton W4A16 kernel (``kernels/gpu/w4a16.py``): it owns the packed
    codes, scales and zero points (made once at load) and the bias."""

    def __init__(self, ops: Any, packed: Any, bias: torch.Tensor | None) -> None:
        self.ops, self.packed, self.bias = ops, packed, bias
        self.run = ops.w4a16_linear

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.run(x, self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y


class W8A16Linear(W4A16Linear):
    """An 8-bit linear (W8A16 per group or channel, symmetric or with zero points; NVFP4A16) on the
    Triton W8A16 kernel (``kernels/gpu/w8a16.py``): it owns the codes, group scales and zero points
    (read once at load) and the bias."""

    def __init__(self, ops: Any, packed: Any, bias: torch.Tensor | None) -> None:
        super().__init__(ops, packed, bias)
        self.run = ops.w8a16_linear


class TritonW8A8Linear(W8A8Linear):
    """A W8A8 INT8 linear with its code products on the Triton kernel (``kernels/gpu/w8a8.py``):
    the activations are quantized and the products scaled exactly as ``W8A8Linear`` does on the CPU
    (its functions, its float64 epilogue); only ``torch._int_mm`` is replaced by the int32 tensor-core
    sum, which holds the same integers, so the result has the CPU path's bits. Owns what
    ``W8A8Linear`` owns (codes, scales, static segments, bias) on the GPU, and the kernels' handle."""

    def __init__(self, ops: Any, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 input_scales: torch.Tensor | None) -> None:
        super().__init__(codes, scales, "int8", bias, input_scales)
        self.ops = ops

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.segments:
            q, sx = quantize_per_token(x, self.kind)
            acc = self.ops.int8_product(q, self.codes).to(torch.float64)
            y = (acc * (sx.to(torch.float64) * self.scales)).to(x.dtype)
        else:  # a fused projection's parts may each have their own static scale (W8A8Linear.segments)
            parts = []
            for a, b, s in self.segments:
                acc = self.ops.int8_product(quantize_static(x, s, self.kind), self.codes[a:b]).to(torch.float64)
                parts.append(acc * (s.to(torch.float64) * self.scales[a:b]))
            y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y


_KERNEL_NAMES = (  # (linear type, what /v1/models says computes it), in the order they are listed
    (W4A16Linear, "the Triton W4A16 kernel (int4 codes, float32 sums)"),
    (W8A16Linear, "the Triton W8A16 kernel (8-bit / FP4 codes, float32 sums)"),
)


def computed_by(model: Any, form: str) -> str:
    """What computes ``model``'s projections in ``form`` on the Triton backend, for the model card's
    ``quantization_detail.computed_by`` (the loader's card names the CPU paths)."""
    found: set[str] = set()
    for mod in model.modules():
        ops = getattr(mod, "ops", None)
        for op in (ops.get(form) or ()) if isinstance(ops, dict) else ():
            if isinstance(op, TritonW8A8Linear):
                found.add("the Triton int8 x int8 -> int32 kernel (W8A8, exact)")
            for kind, name in _KERNEL_NAMES:
                if type(op) is kind:
                    found.add(name)
    return "; ".join([*sorted(found), "cuBLAS on the other weights, dequantized at load"])


class TritonOps:
    """The op families both Triton backends take from the kernels."""

    ops: Any
    split_keys: int = SPLIT_KEYS

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear | W4A16Linear | W8A16Linear | TritonW8A8Linear:
        # An int4 weight stored with its group scales and zero points (--weights stored on an AWQ / GPTQ /
        # compressed-tensors folder) runs on the W4A16 kernel, an 8-bit one (W8A16 symmetric: the Q6_K
        # form, NVFP4A16 too; with zero points: the two 4-bit halves) on the W8A16 kernel, a W8A8 INT8 one
        # on the int8 kernel; every other weight on cuBLAS, dequantized.
        if stored is not None and W8A8_KINDS.get(stored.kind) == "int8":
            assert stored.scales is not None
            dev = weight.device

            def mv(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.to(dev)

            return TritonW8A8Linear(self.ops, stored.blocks.to(dev), stored.scales.to(dev), bias,
                                    mv(stored.input_scales))
        if stored is not None and stored.kind.startswith(("W8A8", "W4A4")):
            # FP8's exact sums need float64 (the CPU path's); Triton's FP8 dot accumulates in float32
            raise ValueError("FP8 W8A8 and NVFP4 W4A4 checkpoints (activations quantized as they say) run on the CPU "
                             "for now (--device cpu); the Triton backend runs W8A8 INT8 only (its FP8 dot sums in "
                             "float32, not the exact float64 sums of the CPU path)")
        if (stored is not None and stored.kind == "Q4_K" and not stored.packed and fp8 is None
                and stored.shape[1] == weight.shape[1]):
            n, k = stored.shape
            packed = self.ops.from_group_blocks(stored.blocks, n, k, stored.perm)
            if packed is not None:
                return W4A16Linear(self.ops, packed.to(weight.device), bias)
        if (stored is not None and stored.kind == "Q6_K" and not stored.packed and fp8 is None
                and stored.shape[1] == weight.shape[1]):
            n, k = stored.shape
            packed8 = self.ops.from_q8_blocks(stored.blocks, n, k, stored.perm)
            if packed8 is not None:
                return W8A16Linear(self.ops, packed8.to(weight.device), bias)
        if (stored is not None and stored.kind == "Q4_K" and not stored.packed and fp8 is None
                and stored.shape[1] == 2 * weight.shape[1]):  # 8-bit with zero points: the two 4-bit halves
            n, k = stored.shape[0], weight.shape[1]
            packed8 = self.ops.from_q8_halves(stored.blocks, n, k, stored.perm)
            if packed8 is not None:
                return W8A16Linear(self.ops, packed8.to(weight.device), bias)
        return make_linear(weight, bias, "dense", fp8=fp8)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self.ops.rms_norm(rows, weight, eps)[0].view(shape)

    def activate(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        if act == "silu" and gu.stride(-1) == 1:
            return self.ops.silu_mul(gu, inter)
        return activate(gu, inter, act)  # GELU has no kernel: torch's op

    def latent_attention(self, q: torch.Tensor, latents: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor,
                         rank: int, scale: float) -> torch.Tensor | None:
        width = idx.shape[1]
        splits = -(-width // self.split_keys)
        keys = self.split_keys if splits > 1 else max(32, -(-width // 32) * 32)
        return self.ops.mla_decode(q.contiguous(), latents, idx, lens, rank, scale, split_keys=keys, splits=splits)

    recurrent_kernels = True
    # the last step's item table: every linear layer of a step reads the same ``StateRows.items``
    _items: tuple[list[tuple[int, int, int]], torch.Tensor] | None = None

    def _item_table(self, items: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        if self._items is None or self._items[0] is not items:
            self._items = (items, upload([v for it in items for v in it], torch.int32, device).view(-1, 3))
        return self._items[1]

    def causal_conv(self, x: torch.Tensor, window: torch.Tensor, items: list[tuple[int, int, int]],
                    weight: torch.Tensor, bias: torch.Tensor | None,
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        assert keep is None, "the Triton recurrence kernels keep no per-row states (speculation is refused)"
        return self.ops.conv_update(x, window, self._item_table(items, x.device), weight, bias)

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor, items: list[tuple[int, int, int]],
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        assert keep is None, "the Triton recurrence kernels keep no per-row states (speculation is refused)"
        assert decay.dim() == 2, "the Triton delta rule takes one decay per head (KDA is refused on Triton)"
        return self.ops.gated_delta(q, k, v, decay, beta, state, self._item_table(items, q.device))

    def ssd_scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
                 state: torch.Tensor, items: list[tuple[int, int, int]],
                 keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        assert keep is None, "the Triton recurrence kernels keep no per-row states (speculation is refused)"
        return self.ops.ssd_scan(x, b, c, dt, decay, state, self._item_table(items, x.device))

    def card(self) -> dict[str, Any]:
        return {"backend": "triton", "isa": None, "interpret": gpu.interpreting(), "device": self.device}

    device: str = "cuda"


class TritonBackend(TritonOps, Backend):
    """Every op but the linears on the Triton kernels, attention through the slot table."""

    name = "triton"
    form = "dense"
    wants_rope_rows = False

    def __init__(self, device: torch.device, group: int, split_keys: int = SPLIT_KEYS) -> None:
        self.ops = gpu.ops()
        self.device = str(device)
        self.split_keys = split_keys
        self.group = group  # query heads per KV head: the query tile's shape
        self.block_m = {many: self.ops.tile(group, many)[0] for many in (False, True)}

    def attend(self, qkv: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        m = batch.kernel
        assert m is not None and m.blocks is not None
        t, d = qkv.shape[0], pool.head_dim
        nh, nkv = spec.num_heads, spec.num_kv_heads
        kv = pool.kv[layer]
        if qkv.stride(1) != 1 or qkv.stride(0) != qkv.shape[1]:
            qkv = qkv.contiguous()
        pos, cos, sin = batch.rope_table or (batch.positions, rotary.cos, rotary.sin)  # (M-RoPE: by row)
        self.ops.rope_store_kv(qkv, pos, cos, sin, kv, batch.out_slots, nh, nkv)
        q = qkv.view(t, -1, d)[:, :nh]
        width = m.table.shape[1]
        splits = -(-width // self.split_keys)
        keys = self.split_keys if splits > 1 else -(-width // 32) * 32
        sinks = spec.sinks.float().contiguous() if spec.sinks is not None else None
        out = self.ops.paged_attention(q, kv, m.table, m.rows, m.lens, m.blocks, m.block_m, spec.scale,
                                       split_keys=keys, splits=splits, window=spec.window, softcap=spec.softcap,
                                       sinks=sinks)
        return out.view(t, nh * d)

    def build_batch(self, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
        """The slot-table layout, with the query blocks: one per decode, runs of a tile's tokens
        for longer items (decode-only steps get the small tile)."""
        batch, sampling = slot_table_batch(self, items, ctx)
        m = batch.kernel
        assert m is not None
        bm = self.block_m[any(it.length > 1 for it in items)]
        starts = [first for _, first in batch.item_rows]
        counts = [it.length for it, _ in batch.item_rows]
        m.blocks = upload(self.ops.query_blocks(starts, counts, bm), torch.int32, ctx.device).view(-1, 2)
        m.block_m = bm
        return batch, sampling

    def describe(self) -> str:
        where = "Triton's interpreter on the CPU" if gpu.interpreting() else self.device
        return f"Triton kernels (paged attention, RoPE + KV write, RMSNorm, SiLU·mul; cuBLAS linears) on {where}"


class TritonLinearBackend(TritonOps, ReferenceBackend):
    """The Triton norms and activations (and MLA's absorbed decode) with torch's attention layout,
    for the models whose attention the paged kernel does not cover (``reason`` says which)."""

    name = "triton"
    form = "dense"

    def __init__(self, device: torch.device, reason: str, split_keys: int = SPLIT_KEYS) -> None:
        super().__init__(reason)
        self.ops = gpu.ops()
        self.device = str(device)
        self.split_keys = split_keys

    def card(self) -> dict[str, Any]:
        return {**TritonOps.card(self), "attention": "torch", "reason": self.reason}

    def describe(self) -> str:
        where = "Triton's interpreter on the CPU" if gpu.interpreting() else self.device
        return f"Triton kernels (RMSNorm, SiLU·mul, MLA decode) with torch's attention on {where} ({self.reason})"
