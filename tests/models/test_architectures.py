"""Every supported architecture, token-exact against Hugging Face transformers (fp32).

For each family a tiny random checkpoint is built and saved with transformers (``tiny_models``),
loaded by tripod from the folder, and its greedy tokens compared with transformers' on the same
weights: each prompt alone, all prompts in one batch (the second time round their prefixes are
cached: radix hits), with chunked prefill (chunks shorter than the prompts, windows shorter than
the sequences), on the reference path and on the optimized one. Same near-tie rule as the other
parity tests (``conftest.check_greedy_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.support.tiny_models import ARCHS, VOCAB, add_mtp, build_hf, save, save_fp8, save_mxfp4
from tripod import Engine, SamplingParams

N_TOKENS = 24


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    a = torch.randint(3, VOCAB, (45,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (7,), generator=g).tolist()
    c = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    d = a[:33] + torch.randint(3, VOCAB, (5,), generator=g).tolist()  # shares a's first 33 tokens
    return [a, b, c, d]


PROMPTS = _prompts()
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    """kind -> (folder, HF reference), built once per module."""
    made: dict[str, tuple[Path, HFReference]] = {}

    def get(kind: str) -> tuple[Path, HFReference]:
        if kind not in made:
            model = build_hf(kind)
            folder = save(model, tmp_path_factory.mktemp(kind), hf_tokenizer)
            made[kind] = (folder, HFReference(model))
        return made[kind]

    return get


def _check_engine(eng: Engine, ref: HFReference, what: str) -> None:
    refs = [ref.greedy(p, N_TOKENS) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):  # alone, cold cache (d's prefix is a's: a hit already)
        (out,) = eng.generate([p], PARAMS)
        check_greedy_tokens(out.token_ids, refs[i], f"{what} prompt {i} alone")
    cached_before = eng.stats.cached_prompt_tokens
    outs = eng.generate(PROMPTS, PARAMS)  # batched, every prefix now in the radix cache
    for i, out in enumerate(outs):
        check_greedy_tokens(out.token_ids, refs[i], f"{what} prompt {i} batched")
    assert eng.stats.cached_prompt_tokens > cached_before, "the batched run never hit the prefix cache"
    eng.assert_consistent()


@pytest.mark.parametrize("kind", list(ARCHS))
@pytest.mark.parametrize("kernels", ["eager", "optimized"])
def test_greedy_parity(kind: str, kernels: str, tiny: Any) -> None:
    folder, ref = tiny(kind)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=16,
                 max_batch_tokens=64, max_running=8, kernels=kernels)
    assert eng.model_config.architecture == ref.model.config.architectures[0]
    _check_engine(eng, ref, f"{kind}/{kernels}")


def test_config_features_read(tiny: Any) -> None:
    """The family options reach tripod's config (a silently ignored option is a fidelity bug)."""
    from tripod.loader.hf_loader import HFFolder

    def cfg(kind: str) -> Any:
        return HFFolder(tiny(kind)[0]).config()

    assert cfg("mistral-sliding").sliding_window == 12 and cfg("mistral-sliding").is_sliding(2)
    g = cfg("gemma3")
    assert (g.sliding_layers, g.rope_local_theta, g.final_softcap, g.norm_offset) == ((0, 1), 10000.0, 30.0, True)
    assert cfg("qwen3").qk_norm and not cfg("llama").qk_norm
    q2 = cfg("qwen2-moe").moe
    assert q2 is not None and q2.shared_gate and q2.dense_layers == (1,) and not q2.norm_topk_prob
    v3 = cfg("deepseek-v3")
    assert v3.moe is not None and v3.moe.scoring == "sigmoid" and v3.moe.correction_bias
    assert v3.moe.topk_method == "group_top2" and v3.moe.dense_layers == (0,)
    assert v3.mla is not None and v3.mla.q_lora_rank == 24
    v2 = cfg("deepseek-v2")
    assert v2.moe is not None and v2.moe.topk_method == "group_max" and v2.mla is not None and v2.mla.q_lora_rank is None
    oss = cfg("gpt-oss")
    assert oss.attn_sinks and oss.attention_bias and oss.sliding_layers == (0, 2) and oss.sliding_window == 12
    assert oss.moe is not None and oss.moe.scoring == "topk_softmax" and oss.moe.router_bias and oss.moe.expert_bias
    assert oss.moe.swiglu_limit == 2.0 and oss.rope_scaling is not None and oss.rope_scaling["rope_type"] == "yarn"
    v4 = cfg("deepseek-v4")
    assert v4.v4 is not None and v4.moe is not None and v4.sliding_window is None  # (V4's window is its attention's)
    a = v4.v4.attn
    assert a.kinds == ("sliding", "csa", "hca") and (a.csa_rate, a.hca_rate, a.window, a.index_topk) == (4, 8, 8, 4)
    assert (a.head_dim, a.rope_dim, a.o_groups, a.o_lora_rank) == (32, 8, 2, 16)
    assert a.compress_scaling is not None and a.compress_scaling["rope_type"] == "yarn" and a.main_theta == 10000.0
    assert v4.v4.hash_layers == (0,) and v4.v4.hc_mult == 2 and v4.moe.scoring == "sqrtsoftplus"
    assert v4.moe.swiglu_style == "clamp" and v4.moe.shared_intermediate_size == 32


