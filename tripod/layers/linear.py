"""Linear projections: ``y = x @ W.T (+ bias) (+ residual)`` with ``W`` held in the form the
chosen kernel wants, prepared once when the model is loaded.

- ``DenseLinear``: ``F.linear`` on the plain weight. The float32 reference path (op for op with
  Hugging Face) and CUDA (cuBLAS needs nothing else).
- ``PackedLinear``: the CPU path. oneDNN's ``F.linear`` reorders a plain weight into its blocked
  layout on every call, which caps small-batch decode at 5-15 GB/s of weight streaming; packing
  once (``mkldnn._reorder_linear_weight``) and calling the packed kernel streams at close to the
  memory bandwidth (measured in ``benchmarks/linear_kernels.py``). The residual add is fused into
  the matmul (oneDNN's sum post-op): one pass over the output instead of two.
- ``Int4Linear``: a GGUF Q4_1 weight executed as stored (``--weights stored``): torch's int4
  matmul over the 4-bit codes, each 32-weight block's scale and minimum kept exactly
  (``w = d * q + m`` becomes ``(q - 8) * d + (m + 8 d)``), a quarter of bf16's bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    """``F.linear`` on the weight as loaded (optionally with ``torch.mv`` for one bf16 row)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mv_single_row: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        self.mv_single_row = mv_single_row
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.mv_single_row and x.shape[0] == 1:
            y = torch.mv(self.weight, x[0]).unsqueeze(0)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y


class PackedLinear:
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


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``PackedLinear`` can run here (oneDNN on the CPU, float32 or bfloat16)."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


Linear = DenseLinear | PackedLinear


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, packed: bool, mv_single_row: bool = False) -> Linear:
    if packed:
        return PackedLinear(weight, bias)
    return DenseLinear(weight, bias, mv_single_row=mv_single_row)
