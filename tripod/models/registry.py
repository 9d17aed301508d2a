"""Maps HF architecture names to model classes."""

from __future__ import annotations

from tripod.models.deepseek import DeepseekForCausalLM
from tripod.models.deepseek_v4 import DeepseekV4ForCausalLM
from tripod.models.gemma3_vl import Gemma3ForConditionalGeneration
from tripod.models.granite_hybrid import GraniteMoeHybridForCausalLM
from tripod.models.kimi_linear import KimiLinearForCausalLM
from tripod.models.lfm2 import Lfm2ForCausalLM
from tripod.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from tripod.models.llava import LlavaForConditionalGeneration
from tripod.models.minimax import MiniMaxForCausalLM
from tripod.models.nemotron_h import NemotronHForCausalLM
from tripod.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tripod.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

# Every family is the one decoder (models/llama.py) configured by its ModelConfig; the classes
# differ only where the weights or the attention differ.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,  # + the lightning indexer's sparse attention
    "GptOssForCausalLM": LlamaForCausalLM,  # sinks, alternating windows, biased clamped-SwiGLU experts
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,  # compressed attention, hyper-connections, hash routing
    # Hybrids: gated-delta-rule layers (their state in the engine's StatePool) beside attention.
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,  # (its text part)
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,  # + a MoE (shared expert with its sigmoid gate) on every layer
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3_5ForCausalLM,  # its mixer's projections grouped per key head (reordered at load)
    "KimiLinearForCausalLM": KimiLinearForCausalLM,  # KDA layers (StatePool) beside NoPE MLA layers, V3 MoE
    "MiniMaxForCausalLM": MiniMaxForCausalLM,  # lightning attention (StatePool) beside GQA, Mixtral MoE
    # State-space hybrids (models/hybrid.py): Mamba2 / short-conv layers (StatePool) beside attention.
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    # Vision-language models (models/multimodal.py): the decoder plus a tower and a projector.
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