def test_deepseek_v4_compressed_attention(tiny: Any) -> None:
    """DeepSeek-V4's compressed caches, with chunks (5 tokens) that end inside compression blocks
    (4 and 8 tokens) and sequences longer than the window (8), several blocks and ``index_topk``
    (4): a prefix-cache hit (33 tokens: inside a block of each rate) decodes the tokens of a
    miss, which are transformers'; the indexer really narrows CSA; seeded sampling is the same
    alone and batched."""
    folder, ref = tiny("deepseek-v4")

    def engine() -> Engine:
        return Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=5, max_batch_tokens=12, max_running=4,
                      kernels="eager")

    a, d = PROMPTS[0], PROMPTS[3]  # d shares a's first 33 tokens
    cold = engine()
    (miss,) = cold.generate([a], PARAMS)
    assert cold.stats.cached_prompt_tokens == 0
    check_greedy_tokens(miss.token_ids, ref.greedy(a, N_TOKENS), "deepseek-v4 miss")
    warm = engine()
    warm.generate([d], PARAMS)
    (hit,) = warm.generate([a], PARAMS)
    assert warm.stats.cached_prompt_tokens >= 33
    assert hit.token_ids == miss.token_ids, "a prefix-cache hit decoded other tokens than a miss"
    cfg = warm.model_config.v4
    assert cfg is not None and warm.pool.kv.shape[-1] == cfg.attn.row_dim
    layers = {layer.attn.kind: layer.attn for layer in warm.loaded.model.layers}
    csa = layers["csa"]
    assert 0 < csa.selected < csa.complete, "the indexer kept every compressed entry: CSA was never sparse"
    seeded = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    alone = [warm.generate([p], seeded)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in warm.generate(PROMPTS, seeded)] == alone
    warm.assert_consistent()
    with pytest.raises(ValueError, match="multi-token-prediction module"):  # (this folder has none)
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=512, speculative="mtp")
    with pytest.raises(ValueError, match="one process"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=512, tensor_parallel_size=2)


def test_deepseek_v4_checkpoint_names(tiny: Any) -> None:
    """V4 folders hold DeepSeek's own tensor names (``attn.wq_a``, ``ffn.experts.N.w1``,
    ``hc_attn_fn`` ...), which transformers writes too: tripod reads them as transformers' modules."""
    from tripod.models.deepseek_v4 import v4_name

    names = _tensors(tiny("deepseek-v4")[0])
    assert "model.layers.1.attn.indexer.compressor.ape" in names and "head.weight" in names
    assert v4_name("model.layers.1.attn.indexer.compressor.ape") == "model.layers.1.self_attn.compressor.indexer.position_bias"
    assert v4_name("layers.0.ffn.shared_experts.w3.weight") == "model.layers.0.mlp.shared_experts.up_proj.weight"
    assert v4_name("layers.2.attn.norm.weight") == "model.layers.2.self_attn.kv_norm.weight"
    assert v4_name("norm.weight") == "model.norm.weight" and v4_name("head.weight") == "lm_head.weight"
    assert v4_name("hc_head_fn") == "model.hc_head.hc_fn" and v4_name("embed.weight") == "model.embed_tokens.weight"


