"""The decoders' side of a vision-language model: the base class every family derives from, its
weight names, and Qwen2.5-VL's multimodal RoPE.

A vision-language model is its text decoder (``LlamaForCausalLM``: every family's decoder) plus a
tower and a projector. The engine (``engine/vision.py``) asks it how many tokens an image's pixels
make (``image_tokens``, which also refuses pixels the tower cannot take), encodes the images a
step needs in one call (``encode``) and hands the features to the forward pass as
``ForwardBatch.images``: the decoder replaces its placeholders' embeddings with them
(``LlamaForCausalLM._forward_stages``). Everything else — KV, batching, sampling — is the decoder's.

M-RoPE (``MRope``, ``mrope_positions``): each token has a (t, h, w) position; text tokens have
three equal ones that continue from the previous image's largest position + 1, an image's tokens
the image's start plus their (frame, row, column) in the merged grid. The rotary frequencies are
split into three sections, each rotated by one axis. Decoding continues at sequence index +
``delta`` (the prompt's largest position + 1 − its length). A text-only request's positions are its
sequence indices on all three axes, which is plain RoPE: its rows need no table of their own.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import torch

from tripod.layers.parallel import SINGLE, ParallelGroup
from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.llama import LlamaForCausalLM
from tripod.models.vision.spec import VisionSpec

# Where checkpoints keep the parts (transformers 4's layout and 5's): renamed to one set of names.
VISION_PREFIXES = (
    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
    ("model.visual.", "visual."), ("visual.", "visual."),
    ("model.multi_modal_projector.", "multi_modal_projector."), ("multi_modal_projector.", "multi_modal_projector."),
)
TEXT_PREFIXES = (
    ("model.language_model.", "model."), ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."), ("language_model.", "model."),
)


def split_names(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the decoder's tensors as a text checkpoint names them, the tower's and projector's)."""
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        for old, new in VISION_PREFIXES:
            if name.startswith(old):
                vision[new + name[len(old):]] = t
                break
        else:
            for old, new in TEXT_PREFIXES:
                if name.startswith(old):
                    text[new + name[len(old):]] = t
                    break
            else:
                text[name] = t
    return text, vision


class VisionLanguageModel(LlamaForCausalLM):
    """A decoder with a vision tower and projector. Owns their weights; ``encode`` maps images to
    decoder-width features, one ``[tokens, hidden]`` tensor per image, where ``tokens`` is exactly
    ``image_tokens`` of its pixels (the invariant the engine's validation relies on)."""

    mrope: MRope | None = None
    # Whether an image's tokens attend to each other both ways (its KV then depends on the whole image).
    bidirectional_images = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        assert cfg.vision is not None
        self.qkv_bias = cfg.vision.text_qkv_bias  # (read by make_layer in the decoder's constructor)
        super().__init__(cfg, dtype, device)
        self.vision: VisionSpec = cfg.vision

    @abstractmethod
    def image_tokens(self, shape: Sequence[int], grid_thw: Sequence[int] | None) -> int:
        """The features the tower makes of pixels of ``shape`` (and grid); ``ValueError`` if the
        tower cannot take them (wrong size, grid or channels)."""

    @abstractmethod
    def encode(self, pixels: list[torch.Tensor], grids: list[list[int] | None]) -> list[torch.Tensor]:
        """Features of several images in one pass: ``[image_tokens, hidden]`` each, in the model dtype."""

    @abstractmethod
    def load_vision(self, src: WeightSource) -> None:
        """The tower's and projector's weights (names as ``split_names`` gives them)."""

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        if tp.size > 1:
            raise ValueError("a vision-language model runs in one process (its tower is not sharded); "
                             "use --replicas instead of --tensor-parallel-size")
        text, vision = split_names(weights)
        super().load_weights(text, fp8_block=fp8_block)
        self.load_vision(WeightSource(vision, self.dtype, self.device))

    def rope_positions(self, prompt_len: int, images: Sequence[tuple[int, int, Sequence[int] | None]]
                       ) -> tuple[torch.Tensor, int] | None:
        """M-RoPE models: the prompt's ``[3, prompt_len]`` positions and decode delta from its images'
        (offset, length, grid); None: positions are sequence indices."""
        return None


class MRope:
    """Qwen2.5-VL's multimodal rotary tables: cos/sin rows for (t, h, w) positions."""

    def __init__(self, head_dim: int, theta: float, section: Sequence[int], device: torch.device) -> None:
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        axis = [i % 3 for i, s in enumerate(section) for _ in range(s)]  # the axis of each frequency
        self.axis = torch.tensor(axis)
        self.device = device

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[3, T]`` → (cos, sin), each ``[T, head_dim]`` float32 on the model's device."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, D/2]
        picked = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((picked, picked), dim=-1)
        return emb.cos().to(self.device), emb.sin().to(self.device)


def mrope_positions(prompt_len: int, images: Sequence[tuple[int, int, Sequence[int]]],
                    merge: int) -> tuple[torch.Tensor, int]:
    """A prompt's ``[3, prompt_len]`` M-RoPE positions and its decode ``delta``, from its images'
    (offset, length, grid (t, h, w) in patches) in prompt order (transformers' ``get_rope_index``)."""
    pos = torch.empty(3, prompt_len, dtype=torch.long)
    at, cur = 0, 0
    for offset, length, (t, h, w) in images:
        text = offset - at
        pos[:, at:offset] = torch.arange(cur, cur + text)
        cur += text
        gh, gw = h // merge, w // merge
        assert t * gh * gw == length, "an image's span is its merged grid"
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        pos[:, offset : offset + length] = grid.reshape(3, -1) + cur
        cur += max(h, w) // merge
        at = offset + length
    pos[:, at:] = torch.arange(cur, cur + prompt_len - at)
    delta = int(pos.max()) + 1 - prompt_len if prompt_len else 0
    return pos, delta
