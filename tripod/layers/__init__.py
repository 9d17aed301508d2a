"""The layers a model is built of (attention, linears, norms, MoE, MLA, LoRA, ...) over the compute backends of ``layers/backends``."""
