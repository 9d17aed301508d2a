"""Test-side quantizers and packers for AWQ, GPTQ and compressed-tensors ``pack-quantized``
checkpoints, written from each format's documentation (independently of tripod's loader), and the
dequantization an fp32 reference must hold.

``quantize`` rounds a float32 weight to ``bits``-bit unsigned codes with a scale (16-bit, as the
formats store it) and a zero point per output and group; ``save_quantized`` writes a tiny model's
decoder projections in one format and returns the folder and the dequantized weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    codes: torch.Tensor  # uint8-valued int64 [N, K], unsigned
    scales: torch.Tensor  # [N, G] in the stored dtype
    zeros: torch.Tensor  # int64 [N, G], unsigned domain
    g_idx: torch.Tensor  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        s = self.scales.float().index_select(1, self.g_idx)
        return (self.codes - self.zeros.index_select(1, self.g_idx)).float() * s


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, scale_dtype: torch.dtype = torch.float16,
             g_idx: torch.Tensor | None = None, min_zero: int = 0) -> Quantized:
    """Round-to-nearest ``w`` ``[N, K]`` in groups (``g_idx``: the group of each input; default
    contiguous runs of ``group``; ``group`` -1: one per row)."""
    n, k = w.shape
    size = k if group == -1 else group
    if g_idx is None:
        g_idx = torch.arange(k) // size
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = (cols.abs().amax(dim=1) / ((1 << (bits - 1)) - 1)).clamp_min(1e-6)
            z = torch.full((n,), 1 << (bits - 1), dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp_max(0), cols.amax(dim=1).clamp_min(0)
            s = ((hi - lo) / top).clamp_min(1e-6)
            s = s.to(scale_dtype).float()
            z = torch.round(-lo / s).to(torch.int64).clamp(min_zero, top)
        scales[:, g] = s.to(scale_dtype).float()
        zeros[:, g] = z
    scales = scales.to(scale_dtype)
    s_full = scales.float().index_select(1, g_idx)
    codes = (torch.round(w / s_full) + zeros.index_select(1, g_idx)).clamp(0, top).to(torch.int64)
    return Quantized(codes, scales, zeros, g_idx)


def _words(vals: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """Unsigned values packed ``32 / bits`` to a uint32 word along ``axis`` (value i at bit bits*i)."""
    per = 32 // bits
    v = np.moveaxis(vals.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // per, per, *v.shape[1:])
    out = np.zeros((v.shape[0], *v.shape[2:]), dtype=np.uint32)
    for i in range(per):
        out |= v[:, i] << np.uint32(bits * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(out, 0, axis)).view(np.int32))


def pack_awq(q: Quantized) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight [K, N/8] along the outputs in AWQ's nibble order, qzeros [G, N/8], scales [G, N]."""

    def along_outputs(vals: torch.Tensor) -> torch.Tensor:  # [R, N] → [R, N/8] words
        r, n = vals.shape
        v = vals.numpy().reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble i holds output AWQ_ORDER[i]
        return _words(v.reshape(r, n), 4, axis=1)

    return {"qweight": along_outputs(q.codes.t().contiguous()), "qzeros": along_outputs(q.zeros.t().contiguous()),
            "scales": q.scales.t().contiguous()}


