"""Maps HF architecture names to model classes."""

from __future__ import annotations

from tripod.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
