"""Tiny random checkpoints of every supported architecture, built and saved with transformers.

Each is a few layers and a small hidden size, with weights re-drawn large enough that greedy
choices are decisive (transformers' 0.02-std initialisation gives near-uniform logits, where any
rounding difference flips a choice). Saved as an HF folder with the embedded model's tokenizer;
DeepSeek-V3 can also be saved in DeepSeek's block-wise FP8 format.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

VOCAB = 256
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# kind -> (model_type, extra config)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral-sliding": ("mistral", dict(sliding_window=12, head_dim=16)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                    mlp_only_layers=[0], norm_topk_prob=True)),
    "deepseek-v2": ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                        topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
    "deepseek-v3": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                        num_key_value_heads=4, num_nextn_predict_layers=0,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 128,
                                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                      "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "deepseek-v32": ("deepseek_v32", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                          routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
                                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                                          num_key_value_heads=4, index_n_heads=8, index_head_dim=16, index_topk=12,
                                          rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 128,
                                                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                           "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=12,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                swiglu_limit=2.0, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "original_max_position_embeddings": 64,
                                                 "rope_theta": 150000.0})),
    "deepseek-v4": ("deepseek_v4", dict(num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
                                        q_lora_rank=24, o_groups=2, o_lora_rank=16, index_n_heads=8,
                                        index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2,
                                        compress_rates={"compressed_sparse_attention": 4,
                                                        "heavily_compressed_attention": 8},
                                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention"],
                                        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=8,
                                        num_experts_per_tok=2, intermediate_size=32,  # (V4's name for moe_intermediate_size)
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 128,
                                                         "beta_fast": 32, "beta_slow": 1})),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   final_logit_softcapping=30.0)),
}


def build_hf(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """The transformers model (fp32, eval) with decisive random weights (``overrides``: config
    fields changed from the family's tiny defaults, e.g. wider layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mtype, extra = ARCHS[kind]
    cfg = AutoConfig.for_model(mtype, **{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:  # projections, experts, embeddings: unit-variance outputs
                fan_in = p.shape[-1]
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                if "lm_head" in name:
                    std = 3.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm.weight"):
                base = 0.0 if mtype.startswith("gemma") else 1.0  # Gemma's norms scale by (1 + w)
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):  # gpt-oss: sinks that take a real share of the softmax
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("router.bias") or name.endswith("hc.base") or name.endswith("hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("hc.scale") or name.endswith("hc_scale"):  # DeepSeek-V4's hyper-connections
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: k distinct experts per token id
                experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.eval()
    return model


def save(model: Any, folder: Path, tokenizer: Any) -> Path:
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def save_fp8(model: Any, folder: Path, tokenizer: Any, block: int = 16) -> tuple[Path, dict[str, torch.Tensor]]:
    """Save ``model`` as DeepSeek's block-wise FP8 checkpoint: every projection of the decoder
    layers as ``float8_e4m3fn`` with a ``weight_scale_inv`` per ``block``×``block`` tile. Returns
    the folder and the dequantized state dict (what an fp32 reference must hold)."""
    from safetensors.torch import load_file, save_file

    save(model, folder, tokenizer)
    files = sorted(folder.glob("*.safetensors"))
    deq: dict[str, torch.Tensor] = {}
    for f in files:
        tensors = load_file(str(f))
        out: dict[str, torch.Tensor] = {}
        for name, w in tensors.items():
            quantize = (
                name.startswith("model.layers.") and name.endswith("proj.weight") and w.ndim == 2
                and "layernorm" not in name
            )
            if not quantize:
                out[name] = w
                deq[name] = w
                continue
            q, scale = _quantize_blocks(w, block)
            out[name] = q
            out[name.replace(".weight", ".weight_scale_inv")] = scale
            deq[name] = dequantize_blocks(q, scale, block)
        save_file(out, str(f), metadata={"format": "pt"})
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder, deq


def _quantize_blocks(w: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // b), -(-k // b)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * b : (i + 1) * b, j * b : (j + 1) * b].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * b : (i + 1) * b, j * b : (j + 1) * b] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, b: int) -> torch.Tensor:
    """An independent reference dequantization (tile by tile)."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * b : (i + 1) * b, j * b : (j + 1) * b] = q[i * b : (i + 1) * b, j * b : (j + 1) * b].float() * scale[i, j]
    return out


def _one_layer_deeper(folder: Path, seed: int, last: dict[str, str] | None = None) -> tuple[dict[str, Any], int, Any]:
    """Mark the saved folder's config as carrying one MTP module; returns (its config, its layer
    count, transformers' random model one layer deeper: the module's block is that last layer).
    Per-layer lists get ``last``'s kind for the new layer (else their last one's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    layers = cfg["num_hidden_layers"]
    d = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    d["num_hidden_layers"] = layers + 1
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(d.get(key), list):
            d[key] = [*d[key], (last or {}).get(key, d[key][-1])]
    torch.manual_seed(seed)
    return cfg, layers, AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), dtype=torch.float32).eval()


def add_mtp(target: Any, folder: Path, seed: int = 6) -> tuple[Any, dict[str, torch.Tensor]]:
    """Give a saved tiny DeepSeek-V3 folder an MTP module (``num_nextn_predict_layers: 1`` and
    ``model.layers.{L}.*``): its decoder block is transformers' own fourth layer (returned, with
    the module's other tensors, for a reference)."""
    from safetensors.torch import save_file

    cfg, layers, bigger = _one_layer_deeper(folder, seed)
    g = torch.Generator().manual_seed(seed + 2)
    block = bigger.model.layers[layers]
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5) if p.ndim >= 2
                    else 1 + 0.1 * torch.randn(p.shape, generator=g))
    h = cfg["hidden_size"]
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "shared_head.head.weight": torch.randn(VOCAB, h, generator=g) * 3 / h**0.5,
    }
    prefix = f"model.layers.{layers}."
    tensors = {prefix + k: v.contiguous() for k, v in extra.items()}
    tensors.update({k: v.contiguous() for k, v in bigger.state_dict().items() if k.startswith(prefix)})
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    return bigger, extra


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[..., n]`` (n a multiple of 32) → (blocks uint8 ``[..., n/32, 16]``, scales uint8
    ``[..., n/32]``, the values they hold), rounding each value to the nearest FP4 after a
    power-of-two scale per block that brings its largest magnitude to at most 6."""
    *lead, n = w.shape
    x = w.float().reshape(*lead, n // 32, 32)
    top = x.abs().amax(dim=-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    y = x / torch.exp2(exp).unsqueeze(-1)
    mag = (y.abs().unsqueeze(-1) - _FP4).abs().argmin(dim=-1)  # 0..7
    code = mag + 8 * (y < 0).long() * (mag > 0).long()
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    held = torch.where(y < 0, -_FP4[mag], _FP4[mag]) * torch.exp2(exp).unsqueeze(-1)
    return packed, (exp + 127).to(torch.uint8), held.reshape(*lead, n)


def save_mxfp4(model: Any, folder: Path, tokenizer: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """Save a tiny gpt-oss as its MXFP4 checkpoint: every layer's experts (``gate_up_proj``,
    ``down_proj``; transformers holds them ``[E, in, out]``, the checkpoint ``[E, out, in]``) as
    ``*_blocks`` + ``*_scales``. Returns the folder and the state dict of the values it holds."""
    from safetensors.torch import load_file, save_file

    save(model, folder, tokenizer)
    held: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(f))
        out: dict[str, torch.Tensor] = {}
        for name, w in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                blocks, scales, values = _mxfp4_quantize(w.transpose(1, 2).contiguous())
                out[name + "_blocks"], out[name + "_scales"] = blocks, scales
                held[name] = values.transpose(1, 2).contiguous()
            else:
                out[name] = held[name] = w
        save_file(out, str(f), metadata={"format": "pt"})
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder, held


def add_v4_mtp(target: Any, folder: Path, seed: int = 6) -> None:
    """Give a saved tiny DeepSeek-V4 folder an MTP block as DeepSeek's checkpoints hold it
    (``num_nextn_predict_layers: 1`` and ``mtp.0.*``): a V4 block with sliding-window attention and
    a top-k MoE (transformers' own, saved under DeepSeek's names), ``e_proj``/``h_proj``,
    ``enorm``/``hnorm``/``norm`` and its own ``hc_head_*``."""
    import tempfile

    from safetensors.torch import load_file, save_file

    cfg, layers, bigger = _one_layer_deeper(folder, seed, {"layer_types": "sliding_attention", "mlp_layer_types": "moe"})
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in bigger.model.layers[layers].named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))
            elif name.endswith("norm.weight") or name.endswith("sinks"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        with tempfile.TemporaryDirectory() as tmp:
            bigger.save_pretrained(tmp)
            saved = {k: v for f in Path(tmp).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    block = f"model.layers.{layers}."
    tensors = {"mtp.0." + k.removeprefix(block): v.contiguous() for k, v in saved.items() if k.startswith(block)}
    h, n = cfg["hidden_size"], cfg["hc_mult"]
    tensors.update({
        "mtp.0.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "mtp.0.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "mtp.0.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "mtp.0.e_proj.weight": torch.randn(h, h, generator=g) / h**0.5,
        "mtp.0.h_proj.weight": torch.randn(h, h, generator=g) / h**0.5,
        "mtp.0.hc_head_fn": torch.randn(n, n * h, generator=g) / (n * h) ** 0.5,
        "mtp.0.hc_head_base": 0.5 * torch.randn(n, generator=g),
        "mtp.0.hc_head_scale": 1 + 0.2 * torch.randn(1, generator=g),
    })
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
