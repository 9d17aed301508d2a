"""Read a GGUF file: config and tokenizer from its metadata, tensors dequantized.

Tensors are dequantized with the ``gguf`` package to float32 and renamed to HF names, with
llama.cpp's rotary permutation of Q/K undone, so the model code sees exactly what an HF
checkpoint of the same weights would hold.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tripod import paths
from tripod.loader import gguf_kimi
from tripod.loader.gguf_hybrid import HYBRID_ARCHS, Entry, as_stored, entries, hf_config
from tripod.loader.lazy import LazyTensors
from tripod.models.config import ModelConfig

log = logging.getLogger(__name__)

# GGUF architecture → HF architecture; both share llama.cpp's tensor naming.
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3: norms on both sublayers' outputs, per-head q/k norms; "ffn_norm" is the pre-MLP norm.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFile:
    """An open GGUF file: metadata access, config, weights and tokenizer."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tripod.loader.gguf_reader import GGUFMetadataReader  # only GGUF users pay for gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file not found: {self.path}")
        self.reader = GGUFMetadataReader(self.path)
        self.arch = str(self.field("general.architecture"))
        if self.arch not in _ARCHS and not self.hybrid:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported; supported: "
                             f"{', '.join([*_ARCHS, *HYBRID_ARCHS, gguf_kimi.ARCH])}"
            )

    @property
    def hybrid(self) -> bool:
        """A hybrid GGUF (linear-attention / state-space layers): read back into transformers' layout
        (``loader/gguf_hybrid.py``; Kimi Linear: ``loader/gguf_kimi.py``)."""
        return self.arch in HYBRID_ARCHS or self.arch == gguf_kimi.ARCH

    def hybrid_config(self) -> dict[str, Any]:
        """A hybrid GGUF's metadata as the HF ``config.json`` dict."""
        return gguf_kimi.hf_config(self) if self.arch == gguf_kimi.ARCH else hf_config(self)

    def hybrid_entries(self) -> dict[str, Entry]:
        if self.arch == gguf_kimi.ARCH:
            return gguf_kimi.entries(self, self.hybrid_config())
        return entries(self, hf_config(self))

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @property
    def quantization(self) -> str:
        """The dominant tensor type of the file (e.g. ``Q4_1``), as stored on disk."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            if t.name.endswith(".weight") and len(t.shape) == 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return max(counts, key=lambda k: counts[k]) if counts else "unknown"

    def config(self) -> ModelConfig:
        if self.hybrid:
            return ModelConfig.from_hf_dict(self.hybrid_config())
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        names = {t.name for t in self.reader.tensors}
        embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        vocab = int(self.field(f"{a}.vocab_size", 0) or embd.shape[-1])
        rope_scaling: dict[str, Any] | None = None
        kind = self.field(f"{a}.rope.scaling.type")
        if kind and kind != "none":
            rope_scaling = {"rope_type": str(kind), "factor": float(self.field(f"{a}.rope.scaling.factor"))}
            orig = self.field(f"{a}.rope.scaling.original_context_length")
            if orig:
                rope_scaling["original_max_position_embeddings"] = int(orig)
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            # llama.cpp stores Llama 3.x rope scaling as per-dimension frequency divisors.
            rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in freqs.data]}
        eos = self.field("tokenizer.ggml.eos_token_id")
        bos = self.field("tokenizer.ggml.bos_token_id")
        extra: dict[str, Any] = {}
        if a == "gemma3":
            layers = int(self.field(f"{a}.block_count"))
            key_len = int(self.field(f"{a}.attention.key_length"))
            window = self.field(f"{a}.attention.sliding_window")
            # llama.cpp's Gemma 3: every sixth layer global, the others local with RoPE base 10k.
            extra = dict(
                head_dim=key_len, hidden_act="gelu_tanh", qk_norm=True, norm_offset=True,
                embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=float(key_len),
                sliding_window=int(window) if window else None,
                sliding_layers=tuple(i for i in range(layers) if (i + 1) % 6) if window else None,
                rope_local_theta=float(self.field(f"{a}.rope.freq_base_swa", 10000.0)),
            )
        base = dict(
            architecture=_ARCHS[a],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_layers=int(self.field(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.field(f"{a}.rope.dimension_count", hidden // heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            rope_scaling=rope_scaling,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
        base.update(extra)
        return ModelConfig(**base)

    def weights(self) -> dict[str, torch.Tensor]:
        """All tensors, dequantized to float32, under HF names."""
        lazy = self.lazy_weights()
        return {name: lazy[name] for name in lazy}

    def lazy_weights(self) -> GGUFTensors:
        """Every tensor under its HF name, dequantized only when asked for (a rank of a model over
        several processes then holds one layer's full tensors at a time, then its slices)."""
        return GGUFTensors(self)

    def dequantized(self, t: Any, name: str, cfg: ModelConfig) -> torch.Tensor:
        """One GGUF tensor as float32, in HF's layout."""
        import gguf

        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = _unpermute_rotary(w, n)
        return torch.from_numpy(w.copy() if not w.flags.writeable else w)

    def stored_weights(self) -> dict[str, Any]:
        """The 2-D weights whose GGUF type tripod's kernels execute as stored (Q4_0, Q4_1, Q8_0,
        Q5_0, Q4_K, Q6_K; ``loader/stored.py``), as blocks under HF names, rows in HF order (Q/K
        un-permuted like ``weights``)."""
        from tripod.layers.linear import StoredWeight
        from tripod.loader.stored import convert

        if self.hybrid:
            return self._hybrid_stored()
        cfg = self.config()
        out: dict[str, Any] = {}
        for t in self.reader.tensors:
            name = _hf_name(t.name, self.arch)
            if name is None or len(t.shape) != 2:
                continue
            found = convert(t.tensor_type.name, np.ascontiguousarray(t.data, dtype=np.uint8))
            if found is None:
                continue
            kind, blocks = found
            if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
                blocks = np.ascontiguousarray(_unpermute_rotary(blocks, n))
            rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
            out[name] = StoredWeight(kind, torch.from_numpy(blocks.copy()), (rows, cols))
        return out

    def _hybrid_stored(self) -> dict[str, Any]:
        """``stored_weights`` of a hybrid GGUF: the rows of each weight gathered back into HF's order
        (whole rows of blocks), a column reorder kept as the linear's input permutation."""
        from tripod.layers.linear import StoredWeight, fuse_rows
        from tripod.loader.stored import convert

        out: dict[str, Any] = {}
        for name, e in self.hybrid_entries().items():
            if e.rows is None and e.cols is None and e.join is None:
                moe, _, tail = name.partition(".block_sparse_moe.")
                if tail in _GRANITE_EXPERTS:  # Granite's stacked experts: as the per-expert names of the others
                    out.update(_expert_blocks(f"{moe}.block_sparse_moe.experts.{_GRANITE_EXPERTS[tail]}", e.tensors))
                    continue
                if name.endswith((".experts.down_proj", ".experts.gate_up_proj")):
                    out.update(_expert_blocks(name, e.tensors))
                    continue
            (t, *more) = e.tensors
            if len(t.shape) != 2:
                continue
            if more:  # (Granite's shared gate|up: two tensors concatenated by rows, whole rows of blocks)
                if e.join is None and e.undo is as_stored and all(len(m.shape) == 2 for m in more):
                    parts = [self._stored_2d(m) for m in e.tensors]
                    fused = fuse_rows(parts)
                    if fused is not None:
                        out[name] = fused
                continue
            found = convert(t.tensor_type.name, np.ascontiguousarray(t.data, dtype=np.uint8))
            if found is None:
                continue
            kind, blocks = found
            if e.rows is not None:
                blocks = blocks[e.rows]
            perm = torch.from_numpy(e.cols.astype(np.int64)) if e.cols is not None else None
            rows, cols = int(t.shape[1]), int(t.shape[0])
            out[name] = StoredWeight(kind, torch.from_numpy(np.array(blocks)), (rows, cols), perm)
        return out

    @staticmethod
    def _stored_2d(t: Any) -> Any:
        """One 2-D GGUF tensor as a ``StoredWeight`` (None: a type the kernels do not execute)."""
        from tripod.layers.linear import StoredWeight
        from tripod.loader.stored import convert

        found = convert(t.tensor_type.name, np.ascontiguousarray(t.data, dtype=np.uint8))
        if found is None:
            return None
        kind, blocks = found
        return StoredWeight(kind, torch.from_numpy(np.array(blocks)), (int(t.shape[1]), int(t.shape[0])))

    def tokenizer(self, cache_dir: Path | None = None) -> Any:
        """The HF fast tokenizer built from the GGUF vocabulary (cached after the first build,
        since converting a 49k vocabulary takes seconds)."""
        from transformers import AutoTokenizer

        st = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = (cache_dir or paths.cache_dir()) / "tokenizers" / key
        if (cache / "tokenizer.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
            except Exception as e:  # a corrupt cache is rebuilt, never fatal
                log.warning("rebuilding cached tokenizer at %s (%s)", cache, e)
        try:
            tok = AutoTokenizer.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, local_files_only=True
            )
        except ValueError as e:
            if "not supported" not in str(e):
                raise
            tok = _tokenizer_via_vocab_only(self.path, cache.with_name(cache.name + ".vocab"))
        template = self.field("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = str(template)
        try:
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
            tok.save_pretrained(str(tmp))
            if cache.exists():  # another process cached it first
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, cache)
        except OSError as e:
            log.warning("could not cache the tokenizer in %s: %s", cache, e)
        return tok


def _tokenizer_via_vocab_only(path: Path, folder: Path) -> Any:
    """The tokenizer of a GGUF whose architecture transformers' GGUF reader does not know (it reads
    tokenizers only from files of the architectures it loads, e.g. not ``qwen3next``): its
    ``tokenizer.*`` metadata copied, as stored, into a tensor-less GGUF labelled ``qwen2`` (the
    vocabulary does not depend on the architecture), which transformers then reads."""
    import gguf
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(path))
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "vocab.gguf"
    writer = gguf.GGUFWriter(str(out), "qwen2")
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    try:
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=out.name, local_files_only=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class GGUFTensors(LazyTensors):
    """A GGUF file's tensors by HF name, each dequantized on access (never cached here)."""

    def __init__(self, src: GGUFFile) -> None:
        self.src = src
        self.cfg = src.config()
        if src.hybrid:
            super().__init__(dict(src.hybrid_entries()))
            return
        where: dict[str, Any] = {}
        for t in src.reader.tensors:
            name = _hf_name(t.name, src.arch)
            if name is None:
                log.debug("skipping GGUF tensor %s", t.name)
                continue
            where[name] = t
        super().__init__(where)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._where[name]
        if isinstance(handle, Entry):  # (a hybrid's rewritten tensor: its shape is the rewrite's)
            return super().shape(name)
        return tuple(int(n) for n in reversed(handle.shape))  # (GGUF lists dimensions innermost first)

    def read(self, name: str, handle: Any) -> torch.Tensor:
        if isinstance(handle, Entry):
            import gguf

            parts = [np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32) for t in handle.tensors]
            whole = handle.join(parts) if handle.join is not None else (
                parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2))
            w = np.ascontiguousarray(handle.undo(whole))
            return torch.from_numpy(w.copy() if not w.flags.writeable else w)
        return self.src.dequantized(handle, name, self.cfg)


