"""``GET /v1/responses/{id}/input_items``: a stored response's input items in OpenAI's
list shape (``openai.types.responses.ResponseItemList``: ``object: "list"``, ``data``,
``first_id``, ``last_id``, ``has_more``), paged with ``after`` (an item id), ``limit``
(1..100, default 20) and ``order`` (``desc``, the default, newest first; or ``asc``).

The items are the request's own ``input`` (a string input is one user message), each
with an ``id`` (the client's, else one made here: ``msg_``, ``fc_``, ``fco_``...), message
content as parts (``input_text``; ``output_text`` for assistant turns) and ``status``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, random_uuid
from llmserve.sampling_params import SamplingParamsError

DEFAULT_LIMIT = 20
MAX_LIMIT = 100  # OpenAI's bounds on ``limit``
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class ResponseItemList(OpenAIBaseModel):
    """OpenAI's list of items."""

    object: str = "list"
    data: list[dict[str, Any]]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


def _message_content(role: str, content: Any) -> Any:
    if not isinstance(content, str):
        return content
    return [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]


def stored_input_items(items: Union[str, list[Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as listed items (see the module docstring); called after
    the input was checked, so every item is an object."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        item.setdefault("id", f"{_ID_PREFIXES.get(kind, 'item')}_{random_uuid()}")
        if kind == "message":
            item["content"] = _message_content(item.get("role", "user"), item.get("content"))
        item.setdefault("status", "completed")
        out.append(item)
    return out


def page(items: list[dict[str, Any]], after: Optional[str], limit: int, order: str) -> ResponseItemList:
    """One page of ``items`` (oldest first as stored). Raises SamplingParamsError
    naming ``limit``, ``order`` or ``after`` (an id not among the items)."""
    if not 1 <= limit <= MAX_LIMIT:
        raise SamplingParamsError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}.", "limit")
    if order not in ("asc", "desc"):
        raise SamplingParamsError(f"order must be 'asc' or 'desc', got {order!r}.", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise SamplingParamsError(f"after: no input item with id {after!r} in this response.", "after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return ResponseItemList(data=data, first_id=data[0]["id"] if data else None,
                            last_id=data[-1]["id"] if data else None, has_more=start + limit < len(ordered))
