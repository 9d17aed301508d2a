"""Integer weight-only quantized HF checkpoints: AWQ, GPTQ and compressed-tensors ``pack-quantized``.

Each format stores a linear's weight ``W [N, K]`` as integer codes ``q`` of ``bits`` bits, a scale
``s`` per output and per group of ``group`` inputs (``-1``: one group, per channel) and a zero point
``z`` (symmetric formats: a fixed one), with ``W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]`` and
``g(k) = k // group`` — or, for act-order checkpoints, the group the checkpoint's ``g_idx`` names.
Every format is unpacked here into that one form (``GroupQuantized``: unsigned codes, float32
scales, integer zero points, the group of each input), from which the loader either dequantizes
(the ``dequantized`` weights, exactly those values in float32) or rewrites the blocks tripod's
kernels execute as stored (``loader/stored.py``: ``group_blocks``).

How each format packs its tensors (from each project's documentation and reference code):

- AWQ (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 ``[K, N / 8]``, packed along the
  outputs, nibble ``i`` of word ``c`` holding output ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``;
  ``qzeros`` int32 ``[K / group, N / 8]`` packed the same way; ``scales`` fp16 ``[K / group, N]``.
- GPTQ (``quant_method: gptq``; AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K * bits / 32, N]``,
  packed along the inputs (value ``i`` of word ``r``, at bit ``bits * i``, is input
  ``(32 / bits) * r + i``); ``qzeros`` int32 ``[groups, N * bits / 32]`` packed along the outputs the
  same way; ``scales`` fp16 ``[groups, N]``; ``g_idx`` int32 ``[K]`` (the group of each input;
  ``desc_act`` checkpoints permute it). The original GPTQ packing (``checkpoint_format: gptq``, the
  default) stores each zero point minus one, and every reader (AutoGPTQ, GPTQModel's v1 → v2
  conversion, transformers through them) adds the one back; ``gptq_v2`` stores it as is.
- compressed-tensors (``quant_method: compressed-tensors``, ``format: pack-quantized``):
  ``weight_packed`` int32 ``[N, K * bits / 32]`` packed along the inputs like GPTQ's rows, each
  code stored as ``q + 2^(bits-1)`` (signed codes made unsigned); ``weight_scale`` ``[N, groups]``;
  ``weight_zero_point`` (asymmetric only) int32 ``[N * bits / 32, groups]`` packed along the outputs
  with the same offset; ``weight_shape`` ``[2]`` = (N, K); ``weight_g_idx`` ``[K]`` for act-order.
  Which linears are quantized and how: ``config_groups`` (each with ``targets``: ``Linear``, an
  exact module name, or ``re:<regex>``) minus ``ignore``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output 8c + AWQ_ORDER[i] sits in nibble i of word c
SUPPORTED = (
    "AWQ (version gemm, 4-bit, zero points), GPTQ (4- or 8-bit, symmetric or not, desc_act, any group size), "
    "compressed-tensors pack-quantized (int4/int8 weights, group or channel strategy, no activation quantization) "
    "and nvfp4-pack-quantized (NVFP4A16: FP4 weights, 16-bit activations; NVFP4 W4A4: FP4 activations in groups "
    "of 16, FP8 scales computed per row over a static input_global_scale), "
    "int-quantized / float-quantized W8A8 (int8 or FP8 E4M3 weights per channel or tensor, symmetric, "
    "activations quantized dynamically per token)"
)
W8A8_FORMATS = ("int-quantized", "float-quantized")


@dataclass(frozen=True, slots=True)
class IntScheme:
    """How one linear's weight is stored: ``bits``-bit integer codes, one scale per ``group`` inputs
    (``-1``: per output channel), with zero points (``symmetric`` False) or without."""

    bits: int
    group: int
    symmetric: bool
    # "int", or "nvfp4": FP4 (E2M1) codes, FP8 group scales over a global scale ("nvfp4-w4a4": with
    # FP4 input activations, W4A4)
    kind: str = "int"

    def describe(self) -> str:
        if self.kind == "nvfp4":
            return f"nvfp4 (fp4 e2m1, group {self.group}, fp8 scales / global scale)"
        if self.kind == "nvfp4-w4a4":
            return (f"nvfp4 w4a4 (fp4 e2m1 weights and activations, group {self.group}, fp8 scales / global scale; "
                    "activation scales per row and group)")
        group = "per channel" if self.group == -1 else f"group {self.group}"
        return f"int{self.bits}, {group}, {'symmetric' if self.symmetric else 'zero points'}"


@dataclass(frozen=True, slots=True)
class GroupQuantized:
    """One weight unpacked: unsigned ``codes`` uint8 ``[N, K]``, ``scales`` float32 ``[N, G]``,
    ``zeros`` int32 ``[N, G]`` (in the codes' unsigned domain) and ``g_idx`` int64 ``[K]``, the group
    of each input. ``W = (codes - zeros[:, g_idx]) * scales[:, g_idx]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: each value ``(q - z) * s``, one rounding (none for 16-bit scales)."""
        q = self.codes.to(torch.int32) - self.zeros.index_select(1, self.g_idx)
        return q.to(torch.float32) * self.scales.index_select(1, self.g_idx)

    @property
    def group_size(self) -> int:
        """Inputs per group: the largest group's count. NOTE: not ``ceil(K / groups)`` where the last
        group is partial (K 576 in groups of 128: four of 128 and one of 64, not five of 116)."""
        return int(torch.bincount(self.g_idx, minlength=self.scales.shape[1]).max())

    @property
    def in_order(self) -> bool:
        """Whether the groups are contiguous runs of inputs (no act-order permutation)."""
        return bool(torch.equal(self.g_idx, torch.arange(self.shape[1]) // self.group_size))


class QuantizedCheckpointError(ValueError):
    """A quantized folder tripod cannot load: an unsupported method or scheme, or a malformed tensor."""


def parse(config: Mapping[str, Any]) -> IntFormat | None:
    """The integer weight-only format of a ``config.json``'s ``quantization_config`` (None for an
    unquantized folder, or one of the formats ``HFFolder`` reads itself: block-wise FP8, MXFP4).
    Raises for anything else, naming what is supported."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        return AwqFormat(q)
    if method == "gptq":
        return GptqFormat(q)
    if method == "compressed-tensors":
        return CompressedTensorsFormat(q)  # (W8A8 folders are told apart first: hf_w8a8.parse)
    return None


