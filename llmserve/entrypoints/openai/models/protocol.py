"""Protocol of ``GET /v1/models``."""
from __future__ import annotations

import time
from typing import Literal, Optional

from pydantic import Field

from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel


class ModelCard(OpenAIBaseModel):
    """One entry of ``GET /v1/models``; ``created`` is a Unix time in seconds."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's): the adapter's served name and its
    PEFT directory or GGUF LoRA file; ``load_inplace``: replace an adapter already loaded
    under that name (new requests use the new weights; running ones finish on the old)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's); ``lora_int_id`` is accepted
    for vLLM's clients and, when given, must be the adapter's id."""

    lora_name: str
    lora_int_id: Optional[int] = None
