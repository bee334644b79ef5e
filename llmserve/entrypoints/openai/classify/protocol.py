"""Protocol of ``POST /classify`` and ``/v1/classify`` (vLLM's ``ClassificationRequest`` /
``ClassificationResponse``)."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES
from llmserve.entrypoints.openai.common.pooling import ActivationFields, PoolingInput
from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, UsageInfo


class ClassificationRequest(ActivationFields):
    """``input``: a string, strings, token ids or lists of token ids (one classification
    each), or, as vLLM's ``ClassificationChatRequest``, ``messages`` rendered with the chat
    template (``chat_template`` / ``chat_template_kwargs`` / ``add_generation_prompt`` /
    ``continue_final_message`` as on /v1/embeddings) into one prompt; exactly one of the
    two (a 400 naming ``input`` otherwise). use_activation (or vLLM's older ``softmax`` /
    ``activation``): softmax / sigmoid over the head's logits (None: yes, as vLLM; false:
    the raw logits)."""

    input: Optional[PoolingInput] = None
    messages: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_MESSAGES)
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


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
