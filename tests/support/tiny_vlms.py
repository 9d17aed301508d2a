"""Tiny random vision-language checkpoints, built and saved with transformers (issue 38).

Each family is a few vision layers over 32–64-pixel images, a small decoder, a byte-level
tokenizer built with ``tokenizers`` (every byte a token, one merge "\\n\\n" so that Gemma 3's
newlines around an image merge with the prompt's as they do in real tokenizers) plus the family's
special tokens, a chat template that emits one placeholder per image part, and the family's own
(PIL) image processor and processor class, all saved into one folder the way a real checkpoint
ships. Weights are re-drawn large enough that greedy choices are decisive (see ``tiny_models``).

Kinds: ``llava-clip`` (CLIP tower, Llama decoder, feature layer -2, "default" selection: CLS
dropped), ``llava-siglip`` (SigLIP tower, Qwen2 decoder, feature layers [-3, -1] concatenated,
"full" selection), ``qwen2_5_vl`` (windowed tower with a full-attention block, M-RoPE decoder),
``gemma3`` (SigLIP tower, pooled soft tokens, sliding-window Gemma 3 decoder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

KINDS = ("llava-clip", "llava-siglip", "qwen2_5_vl", "gemma3")

# The special tokens every tokenizer has (ids 257..), then each family's own.
BASE_SPECIALS = ["<pad>", "<s>", "</s>"]
FAMILY_SPECIALS: dict[str, list[str]] = {
    "llava": ["<image>"],
    "qwen2_5_vl": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                   "<|video_pad|>"],
    "gemma3": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}
VOCAB = 288  # bytes (256) + "\n\n" + the specials, rounded up

_PARTS = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
          "{% for part in message['content'] %}{% if part['type'] == 'image' %}{IMAGE}"
          "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
TEMPLATES = {
    "llava": ("{% for message in messages %}{{ message['role'] }}: " + _PARTS.replace("{IMAGE}", "<image>\n")
              + "\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"),
    "qwen2_5_vl": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                   + _PARTS.replace("{IMAGE}", "<|vision_start|><|image_pad|><|vision_end|>")
                   + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma3": ("<s>{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
               + _PARTS.replace("{IMAGE}", "<start_of_image>")
               + "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}


def family(kind: str) -> str:
    return "llava" if kind.startswith("llava") else kind


def byte_tokenizer(fam: str) -> Any:
    """A byte-level BPE tokenizer (one merge: "\\n\\n") with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ĊĊ"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BASE_SPECIALS + FAMILY_SPECIALS[fam])
    extra: dict[str, str] = {}
    if fam == "llava":
        extra = {"image_token": "<image>"}
    elif fam == "gemma3":
        extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  extra_special_tokens=extra)
    out.chat_template = TEMPLATES[fam]
    assert len(out) <= VOCAB
    return out


def _text(kind: str, tok: Any) -> dict[str, Any]:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "llava-clip":  # (head_dim 32: a shape tripod's CPU kernels' paged attention covers)
        return dict(common, model_type="llama", num_attention_heads=2, num_key_value_heads=1)
    if kind == "llava-siglip":
        return dict(model_type="qwen2", **common)
    if kind == "qwen2_5_vl":  # (head_dim 32, as llava-clip's)
        return dict(common, num_attention_heads=2, num_key_value_heads=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    return dict(common, head_dim=16, sliding_window=16, query_pre_attn_scalar=16, num_hidden_layers=3,
                layer_types=["full_attention", "sliding_attention", "full_attention"],
                final_logit_softcapping=30.0, tie_word_embeddings=False)


def _vit(**kw: Any) -> dict[str, Any]:
    return dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2, **kw)


def hf_config(kind: str, tok: Any) -> Any:
    """The transformers config of a tiny ``kind``."""
    from transformers import (
        AutoConfig,
        CLIPVisionConfig,
        Gemma3Config,
        LlavaConfig,
        Qwen2_5_VLConfig,
        SiglipVisionConfig,
    )

    text = _text(kind, tok)
    ids = tok.convert_tokens_to_ids
    if kind == "llava-clip":
        return LlavaConfig(vision_config=CLIPVisionConfig(**_vit(image_size=32, patch_size=8)),
                           text_config=AutoConfig.for_model(**text), image_token_index=ids("<image>"),
                           vision_feature_layer=-2, vision_feature_select_strategy="default",
                           tie_word_embeddings=False)
    if kind == "llava-siglip":
        return LlavaConfig(vision_config=SiglipVisionConfig(**_vit(image_size=32, patch_size=8)),
                           text_config=AutoConfig.for_model(**text), image_token_index=ids("<image>"),
                           vision_feature_layer=[-3, -1], vision_feature_select_strategy="full",
                           multimodal_projector_bias=True, tie_word_embeddings=False)
    if kind == "qwen2_5_vl":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                      fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                                video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                                vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)
    return Gemma3Config(text_config=text, vision_config=_vit(image_size=64, patch_size=8, vision_use_head=False),
                        mm_tokens_per_image=16, boi_token_index=ids("<start_of_image>"),
                        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"),
                        tie_word_embeddings=False)  # (tied, the last input token's scaled embedding wins every step)


