"""Protocol of ``POST /v1/embeddings`` (parsed to check the model; a generative model
answers 400)."""
from __future__ import annotations

from typing import Optional, Union

from llmserve.entrypoints.openai.common.protocol import OpenAIRequestModel


class EmbeddingRequest(OpenAIRequestModel):
    """``POST /v1/embeddings``: parsed to check the model; generate models answer 400."""

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Optional[str] = "float"
