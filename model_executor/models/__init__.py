"""The model classes, by the `architectures` name of a checkpoint's config.json."""

from model_executor.models.eagle3 import Eagle3ForCausalLM
from model_executor.models.gemma3 import Gemma3ForCausalLM
from model_executor.models.gpt_oss import GptOssForCausalLM
from model_executor.models.llama import LlamaEmbeddingModel, LlamaForCausalLM, LlamaForSequenceClassification
from model_executor.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from model_executor.models.phi3 import Phi3ForCausalLM
from model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

# Mistral, Qwen2 and Qwen3 share the Llama block; Qwen2's q/k/v bias comes from ModelConfig.attention_bias,
# Qwen3's q/k norms from ModelConfig.qk_norm, the MoE layers from ModelConfig.moe_layers.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # the text tower
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Pooling models (--is-embedding): a backbone-only embedding checkpoint, a reranker with a score head.
    "LlamaModel": LlamaEmbeddingModel,
    "MistralModel": LlamaEmbeddingModel,
    "Qwen2Model": LlamaEmbeddingModel,
    "Qwen3Model": LlamaEmbeddingModel,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
    "LlamaForCausalLMEagle3": Eagle3ForCausalLM,  # a draft head (ModelConfig's DRAFT_ARCHITECTURES)
}
# A dense causal LM served for embeddings (ModelConfig.embedding_only) loads as this class.
EMBEDDING_CLASS = LlamaEmbeddingModel

__all__ = ["EMBEDDING_CLASS", "MODEL_REGISTRY"]
