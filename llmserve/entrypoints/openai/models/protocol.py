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
