"""Linear projections: ``y = x @ W.T (+ bias) (+ residual)`` with ``W`` held in the form its kernel
wants, prepared once when the model is loaded (``Form``).

- ``dense``: ``F.linear`` on the plain weight. The float32 reference path (op for op with Hugging
  Face) and CUDA (cuBLAS needs nothing else).
- ``onednn``: oneDNN's packed layout (``mkldnn._reorder_linear_weight`` once, instead of the
  reorder plain ``F.linear`` does on every call, which caps small-batch decode at 5-15 GB/s), the
  residual add fused as oneDNN's sum post-op. The CPU path while tripod's kernels are building, or
  where they cannot be built.
- ``kernel``: tripod's own CPU kernel over weights packed for it (``tripod/kernels/csrc/linear.cpp``):
  bfloat16 (``vdpbf16ps``) or float32. Every output is summed in the same order whatever the number
  of rows, so a row's result never depends on the rest of the batch (see docs/performance.md, "Compute paths").
- ``stored``: like ``kernel``, but GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K weights executed as stored
  (``--weights stored``): 18 / 20 / 34 bytes per 32 weights for Q4_0 / Q4_1 / Q8_0 (~0.28 / 0.31 / 0.53 of
  bfloat16's 64; Q4_K 24, Q6_K 40 after their rewrite at load), with exactly the dequantized
  weights; the activations of the run dtype (bfloat16: each activation x code product is exact, summed by
  ``vdpbf16ps`` or in its order; float32: float32 FMA).

Whatever the form, a weight kept in block-wise FP8 (``--weights fp8`` on a DeepSeek-format
checkpoint) runs as ``Fp8BlockLinear``: FP8 in memory, each band of block rows dequantized to the
activations' dtype inside the call (w8a16), never the whole matrix at once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch
import torch.nn.functional as F

from tripod.layers.fp8 import (
    FP8_DTYPES,
    Fp8BlockLinear,
    Fp8ScaledLinear,
    Fp8Scales,
    dequantize_fp8,
    report_fp8,
)
from tripod.layers.fp8 import unsupported_reason as fp8_unsupported_reason
from tripod.layers.w4a4 import W4A4Linear
from tripod.layers.w8a8 import W8A8_KINDS, W8A8Linear

__all__ = ["FP8_DTYPES", "Fp8BlockLinear", "Fp8ScaledLinear", "Fp8Scales", "dequantize_fp8"]

Form = Literal["dense", "onednn", "kernel", "stored"]


@dataclass(frozen=True, slots=True)
class StoredWeight:
    """A weight as the GGUF file stores it (or rewritten with exactly its values,
    ``loader/stored.py``): ``blocks`` uint8 ``[N, K / 32 * block bytes]``."""

    kind: str  # "Q4_0" | "Q4_1" | "Q8_0" | "Q4_K" | "Q6_K" (loader/stored.py: Q5_0 arrives as Q8_0)
    blocks: torch.Tensor
    shape: tuple[int, int]  # (N, K)
    # The blocks' input order as a permutation of the activations' (act-order GPTQ / compressed-
    # tensors groups made contiguous at load, ``loader/hf_quant.py``): the linear reads x[:, perm].
    perm: torch.Tensor | None = None
    # ``blocks`` already in the CPU kernels' packed layout (``pack_linear``'s output, the same bytes at
    # every ISA level): kept so after the stored form is built, the model's one copy of the codes is
    # the one the kernels read (``LlamaForCausalLM.release_dense_stored``).
    packed: bool = False
    # W8A8 kinds (``layers/w8a8.py``): ``blocks`` holds the int8 / float8 codes [N, K] as stored and
    # these are the weight scales, float32 [N]. W4A4_NVFP4 (``layers/w4a4.py``): ``blocks`` int8
    # ``2 · fp4`` [N, K], scales float32 [N, K / 16] and ``input_scales`` the activations' global scale per row.
    scales: torch.Tensor | None = None
    # W8A8 with static activation scales: each output row's activation scale, float32 [N] (a fused
    # projection's parts each keep their own); None: activations quantized dynamically per token.
    input_scales: torch.Tensor | None = None


def fuse_rows(parts: Sequence[StoredWeight | None]) -> StoredWeight | None:
    """Stored weights over the same inputs as one projection (their rows in order, each part's
    per-row scales with them), or None where they cannot be one (the projection then runs
    dequantized): a part missing or already packed for the kernels, another kind or activation
    scheme, input width or input order (act-order parts fuse only when they read their inputs in
    one order)."""
    if any(p is None or p.packed for p in parts):
        return None
    ps = [p for p in parts if p is not None]
    first = ps[0]
    if len({(p.kind, p.input_scales is None) for p in ps}) != 1 or any(p.shape[1] != first.shape[1] for p in ps):
        return None
    perm = first.perm
    if any((p.perm is None) != (perm is None) or (perm is not None and not torch.equal(p.perm, perm)) for p in ps):
        return None
    blocks = torch.cat([p.blocks for p in ps]).contiguous() if len(ps) > 1 else first.blocks

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:  # (W8A8 scales, per output row)
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

    return StoredWeight(first.kind, blocks, (sum(p.shape[0] for p in ps), first.shape[1]), perm,
                        scales=cat([p.scales for p in ps]), input_scales=cat([p.input_scales for p in ps]))


# The stored kinds tripod's kernels execute, and their packed format name.
STORED_KINDS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def narrowed_kind(stored: StoredWeight) -> str:
    """The stored kind ``narrowed`` gives ``stored``: ``Q4_0`` or ``Q4_1`` for a Q4_K-form weight
    (per 32 inputs ``[a f32, b f32, 16 bytes of nibbles]``, ``w = a q - b``; what AWQ / GPTQ /
    compressed-tensors int4 become, ``loader/stored.group_blocks``) whose values that smaller GGUF
    form holds, else its own kind:

    - ``Q4_0`` (18 bytes per 32 inputs instead of 24) where every ``a`` is exact in fp16 and
      ``b = 8 a`` (symmetric int4: ``w = a (q - 8)``);
    - ``Q4_1`` (20 bytes) where every ``a`` and ``-b`` are exact in fp16 (``d = a``, ``m = -b``).

    NOTE: the kernels then compute the same bits as for the Q4_K form: its epilogue is
    ``fnmadd(b, sum(x), fmadd(a, sum(x q), acc))``, Q4_0's / Q4_1's ``fmadd(m, sum(x), fmadd(d, ...))``
    with ``m = -8 d = -b`` / ``m = -b`` exactly in float32, and ``t + (-b) X`` rounded once is
    ``t - b X`` rounded once (``kernels/csrc/linear.cpp``'s ``apply_scales``, every level and row
    count). Fewer bytes read per token: a group-128 W4A16 checkpoint's bf16 scales fit fp16."""
    if stored.kind != "Q4_K" or stored.packed:
        return stored.kind
    a, b = _q4_k_scales(stored)
    if not torch.equal(a.to(torch.float16).float(), a):  # (an fp16 overflow gives inf != a)
        return stored.kind
    if torch.equal(b, a * 8):
        return "Q4_0"
    return "Q4_1" if torch.equal((-b).to(torch.float16).float(), -b) else stored.kind


