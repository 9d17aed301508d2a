"""Hybrid GGUFs made by llama.cpp's own converter, loaded by tripod, against the HF folder they came from.

A tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / LFM2 / Nemotron-H / Granite 4.0-H / Kimi Linear checkpoint is built with transformers (fixed seed,
the embedded tokenizer's vocabulary), converted by ``convert_hf_to_gguf.py`` from the llama.cpp
sources of the ``llama-cpp-python`` sdist (``tests/support/llamacpp_convert.py``: fetched with pip,
cached), and both are loaded by tripod:

- F32 GGUF (and F16 for Qwen3.5; the checkpoints hold float16-representable values): the greedy
  tokens and every logprob equal the HF folder's bit for bit (the loader undoes each rewrite of the
  converter exactly, ``loader/gguf_hybrid.py``);
- Q8_0 GGUF: its blocks run as stored on tripod's kernels and give the dequantized file's tokens
  (logprobs within 1e-3, float32 activations both), and every dequantized weight is within Q8_0's
  rounding (half a step of its block's scale) of the HF folder's. Tokens are not compared with the HF
  folder at Q8_0: the rounding moves logits by ~1e-2, enough to flip the near ties that random weights
  over a 49k vocabulary have.

If the converter cannot be fetched (no package index), the tests fail saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.models.test_hybrid_gdn import PROMPTS, build_qwen3_5
from tripod import Engine, SamplingParams

pytestmark = pytest.mark.slow  # (fetching and running llama.cpp's converter: ~10-20 s per file)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
ENGINE: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=64, max_batch_tokens=128,
                              max_running=4)
# model_type -> (GGUF architecture, overrides): llama.cpp's converter maps no dense layer in Qwen3-Next
# (``mlp_only_layers``: "Can not map tensor ...mlp.down_proj"), so its checkpoint is MoE on every layer.
# Nemotron-H with MoE layers converts as ``nemotron_h_moe``.
FAMILIES = {"qwen3_5_text": ("qwen35", {}), "qwen3_5_moe_text": ("qwen35moe", {}),
            "qwen3_next": ("qwen3next", {"mlp_only_layers": None}), "lfm2": ("lfm2", {}),
            "nemotron_h": ("nemotron_h_moe", {}), "granitemoehybrid": ("granitehybrid", {}),
            "kimi_linear": ("kimi-linear", {})}
MAMBA2 = {"nemotron_h": "NemotronHForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM"}


def build_lfm2(vocab: int) -> Any:
    """A tiny LFM2 (short-conv and attention layers; head_dim 32, a shape the CPU kernels' attention
    covers) with the random weights of ``tests/models/test_mamba_hybrids.py``."""
    import transformers

    from tests.models.test_mamba_hybrids import _lfm2_config

    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(_lfm2_config(vocab_size=vocab, hidden_size=64, num_attention_heads=2,
                                                     num_key_value_heads=1)).eval()
    return _randomized(model)


def _randomized(model: Any) -> Any:
    """``model`` with fixed random weights: norms 1 + 0.1·N(0, 1), every other tensor 0.2·N(0, 1)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in n else 0.2 * noise)
    return model