# Granite 4.0's stacked experts (``block_sparse_moe.input_linear`` = gate|up, ``output_linear`` = down)
# under the stacked names ``_expert_blocks`` splits per expert
_GRANITE_EXPERTS = {"input_linear.weight": "gate_up_proj", "output_linear.weight": "down_proj"}


def _expert_blocks(name: str, tensors: tuple[Any, ...]) -> dict[str, Any]:
    """A MoE layer's stacked expert tensors (``ffn_down_exps`` ``[E, rows, cols]``, or the gate and up
    pair behind transformers' ``gate_up_proj``) as each expert's stored weights under the per-expert HF
    names (``...experts.{e}.down_proj.weight``, ``gate_proj`` / ``up_proj``), whole rows of blocks: the
    routed experts then run as stored (``ExpertSet.load_stored``). None of a type the kernels do not take."""
    from tripod.layers.linear import StoredWeight
    from tripod.loader.stored import convert

    prefix = name.rsplit(".", 1)[0] + "."
    parts = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
    out: dict[str, Any] = {}
    for part, t in zip(parts, tensors, strict=True):
        if len(t.shape) != 3 or t.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"):
            return {}
        raw = np.ascontiguousarray(t.data, dtype=np.uint8)
        experts, rows, cols = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])  # innermost first
        found = convert(t.tensor_type.name, raw.reshape(experts * rows, -1))
        if found is None:
            return {}
        kind, blocks = found
        per = blocks.reshape(experts, rows, -1)
        for e in range(experts):
            out[f"{prefix}{e}.{part}.weight"] = StoredWeight(kind, torch.from_numpy(np.array(per[e])), (rows, cols))
    return out


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in names:
            return f"model.layers.{idx}.{names[rest]}"
    return None


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order.

    Within each head llama.cpp stores rows as (pair, 2) — row 2i and 2i+1 are the two halves of
    pair i; HF stores (2, pair) — all first halves, then all second halves.
    """
    rows = w.shape[0]
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, pairs, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
