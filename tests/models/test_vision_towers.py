"""The vision towers, projectors and M-RoPE positions against transformers (float32).

For each family the tiny checkpoint (``tests/support/tiny_vlms.py``) is loaded by tripod; the
features ``encode`` makes of processed images (two at once, of different sizes for Qwen2.5-VL's
dynamic resolution and windows) must be transformers' ``get_image_features``, and Qwen2.5-VL's
3-D positions and decode delta must be its ``get_rope_index``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.support import tiny_vlms
from tripod.loader import load_model
from tripod.loader.multimodal import VisionProcessor
from tripod.models.multimodal import MRope, mrope_positions


def _inputs(vlm: Any, sizes: list[tuple[int, int]]) -> tuple[Any, list[Any], Any, str]:
    proc = VisionProcessor.from_folder(vlm.folder)
    assert proc is not None
    images = [tiny_vlms.image(20 + i, s) for i, s in enumerate(sizes)]
    text = vlm.template(tiny_vlms.messages("Look.", len(images)))
    ids, inputs = proc.expand(list(proc.tokenizer(text)["input_ids"]), images)
    return ids, inputs, vlm.processor(text=text, images=images, return_tensors="pt"), text


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_features_equal_transformers(tiny_vlm: Any, kind: str) -> None:
    vlm = tiny_vlm(kind)
    model = load_model(str(vlm.folder), torch.float32, torch.device("cpu")).model
    _, inputs, ref, _ = _inputs(vlm, [(32, 32), (64, 48), (48, 64)])
    pixels = [torch.from_numpy(np.frombuffer(im.pixels, dtype=np.float32).reshape(im.shape).copy()) for im in inputs]
    feats = model.encode(pixels, [im.grid_thw for im in inputs])
    assert [f.shape[0] for f in feats] == [im.length for im in inputs]
    assert [model.image_tokens(im.shape, im.grid_thw) for im in inputs] == [im.length for im in inputs]
    kw = {"image_grid_thw": ref["image_grid_thw"]} if "image_grid_thw" in ref else {}
    with torch.no_grad():
        hf = vlm.model.model.get_image_features(pixel_values=ref["pixel_values"], **kw).pooler_output
    hf = torch.cat(list(hf)) if isinstance(hf, list | tuple) else hf.reshape(-1, hf.shape[-1])
    torch.testing.assert_close(torch.cat(feats), hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_pixels_the_tower_cannot_take_are_refused(tiny_vlm: Any, kind: str) -> None:
    model = load_model(str(tiny_vlm(kind).folder), torch.float32, torch.device("cpu")).model
    with pytest.raises(ValueError, match=r"shape|grid"):
        model.image_tokens([3, 48, 48], None)
    if kind == "qwen2_5_vl":
        with pytest.raises(ValueError, match="multiple of 2"):
            model.image_tokens([9, 384], [1, 3, 3])
        with pytest.raises(ValueError, match="do not match the grid"):
            model.image_tokens([16, 384], [1, 2, 4])


def test_mrope_positions_equal_transformers_rope_index(tiny_vlm: Any) -> None:
    vlm = tiny_vlm("qwen2_5_vl")
    ids, inputs, ref, _ = _inputs(vlm, [(64, 48), (32, 32), (48, 80)])
    assert ids == ref["input_ids"][0].tolist()
    pos, delta = mrope_positions(len(ids), [(im.offset, im.length, im.grid_thw) for im in inputs], 2)
    hf_pos, hf_delta = vlm.model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                      image_grid_thw=ref["image_grid_thw"])
    assert torch.equal(pos, hf_pos[:, 0]) and delta == int(hf_delta[0, 0])
    text_only, d0 = mrope_positions(5, [], 2)
    assert torch.equal(text_only, torch.arange(5).expand(3, 5)) and d0 == 0


def test_mrope_rows_with_equal_axes_are_plain_rope() -> None:
    """A text token's (p, p, p) rotates like RoPE at p: text-only rows need no table of their own."""
    from tripod.layers.rotary import RotaryEmbedding

    mrope = MRope(16, 10000.0, (2, 3, 3), torch.device("cpu"))
    plain = RotaryEmbedding(16, 10000.0, None, 64, torch.device("cpu"))
    p = torch.arange(40)
    cos, sin = mrope.rows(p.expand(3, -1))
    assert torch.equal(cos, plain.cos[p]) and torch.equal(sin, plain.sin[p])
    skew = torch.stack([p, p + 1, p]).contiguous()
    assert not torch.equal(mrope.rows(skew)[0], cos)


def test_weight_names_of_transformers_4_and_5_layouts() -> None:
    from tripod.models.multimodal import split_names

    t = torch.zeros(1)
    text, vision = split_names({
        "model.language_model.layers.0.mlp.up_proj.weight": t, "language_model.model.norm.weight": t,
        "language_model.lm_head.weight": t, "lm_head.weight": t, "model.embed_tokens.weight": t,
        "model.vision_tower.vision_model.post_layernorm.weight": t, "vision_tower.encoder.layers.0.mlp.fc1.bias": t,
        "model.visual.merger.ln_q.weight": t, "visual.blocks.0.norm1.weight": t,
        "model.multi_modal_projector.linear_1.weight": t, "multi_modal_projector.mm_soft_emb_norm.weight": t,
    })
    assert sorted(text) == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                            "model.norm.weight"]
    assert sorted(vision) == ["multi_modal_projector.linear_1.weight", "multi_modal_projector.mm_soft_emb_norm.weight",
                              "vision_tower.encoder.layers.0.mlp.fc1.bias",
                              "vision_tower.vision_model.post_layernorm.weight", "visual.blocks.0.norm1.weight",
                              "visual.merger.ln_q.weight"]


def test_a_checkpoint_in_transformers_4_names_loads_the_same(tiny_vlm: Any, tmp_path: Any) -> None:
    """LLaVA-1.5's published layout (``vision_tower.vision_model.*``, ``language_model.model.*``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    vlm = tiny_vlm("llava-clip")
    for f in vlm.folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    old = {k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k: v
           for k, v in load_file(str(vlm.folder / "model.safetensors")).items()}
    assert any(k.startswith("vision_tower.vision_model.encoder") for k in old)
    save_file(old, str(tmp_path / "model.safetensors"))
    a = load_model(str(vlm.folder), torch.float32, torch.device("cpu")).model
    b = load_model(str(tmp_path), torch.float32, torch.device("cpu")).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize("decoder", ["granite", "gemma2", "phi3"])
def test_a_llava_decoder_tripod_does_not_run_is_refused_by_name(decoder: str) -> None:
    """A LLaVA checkpoint over a decoder tripod has no family for is refused, naming it, rather than
    run as a Llama (a Granite decoder's multipliers or Gemma 2's norms would be silently dropped)."""
    from tripod.models.config import ModelConfig

    d = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 5,
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                           "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
         "text_config": {"model_type": decoder, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                         "num_hidden_layers": 1, "num_attention_heads": 2}}
    with pytest.raises(ValueError, match=f"model_type '{decoder}'.*supported decoders: .*llama"):
        ModelConfig.from_hf_dict(d)
    d["text_config"]["model_type"] = "mistral"
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "LlavaForConditionalGeneration" and cfg.vision is not None