def build_mamba2(mtype: str, vocab: int) -> Any:
    """A tiny Nemotron-H (Mamba2, attention, MLP and MoE layers) or Granite 4.0 hybrid (Mamba2 and
    attention layers, MoE + shared MLP, NoPE as Granite 4.0-H) with head_dim 32 (a shape the CPU
    kernels' attention covers), the configs and random weights of ``tests/models/test_mamba_hybrids.py``."""
    import transformers

    from tests.models.test_mamba_hybrids import _granite_config, _nemotron_config

    if mtype == "nemotron_h":
        cfg = _nemotron_config(vocab_size=vocab, head_dim=32, layers_block_type=[
            "linear_attention", "full_attention", "mlp", "linear_attention", "moe"])
    else:
        d = {**_granite_config(False, 4).to_dict(), "vocab_size": vocab, "hidden_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "mamba_d_head": 32}
        cfg = transformers.GraniteMoeHybridConfig(**d)
    torch.manual_seed(0)
    model = getattr(transformers, MAMBA2[mtype])(cfg).eval()
    return _randomized(model)


def build_kimi_linear(vocab: int) -> Any:
    """A tiny Kimi Linear (KDA and MLA layers, a dense then MoE MLPs) with the random weights of
    ``tests/models/test_kimi_linear.py``; one expert group (as Moonshot's checkpoints: the GGUF does not
    record the group count)."""
    from tests.models.test_kimi_linear import build_kimi

    return build_kimi(vocab_size=vocab, n_group=1, topk_group=1)


def _moonshot_layout(folder: Path) -> Path:
    """A copy of a Kimi Linear folder in Moonshot's checkpoint layout, the one llama.cpp's converter
    reads: a dense layer's MLP under ``mlp`` (transformers saves it under ``block_sparse_moe``) and
    the config's ``linear_attn_config.full_attn_layers`` / ``kda_layers`` (1-indexed) and
    ``first_k_dense_replace``. The same tensors, renamed only."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = folder.with_name(folder.name + "_moonshot")
    shutil.copytree(folder, out)
    dense = ("gate_proj", "up_proj", "down_proj")
    w = load_file(str(out / "model.safetensors"))
    w = {k.replace(".block_sparse_moe.", ".mlp.") if k.split(".")[-2] in dense and "shared_experts" not in k else k: v
         for k, v in w.items()}
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((out / "config.json").read_text())
    types = d["layer_types"]
    d["linear_attn_config"].update(full_attn_layers=[i + 1 for i, t in enumerate(types) if t == "full_attention"],
                                   kda_layers=[i + 1 for i, t in enumerate(types) if t != "full_attention"])
    d["first_k_dense_replace"] = d["mlp_layer_types"].index("sparse")
    (out / "config.json").write_text(json.dumps(d))
    return out


def _hub_layer_types(folder: Path) -> None:
    """Granite's ``layer_types`` in the hub checkpoints' words (``mamba`` / ``attention``): llama.cpp's
    converter reads only those (transformers writes ``linear_attention`` / ``full_attention``, which
    the converter would take for Mamba2 layers everywhere); tripod reads both."""
    import json

    path = folder / "config.json"
    d = json.loads(path.read_text())
    d["layer_types"] = ["attention" if k == "full_attention" else "mamba" for k in d["layer_types"]]
    path.write_text(json.dumps(d))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> dict[str, Path]:
    out = {}
    for mtype, (_, extra) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(mtype)
        if mtype in MAMBA2:
            model = build_mamba2(mtype, len(hf_tokenizer))
        elif mtype == "lfm2":
            model = build_lfm2(len(hf_tokenizer))
        elif mtype == "kimi_linear":
            model = build_kimi_linear(len(hf_tokenizer))
        else:
            model = build_qwen3_5(0, mtype, vocab_size=len(hf_tokenizer), **extra)
        with torch.no_grad():  # values float16 holds exactly: an F16 GGUF then stores the folder's weights
            for p in model.parameters():
                p.copy_(p.half().float())
        model.save_pretrained(str(folder))
        hf_tokenizer.save_pretrained(str(folder))
        if mtype == "granitemoehybrid":
            _hub_layer_types(folder)
        if mtype == "kimi_linear":
            _moonshot_layout(folder)
        out[mtype] = folder
    return out


def _convert(folder: Path, outtype: str) -> Path:
    from tests.support.llamacpp_convert import convert

    moonshot = folder.with_name(folder.name + "_moonshot")  # (Kimi Linear: the layout the converter reads)
    out = folder.with_name(folder.name + f".{outtype}.gguf")
    if out.is_file():  # (converted once per session: several tests read the same file)
        return out
    try:
        return convert(moonshot if moonshot.is_dir() else folder, out, outtype,
                       no_mtp=not folder.name.startswith(("lfm2", "granite", "kimi")))
    except RuntimeError as e:  # (fetching the converter, or running it)
        pytest.fail(f"making the hybrid GGUF with llama.cpp's converter failed: {e}")


def _run(model: Path, **kw: Any) -> list[Any]:
    return Engine(model=str(model), **{**ENGINE, **kw}).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize(("mtype", "outtype"), [(m, "f32") for m in FAMILIES] + [("qwen3_5_text", "f16")])
def test_f32_f16_gguf_equals_the_hf_folder_bit_for_bit(mtype: str, outtype: str, checkpoints: dict[str, Path]) -> None:
    from tripod.loader.gguf_loader import GGUFFile

    folder = checkpoints[mtype]
    path = _convert(folder, outtype)
    src = GGUFFile(path)
    assert src.arch == FAMILIES[mtype][0] and src.hybrid and src.quantization == outtype.upper()
    from tripod.loader.hf_loader import HFFolder

    mine, theirs = src.config(), HFFolder(folder).config()
    assert (mine.architecture, mine.hybrid, mine.num_layers, mine.head_dim) == (
        theirs.architecture, theirs.hybrid, theirs.num_layers, theirs.head_dim)
    want = _run(folder, kernels="eager")
    for kernels in ("eager", "optimized"):
        got = _run(path, kernels=kernels)
        ref = want if kernels == "eager" else _run(folder, kernels=kernels)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert a.token_ids == b.token_ids, f"{mtype} {kernels} prompt {i}"
            assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs], f"{mtype} {kernels} prompt {i}"


def test_q8_0_gguf_runs_as_stored(checkpoints: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    from tripod.config import EngineConfig
    from tripod.loader.gguf_loader import GGUFFile
    from tripod.loader.weights_mode import auto_weights

    folder = checkpoints["qwen3_5_text"]
    path = _convert(folder, "q8_0")
    src = GGUFFile(path)
    assert src.quantization == "Q8_0" and auto_weights(EngineConfig(model=str(path)))[0] == "stored"
    # Every weight within Q8_0's rounding of the HF folder's (half a step of the largest block scale).
    hf = load_file(str(folder / "model.safetensors"))
    weights = src.weights()
    assert set(weights) == {k.replace(".A_log", ".A") for k in hf}
    for name, w in weights.items():
        if name.endswith(".A"):  # -exp(A_log), as the converter stored it (float32)
            assert torch.equal(w, -hf[name[:-1] + "A_log"].exp()), name
            continue
        ref = hf[name].reshape(w.shape)
        # Q8_0: half a step of the largest block scale, plus that scale rounded to float16 (127 * 2^-11 steps)
        tol = max(0.6 * float(ref.abs().max()) / 127, 1e-6)
        assert float((w - ref).abs().max()) <= tol, name
    stored = Engine(model=str(path), weights="stored", **ENGINE)
    model = stored.loaded.model
    assert stored.runner.form.startswith("stored") and model.stored_head is not None
    for layer in model.layers:  # every projection of every layer kind kept as stored blocks
        want = {"in_proj", "out_proj"} if layer.layer in model.hybrid.linear_layers else {"qkv", "gate", "o"}
        assert want | {"gate_up", "down"} <= set(layer.stored), (layer.layer, sorted(layer.stored))
    got = stored.generate(PROMPTS, PARAMS)
    want_out = _run(path, weights="dequantized")
    for i, (a, b) in enumerate(zip(got, want_out, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3, i
    alone = [stored.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    assert alone == [o.token_ids for o in got], "a request's tokens differ alone and batched"
    stored.assert_consistent()
    assert np.isfinite([lp.logprob for o in got for lp in o.logprobs]).all()
    # The defaults (--weights auto, --dtype auto) choose the stored blocks with bf16 activations; a
    # request's tokens are the same alone as batched there too.
    auto = Engine(model=str(path), kv_cache_tokens=1024)
    assert auto.loaded.weights == "stored" and auto.dtype_name == "bfloat16"
    batched = [o.token_ids for o in auto.generate(PROMPTS, PARAMS)]
    assert [auto.generate([p], PARAMS)[0].token_ids for p in PROMPTS] == batched


def test_q8_0_moe_gguf_experts_run_as_stored(checkpoints: dict[str, Path]) -> None:
    """A Qwen3.5-MoE Q8_0 GGUF with --weights stored: each routed expert's gate/up and down (the file's
    stacked ``ffn_*_exps``, split per expert by whole rows of blocks) run as stored Q8_0 blocks on the
    kernels' stored linear, no dense expert stack is held, the weights resident are below the
    dequantized load's by at least the experts' float32 minus their blocks, and the tokens are the
    dequantized file's, alone and batched."""
    from tripod.engine.executor.group import resident_weight_bytes
    from tripod.layers.linear import KernelLinear
    from tripod.layers.moe import MoE

    path = _convert(checkpoints["qwen3_5_moe_text"], "q8_0")
    stored = Engine(model=str(path), weights="stored", **ENGINE)
    model, form = stored.loaded.model, stored.runner.backend.form
    experts = [layer.mlp.experts for layer in model.layers if isinstance(layer.mlp, MoE)]
    assert experts and len(experts) == len(model.layers)
    blocks = dense = 0
    for ex in experts:
        assert ex.gate_up.numel() == 0 and ex.down.numel() == 0, "a dense expert stack is still held"
        ops = ex.ops[form]
        assert len(ops) == 2 * ex.num_experts
        for e in range(ex.num_experts):
            for j, name in enumerate(("gate_up", "down")):
                sw, op = ex.stored[f"{name}.{e}"], ops[2 * e + j]
                assert isinstance(op, KernelLinear) and op.fmt == "q8_0" and op.packed.data_ptr() == sw.blocks.data_ptr()
                blocks += sw.blocks.numel()
                dense += 4 * sw.shape[0] * sw.shape[1]
    for layer in model.layers:  # the shared expert's Q8_0 gate/up runs as stored too (its down is F16 here)
        assert set(layer.mlp.stored) == {"gate_up"} and layer.mlp.shared.gate_up.numel() == 0
    # the experts hold their blocks and nothing else (34 bytes a 32 weights: < 0.3x their float32 stacks)
    assert sum(resident_weight_bytes(ex) for ex in experts) == blocks < 0.3 * dense
    deq = Engine(model=str(path), weights="dequantized", **ENGINE)
    deq_experts = [layer.mlp.experts for layer in deq.loaded.model.layers if isinstance(layer.mlp, MoE)]
    assert sum(resident_weight_bytes(ex) for ex in deq_experts) == dense
    got = stored.generate(PROMPTS, PARAMS)
    want = deq.generate(PROMPTS, PARAMS)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3, i
    alone = [stored.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    assert alone == [o.token_ids for o in got], "a request's tokens differ alone and batched"
    stored.assert_consistent()


def test_granite_gguf_from_transformers_layer_names_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A Granite hybrid converted from a config with transformers' layer names (``full_attention``):
    llama.cpp's converter then writes its attention layer as a Mamba2 one (no ``head_count_kv``, Q/K
    left unpermuted), which neither llama.cpp nor tripod can run: refused, saying what to change."""
    import json
    import shutil

    from tripod.loader.gguf_loader import GGUFFile

    folder = tmp_path / "granite_tf_names"
    shutil.copytree(checkpoints["granitemoehybrid"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"] = ["full_attention" if k == "attention" else "linear_attention" for k in cfg["layer_types"]]
    (folder / "config.json").write_text(json.dumps(cfg))
    path = _convert(folder, "f32")
    with pytest.raises(ValueError, match=r"layer 1 has attention tensors but attention\.head_count_kv 0"):
        GGUFFile(path).config()


# The state-space hybrids' GGUFs (loader/gguf_hybrid.py, gguf_kimi.py) with --weights stored: each
# layer's sites the file quantized (Q8_0 by the converter; a 2-D tensor whose input width is not a
# multiple of 32 stays F16 there and runs dequantized) and what they must hold.
STORED_SITES = {
    "lfm2": {"conv": {"in_proj", "out_proj", "gate_up", "down"}, "full_attention": {"qkv", "o", "gate_up", "down"}},
    "nemotron_h": {"linear_attention": {"in_proj", "out_proj"}, "full_attention": {"qkv", "o"}, "mlp": {"up"},
                   "moe": {"up"}},  # (down: F16 here; the routed experts stay dense: models/nemotron_h.py)
    "granitemoehybrid": {"mamba": {"in_proj", "out_proj", "gate_up"}, "attention": {"qkv", "o", "gate_up"}},
    # (KDA: f_b / g_b F16 here; MLA's projections stay dense: models/kimi_linear.py; the routed and
    # shared experts are the MoE's own stored sites)
    "kimi_linear": {"linear_attention": {"qkv", "o", "f_a", "g_a", "b"}, "full_attention": set(),
                    "linear_attention+mlp": {"qkv", "o", "f_a", "g_a", "b", "gate_up", "down"}},
}
# Families whose every matmul runs on the CPU kernels here (rows independent of the batch): their logprobs
# are equal alone and batched bit for bit, with stored weights as with dequantized ones. The others run
# some matmuls through torch on a batch-dependent row subset (dense routed experts, MLA's absorbed
# factors) and are token-equal there (their logprobs differ by ~1e-6 dequantized as well).
ROW_EXACT = {"lfm2"}


def _layer_kind(model: Any, layer: Any, mtype: str) -> str:
    hf = model.cfg.hybrid.hf
    if mtype == "lfm2":
        return hf["layer_types"][layer.layer]
    if mtype == "nemotron_h":
        return layer.kind
    if mtype == "granitemoehybrid":
        return hf["layer_types"][layer.layer]
    from tripod.layers.mlp import GatedMLP

    if layer.layer not in model.cfg.hybrid.linear_layers:
        return "full_attention"
    return "linear_attention+mlp" if isinstance(layer.mlp, GatedMLP) else "linear_attention"


def _sites(model: Any, layer: Any, form: str) -> list[Any]:
    sites = getattr(layer, "stored_sites", None)
    return list(sites(form) if callable(sites) else model.stored_sites(layer, form))


# (LFM2 at Q4_0 only, the others at Q8_0: each case costs two engines, ~15 s on 2 shared cores)
@pytest.mark.parametrize(("mtype", "qtype"), [("lfm2", "Q4_0"), ("nemotron_h", "Q8_0"), ("granitemoehybrid", "Q8_0"),
                                              ("kimi_linear", "Q8_0")])
def test_state_space_hybrid_gguf_runs_as_stored(mtype: str, qtype: str, checkpoints: dict[str, Path]) -> None:
    """A Nemotron-H / Granite 4.0-H / LFM2 / Kimi Linear GGUF (Q8_0 from llama.cpp's converter; Q4_0 its
    Q8_0 values re-quantized by gguf-py) with --weights stored (and --weights auto's choice): every site
    the file quantized runs its codes on the kernels' stored linear, which holds the file's blocks and no
    dense copy (the dense weight released, resident bytes the codes'), at a fraction of the float32
    weights' bytes; the greedy tokens equal the dequantized file's, logprobs within 1e-3 (float32
    activations both: the stored kernel sums code products per block, the dense one weight products),
    and a request's tokens are the same alone as batched."""
    from tests.support.gguf_requant import requantized
    from tripod.config import EngineConfig
    from tripod.engine.executor.group import resident_weight_bytes
    from tripod.layers.linear import KernelLinear
    from tripod.loader.weights_mode import auto_weights

    path = _convert(checkpoints[mtype], "q8_0")
    if qtype != "Q8_0":
        path = requantized(path, path.with_name(path.name.replace(".q8_0.", f".{qtype.lower()}.")), qtype)
    assert auto_weights(EngineConfig(model=str(path)))[0] == "stored"
    stored = Engine(model=str(path), weights="stored", **ENGINE)
    model, form = stored.loaded.model, stored.runner.backend.form
    assert form.startswith("stored") and model.stored_head is not None
    codes = dense = 0
    for layer in model.layers:
        want = STORED_SITES[mtype][_layer_kind(model, layer, mtype)]
        assert set(layer.stored) == want, (layer.layer, sorted(layer.stored))
        sites = {key: (w, op) for key, w, op in _sites(model, layer, form)}
        for key, sw in layer.stored.items():
            w, op = sites[key]
            assert isinstance(op, KernelLinear) and op.fmt == qtype.lower(), (layer.layer, key)
            assert sw.packed and op.packed.data_ptr() == sw.blocks.data_ptr(), (layer.layer, key)
            assert w.numel() == 0, f"layer {layer.layer} {key}: a dense copy is held"
            codes += sw.blocks.numel()
            dense += 4 * sw.shape[0] * sw.shape[1]
    experts = [ex for layer in model.layers for ex in [getattr(getattr(layer, "moe", None) or getattr(layer, "mlp", None),
                                                               "experts", None)] if ex is not None and ex.stored]
    assert bool(experts) == (mtype == "kimi_linear")  # (Granite's routed down_proj is F16 in this file: dense)
    for ex in experts:
        assert ex.gate_up.numel() == 0 and ex.down.numel() == 0, "a dense expert stack is still held"
        assert resident_weight_bytes(ex) == sum(sw.blocks.numel() for sw in ex.stored.values())
    # the sites hold their codes only: Q8_0 34 bytes, Q4_0 18 bytes a 32 weights (float32: 128; the
    # kernels pad the outputs of a small projection to their tile)
    assert codes <= {"Q8_0": 0.3, "Q4_0": 0.17}[qtype] * dense
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    got = stored.generate(prompts, params)
    want_out = Engine(model=str(path), weights="dequantized", **ENGINE).generate(prompts, params)
    for i, (a, b) in enumerate(zip(got, want_out, strict=True)):
        assert a.token_ids == b.token_ids, f"{mtype} {qtype} prompt {i}"
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3, i
    alone = [stored.generate([p], params)[0] for p in prompts]
    for i, (a, b) in enumerate(zip(alone, got, strict=True)):
        assert a.token_ids == b.token_ids, f"{mtype} {qtype} prompt {i}: alone and batched differ"
        if mtype in ROW_EXACT:
            assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs], f"prompt {i}: logprobs"
    stored.assert_consistent()


def test_state_space_hybrid_stored_refuses_lora(checkpoints: dict[str, Path]) -> None:
    """What the stored hybrids still cannot run is refused at start with the reason: --lora (as on
    every hybrid; a checkpoint folder with --weights stored: tests/models/test_mamba_hybrids.py)."""
    path = _convert(checkpoints["lfm2"], "q8_0")
    with pytest.raises(ValueError, match="--lora is not supported on hybrid"):
        Engine(model=str(path), weights="stored", lora="a=/nonexistent", **ENGINE)
