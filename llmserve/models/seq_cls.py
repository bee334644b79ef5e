"""Sequence-classification checkpoints (transformers' ``*ForSequenceClassification``):
the base model plus its classification head, for the pooling runner's ``classify``,
``score`` and ``token_classify`` tasks (vLLM's ``ClassifierPooler`` /
``TokenClassifierPoolerHead``; ``worker/classifier_pooler.py`` calls the two heads).

Every model here has ``classify_logits(pooled [B, H]) -> [B, num_labels]`` (the head on
the rows the pooler picked: BERT's [CLS], a decoder's last token) and
``token_logits(rows [n, H]) -> [n, num_labels]`` (the label projection on every token,
as vLLM's ``token_classify``). Both return float32 (vLLM's ``head_dtype``) whatever the
model dtype. ``forward`` is the base model's: final hidden states ``[T, H]``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.models.bert import BertModel
from llmserve.models.llama import LlamaForCausalLM


def _linear32(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """``lin(x)`` computed in float32."""
    bias = None if lin.bias is None else lin.bias.float()
    return F.linear(x.float(), lin.weight.float(), bias)


class BertForSequenceClassification(BertModel):
    """transformers' ``BertForSequenceClassification`` (cross-encoders such as
    ms-marco-MiniLM): the encoder, its pooler (dense + tanh on [CLS]) and ``classifier``
    (``[num_labels, H]`` with bias). Dropout is off (inference)."""

    _NAMES = {**BertModel._NAMES, "pooler.dense.weight": "pooler_dense.weight",
              "pooler.dense.bias": "pooler_dense.bias", "classifier.weight": "classifier.weight",
              "classifier.bias": "classifier.bias"}

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        h = config.hidden_size
        self.pooler_dense = nn.Linear(h, h, dtype=dtype)
        self.classifier = nn.Linear(h, config.num_labels, dtype=dtype)

    def classify_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[CLS] rows ``[B, H]`` -> ``classifier(tanh(pooler(x)))`` ``[B, num_labels]``."""
        return _linear32(torch.tanh(_linear32(pooled, self.pooler_dense)), self.classifier)

    def token_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Every token's ``classifier(h)`` (vLLM's BERT ``token_classify``: no pooler)."""
        return _linear32(rows, self.classifier)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """transformers' ``LlamaForSequenceClassification`` (reward models, classifiers):
    the decoder (``model.*``) and ``score`` (``[num_labels, H]``, no bias), no LM head.
    The pooled row is the last non-pad token; the InputProcessor runs a prompt only up to
    it (``engine/pooling_inputs.classified_prefix``), so the pooler takes the LAST row."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config, dtype)
        self.lm_head = None  # the checkpoint has none (nor a tied one worth packing)
        self.score = nn.Linear(hf_config.hidden_size, hf_config.num_labels, bias=False, dtype=dtype)

    def pack_tied_head(self) -> None:
        """No LM head to pack (``onednn_linear.pack_model`` calls this)."""

    def classify_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """Last-token rows ``[B, H]`` -> ``score(x)`` ``[B, num_labels]``."""
        return _linear32(pooled, self.score)

    def token_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Every token's ``score(h)`` ``[n, num_labels]``."""
        return _linear32(rows, self.score)


class MistralForSequenceClassification(LlamaForSequenceClassification):
    """Mistral's (same head and pooling as Llama's)."""


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    """Qwen2's (same head and pooling as Llama's)."""


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    """Qwen3's (same head and pooling as Llama's)."""
