"""Architecture name (HF ``config.architectures``) -> llmserve model class.

As vLLM's ``ModelRegistry``: the first entry of ``architectures`` that llmserve implements
picks the class.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.models.bert import BertModel
from llmserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from llmserve.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from llmserve.models.phi3 import Phi3ForCausalLM
from llmserve.models.seq_cls import (BertForSequenceClassification, LlamaForSequenceClassification,
                                     MistralForSequenceClassification, Qwen2ForSequenceClassification,
                                     Qwen3ForSequenceClassification)
from llmserve.models.whisper import WhisperForConditionalGeneration
from llmserve.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                   Qwen3ForCausalLM)

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,  # sparse MoE (models/moe.py)
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,  # encoder-decoder (audio)
    # Encoders (pooling only): the MLM/pre-training heads are ignored.
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
    # Sequence classification (pooling only; models/seq_cls.py): base model + classification head.
    "BertForSequenceClassification": BertForSequenceClassification,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": MistralForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}


def supported_architectures() -> list[str]:
    """Names of the architectures llmserve can run (generation or pooling)."""
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for ``hf_config.architectures``.

    Raises ValueError naming the config's architectures and the supported ones when none
    is implemented.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architectures {archs} are not supported; supported "
                     f"architectures: {supported_architectures()}")
