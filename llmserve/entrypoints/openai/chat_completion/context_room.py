"""The room a chat prompt leaves in the context, for the front doors that clamp an output
budget to it instead of refusing (Anthropic Messages: llama.cpp's rule, as Claude Code asks
for 32000 tokens whatever the model; Ollama: ``num_predict`` above the context generates
until the context is full). The prompt is rendered and counted only when a cheap bound
(its UTF-8 bytes; a byte-level tokenizer's token never holds less than one byte) says it
might not fit."""
from __future__ import annotations

import json
from typing import Any, Optional

# Template text around each message and the generation prompt, in bytes, for the bound.
TEMPLATE_BYTES_PER_MESSAGE = 64
TEMPLATE_BYTES_BASE = 1024


def prompt_bytes_bound(request: Any) -> int:
    """An upper bound of a ChatCompletionRequest's rendered prompt length in bytes (so in
    tokens): its messages and tools as JSON plus the template's share."""
    text = json.dumps([m.model_dump(exclude_none=True) for m in request.messages], ensure_ascii=False)
    tools = json.dumps(request.tools, ensure_ascii=False) if request.tools else ""
    # surrogatepass: a bound must not raise; a lone surrogate is refused, naming its field,
    # where the prompt is checked and rendered
    return (len(text.encode("utf-8", "surrogatepass")) + len(tools.encode("utf-8", "surrogatepass"))
            + TEMPLATE_BYTES_BASE + TEMPLATE_BYTES_PER_MESSAGE * len(request.messages))


async def prompt_tokens(handler: Any, request: Any) -> int:
    """The token count of ``request``'s rendered prompt (tools included) on ``handler``
    (one model's chat handler). Raises ModelNotFoundError (404) for an unknown model."""
    handler._check_model(request)  # a 404 for an unknown model, before any rendering
    return len((await handler.render(request, request.tools)).token_ids)


async def room_left(handler: Any, request: Any, max_tokens: int, context: Optional[int] = None) -> int:
    """``max_tokens`` (tokens), or the room ``request``'s prompt leaves in the model's
    context (or in ``context`` tokens: Ollama's per-request ``options.num_ctx``) when that
    is less (0 or below: the prompt alone fills it; the caller refuses)."""
    max_len = handler.max_model_len if context is None else context
    if max_tokens + prompt_bytes_bound(request) <= max_len:
        return max_tokens
    return min(max_tokens, max_len - await prompt_tokens(handler, request))
