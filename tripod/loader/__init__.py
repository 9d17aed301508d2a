"""Model loading: the embedded default, GGUF files and local HF folders."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tripod.layers.parallel import SINGLE, SINGLE_STAGE, ParallelGroup, PipeStage
from tripod.loader.embedded import (
    EMBEDDED_NAME,
    PACKAGED_ENCODERS,
    PACKAGED_MODELS,
    embedded_model_path,
    packaged_encoder_path,
    packaged_model_path,
)
from tripod.loader.gguf_loader import GGUFFile
from tripod.loader.hf_loader import HFFolder
from tripod.loader.quant_card import quantization_card
from tripod.models.config import ModelConfig
from tripod.models.llama import LlamaForCausalLM
from tripod.models.registry import model_class
from tripod.protocol.engine_ipc import ENCODER_ARCHITECTURE

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    quantization: str  # how the weights are stored on disk
    dtype: torch.dtype
    # "dequantized" (every weight dequantized to ``dtype``), "stored" (the GGUF's Q4_0/Q4_1/Q8_0/...
    # blocks kept too, for kernels that execute them as stored; see layers/linear.py) or "fp8"
    # (a block-wise FP8 checkpoint's weights kept in FP8: layers/linear.py Fp8BlockLinear).
    weights: str = "dequantized"
    # format, bits, group size, activations and what computes them (loader/quant_card.py); None: unquantized
    quantization_detail: dict[str, Any] | None = None


@dataclass(slots=True)
class LoadedTokenizer:
    """The text side of a model without its weights (what the HTTP server process needs)."""

    name: str
    path: str
    config: ModelConfig
    tokenizer: Any
    quantization: str




def encoder_folder(model: str | None) -> Path | None:
    """The folder of the encoder model (BERT family, for embeddings) ``model`` names: a packaged
    one (``all-minilm-l6-v2``) or a local folder whose config says ``model_type: bert``; None for
    a decoder."""
    if model is None:
        return None
    if model in PACKAGED_ENCODERS and not Path(model).exists():
        return packaged_encoder_path(model)
    path = Path(model).expanduser()
    cfg = path / "config.json"
    if path.is_dir() and cfg.is_file() and json.loads(cfg.read_text()).get("model_type") == "bert":
        return path
    return None


def _encoder_tokenizer(path: Path) -> LoadedTokenizer:
    from transformers import AutoTokenizer

    raw = json.loads((path / "config.json").read_text())
    heads = raw["num_attention_heads"]
    # NOTE: a decoder-shaped config of the encoder (the server reads its vocabulary and architecture).
    arch = (raw.get("architectures") or [ENCODER_ARCHITECTURE])[0]
    cfg = ModelConfig(arch, raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"],
                      raw["num_hidden_layers"], heads, heads, raw["hidden_size"] // heads,
                      raw.get("layer_norm_eps", 1e-12), 10000.0, raw["max_position_embeddings"], False)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return LoadedTokenizer(path.name, str(path), cfg, tok, "f32")


def load_tokenizer(model: str | None) -> LoadedTokenizer:
    """The tokenizer, chat template and config of ``model``, reading no weights."""
    enc = encoder_folder(model)
    if enc is not None:
        return _encoder_tokenizer(enc)
    name, path, src = open_source(model)
    return LoadedTokenizer(name, str(path), src.config(), src.tokenizer(), src.quantization)


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device, weights: str = "dequantized",
    tp: ParallelGroup = SINGLE, expert_parallel: bool = False, pp: PipeStage = SINGLE_STAGE,
    stored_only: bool = False,
) -> LoadedModel:
    """Load ``model`` (None: the embedded default; a ``.gguf`` file; or an HF folder).
    ``weights="stored"`` also keeps a GGUF's quantized blocks for the ``stored`` compute form.
    ``tp``: keep only this tensor-parallel rank's slices (an HF folder's tensors are then read one
    at a time, so the rank never holds the whole model); ``pp``: only this pipeline stage's layers.
    ``stored_only`` (``weights="stored"``, an HF integer-quantized folder, one process): the caller runs
    only the stored form, so each projection taken as stored gets no dense copy at all — the ``[0, K]``
    placeholder ``release_dense_stored`` would leave — and the load never holds it dequantized."""
    name, path, src = open_source(model)
    cfg = src.config()
    quant = src.quantization
    cls = model_class(cfg.architecture)
    net = cls(cfg, dtype, device)
    net.keep_stage(pp)
    fmt = src.int_format if isinstance(src, HFFolder) else None
    if fmt is not None and fmt.quantizes_activations and weights != "stored":
        raise ValueError(f"{path.name} is {quant}: its activations are quantized per token (or with its static scales) as the checkpoint says, "
                         f"which runs with --weights stored (or auto) on the CPU; --weights {weights} would run "
                         "another model")
    if fmt is not None and fmt.quantizes_activations and (tp.size > 1 or pp.stages > 1):
        raise ValueError(f"{path.name} is {quant}: W8A8 and W4A4 run in one process for now (no tensor or pipeline parallel)")
    if weights == "fp8":  # (the other modes load below)
        block = src.fp8_block if isinstance(src, HFFolder) else None
        if block is None:
            raise ValueError(
                f"--weights fp8 keeps a block-wise FP8 checkpoint's weights in FP8; {path.name} is {quant}: "
                "use the default dequantized weights"
            )
        net.load_weights(src.weights(keep_fp8=True), fp8_block=block)
        log.info("%s: %d weights kept in FP8 (w8a16: dequantized per block band inside each matmul)",
                 name, net.fp8_weights)
    stored: Mapping[str, Any] = {}
    if weights == "stored" and isinstance(src, HFFolder) and src.int_format is None:
        raise ValueError("--weights stored executes a GGUF file's quantized weights or an AWQ / GPTQ / "
                         "compressed-tensors folder's integer ones; this model is an unquantized HF folder")
    early = stored_only and weights == "stored" and fmt is not None and tp.size == 1 and pp.stages == 1
    if early:  # the stored form first: what it takes needs no dense weight (a [0, K] placeholder instead)
        stored = src.stored_weights()
        net.load_stored(stored)
    if weights != "fp8":
        lazy = src.lazy_weights() if tp.size > 1 or pp.stages > 1 else None
        dense = lazy if lazy is not None else src.weights()
        net.load_weights(_Placeholders(dense, _taken(net)) if early else dense, tp=tp, expert_parallel=expert_parallel)
    if weights == "stored":
        stored = stored or src.stored_weights()
        net.load_stored(stored)
        if fmt is not None and fmt.quantizes_activations:
            _check_w8a8_covered(net, stored)
        if not net.has_stored_weights:
            raise ValueError(
                f"--weights stored: {path.name} has no weights in a type tripod executes as stored "
                f"(GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K; int4 or int8 groups of a multiple of 32; this model is {quant}); "
                "use the default dequantized weights"
            )
    net.eval()
    tok = src.tokenizer()
    detail = quantization_card(src, weights, stored)
    if detail is not None:
        log.info("%s: quantization %s", name, detail)
    return LoadedModel(name, str(path), cfg, net, tok, quant, dtype, weights, detail)


def open_source(model: str | None) -> tuple[str, Path, GGUFFile | HFFolder]:
    """(name, path, the open GGUF file or HF folder) of ``model``, reading no weights."""
    if model is None:
        path = embedded_model_path()
        name = EMBEDDED_NAME
    elif model in PACKAGED_MODELS and not Path(model).exists():
        path = packaged_model_path(model)
        name = model
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ValueError(
                f"model path {str(path)!r} does not exist (give a .gguf file, a local HF folder or "
                f"one of the packaged models: {', '.join(PACKAGED_MODELS)}; tripod never downloads weights)"
            )
        name = path.stem if path.is_file() else path.name
    src: GGUFFile | HFFolder
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a .gguf file or a model folder")
        src = GGUFFile(path)
    else:
        src = HFFolder(path)
    return name, path, src


_SITES = {"qkv": ("attn", "qkv", "self_attn.", ("q_proj", "k_proj", "v_proj")), "o": ("attn", "o", "self_attn.", ("o_proj",)),
          "gate_up": ("mlp", "gate_up", "mlp.", ("gate_proj", "up_proj")), "down": ("mlp", "down", "mlp.", ("down_proj",))}


def _taken(net: Any) -> dict[str, int]:
    """The HF names of the weights ``net.load_stored`` took as stored (every part of each fused site),
    with their input widths (the model's parameters are made at their full shapes)."""
    out = {}
    for layer in net.layers:
        for key in layer.stored:
            mod, attr, prefix, parts = _SITES[key]
            k = int(getattr(getattr(layer, mod), attr).shape[1])
            out.update({f"model.layers.{layer.layer}.{prefix}{part}.weight": k for part in parts})
        mlp = getattr(layer, "mlp", None)
        shared = getattr(mlp, "shared", None)
        for key, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
            if shared is not None and key in getattr(mlp, "stored", {}):  # a MoE's shared expert run as stored
                k = int(getattr(shared, key).shape[1])
                out.update({f"{mlp.stored_prefix}{part}.weight": k for part in parts})
        experts = getattr(mlp, "experts", None)
        if getattr(experts, "stored", None):  # routed experts run as stored: no dense stacks either
            prefix, (g, u, d) = experts.source
            hidden, inter = int(experts.gate_up.shape[2]), int(experts.down.shape[2])
            for e in range(experts.num_experts):
                out.update({f"{prefix}{e}.{g}.weight": hidden, f"{prefix}{e}.{u}.weight": hidden,
                            f"{prefix}{e}.{d}.weight": inter})
    return out


class _Placeholders(Mapping[str, torch.Tensor]):
    """``base`` with each weight of ``widths`` read as a ``[0, K]`` placeholder (no memory; what
    ``layers/linear.py``'s ``released`` leaves), so its fused site loads as a released weight and the
    checkpoint's codes are never dequantized for it."""

    def __init__(self, base: Mapping[str, torch.Tensor], widths: dict[str, int]) -> None:
        self.base, self.widths = base, widths

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.widths:
            return torch.empty((0, self.widths[name]), dtype=torch.float32)
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __contains__(self, name: object) -> bool:
        return name in self.base


def _check_w8a8_covered(net: Any, stored: Mapping[str, Any]) -> None:
    """Every W8A8 weight must run as W8A8 (its activations quantized): refuse one the model did
    not take as stored (MoE experts, a projection fused with an unquantized one)."""
    parts = {"qkv": 3, "gate_up": 2}
    taken = sum(parts.get(k, 1) for layer in net.layers for k, sw in layer.stored.items()
                if sw.kind.startswith(("W8A8", "W4A4")))
    if taken != len(stored):
        experts = sorted(n for n in stored if ".experts." in n)[:2]
        why = f"MoE experts ({', '.join(experts)}, ...)" if experts else "a projection fused with one left unquantized"
        raise ValueError(f"W8A8 / W4A4 checkpoint: {len(stored) - taken} quantized weights would not run with their "
                         f"activations quantized here: {why}; W8A8 and W4A4 run the attention and dense MLP projections "
                         "for now")