class IntFormat:
    """One checkpoint's integer format: which tensors mark a quantized linear, its scheme, and how
    its tensors unpack into ``GroupQuantized``."""

    name = ""
    marker = ""  # the tensor suffix that makes ``<module>`` a quantized linear
    aux: tuple[str, ...] = ()  # every tensor suffix the format adds (consumed by ``unpack``)

    def scheme_for(self, module: str) -> IntScheme | None:
        raise NotImplementedError

    def unpack(self, tensors: Mapping[str, torch.Tensor], module: str) -> GroupQuantized:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def schemes(self) -> list[IntScheme]:
        raise NotImplementedError

    act_order = False
    weight_is_codes = False  # the codes are ``<module>.weight`` itself (W8A8), not a tensor of their own
    quantizes_activations = False

    def not_stored_reason(self) -> str | None:
        """Why the config's schemes leave no weight to execute as stored (None: some are)."""
        for sc in self.schemes():
            if sc.kind.startswith("nvfp4"):
                return None
            if sc.group != -1 and sc.group % 32:
                continue
            return None  # 4-bit, 8-bit symmetric or with zero points (loader/stored.py's group_blocks)
        return "no scheme with groups of a multiple of 32 inputs (or one per channel)"

    def modules(self, names: list[str]) -> list[str]:
        """The quantized linears among a checkpoint's tensor names; refuses a stray tensor of the
        format (a scale without its codes)."""
        mods = sorted(n.removesuffix("." + self.marker) for n in names if n.endswith("." + self.marker))
        have = set(mods)
        for n in names:
            for suffix in self.aux:
                if n.endswith("." + suffix) and n.removesuffix("." + suffix) not in have:
                    raise QuantizedCheckpointError(f"{self.name} checkpoint: {n} has no {self.marker} beside it")
        for m in mods:
            if self.scheme_for(m) is None:
                raise QuantizedCheckpointError(
                    f"{self.name} checkpoint: {m} is stored quantized but its quantization_config leaves it unquantized"
                )
        if not mods:
            raise QuantizedCheckpointError(f"{self.name} checkpoint has no quantized weights ({self.marker} tensors)")
        return mods


def need_tensor(tensors: Mapping[str, torch.Tensor], name: str, fmt: str) -> torch.Tensor:
    if name not in tensors:
        raise QuantizedCheckpointError(f"{fmt} checkpoint is missing {name}")
    return tensors[name]


def check_shape(t: torch.Tensor, want: tuple[int, ...], name: str, fmt: str, why: str) -> None:
    if tuple(t.shape) != want:
        raise QuantizedCheckpointError(f"{fmt} checkpoint: {name} has shape {tuple(t.shape)}, expected {want} ({why})")


