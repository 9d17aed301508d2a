"""Where a layer's ``load`` reads its tensors from: HF-named checkpoint tensors, converted to the
run dtype — except block-wise FP8 weights when the model keeps them in FP8 (``--weights fp8``),
which come with their scales and are fused (Q/K/V, gate/up, stacked experts) scales and all."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from tripod.layers.linear import FP8_DTYPES, Fp8Scales, dequantize_fp8

Part = tuple[torch.Tensor, Fp8Scales | None]


class WeightSource:
    """A checkpoint's tensors by HF name; every parameter must be covered (a missing tensor is
    an error, never zeros).

    ``weights`` may name ``joinable_storages`` (the data pointers of the buffers that a weight
    update's received tensors lie in, back to back, never written again): parts fused (Q/K/V,
    gate/up, stacked experts) that already lie back to back in one of those buffers, in order, are
    then taken as one view of it instead of copied (the same values as the concatenation, without
    its copy)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 fp8_block: tuple[int, int] | None = None) -> None:
        self.weights, self.dtype, self.device = weights, dtype, device
        self.fp8_block = fp8_block  # set: FP8 weights stay FP8 (with their weight_scale_inv)
        # NOTE: only in buffers the mapping names: a checkpoint's own tensors (e.g. memory-mapped
        # file pages) must never become parameters by reference.
        self.joinable: frozenset[int] = frozenset(getattr(weights, "joinable_storages", ()))

    def has(self, name: str) -> bool:
        return name in self.weights

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.weights[name]

    def get(self, name: str) -> torch.Tensor:
        """A tensor in the run dtype (an FP8 one dequantized)."""
        t, sc = self.part(name)
        if sc is not None:
            return dequantize_fp8(t, sc, self.dtype)
        return t

    def raw(self, name: str) -> torch.Tensor:
        """A tensor exactly as the checkpoint stores it (e.g. MXFP4's packed blocks)."""
        return self._raw(name)

    def get_f32(self, name: str) -> torch.Tensor:
        return self._raw(name).to(device=self.device, dtype=torch.float32).contiguous()

    def part(self, name: str) -> Part:
        """A weight as kept: FP8 with its scales, or converted to the run dtype."""
        t = self._raw(name)
        if t.dtype in FP8_DTYPES:
            if self.fp8_block is None:
                raise ValueError(f"{name} is FP8 but the checkpoint was not loaded as block-wise FP8")
            scale = self._raw(name.removesuffix(".weight") + ".weight_scale_inv"
                              if name.endswith(".weight") else name + "_scale_inv")
            return t.to(self.device), Fp8Scales(scale.to(device=self.device, dtype=torch.float32), self.fp8_block)
        return t.to(device=self.device, dtype=self.dtype), None

    def cat(self, names: list[str]) -> Part:
        """Parts fused along their rows (kept FP8 when every part is FP8 and starts on a block)."""
        parts = [self.part(n) for n in names]
        joined = adjacent(parts, self.joinable, dim0=True) if self.joinable else None
        return joined if joined is not None else fuse(parts, self.dtype, lambda p: torch.cat(p), dim0=True)

    def stack(self, parts: list[Part]) -> Part:
        joined = adjacent(parts, self.joinable, dim0=False) if self.joinable else None
        return joined if joined is not None else fuse(parts, self.dtype, lambda p: torch.stack(p), dim0=False)


def adjacent(parts: list[Part], storages: frozenset[int], dim0: bool) -> Part | None:
    """``parts`` concatenated along rows (``dim0``) or stacked, as one view of the buffer (one of
    ``storages``) they already fill back to back, in order (None: they do not; the caller copies)."""
    ts = [t for t, _ in parts]
    first = ts[0]
    storage = first.untyped_storage().data_ptr()
    if (storage not in storages or any(sc is not None for _, sc in parts) or not first.is_contiguous()
            or first.dim() == 0):
        return None
    for a, b in itertools.pairwise(ts):
        if (b.dtype != first.dtype or b.device != first.device or not b.is_contiguous()
                or b.untyped_storage().data_ptr() != storage or a.data_ptr() + a.nbytes != b.data_ptr()
                or (b.shape[1:] != first.shape[1:] if dim0 else b.shape != first.shape)):
            return None
    if dim0:
        shape = (sum(int(t.shape[0]) for t in ts), *first.shape[1:])
    else:
        shape = (len(ts), *first.shape)
    stride = torch.empty(shape, device="meta").stride()
    return first.as_strided(shape, stride, first.storage_offset()), None


def fuse(parts: list[Part], dtype: torch.dtype, op: object, dim0: bool) -> Part:
    scales = [sc for _, sc in parts]
    if all(sc is not None for sc in scales):
        bn = scales[0].block[0]  # type: ignore[union-attr]
        if not dim0 or all(t.shape[0] % bn == 0 for t, _ in parts[:-1]):
            w = op([t for t, _ in parts])  # type: ignore[operator]
            s = op([sc.scale_inv for sc in scales])  # type: ignore[union-attr,operator]
            return w.contiguous(), Fp8Scales(s.contiguous(), scales[0].block)  # type: ignore[union-attr]
    plain = [t if sc is None else dequantize_fp8(t, sc, dtype) for t, sc in parts]
    return op(plain).contiguous(), None  # type: ignore[operator]


# FP4 (e2m1) codes 0..15 as values: the sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """OCP MXFP4 (gpt-oss's experts): ``blocks`` uint8 ``[*rows, G, 16]`` (two FP4 codes a byte, the
    low nibble first), ``scales`` uint8 ``[*rows, G]`` (E8M0: 2^(s - 127) for each block of 32) →
    ``[*rows, G * 32]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)  # [*rows, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return vals.flatten(-2).to(dtype)
