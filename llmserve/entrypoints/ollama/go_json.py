"""JSON ``null`` read as Go's encoding/json reads it on Ollama's routes.

Go decodes ``null`` into any field as "leave it alone": the field keeps its zero value
(``""``, ``0``, ``false``, an empty list, a nil map or pointer), so Ollama takes
``{"messages": null}`` as no messages (``/api/chat`` then loads the model and answers
``done_reason: "load"``), ``"prompt": null`` as no prompt, ``"input": null`` as no input,
``"options": {"temperature": null}`` as no temperature. A ``null`` element of a typed list
becomes that type's zero value (an empty message, ``""``, ``0``). pydantic refuses ``null``
where a field has a type, so :func:`zero_nulls` rewrites the body first: a null field of a
Go struct is dropped (the request model's default is the zero value, or the "unset" that
Go's pointer fields have), a null element of a typed list becomes the element's zero value.
Values whose Go type decodes itself or is open (``format``, ``keep_alive``, ``think``, embed
``input``'s elements, tool ``arguments``, JSON schemas) are left as they are.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from llmserve.entrypoints.ollama.go_errors import GO_TYPES, STRUCT_OF_TYPE

# The zero value of a Go element type when it is not a struct (api.ImageData is []byte).
_ZERO = {"string": "", "int": 0, "bool": False, "api.ImageData": ""}
_NAMED_LISTS = {"api.Tools": "[]api.Tool"}  # Go's named list types (api/types.go)


def _zero(go_type: str) -> Any:
    return {} if go_type in STRUCT_OF_TYPE else _ZERO.get(go_type)


def _value(go_type: Optional[str], value: Any) -> Any:
    """``value`` (of Go type ``go_type``; None: open) with its nulls as Go reads them."""
    if go_type is None:
        return value
    go_type = _NAMED_LISTS.get(go_type, go_type)
    if go_type.startswith("[]") and isinstance(value, list):
        element = go_type[2:]
        return [_zero(element) if v is None else _value(element, v) for v in value]
    if go_type in STRUCT_OF_TYPE and isinstance(value, dict):
        return _struct(STRUCT_OF_TYPE[go_type], value)
    return value


def _struct(struct: str, obj: dict[str, Any]) -> dict[str, Any]:
    fields = GO_TYPES.get(struct, {})
    return {k: _value(fields.get(k), v) for k, v in obj.items() if v is not None}


def zero_nulls(struct: str, body: bytes) -> bytes:
    """``body`` (the JSON of Go struct ``struct``: ``ChatRequest``...) with its nulls as Go
    reads them (see the module docstring); unchanged when it holds no ``null`` or is not a
    JSON object (the caller's parser reports that)."""
    if b"null" not in body:
        return body
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(value, dict):
        return body
    return json.dumps(_struct(struct, value)).encode("ascii")  # escapes keep a lone surrogate for the caller
