"""OpenAI request fields that only tune OpenAI's own service or bookkeeping, shared by
``/v1/chat/completions`` and ``/v1/responses`` (the legacy ``/v1/completions`` has none
of them): ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``safety_identifier`` and ``verbosity`` (chat's top-level
field; the Responses API's ``text.verbosity``).

They change nothing in a text answer here (Responses' ``store`` keeps the response in the
in-process store; its ``metadata`` is echoed back), so a value OpenAI takes is accepted
and ignored, as vLLM does; a value OpenAI refuses is a 400 naming the field, on every
route alike (the fresh-user trial found chat answering 200 for ``"metadata": "x"``,
``{"metadata": {"k": 5}}`` and ``"store": "yes"`` while Responses answered 400). The
limits and values are OpenAI's (the ``openai`` client's ``completion_create_params`` /
``response_create_params``, 3.63): ``metadata`` at most 16 string keys of at most 64
characters with string values of at most 512; ``safety_identifier`` at most 128
characters. ``store`` takes JSON booleans only (OpenAIRequestModel's strict booleans).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from llmserve.entrypoints.openai.common.protocol import OpenAIRequestModel

MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_SAFETY_IDENTIFIER_CHARS = 128

# ``metadata``: an object of at most 16 string -> string pairs (key <= 64, value <= 512 chars)
Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA_ENTRIES)]
# The client's values for chat and Responses together ("ultrafast": Responses only, by access)
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
Verbosity = Literal["low", "medium", "high"]
# "in_memory" is the client's spelling; "in-memory" that of OpenAI's prompt-caching guide
PromptCacheRetention = Literal["in_memory", "in-memory", "24h"]


class OpenAIServiceFields(OpenAIRequestModel):
    """The fields above, declared once for chat and Responses (a mixin of both request
    models). A wrong type, unknown value or limit exceeded is a pydantic error: a 400
    naming the field as sent (``metadata``, ``metadata.k``, ``service_tier``)."""

    metadata: Optional[Metadata] = None
    store: Optional[bool] = None  # Responses: default true (its own declaration)
    service_tier: Optional[ServiceTier] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[PromptCacheRetention] = None
    safety_identifier: Optional[Annotated[str, Field(max_length=MAX_SAFETY_IDENTIFIER_CHARS)]] = None