def test_deepseek_v32_attends_only_the_indexed_tokens(tiny: Any) -> None:
    """V3.2's lightning indexer really prunes (sequences longer than ``index_topk``), the pool
    keeps its key beside each token's latent, and transformers' tokens still come out (prefill,
    chunked prefill over a cached prefix, decode)."""
    folder, ref = tiny("deepseek-v32")
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, kernels="eager")
    mc = eng.model_config
    assert mc.mla is not None and mc.mla.index_topk == 12
    assert eng.pool.kv.shape[-1] == mc.mla.latent_dim + mc.mla.index_head_dim
    (out,) = eng.generate([PROMPTS[0]], PARAMS)
    check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[0], N_TOKENS), "deepseek-v32 alone")
    indexers = [layer.attn.indexer for layer in eng.loaded.model.layers]
    assert all(ix is not None for ix in indexers)
    assert sum(ix.pruned for ix in indexers if ix is not None) > 0, "no query attended fewer tokens than it saw"


@pytest.mark.parametrize("kind", ["deepseek-v32", "gpt-oss"])
def test_day0_seeded_sampling_alone_equals_batched(kind: str, tiny: Any) -> None:
    """Seeded sampling on the sparse (V3.2) and sink/window (gpt-oss) attention: each request's
    tokens are the same alone and batched with the others (V4: its own test above)."""
    eng = Engine(model=str(tiny(kind)[0]), dtype="float32", kv_cache_tokens=4096, chunk_size=16, kernels="eager")
    seeded = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    alone = [eng.generate([p], seeded)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in eng.generate(PROMPTS, seeded)] == alone


def test_gpt_oss_mxfp4_checkpoint(tmp_path: Path, hf_tokenizer: Any) -> None:
    """gpt-oss's MXFP4 folder (experts as packed FP4 blocks with E8M0 scales, made here by an
    independent quantizer) loads, says so, and decodes transformers' greedy tokens on the values
    the blocks hold (a dequantized copy given to transformers)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = build_hf("gpt-oss", seed=5)
    folder, held = save_mxfp4(model, tmp_path / "oss-mxfp4", hf_tokenizer)
    assert any(n.endswith("_blocks") for n in _tensors(folder)), "nothing was stored as MXFP4"
    plain = tmp_path / "oss-dequantized"
    plain.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    save_file(held, str(plain / "model.safetensors"), metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    assert not torch.equal(ref.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=16, kernels="eager")
    assert eng.loaded.quantization == "mxfp4 (MoE experts; dequantized at load)"
    _check_engine(eng, HFReference(ref), "gpt-oss mxfp4")


def _copy_with_config(src: Path, dst: Path, edit: Any) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_model_type_dispatch_without_architectures(tiny: Any, tmp_path: Path) -> None:
    """A config.json without ``architectures`` is read by its ``model_type``, as transformers does
    (a DeepSeek-V3 folder was loaded as Llama and failed on a missing q_proj): same tokens as the
    transformers reference."""
    folder, ref = tiny("deepseek-v3")
    bare = _copy_with_config(folder, tmp_path / "v3-bare", lambda c: c.pop("architectures", None))
    eng = Engine(model=str(bare), dtype="float32", kv_cache_tokens=2048, kernels="eager")
    assert eng.model_config.architecture == "DeepseekV3ForCausalLM"
    (out,) = eng.generate([PROMPTS[0]], PARAMS)
    check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[0], N_TOKENS), "deepseek-v3 without architectures")


def test_model_type_and_architectures_disagree(tiny: Any, tmp_path: Path) -> None:
    """``architectures`` naming one family and ``model_type`` another is refused, naming both."""
    folder, _ = tiny("deepseek-v3")
    bad = _copy_with_config(folder, tmp_path / "v3-llama", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*deepseek_v3"):
        Engine(model=str(bad), dtype="float32", kv_cache_tokens=2048, kernels="eager")
    odd = _copy_with_config(folder, tmp_path / "odd", lambda c: (c.pop("architectures", None), c.update(model_type="nope")))
    with pytest.raises(ValueError, match=r"model_type 'nope' is not one tripod supports"):
        Engine(model=str(odd), dtype="float32", kv_cache_tokens=2048, kernels="eager")


def test_mla_latent_pool_bytes(tiny: Any) -> None:
    """MLA's pool holds the latent per token, not per-head K/V: fewer bytes than MHA would."""
    folder, _ = tiny("deepseek-v3")
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)
    mc = eng.model_config
    assert mc.mla is not None
    assert eng.pool.kv.shape == (mc.num_layers, 256, mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim)
    latent = mc.pool_spec().bytes_per_token(torch.float32)
    mha = mc.mha_equivalent_spec().bytes_per_token(torch.float32)
    assert latent == mc.num_layers * 24 * 4
    assert mha == mc.num_layers * 4 * (24 + 16) * 4
    assert eng.kv_bytes_per_token == latent