def runs_stored(op: object, stored: StoredWeight) -> TypeGuard[KernelLinear]:
    """Whether ``op`` is the CPU kernels' linear over ``stored``'s codes (in the kind it packed them:
    a Q4_K-form weight may run as Q4_0 / Q4_1, ``narrowed_kind``)."""
    return isinstance(op, KernelLinear) and op.fmt == STORED_KINDS.get(narrowed_kind(stored))


def narrowed(stored: StoredWeight) -> StoredWeight:
    """``stored`` in the form ``narrowed_kind`` names (the same values, fewer bytes)."""
    kind = narrowed_kind(stored)
    if kind == stored.kind:
        return stored
    n = stored.shape[0]
    a, b = _q4_k_scales(stored)
    parts = [a.to(torch.float16).view(torch.uint8)]
    if kind == "Q4_1":
        parts.append((-b).to(torch.float16).view(torch.uint8))
    parts.append(stored.blocks.reshape(n, -1, 24)[:, :, 8:])  # the nibbles, in the same order
    return StoredWeight(kind, torch.cat(parts, dim=2).reshape(n, -1), stored.shape, stored.perm)


def _q4_k_scales(stored: StoredWeight) -> tuple[torch.Tensor, torch.Tensor]:
    per = stored.blocks.reshape(stored.shape[0], -1, 24)
    return per[:, :, 0:4].contiguous().view(torch.float32), per[:, :, 4:8].contiguous().view(torch.float32)


def release_sites(stored: dict[str, StoredWeight], sites: Iterable[tuple[str, torch.Tensor, Any]]) -> int:
    """``models/llama.LlamaForCausalLM.release_dense_stored`` for the sites given (its ``stored_sites``): each one whose
    linear runs its stored codes keeps only them (the kernels' packed blocks, put back in ``stored``)
    and its dense weight becomes the ``[0, K]`` placeholder. Returns the bytes given back."""
    freed = 0
    for key, w, op in sites:
        sw = stored.get(key)
        if sw is None or sw.packed:
            continue
        if getattr(op, "codes", None) is sw.blocks:  # W8A8 / W4A4: runs the stored codes as they are
            freed += w.numel() * w.element_size()
            w.data = released(w.data)
            continue
        if not runs_stored(op, sw):  # (a Q4_K-form weight may run as Q4_0 / Q4_1: narrowed_kind)
            continue
        freed += w.numel() * w.element_size() + sw.blocks.numel() * sw.blocks.element_size()
        stored[key] = StoredWeight(op.fmt.upper(), op.packed, sw.shape, sw.perm, packed=True)
        w.data = released(w.data)
    return freed


class DenseLinear:
    """``F.linear`` on the weight as loaded (optionally ``torch.mv`` for one 16-bit row)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mv_single_row: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        self.mv_single_row = mv_single_row

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.mv_single_row and x.shape[0] == 1:
            y = torch.mv(self.weight, x[0]).unsqueeze(0)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y


class OneDNNLinear:
    """The weight reordered once into oneDNN's layout for the CPU's matmul kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 0:
            y = x.new_empty((0, self.out_features))
            return y if residual is None else residual + y
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


