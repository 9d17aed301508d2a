"""``VisionProcessor`` (``tripod/loader/multimodal.py``) against transformers' own processor.

For each family a tiny checkpoint folder (tokenizer, chat template, image processor, processor
config: ``tests/support/tiny_vlms.py``) is loaded offline; ``expand`` of the chat template's
tokenized prompt must give exactly the ids transformers' processor gives for the same text and
images, and the pixels of each image must be transformers' ``pixel_values`` (and grid).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support import tiny_vlms
from tripod.loader.multimodal import VisionProcessor
from tripod.protocol.multimodal import ImageInput, pixel_hash


def _case(tiny_vlm: Any, kind: str, n_images: int = 2) -> tuple[Any, VisionProcessor, list[int], list[Any], Any]:
    vlm = tiny_vlm(kind)
    proc = VisionProcessor.from_folder(vlm.folder)
    assert proc is not None and proc.family == tiny_vlms.family(kind)
    text = vlm.template(tiny_vlms.messages("What is in these pictures?", n_images))
    images = [tiny_vlms.image(10 + i, (32 + 16 * i, 48 - 8 * i)) for i in range(n_images)]
    prompt = list(proc.tokenizer(text)["input_ids"])
    ref = vlm.processor(text=text, images=images, return_tensors="np")
    return vlm, proc, prompt, images, ref


def _pixels(img: ImageInput) -> np.ndarray:
    return np.frombuffer(img.pixels, dtype=np.float32).reshape(img.shape)


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_expand_equals_transformers_processor(tiny_vlm: Any, kind: str) -> None:
    _, proc, prompt, images, ref = _case(tiny_vlm, kind)
    assert proc.render(tiny_vlms.messages("What is in these pictures?", 2)) == prompt
    ids, inputs = proc.expand(prompt, images)
    assert ids == ref["input_ids"][0].tolist()
    assert len(inputs) == 2
    token = proc.model_image_token_id
    assert [i for i, t in enumerate(ids) if t == token] == [
        p for im in inputs for p in range(im.offset, im.offset + im.length)]
    ref_pixels = np.asarray(ref["pixel_values"], dtype=np.float32)
    if kind == "qwen2_5_vl":
        grids = ref["image_grid_thw"].tolist()
        assert [im.grid_thw for im in inputs] == grids
        rows = [g[0] * g[1] * g[2] for g in grids]
        np.testing.assert_array_equal(np.concatenate([_pixels(im) for im in inputs]), ref_pixels)
        assert [im.shape[0] for im in inputs] == rows
    else:
        np.testing.assert_array_equal(np.stack([_pixels(im) for im in inputs]), ref_pixels)
    for im in inputs:
        assert im.hash == pixel_hash(im.pixels, im.shape, im.grid_thw)
    assert inputs[0].hash != inputs[1].hash


def test_gemma3_newlines_merge_with_the_prompt(tiny_vlm: Any) -> None:
    """Gemma 3's "\\n\\n" around an image tokenize together with the template's own newline (as in
    transformers), which splicing the marker's ids would not reproduce."""
    _, proc, prompt, images, ref = _case(tiny_vlm, "gemma3", 1)
    naive = []
    for t in prompt:
        naive += proc.tokenizer.encode(f"\n\n{proc.placeholder}", add_special_tokens=False) if t == proc.image_token_id else [t]
    ids, _ = proc.expand(prompt, images)
    assert ids == ref["input_ids"][0].tolist()
    assert ids[: len(naive)] != naive[: len(ids)]