def test_mla_absorbed_equals_expanded(tiny: Any) -> None:
    """The decode form (W_UK folded into the query, W_UV after attention, latents never
    expanded) and the prefill form (latents expanded to per-head K/V) give the same output."""
    from tripod.layers.backends import REFERENCE
    from tripod.layers.mla import MLAttention

    folder, _ = tiny("deepseek-v3")
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)
    attn = eng.loaded.model.layers[1].attn
    assert isinstance(attn, MLAttention)
    attn.prepare(REFERENCE)
    g = torch.Generator().manual_seed(3)
    c, h, n = attn.cfg, attn.h, 9
    q_nope = torch.randn(n, h, c.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(n, h, c.qk_rope_head_dim, generator=g)
    lat = torch.randn(n, c.latent_dim, generator=g)
    expanded = attn._expanded(q_nope, q_pe, lat, None, True, attn.ops["dense"])
    mask = torch.ones(n, n, dtype=torch.bool).tril()[:, None, None, :]
    absorbed = attn._absorbed(q_nope, q_pe, lat.unsqueeze(0).expand(n, -1, -1), mask)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    """DeepSeek-V3 saved as block-wise FP8 (16x16 blocks), and transformers holding the
    dequantized weights (an unquantized copy, dequantized tile by tile in the test,
    independently of tripod's loader)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("fp8")
    model = build_hf("deepseek-v3", seed=3)
    folder, deq = save_fp8(model, tmp / "v3-fp8", hf_tokenizer, block=16)
    plain = tmp / "v3-dequantized"
    plain.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in deq.items()}, str(plain / "model.safetensors"), metadata={"format": "pt"})
    assert any(t.dtype == torch.float8_e4m3fn for t in _tensors(folder).values()), "nothing was stored as FP8"
    ref_model = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    return folder, HFReference(ref_model)


def test_fp8_block_checkpoint(fp8_v3: tuple[Path, HFReference]) -> None:
    """DeepSeek's block-wise FP8 folder loads (dequantized to the run dtype by default, said so)
    and decodes the same greedy tokens as transformers holding the dequantized weights."""
    folder, ref = fp8_v3
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=16)
    assert eng.loaded.quantization == "fp8 (block 16x16, e4m3)"
    assert eng.loaded.weights == "dequantized"
    assert eng.loaded.model.fp8_weights == 0
    _check_engine(eng, ref, "deepseek-v3 fp8 dequantized")


def test_fp8_weights_kept_in_fp8(fp8_v3: tuple[Path, HFReference]) -> None:
    """``weights="fp8"`` (w8a16): the projections stay float8 in memory, dequantized per block
    band inside each matmul, and decode the dequantized reference's greedy tokens."""
    from tripod.layers.linear import Fp8BlockLinear

    folder, ref = fp8_v3
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=16, weights="fp8")
    net = eng.loaded.model
    assert eng.loaded.weights == "fp8" and net.fp8_weights > 0
    moe_layer = net.layers[1]
    assert moe_layer.mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    assert moe_layer.mlp.experts.down.dtype == torch.float8_e4m3fn
    assert moe_layer.attn.o.dtype == torch.float8_e4m3fn
    assert isinstance(moe_layer.attn.ops[eng.runner.backend.form]["o"], Fp8BlockLinear)
    assert net.layers[0].mlp.gate_up.dtype == torch.float8_e4m3fn  # the dense first layer too
    _check_engine(eng, ref, "deepseek-v3 fp8 kept in FP8")