def hf_processor(kind: str, tok: Any) -> Any:
    """The family's processor with its PIL image processor (what the checkpoint folder ships)."""
    from transformers import Gemma3Processor, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    fam = family(kind)
    template = TEMPLATES[fam]
    if kind == "llava-clip":
        ip = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                              num_additional_image_tokens=1, chat_template=template)
    if kind == "llava-siglip":
        ip = SiglipImageProcessorPil(size={"height": 32, "width": 32})
        return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8, vision_feature_select_strategy="full",
                              chat_template=template)
    if kind == "qwen2_5_vl":
        ip = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
        return _QwenProcessor(image_processor=ip, tokenizer=tok, video_processor=None, chat_template=template)
    ip = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    return Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=template, image_seq_length=16)


def _qwen_processor_class() -> Any:
    from transformers import Qwen2_5_VLProcessor

    class QwenImageOnlyProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video processor (which needs torchvision, absent here)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return QwenImageOnlyProcessor


def _QwenProcessor(**kw: Any) -> Any:
    return _qwen_processor_class()(**kw)


def _decisive(model: Any, gemma: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):  # x @ W (fan-in: its first dim), as large
                # as Gemma's sqrt(hidden)-scaled text embeddings, so that the image matters
                p.copy_(torch.randn(p.shape, generator=g) * math.sqrt(p.shape[1] / p.shape[0]))
            elif p.ndim >= 2:
                fan_in = int(np.prod(p.shape[1:]))
                std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in)
                if "position_embedding" in name:
                    std = 0.5
                if "lm_head" in name:
                    std = 3.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif ("norm" in name and name.endswith(".weight")) or name.endswith("ln_q.weight"):
                offset = gemma and ("language_model" in name or "mm_soft_emb_norm" in name)
                p.copy_((0.0 if offset else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:  # biases, CLIP's class embedding
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.eval()


@dataclass
class TinyVLM:
    """A saved tiny checkpoint and its transformers counterparts (float32, eval)."""

    kind: str
    folder: Path
    model: Any
    processor: Any

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    def template(self, messages: list[dict[str, Any]]) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build(kind: str, folder: Path, seed: int = 0) -> TinyVLM:
    """Build, randomise and save a tiny ``kind`` checkpoint (model, tokenizer, processor, template)."""
    from transformers import AutoModelForImageTextToText

    tok = byte_tokenizer(family(kind))
    cfg = hf_config(kind, tok)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    _decisive(model, kind == "gemma3", seed)
    proc = hf_processor(kind, tok)
    model.save_pretrained(str(folder))
    if kind == "qwen2_5_vl":  # (its processor cannot be saved without a video processor: the parts)
        proc.image_processor.save_pretrained(str(folder))
    else:
        proc.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return TinyVLM(kind, folder, model, proc)


def image(seed: int, size: tuple[int, int] = (32, 32)) -> Any:
    """A random RGB image (PIL) of ``size`` (width, height): a 4x4 grid of random colours with
    noise on top (coarse content differs from seed to seed; iid noise alone looks alike to a tower)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), "RGB").resize(size, Image.NEAREST)
    noise = rng.integers(-24, 25, (size[1], size[0], 3))
    return Image.fromarray(np.clip(np.asarray(coarse, dtype=np.int64) + noise, 0, 255).astype(np.uint8), "RGB")


def messages(text: str, images: int = 1) -> list[dict[str, Any]]:
    """One user turn: ``images`` image parts, then ``text``."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_greedy(vlm: TinyVLM, text: str, images: list[Any], n: int) -> Any:
    """transformers' greedy ``generate`` (float32, never stopping at EOS) of ``text`` with ``images``:
    a ``conftest.Greedy`` (tokens, top-2 margins, runners-up) for ``check_greedy_tokens``."""
    from tests.conftest import Greedy

    inputs = vlm.processor(text=text, images=images or None, return_tensors="pt")
    vlm.model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = vlm.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    margins, runner_up, logprobs = [], [], []
    for step, logits in enumerate(out.logits):
        row = logits[0].float()
        top = row.topk(2)
        assert int(top.indices[0]) == tokens[step]
        margins.append(float(top.values[0] - top.values[1]))
        runner_up.append(int(top.indices[1]))
        logprobs.append(float(torch.log_softmax(row, -1)[tokens[step]]))
    return Greedy(tokens, margins, runner_up, logprobs)
