from model_executor.models.llama import MODEL_REGISTRY

__all__ = ["MODEL_REGISTRY"]