def test_fp8_mode_needs_an_fp8_checkpoint(tiny: Any) -> None:
    folder, _ = tiny("llama")
    with pytest.raises(ValueError, match="--weights fp8 keeps a block-wise FP8"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="fp8")


def test_fp8_refused_in_kernels_weights_mode_on_gguf_only(tmp_path: Path, hf_tokenizer: Any) -> None:
    """An absurd combination gets a clear error, not a silent precision change."""
    model = build_hf("llama", seed=4)
    folder = save(model, tmp_path / "llama", hf_tokenizer)
    with pytest.raises(ValueError, match="stored"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="stored")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_mtp_module_forward(tmp_path: Path, hf_tokenizer: Any) -> None:
    """DeepSeek-V3's MTP module is loaded from the checkpoint (``model.layers.{L}.*``) and its
    forward — a prefill over a sequence, then a decode step (absorbed MLA) — equals the module
    assembled from transformers' own DeepSeek-V3 decoder layer with the same weights."""
    from tripod.layers.backends import REFERENCE
    from tripod.layers.batch import ForwardBatch, PrefillSegment
    from tripod.models.deepseek import MTPModule

    target = build_hf("deepseek-v3", seed=5)
    folder = save(target, tmp_path / "v3-mtp", hf_tokenizer)
    bigger, extra = add_mtp(target, folder)
    cfg = json.loads((folder / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(8)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    n = 10
    ids = torch.randint(3, VOCAB, (n + 1,), generator=g)
    hidden = torch.randn(n + 1, h, generator=g)

    @torch.inference_mode()
    def reference(upto: int) -> torch.Tensor:
        e = target.model.embed_tokens(ids[:upto])
        x = torch.nn.functional.linear(
            torch.cat((rms(e, extra["enorm.weight"]), rms(hidden[:upto], extra["hnorm.weight"])), -1), extra["eh_proj.weight"]
        )[None]
        pos = torch.arange(upto)[None]
        block = bigger.model.layers[layers]
        y = block(x, attention_mask=None, position_ids=pos, position_embeddings=bigger.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return torch.nn.functional.linear(rms(y[0], extra["shared_head.norm.weight"]), extra["shared_head.head.weight"])

    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)
    net = eng.loaded.model
    assert net.mtp is not None, "the MTP module was not loaded"
    pool = MTPModule.pool_spec(eng.model_config).make(64, torch.float32, torch.device("cpu"))
    prefill = ForwardBatch(
        input_ids=ids[:n], positions=torch.arange(n), out_slots=torch.arange(n), num_decode=0,
        decode_kv_idx=None, decode_mask=None, backend=REFERENCE, prefills=[PrefillSegment(0, n, 0, None, None)],
        logits_idx=None,
    )
    logits, own = net.mtp(net, prefill, hidden[:n], pool)
    assert own.shape == (n, h)
    torch.testing.assert_close(logits, reference(n), rtol=1e-4, atol=1e-4)
    decode = ForwardBatch(
        input_ids=ids[n:], positions=torch.tensor([n]), out_slots=torch.tensor([n]), num_decode=1,
        decode_kv_idx=torch.arange(n + 1)[None], decode_mask=torch.ones(1, 1, 1, n + 1, dtype=torch.bool),
        backend=REFERENCE,
    )
    step, _ = net.mtp(net, decode, hidden[n:], pool)
    torch.testing.assert_close(step[0], reference(n + 1)[-1], rtol=1e-4, atol=1e-4)
