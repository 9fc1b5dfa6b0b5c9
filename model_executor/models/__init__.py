"""The model classes, by the `architectures` name of a checkpoint's config.json."""

from model_executor.models.eagle3 import Eagle3ForCausalLM
from model_executor.models.llama import LlamaForCausalLM
from model_executor.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

# Mistral, Qwen2 and Qwen3 share the Llama block; Qwen2's q/k/v bias comes from ModelConfig.attention_bias,
# Qwen3's q/k norms from ModelConfig.qk_norm, the MoE layers from ModelConfig.moe_layers.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "LlamaForCausalLMEagle3": Eagle3ForCausalLM,  # a draft head (ModelConfig's DRAFT_ARCHITECTURES)
}

__all__ = ["MODEL_REGISTRY"]
