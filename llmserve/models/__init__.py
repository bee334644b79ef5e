"""Torch model implementations and the architecture registry."""
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "get_model_class", "supported_architectures"]