def test_text_only_checkpoint_has_no_processor(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    assert VisionProcessor.from_folder(tmp_path) is None


def test_same_pixels_same_hash_other_pixels_other_hash(tiny_vlm: Any) -> None:
    _, proc, prompt, _, _ = _case(tiny_vlm, "llava-clip", 1)
    a = proc.expand(prompt, [tiny_vlms.image(1)])[1][0]
    b = proc.expand(prompt, [tiny_vlms.image(1)])[1][0]
    c = proc.expand(prompt, [tiny_vlms.image(2)])[1][0]
    assert a.hash == b.hash and a.hash != c.hash and (a.offset, a.length) == (c.offset, c.length)


@pytest.mark.parametrize("kind", ["llava-clip", "qwen2_5_vl", "gemma3"])
def test_wrong_image_counts_are_value_errors(tiny_vlm: Any, kind: str) -> None:
    _, proc, prompt, images, _ = _case(tiny_vlm, kind)
    with pytest.raises(ValueError, match=r"2 image placeholder.*3 image"):
        proc.expand(prompt, [*images, images[0]])
    with pytest.raises(ValueError, match=r"2 image placeholder.*1 image"):
        proc.expand(prompt, images[:1])
    with pytest.raises(ValueError, match="not an image"):
        proc.expand(prompt, [images[0], b"\x89PNG"])
    with pytest.raises(ValueError, match="detail must be one of"):
        proc.expand(prompt, images, ["low", "tiny"])


def test_qwen_rejects_an_image_it_cannot_resize(tiny_vlm: Any) -> None:
    _, proc, prompt, _, _ = _case(tiny_vlm, "qwen2_5_vl", 1)
    with pytest.raises(ValueError, match=r"image 0 .*cannot be used by this model"):
        proc.expand(prompt, [tiny_vlms.image(3, (1, 400))])


def test_qwen_low_detail_caps_the_image_tokens(tiny_vlm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tripod.loader import multimodal

    _, proc, prompt, _, _ = _case(tiny_vlm, "qwen2_5_vl", 1)
    img = tiny_vlms.image(4, (64, 64))
    (high,) = proc.expand(prompt, [img], ["high"])[1]
    monkeypatch.setattr(multimodal, "LOW_DETAIL_TOKENS", 4)
    ids, (low,) = proc.expand(prompt, [img], ["low"])
    assert high.length == 16 and low.length == 4 and low.grid_thw == [1, 4, 4]
    assert len(ids) == len(prompt) - 1 + 4
    (same,) = proc.expand(prompt, [img], ["auto"])[1]
    assert same.hash == high.hash
    (other,) = multimodal.VisionProcessor.from_folder(proc.folder).expand(prompt, [img], ["low"])[1]  # type: ignore[union-attr]
    assert other.hash == low.hash and other.hash != high.hash


def test_detail_is_ignored_by_fixed_resolution_towers(tiny_vlm: Any) -> None:
    _, proc, prompt, images, _ = _case(tiny_vlm, "llava-clip", 1)
    assert proc.expand(prompt, images[:1], ["low"]) == proc.expand(prompt, images[:1], ["high"])


def test_the_image_token_in_the_text_is_refused(tiny_vlm: Any) -> None:
    _, proc, prompt, images, _ = _case(tiny_vlm, "gemma3", 1)
    soft = proc.model_image_token_id
    with pytest.raises(ValueError, match="outside the images' placeholders"):
        proc.expand([*prompt[:3], soft, *prompt[3:]], images[:1])


def test_a_template_writing_the_bos_gets_no_second_one(tiny_vlm: Any) -> None:
    """As transformers' processor: a tokenizer that adds a BOS does not add it before a rendered
    prompt that starts with one (Gemma 3's template writes ``<bos>`` itself)."""
    proc = VisionProcessor.from_folder(tiny_vlm("gemma3").folder)
    assert proc is not None
    proc.tokenizer.add_bos_token = True
    ids = proc.render(tiny_vlms.messages("Hi", 1))
    assert ids[0] == proc.tokenizer.bos_token_id and ids[1] != proc.tokenizer.bos_token_id


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P-transparent", "RGB-transparent", "L"])
def test_images_with_transparency_or_one_channel_get_transformers_pixels(tiny_vlm: Any, mode: str) -> None:
    """An image given as it was opened (a screenshot's RGBA, a palette GIF with a transparent colour,
    grey) is made RGB as transformers makes it: transparency composited onto white. Dropping the
    alpha instead keeps whatever colour the transparent pixels store (here: their random RGB)."""
    from PIL import Image

    vlm = tiny_vlm("llava-siglip")
    proc = VisionProcessor.from_folder(vlm.folder)
    assert proc is not None
    text = vlm.template(tiny_vlms.messages("x", 1))
    prompt = list(proc.tokenizer(text)["input_ids"])
    rgb = tiny_vlms.image(3, (32, 32))
    alpha = Image.fromarray(np.tile(np.arange(0, 256, 8, dtype=np.uint8), (32, 1)), "L")
    if mode == "RGBA":
        img = rgb.copy()
        img.putalpha(alpha)
    elif mode == "LA":
        img = Image.merge("LA", (rgb.convert("L"), alpha))
    elif mode in ("P-transparent", "RGB-transparent"):
        img = rgb.quantize(16)
        img.info["transparency"] = int(np.bincount(np.asarray(img).ravel()).argmax())  # its commonest colour
        if mode == "RGB-transparent":  # (what PIL makes of such a GIF converted to RGB: a transparent colour)
            img = img.convert("RGB")
            assert img.info.get("transparency") is not None
    else:
        img = rgb.convert("L")
    ref = vlm.processor(text=text, images=[img], return_tensors="np")
    _, (got,) = proc.expand(prompt, [img])
    np.testing.assert_array_equal(_pixels(got), np.asarray(ref["pixel_values"], dtype=np.float32)[0])
    if mode != "L":
        dropped = proc.expand(prompt, [Image.fromarray(np.asarray(img.convert("RGB")))])[1][0]
        assert not np.array_equal(_pixels(dropped), _pixels(got))
