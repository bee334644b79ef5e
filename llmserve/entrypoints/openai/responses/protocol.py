"""Protocol of ``POST /v1/responses`` (OpenAI's Responses API; not served yet: the request
is parsed far enough to check the model and the input length)."""
from __future__ import annotations

from typing import Any, Optional, Union

from llmserve.entrypoints.openai.common.protocol import OpenAIRequestModel


class ResponsesRequest(OpenAIRequestModel):
    """``POST /v1/responses``: only parsed far enough to check the model and the input
    length; the endpoint itself is not served yet."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