def _int32(t: torch.Tensor, name: str, fmt: str) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise QuantizedCheckpointError(f"{fmt} checkpoint: {name} is {t.dtype}, expected packed int32")
    return t


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` with ``32 / bits`` values a word along the rows → ``[R * 32 / bits, C]``
    (value ``i`` of word ``r`` is row ``(32 / bits) * r + i``)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    vals = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` with ``32 / bits`` values a word along the columns → ``[R, C * 32 / bits]``."""
    return _unpack_rows(packed.t(), bits).t()


def _check_bits(bits: Any, allowed: tuple[int, ...], fmt: str) -> int:
    if bits not in allowed:
        raise QuantizedCheckpointError(f"{fmt} with {bits}-bit weights is not supported (supported: {SUPPORTED})")
    return int(bits)


def _check_group(group: Any, fmt: str) -> int:
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise QuantizedCheckpointError(f"{fmt}: group_size {group!r} is not a positive size or -1")
    return group


def float_scales(t: torch.Tensor, name: str, fmt: str) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        raise QuantizedCheckpointError(f"{fmt} checkpoint: {name} is {t.dtype}, expected floating-point scales")
    return t.to(torch.float32)


def _groups(k: int, group: int) -> int:
    return 1 if group == -1 else -(-k // group)


def _default_g_idx(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // (k if group == -1 else group)


def _check_g_idx(g_idx: torch.Tensor, k: int, groups: int, name: str, fmt: str) -> torch.Tensor:
    check_shape(g_idx, (k,), name, fmt, "one group index per input")
    g = g_idx.to(torch.int64)
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise QuantizedCheckpointError(f"{fmt} checkpoint: {name} names groups outside 0..{groups - 1}")
    return g


class AwqFormat(IntFormat):
    """AutoAWQ's GEMM packing (``version: gemm``): 4-bit codes with zero points."""

    name = "AWQ"
    marker = "qweight"
    aux = ("qzeros", "scales")

    def __init__(self, q: Mapping[str, Any]) -> None:
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizedCheckpointError(f"AWQ version {version!r} is not supported (supported: {SUPPORTED})")
        if q.get("zero_point", True) is not True:
            raise QuantizedCheckpointError(f"AWQ without zero points is not supported (supported: {SUPPORTED})")
        bits = _check_bits(q.get("bits", q.get("w_bit", 4)), (4,), "AWQ")
        group = _check_group(q.get("group_size", q.get("q_group_size", 128)), "AWQ")
        self.scheme = IntScheme(bits, group, False)
        self.skip = tuple(q.get("modules_to_not_convert") or ())

    def scheme_for(self, module: str) -> IntScheme | None:
        return None if any(s in module for s in self.skip) else self.scheme

    def describe(self) -> str:
        return f"awq ({self.scheme.describe()})"

    def schemes(self) -> list[IntScheme]:
        return [self.scheme]

    def unpack(self, tensors: Mapping[str, torch.Tensor], module: str) -> GroupQuantized:
        f, group = "AWQ", self.scheme.group
        qw = _int32(need_tensor(tensors, module + ".qweight", f), module + ".qweight", f)
        k, n = int(qw.shape[0]), int(qw.shape[1]) * 8
        gs = _groups(k, group)
        if group != -1 and k % group:
            raise QuantizedCheckpointError(f"AWQ checkpoint: {module} has {k} inputs, not a multiple of group_size {group}")
        scales = need_tensor(tensors, module + ".scales", f)
        check_shape(scales, (gs, n), module + ".scales", f, f"{gs} groups x {n} outputs")
        qz = _int32(need_tensor(tensors, module + ".qzeros", f), module + ".qzeros", f)
        check_shape(qz, (gs, n // 8), module + ".qzeros", f, f"{gs} groups x {n} outputs / 8")
        order = torch.tensor(AWQ_ORDER)

        def outputs(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] → [R, N] in output order
            nib = _unpack_cols(packed, 4).view(packed.shape[0], -1, 8)
            out = torch.empty_like(nib)
            out[:, :, order] = nib  # nibble i is output AWQ_ORDER[i]
            return out.reshape(packed.shape[0], -1)

        codes = outputs(qw).t().contiguous().to(torch.uint8)
        zeros = outputs(qz).t().contiguous()
        return GroupQuantized(codes, float_scales(scales, module + ".scales", f).t().contiguous(), zeros,
                              _default_g_idx(k, group), 4)


class GptqFormat(IntFormat):
    """AutoGPTQ / GPTQModel's packing: 4- or 8-bit codes, zero points (stored minus one in the
    original ``gptq`` format), optional act-order ``g_idx``."""

    name = "GPTQ"
    marker = "qweight"
    aux = ("qzeros", "scales", "g_idx")

    def __init__(self, q: Mapping[str, Any]) -> None:
        bits = _check_bits(q.get("bits", 4), (4, 8), "GPTQ")
        group = _check_group(q.get("group_size", 128), "GPTQ")
        self.scheme = IntScheme(bits, group, bool(q.get("sym", True)))
        self.act_order = bool(q.get("desc_act", False))
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizedCheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.checkpoint_format = fmt
        self.skip = tuple(q.get("modules_to_not_convert") or ())

    def scheme_for(self, module: str) -> IntScheme | None:
        return None if any(s in module for s in self.skip) else self.scheme

    def describe(self) -> str:
        order = ", act-order" if self.act_order else ""
        return f"gptq ({self.scheme.describe()}{order})"

    def schemes(self) -> list[IntScheme]:
        return [self.scheme]

    def unpack(self, tensors: Mapping[str, torch.Tensor], module: str) -> GroupQuantized:
        f, bits, group = "GPTQ", self.scheme.bits, self.scheme.group
        per = 32 // bits
        qw = _int32(need_tensor(tensors, module + ".qweight", f), module + ".qweight", f)
        k, n = int(qw.shape[0]) * per, int(qw.shape[1])
        gs = _groups(k, group)
        scales = need_tensor(tensors, module + ".scales", f)
        check_shape(scales, (gs, n), module + ".scales", f, f"{gs} groups of {group} x {n} outputs")
        qz = _int32(need_tensor(tensors, module + ".qzeros", f), module + ".qzeros", f)
        check_shape(qz, (gs, n // per), module + ".qzeros", f, f"{gs} groups x {n} outputs / {per}")
        gi = tensors.get(module + ".g_idx")
        g_idx = _default_g_idx(k, group) if gi is None else _check_g_idx(gi, k, gs, module + ".g_idx", f)
        codes = _unpack_rows(qw, bits).t().contiguous().to(torch.uint8)
        zeros = _unpack_cols(qz, bits).t().contiguous() + self.zero_offset
        return GroupQuantized(codes, float_scales(scales, module + ".scales", f).t().contiguous(), zeros, g_idx, bits)


@dataclass(frozen=True, slots=True)
class TargetGroup:
    targets: tuple[str, ...]
    scheme: IntScheme


class CompressedTensorsFormat(IntFormat):
    """compressed-tensors' ``pack-quantized`` weight-only schemes (W4A16, W8A16; group or channel)."""

    name = "compressed-tensors"
    marker = "weight_packed"
    aux = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale",
           "input_global_scale")

    def __init__(self, q: Mapping[str, Any]) -> None:
        top = q.get("format")
        self.groups: list[TargetGroup] = []
        for gname, g in (q.get("config_groups") or {}).items():
            fmt = g.get("format") or top
            if fmt == "nvfp4-pack-quantized":
                self.groups.append(TargetGroup(self._targets(gname, g), self._nvfp4(gname, g)))
                continue
            if fmt != "pack-quantized":
                raise QuantizedCheckpointError(
                    f"compressed-tensors format {fmt!r} (config group {gname}) is not supported beside "
                    f"pack-quantized groups (supported: {SUPPORTED})"
                )
            if g.get("input_activations") or g.get("output_activations"):
                raise QuantizedCheckpointError(
                    f"compressed-tensors config group {gname} quantizes activations (W8A8-style); "
                    f"only weight-only schemes are supported (supported: {SUPPORTED})"
                )
            w = g.get("weights") or {}
            if w.get("type", "int") != "int":
                raise QuantizedCheckpointError(f"compressed-tensors {w.get('type')} weights are not supported (supported: {SUPPORTED})")
            bits = _check_bits(w.get("num_bits"), (4, 8), "compressed-tensors")
            strategy = w.get("strategy")
            if strategy == "group":
                group = _check_group(w.get("group_size"), "compressed-tensors")
            elif strategy == "channel":
                group = -1
            else:
                raise QuantizedCheckpointError(
                    f"compressed-tensors strategy {strategy!r} is not supported (group or channel; supported: {SUPPORTED})"
                )
            if w.get("dynamic"):
                raise QuantizedCheckpointError("compressed-tensors dynamic weight quantization is not a stored format")
            if w.get("actorder"):
                self.act_order = True
            self.groups.append(TargetGroup(self._targets(gname, g), IntScheme(bits, group, bool(w.get("symmetric", True)))))
        if not self.groups:
            raise QuantizedCheckpointError("compressed-tensors quantization_config has no config_groups")
        self.ignore = tuple(q.get("ignore") or ())
        # NVFP4 W4A4: the activations are quantized as the checkpoint says (layers/w4a4.py), stored form only
        self.quantizes_activations = any(g.scheme.kind == "nvfp4-w4a4" for g in self.groups)
        if self.quantizes_activations and not all(g.scheme.kind == "nvfp4-w4a4" for g in self.groups):
            raise QuantizedCheckpointError("compressed-tensors: NVFP4 W4A4 config groups beside weight-only ones are not "
                                           f"supported (every group W4A4, or none; supported: {SUPPORTED})")

    @staticmethod
    def _targets(gname: str, g: Mapping[str, Any]) -> tuple[str, ...]:
        targets = tuple(g.get("targets") or ())
        if not targets:
            raise QuantizedCheckpointError(f"compressed-tensors config group {gname} names no targets")
        return targets

    def _nvfp4(self, gname: str, g: Mapping[str, Any]) -> IntScheme:
        """An ``nvfp4-pack-quantized`` group's scheme: read by ``hf_nvfp4.Nvfp4Format`` (what
        ``hf_w8a8.parse`` returns for a folder with such groups)."""
        raise QuantizedCheckpointError(f"compressed-tensors config group {gname}: nvfp4-pack-quantized is read by "
                                       "tripod.loader.hf_nvfp4.Nvfp4Format")

    def _unpack_fp4(self, tensors: Mapping[str, torch.Tensor], module: str, scheme: IntScheme) -> Any:
        raise NotImplementedError  # (hf_nvfp4.Nvfp4Format)

    @staticmethod
    def _matches(pattern: str, module: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], module) is not None
        if pattern == "Linear":  # every linear layer (the tensors tell which modules are linears)
            return True
        return module == pattern or module.endswith("." + pattern)

    def scheme_for(self, module: str) -> IntScheme | None:
        if any(self._matches(p, module) for p in self.ignore):
            return None
        for g in self.groups:
            if any(self._matches(t, module) for t in g.targets):
                return g.scheme
        return None

    def describe(self) -> str:
        schemes = sorted({g.scheme.describe() for g in self.groups})
        order = ", act-order" if self.act_order else ""
        fmt = "nvfp4-pack-quantized" if all(g.scheme.kind.startswith("nvfp4") for g in self.groups) else "pack-quantized"
        return f"compressed-tensors {fmt} ({'; '.join(schemes)}{order})"

    def schemes(self) -> list[IntScheme]:
        return [g.scheme for g in self.groups]

    def unpack(self, tensors: Mapping[str, torch.Tensor], module: str) -> GroupQuantized:
        f = "compressed-tensors"
        scheme = self.scheme_for(module)
        assert scheme is not None  # modules() refused the others
        if scheme.kind.startswith("nvfp4"):
            return self._unpack_fp4(tensors, module, scheme)
        bits, group = scheme.bits, scheme.group
        per = 32 // bits
        packed = _int32(need_tensor(tensors, module + ".weight_packed", f), module + ".weight_packed", f)
        shape = need_tensor(tensors, module + ".weight_shape", f)
        if shape.numel() != 2:
            raise QuantizedCheckpointError(f"{f} checkpoint: {module}.weight_shape must hold (outputs, inputs)")
        n, k = (int(v) for v in shape.tolist())
        check_shape(packed, (n, -(-k // per)), module + ".weight_packed", f, f"{n} outputs x {k} inputs / {per}")
        gs = _groups(k, group)
        scales = need_tensor(tensors, module + ".weight_scale", f)
        check_shape(scales, (n, gs), module + ".weight_scale", f, f"{n} outputs x {gs} groups ({scheme.describe()})")
        offset = 1 << (bits - 1)
        codes = _unpack_cols(packed, bits)[:, :k].contiguous().to(torch.uint8)  # unsigned: q + offset
        if scheme.symmetric:
            zeros = torch.full((n, gs), offset, dtype=torch.int32)
        else:
            zp = _int32(need_tensor(tensors, module + ".weight_zero_point", f), module + ".weight_zero_point", f)
            check_shape(zp, (-(-n // per), gs), module + ".weight_zero_point", f, f"{n} outputs / {per} x {gs} groups")
            zeros = _unpack_rows(zp, bits)[:n].contiguous()  # q + offset - (z + offset)
        gi = tensors.get(module + ".weight_g_idx")
        g_idx = _default_g_idx(k, group) if gi is None else _check_g_idx(gi, k, gs, module + ".weight_g_idx", f)
        return GroupQuantized(codes, float_scales(scales, module + ".weight_scale", f), zeros, g_idx, bits)


