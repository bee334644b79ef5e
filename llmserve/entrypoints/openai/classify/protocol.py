"""Protocol of ``POST /classify`` and ``/v1/classify`` (vLLM's ``ClassificationRequest`` /
``ClassificationResponse``)."""
from __future__ import annotations

from typing import Optional

from llmserve.entrypoints.openai.common.pooling import ActivationFields, PoolingInput
from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, UsageInfo


class ClassificationRequest(ActivationFields):
    """``input``: a string, strings, token ids or lists of token ids (one classification
    each); use_activation (or vLLM's older ``softmax`` / ``activation``): softmax /
    sigmoid over the head's logits (None: yes, as vLLM; false: the raw logits)."""

    input: PoolingInput


class ClassificationData(OpenAIBaseModel):
    """One input's result: ``probs`` (one per label), ``label`` the config's ``id2label``
    name of the most probable one, ``num_classes`` = len(probs)."""

    index: int
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
