"""Read a local HF-format folder: config.json, *.safetensors, tokenizer files. No hub."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tripod.loader import hf_nvfp4, hf_quant, hf_w8a8
from tripod.loader.lazy import LazyTensors
from tripod.models.config import ModelConfig
from tripod.models.vision.spec import vlm_family

log = logging.getLogger(__name__)


class LazySafetensors(LazyTensors):
    """The tensors of several safetensors files by name, read on access (never cached here)."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        super().__init__({k: h for h in self._handles for k in h.keys()})

    def read(self, name: str, handle: Any) -> torch.Tensor:
        return handle.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())


class HFFolder:
    """A local checkpoint folder in Hugging Face layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{self.path} is not a model folder: config.json is missing")
        self.raw_config: dict[str, Any] = json.loads(cfg.read_text())
        if vlm_family(self.raw_config) is not None:
            self.raw_config = _completed(self.path, self.raw_config)
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(
                f"{self.path} has no *.safetensors files (tripod loads safetensors or GGUF only)"
            )
        # AWQ / GPTQ / compressed-tensors integer weights (None: unquantized, FP8 or MXFP4); an
        # unsupported scheme is refused here, before anything is read.
        self.int_format = hf_w8a8.parse(self.raw_config)

    def config(self) -> ModelConfig:
        cfg = ModelConfig.from_hf_dict(self.raw_config)
        if not cfg.eos_token_ids:
            gen = self.path / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                if eos is not None:
                    ids = tuple(eos) if isinstance(eos, list) else (eos,)
                    cfg = _replace(cfg, eos_token_ids=tuple(int(e) for e in ids))
        return cfg

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """DeepSeek's block-wise FP8 format (``quant_method: fp8`` with ``weight_block_size``):
        the block shape, or None for an unquantized folder. Other quantizations are refused."""
        q = self.raw_config.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        block = q.get("weight_block_size")
        if method == "mxfp4":  # gpt-oss: MXFP4 experts, dequantized as they load (``ExpertSet``)
            return None
        if self.int_format is not None:
            return None
        if method == "fp8" and isinstance(block, list) and len(block) == 2:
            if q.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"FP8 format {q.get('fmt')!r} is not supported (only e4m3)")
            return int(block[0]), int(block[1])
        raise ValueError(
            f"quantized checkpoints ({method or q}) are not supported; tripod loads unquantized "
            "folders, DeepSeek's block-wise FP8 folders, gpt-oss's MXFP4 folders, "
            f"{hf_quant.SUPPORTED} and GGUF files"
        )

    @property
    def quantization(self) -> str:
        block = self.fp8_block
        if block is not None:
            return f"fp8 (block {block[0]}x{block[1]}, e4m3)"
        if (self.raw_config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
            return "mxfp4 (MoE experts; dequantized at load)"
        if self.int_format is not None:
            return self.int_format.describe()
        return str(self.raw_config.get("torch_dtype") or self.raw_config.get("dtype") or "none")

    def lazy_weights(self) -> Mapping[str, torch.Tensor] | None:
        """Every tensor, each read from its file only when asked for (a tensor-parallel rank keeps
        one layer's full tensors at a time, then its slices); None for a block-wise FP8 checkpoint,
        whose weights are dequantized as a whole."""
        if self.fp8_block is not None or self.int_format is not None:
            return None
        return LazySafetensors(self.files)

    def weights(self, keep_fp8: bool = False) -> Mapping[str, torch.Tensor]:
        """Every tensor; block-wise FP8 weights dequantized (float32) with their
        ``weight_scale_inv`` (the scales themselves are not returned) — or, with ``keep_fp8``,
        as stored, scales included. Integer-quantized folders: a lazy mapping that reads each tensor
        when asked for and dequantizes a quantized linear's ``weight`` then (float32), one at a time,
        so loading never holds the whole model dequantized (``DequantizedTensors``)."""
        from safetensors.torch import load_file

        if self.int_format is not None:
            lazy = DequantizedTensors(LazySafetensors(self.files), self.int_format)
            log.info("%s: %d %s weights dequantized as they load", self.path.name, len(lazy.modules),
                     self.int_format.describe())
            return lazy
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            out.update(load_file(str(f)))
        block = self.fp8_block
        if block is None or keep_fp8:
            return out
        scales = [n for n in out if n.endswith(".weight_scale_inv")]
        for s in scales:
            w = s.removesuffix("_scale_inv")
            if w not in out:
                raise ValueError(f"FP8 checkpoint has {s} but no {w}")
            out[w] = dequantize_fp8_blocks(out[w], out.pop(s), block)
        left = [n for n, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        if left:
            raise ValueError(f"FP8 tensors without a weight_scale_inv: {', '.join(left[:4])}")
        log.info("%s: %d block-wise FP8 weights dequantized at load (block %dx%d)", self.path.name,
                 len(scales), *block)
        return out

    def stored_weights(self) -> dict[str, Any]:
        """The integer-quantized weights tripod's kernels execute as stored (``stored.group_blocks``),
        as blocks under HF names (act-order ones with the input permutation that makes their groups
        contiguous); the others (groups not a multiple of 32, float32 scales whose products with the
        zero points round) are left to their dequantized form, counted in the log."""
        from tripod.layers.linear import StoredWeight
        from tripod.loader.stored import group_blocks

        if self.int_format is None:
            return {}
        # one quantized linear at a time (read, unpacked, rewritten): never every unpacked code at once
        tensors = DequantizedTensors(LazySafetensors(self.files), self.int_format)
        stored: dict[str, Any] = {}
        found = tensors.modules
        for module in found:
            w = tensors.unpack(module)
            if isinstance(w, hf_w8a8.W8A8Weight):  # run as stored, activations quantized (layers/w8a8.py)
                kind = "W8A8_INT8" if w.kind == "int8" else "W8A8_FP8"
                ins = None if w.input_scale is None else w.input_scale.expand(w.shape[0]).contiguous()
                stored[module + ".weight"] = StoredWeight(kind, w.codes, w.shape, None, scales=w.scales, input_scales=ins)
                continue
            if isinstance(w, hf_nvfp4.Nvfp4W4A4Weight):  # FP4 activations quantized per row (layers/w4a4.py)
                ins = w.input_global_scale.expand(w.shape[0]).contiguous()
                stored[module + ".weight"] = StoredWeight("W4A4_NVFP4", w.codes, w.shape, None, scales=w.scales,
                                                          input_scales=ins)
                continue
            blocks = group_blocks(w)
            if blocks is not None:
                # (8-bit codes with zero points run as two 4-bit halves over the inputs read twice: K' = 2K)
                k = w.shape[1] if blocks[2] is None else int(blocks[2].numel())
                stored[module + ".weight"] = StoredWeight(blocks[0], blocks[1], (w.shape[0], k), blocks[2])
        kinds = sorted({sw.kind for sw in stored.values()})
        log.info("%s: %d %s weights executed as stored on tripod's CPU kernels (%s blocks: codes x activations, "
                 "the group scales per 32 inputs%s)", self.path.name, len(stored), self.int_format.describe(),
                 "/".join(kinds) or "no", "; act-order inputs permuted once at load" if any(
                     sw.perm is not None for sw in stored.values()) else "")
        if len(stored) < len(found):
            log.info("%s: %d of %d quantized weights have no stored form the kernels execute "
                     "(groups not a multiple of 32, or float32 scales times zero points that round): they run dequantized",
                     self.path.name, len(found) - len(stored), len(found))
        return stored

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)


class DequantizedTensors(Mapping[str, torch.Tensor]):
    """An integer-quantized folder's tensors under the names of the model they make: each plain
    tensor as stored, each quantized linear's ``<module>.weight`` dequantized (float32) from its
    codes and scales when asked for — one tensor at a time, nothing cached — and none of the
    format's own tensors (codes, scales, zero points). Owns the format's checks of the names: a
    stray scale, a module stored quantized that the config leaves unquantized, a plain weight beside
    quantized tensors are refused when it is made."""

    def __init__(self, files: Mapping[str, torch.Tensor], fmt: hf_quant.IntFormat) -> None:
        self.files, self.fmt = files, fmt
        self.modules = fmt.modules(list(files))
        quantized = set(self.modules)
        for module in self.modules:
            if module + ".weight" in files and not fmt.weight_is_codes:
                raise hf_quant.QuantizedCheckpointError(
                    f"{fmt.name} checkpoint: {module} has both a plain weight and quantized tensors")
        own = {f"{m}.{s}" for m in self.modules for s in (fmt.marker, *fmt.aux, *(("weight",) if fmt.weight_is_codes else ()))}
        self.plain = {n for n in files if n not in own}
        self.names = [n for n in files if n in self.plain] + [m + ".weight" for m in self.modules]
        self.quantized_weights = {m + ".weight": m for m in quantized}

    def unpack(self, module: str) -> Any:
        """``module``'s weight in the format's unpacked form (``GroupQuantized``, ``W8A8Weight``, …)."""
        return self.fmt.unpack(self.files, module)

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self.quantized_weights.get(name)
        if module is not None:
            return self.unpack(module).dequantize()
        if name not in self.plain:
            raise KeyError(name)
        return self.files[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.quantized_weights or name in self.plain


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` float8 ``[N, K]`` times its per-block scale ``[ceil(N/bn), ceil(K/bk)]`` → float32."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"FP8 weight {tuple(w.shape)} needs a {rows}x{cols} scale grid for {bn}x{bk} blocks, "
                         f"got {tuple(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w.float() * s


def _completed(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language ``config.json`` with its sub-configs' defaults filled in as transformers
    fills them (checkpoints often store only what differs: LLaVA-1.5's text config names five keys)."""
    from transformers import AutoConfig

    try:
        full = AutoConfig.from_pretrained(str(path), local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: transformers cannot read this vision-language config.json ({err})") from err
    return {**raw, **{k: full[k] for k in ("text_config", "vision_config") if isinstance(full.get(k), dict)}}


def _replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)