class KernelLinear:
    """tripod's CPU kernel over a weight packed for it (formats: bf16, f32, q4_0, q4_1, q8_0, q4_k, q6_k)."""

    def __init__(self, ops: Any, packed: torch.Tensor, fmt: str, n: int, k: int, bias: torch.Tensor | None,
                 perm: torch.Tensor | None = None) -> None:
        self.op = ops.linear_packed.default
        self.packed, self.fmt, self.n, self.k = packed, fmt, n, k
        self.bias = bias
        self.perm = perm  # the packed inputs' order (act-order weights): an exact gather of x first

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.bias is None:
            return self.op(x, self.packed, self.fmt, self.n, self.k, residual)
        y = self.op(x, self.packed, self.fmt, self.n, self.k, None) + self.bias
        return y if residual is None else residual + y

    @classmethod
    def pack_dense(cls, ops: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> KernelLinear:
        n, k = weight.shape
        fmt = "bf16" if weight.dtype == torch.bfloat16 else "f32"
        w = weight.contiguous() if fmt == "bf16" else weight.float().contiguous()
        return cls(ops, ops.pack_linear(w, fmt, n, k), fmt, n, k, bias)

    @classmethod
    def pack_stored(cls, ops: Any, stored: StoredWeight, bias: torch.Tensor | None) -> KernelLinear:
        n, k = stored.shape
        stored = narrowed(stored)
        fmt = STORED_KINDS[stored.kind]
        packed = stored.blocks if stored.packed else ops.pack_linear(stored.blocks.contiguous(), fmt, n, k)
        return cls(ops, packed, fmt, n, k, bias, stored.perm)


Linear = DenseLinear | OneDNNLinear | KernelLinear | Fp8BlockLinear | Fp8ScaledLinear | W8A8Linear | W4A4Linear


def onednn_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's packed linear can run here (the CPU, float32 or bfloat16; bfloat16 only
    where oneDNN has a bf16 path on this CPU: AVX512-BW/VL/DQ or AVX-NE-CONVERT, else its reorder
    raises)."""
    if not (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def released(weight: torch.Tensor) -> torch.Tensor:
    """The placeholder left for a projection whose dense weight was released: ``[0, K]`` of its dtype
    (it keeps the input width and dtype the model's shape checks read, and no memory)."""
    return weight.new_empty((0, weight.shape[1]))


def is_released(weight: torch.Tensor) -> bool:
    return weight.ndim == 2 and weight.shape[0] == 0 and weight.shape[1] > 0


def kernel_supported(weight: torch.Tensor) -> bool:
    """Whether tripod's linear kernel takes this dense weight (CPU, bf16 with even K, or fp32)."""
    return weight.device.type == "cpu" and (
        weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)
    )


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    form: Form,
    *,
    ops: Any = None,
    stored: StoredWeight | None = None,
    fp8: Fp8Scales | None = None,
) -> Linear:
    """The executable form of one projection. ``stored``: the GGUF blocks of ``weight`` (same
    values), used by the ``stored`` form when their type is one tripod executes. ``fp8``: the
    scales of a weight kept in FP8 (any form)."""
    if stored is not None and stored.kind == "W4A4_NVFP4":  # FP4 activations quantized as the checkpoint says
        assert stored.scales is not None and stored.input_scales is not None
        return W4A4Linear(stored.blocks, stored.scales, stored.input_scales, bias)
    if stored is not None and stored.kind in W8A8_KINDS:  # activations quantized as the checkpoint says, any form
        assert stored.scales is not None
        # (the CPU kernels' forms: their int8_linear forms the INT8 products; others torch._int_mm)
        return W8A8Linear(stored.blocks, stored.scales, W8A8_KINDS[stored.kind], bias, stored.input_scales,
                          ops=ops if form in ("kernel", "stored") else None)
    if weight.dtype in FP8_DTYPES:
        if fp8 is None:
            raise ValueError("an FP8 weight needs its block scales")
        why = fp8_unsupported_reason(weight, fp8)
        report_fp8(why)
        return Fp8BlockLinear(weight, fp8, bias) if why is not None else Fp8ScaledLinear(weight, fp8, bias)
    if form == "stored" and stored is not None and stored.kind in STORED_KINDS:
        return KernelLinear.pack_stored(ops, stored, bias)
    if is_released(weight):
        raise ValueError(
            "this model's dense weights were released after its stored codes were packed for tripod's CPU "
            "kernels (--weights stored keeps only the stored form in memory); only the stored form can run it: "
            "load the model again with --weights dequantized for another compute path"
        )
    if form in ("kernel", "stored") and kernel_supported(weight):
        return KernelLinear.pack_dense(ops, weight, bias)
    if form in ("onednn", "kernel", "stored") and onednn_supported(weight.dtype, weight.device):
        return OneDNNLinear(weight, bias)
    mv = weight.dtype != torch.float32 and weight.device.type == "cpu"
    return DenseLinear(weight, bias, mv_single_row=mv)
