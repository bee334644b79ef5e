"""Protocol of ``GET /v1/models``."""
from __future__ import annotations

import datetime
import time
from typing import Literal, Optional

from pydantic import Field, computed_field

from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, OpenAIRequestPart


class ModelCard(OpenAIBaseModel):
    """One entry of ``GET /v1/models``; ``created`` is a Unix time in seconds.

    OpenAI's fields, and also those Anthropic's ``ModelInfo`` requires (``type``,
    ``display_name``, ``lifecycle``, ``created_at`` as RFC 3339; ``max_input_tokens`` and
    ``max_tokens`` from ``max_model_len``), so the ``anthropic`` SDK's
    ``models.list()`` / ``models.retrieve()`` against this server give complete objects
    (without them ``created_at`` and ``display_name`` came back None; ``created_at`` is a
    required datetime there). Extra fields are ignored by the ``openai`` SDK."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    type: Literal["model"] = "model"
    lifecycle: Literal["active"] = "active"  # Anthropic's: a served model is callable

    @computed_field  # type: ignore[prop-decorator]
    @property
    def display_name(self) -> str:
        return self.id

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created_at(self) -> str:
        return datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def max_input_tokens(self) -> Optional[int]:
        """Anthropic's context window of the model (``ModelInfo.max_input_tokens``): the
        longest prompt, ``max_model_len - 1`` (one token is left for the answer)."""
        return self.max_model_len - 1 if self.max_model_len else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def max_tokens(self) -> Optional[int]:
        """Anthropic's largest output (``ModelInfo.max_tokens``), in tokens: what a
        one-token prompt leaves of the context (a larger ``max_tokens`` is clamped)."""
        return self.max_model_len - 1 if self.max_model_len else None


class ModelList(OpenAIBaseModel):
    """The body of ``GET /v1/models``: OpenAI's list, with Anthropic's page fields
    (``has_more`` false: every model is on the one page; ``first_id``, ``last_id``)."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
    has_more: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_id(self) -> Optional[str]:
        return self.data[0].id if self.data else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def last_id(self) -> Optional[str]:
        return self.data[-1].id if self.data else None


class LoadLoRAAdapterRequest(OpenAIRequestPart):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's): the adapter's served name and its
    PEFT directory or GGUF LoRA file; ``load_inplace``: replace an adapter already loaded
    under that name (new requests use the new weights; running ones finish on the old)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIRequestPart):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's); ``lora_int_id`` is accepted
    for vLLM's clients and, when given, must be the adapter's id."""

    lora_name: str
    lora_int_id: Optional[int] = None