def pack_gptq(q: Quantized, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ: qweight [K*bits/32, N] along the inputs, qzeros [G, N*bits/32] (the zero point minus
    one in the original format), scales [G, N], g_idx [K]."""
    zeros = (q.zeros - 1 if v1 else q.zeros).t().contiguous().numpy() & ((1 << bits) - 1)
    return {"qweight": _words(q.codes.t().contiguous().numpy(), bits, axis=0), "qzeros": _words(zeros, bits, axis=1),
            "scales": q.scales.t().contiguous(), "g_idx": q.g_idx.to(torch.int32)}


def pack_ct(q: Quantized, bits: int, sym: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: weight_packed [N, K*bits/32] (q + 2^(bits-1) of the signed
    code, which is the unsigned code), weight_scale [N, G], weight_zero_point [N*bits/32, G] packed
    along the outputs (asymmetric), weight_shape, weight_g_idx (act-order)."""
    n, k = q.codes.shape
    out = {"weight_packed": _words(q.codes.numpy(), bits, axis=1), "weight_scale": q.scales.contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = _words(q.zeros.numpy(), bits, axis=0)
    if act_order:
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """NVFP4 (compressed-tensors ``nvfp4-pack-quantized``): a float32 global scale (448 * 6 / max|w|),
    an E4M3 scale per 16 inputs (the block's max|w| / 6, times the global scale), FP4 E2M1 codes
    (sign bit 3, magnitude index bits 0-2) two a byte, input 2i in the low nibble. Returns the
    tensors and the dequantized weight ``fp4 * (scale / global)`` (float32)."""
    n, k = w.shape
    glob = torch.tensor([448.0 * 6.0 / float(w.abs().max())], dtype=torch.float32)
    blocks = w.view(n, k // 16, 16)
    scale = (blocks.abs().amax(dim=2) / 6.0 * glob).to(torch.float8_e4m3fn)
    eff = scale.float() / glob
    x = blocks / eff.clamp_min(1e-30).unsqueeze(-1)
    idx = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # nearest magnitude
    codes = (idx + (x < 0).long() * 8).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    vals = E2M1[idx] * torch.where(x < 0, -1.0, 1.0)
    deq = (vals * eff.unsqueeze(-1)).reshape(n, k)
    return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": glob}, deq


def pack_w8a8(w: torch.Tensor, kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors ``int-quantized`` / ``float-quantized`` (W8A8, per channel, symmetric):
    ``weight`` int8 or float8_e4m3fn ``[N, K]`` and ``weight_scale`` bf16 ``[N, 1]``; returns the
    tensors and the float32 dequantized weight."""
    top = 127.0 if kind == "int8" else 448.0
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp_min(1e-6).to(torch.bfloat16)
    x = w / scale.float()
    codes = torch.round(x).clamp(-128, 127).to(torch.int8) if kind == "int8" else x.clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale.float()


def static_input_scale(module: str, kind: str, seed: int = 0) -> torch.Tensor:
    """A static per-tensor activation scale for ``module`` (bf16 ``[1]``, as compressed-tensors saves
    ``input_scale``): no calibration, a value per module so fused parts (Q/K/V, gate/up) differ, clipping
    activations beyond about 2 to 4 (the tiny models' normed inputs run past that, so clamping is exercised)."""
    g = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, module)))
    top = 127.0 if kind == "int8" else 448.0
    return ((2.0 + 2.0 * torch.rand(1, generator=g)) / top).to(torch.bfloat16)


class W8A8Reference(torch.nn.Module):
    """A transformers linear replaced by the W8A8 math written independently of tripod: activations
    quantized by compressed-tensors' own ``calculate_qparams`` / ``_quantize`` (the package's dynamic
    per-token quantization), or with ``input_scale`` (static per tensor: ``_quantize`` of float32
    activations by that float32 scale), the product of codes in integers (int64; FP8 E4M3 values are
    multiples of 2^-9), scaled by ``s_x * s_w`` in float64, rounded to the activations' dtype."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, kind: str,
                 input_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        from compressed_tensors.quantization import QuantizationArgs

        self.codes, self.scale, self.kind = codes, scale.float().reshape(-1), kind
        self.input_scale = None if input_scale is None else input_scale.float().reshape(1, 1)
        self.args = QuantizationArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True,
                                     strategy="token" if input_scale is None else "tensor",
                                     dynamic=input_scale is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.quantization.lifecycle.forward_helpers import _quantize
        from compressed_tensors.quantization.utils.helpers import calculate_qparams, calculate_range

        rows = x.reshape(-1, x.shape[-1])
        q_min, q_max = calculate_range(self.args, rows.device)
        if self.input_scale is None:
            scale, zp = calculate_qparams(rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True), self.args)
            q = _quantize(rows, scale, zp, q_min, q_max, self.args)
        else:
            scale = self.input_scale
            q = _quantize(rows.float(), scale, None, q_min, q_max, self.args)
        to_int = (lambda t: t.to(torch.int64)) if self.kind == "int8" else (lambda t: (t.double() * 512).to(torch.int64))
        acc = (to_int(q) @ to_int(self.codes).t()).double() / (1.0 if self.kind == "int8" else 2.0**18)
        y = (acc * (scale.double() * self.scale.double())).to(x.dtype)
        return y.reshape(*x.shape[:-1], -1)


def use_w8a8_reference(model: Any, tensors: dict[str, torch.Tensor], kind: str) -> None:
    """Replace ``model``'s linears that ``tensors`` (a W8A8 folder's) quantize with ``W8A8Reference``."""
    for name in [n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")]:
        parent, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), child,
                W8A8Reference(tensors[name + ".weight"], tensors[name + ".weight_scale"], kind,
                              tensors.get(name + ".input_scale")))


def _quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, w in state.items()
            if n.startswith("model.layers.") and n.endswith("proj.weight") and w.ndim == 2]


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Stacked MoE experts (transformers' ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
    ``down_proj`` ``[E, H, I]``) as the per-expert linears quantized checkpoints store
    (``mlp.experts.{e}.gate_proj.weight`` …), in place; returns each prefix's expert count."""
    found: dict[str, int] = {}
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gu, down = state.pop(name), state.pop(prefix + "down_proj")
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            state[f"{prefix}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
            state[f"{prefix}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
            state[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
        found[prefix] = gu.shape[0]
    return found


def save_quantized(model: Any, folder: Path, tokenizer: Any, method: str, *, bits: int = 4, group: int = 32,
                   sym: bool = False, act_order: bool = False, ignore: tuple[str, ...] = (),
                   seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """Save ``model`` with its decoder projections quantized in ``method`` ("awq", "gptq", "ct", "nvfp4", "w8a8-int8" / "w8a8-fp8", with "-static" activation scales);
    returns the folder and the dequantized state dict (what an fp32 reference must hold).
    ``ignore``: name fragments of projections left unquantized (AWQ's modules_to_not_convert,
    compressed-tensors' ``ignore`` as ``re:`` patterns)."""
    from safetensors.torch import save_file

    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    stacked = _split_experts(state)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    out: dict[str, torch.Tensor] = {}
    deq = dict(state)
    for name in _quantized_names(state):
        if any(frag in name for frag in ignore):
            continue
        w = state.pop(name)
        module = name.removesuffix(".weight")
        k = w.shape[1]
        g_idx = None
        if act_order:  # one order per layer and input width, as GPTQ's (projections of one input share it)
            size = k if group == -1 else group
            layer = int(name.split(".")[2])
            g = torch.Generator().manual_seed(seed * 1000 + layer * 10 + k)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[torch.randperm(k, generator=g)] = torch.arange(k) // size
        if method.startswith("w8a8-"):  # w8a8-int8 / w8a8-fp8, "-static": with an input_scale per module
            kind = method.split("-")[1]
            parts, deq[name] = pack_w8a8(w, kind)
            if method.endswith("-static"):
                parts["input_scale"] = static_input_scale(module, kind, seed)
            for suffix, t in parts.items():
                out[f"{module}.{suffix}"] = t
            continue
        if method == "nvfp4":
            parts, deq[name] = pack_nvfp4(w)
            for suffix, t in parts.items():
                out[f"{module}.{suffix}"] = t
            continue
        scale_dtype = torch.bfloat16 if method == "ct" else torch.float16
        q = quantize(w, bits, group, sym, scale_dtype, g_idx, min_zero=1 if method == "gptq" else 0)
        deq[name] = q.dequantize()
        if method == "awq":
            parts = pack_awq(q)
        elif method == "gptq":
            parts = pack_gptq(q, bits)
        else:
            parts = pack_ct(q, bits, sym, act_order)
        for suffix, t in parts.items():
            out[f"{module}.{suffix}"] = t
    for prefix, experts in stacked.items():  # the reference model holds the experts stacked again
        gate_up = [torch.cat((deq.pop(f"{prefix}{e}.gate_proj.weight"), deq.pop(f"{prefix}{e}.up_proj.weight")))
                   for e in range(experts)]
        deq[prefix + "gate_up_proj"] = torch.stack(gate_up)
        deq[prefix + "down_proj"] = torch.stack([deq.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)])
    # the plain tensors (embeddings, norms, the head, ignored projections) as saved
    out.update(state)
    if "lm_head.weight" in out and model.config.tie_word_embeddings:
        del out["lm_head.weight"]
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = quant_config(method, bits, group, sym, act_order, ignore)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder, deq


def quant_config(method: str, bits: int, group: int, sym: bool, act_order: bool, ignore: tuple[str, ...]) -> dict[str, Any]:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(ignore) or None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    if method.startswith("w8a8-"):
        t = "int" if method.startswith("w8a8-int8") else "float"
        static = method.endswith("-static")
        return {"quant_method": "compressed-tensors", "format": f"{t}-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": t, "symmetric": True, "strategy": "channel", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": t, "symmetric": True,
                                          "strategy": "tensor" if static else "token", "dynamic": not static}}},
                "ignore": ["lm_head", *(f"re:.*{frag}" for frag in ignore)]}
    if method == "nvfp4":
        nv = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
              "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": nv, "input_activations": None}},
                "ignore": ["lm_head", *(f"re:.*{frag}" for frag in ignore)]}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group, "dynamic": False,
               "actorder": "group" if act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head", *(f"re:.*{frag}" for frag in ignore)]}
