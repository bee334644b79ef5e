"""A conversation that ends with the assistant's own text (a "prefill") is continued, not
answered: the Anthropic Messages route and Ollama's ``/api/chat`` both promise this
(Anthropic: the reply continues from the final assistant message and holds only the new
text; Ollama: its templates leave a final assistant message open). The OpenAI route
leaves it to the client (vLLM's ``continue_final_message``); these two routes set it for
the client, through the same chat-template path.
"""
from __future__ import annotations

from typing import Any


def continuation_fields(messages: list[dict[str, Any]]) -> dict[str, bool]:
    """The chat request's template switches for ``messages`` (chat messages as dicts,
    already mapped from the route's own).

    - A final assistant message with text and no tool calls is a prefill: it is left
      open and the model goes on from its last character (``continue_final_message``
      true, ``add_generation_prompt`` false). The answer then holds only the new text.
    - A final assistant message with nothing in it (no text, no tool calls, no
      reasoning) prefills nothing: it is removed from ``messages`` (in place), so the
      reply opens the assistant's turn as it would without it. A chat template cannot
      continue an empty message (the rendered turn would be closed), and rendering it
      closed put an empty assistant turn before the reply. A lone message stays.
    - Anything else (a final user or tool message, a final assistant message with tool
      calls: a turn awaiting results) keeps the default: a new assistant turn.

    Returns the fields to set ({} for the default)."""
    if not messages or messages[-1].get("role") != "assistant":
        return {}
    last = messages[-1]
    if last.get("tool_calls"):
        return {}
    if last.get("content"):
        return {"add_generation_prompt": False, "continue_final_message": True}
    if len(messages) > 1 and not last.get("reasoning_content"):
        messages.pop()
    return {}
