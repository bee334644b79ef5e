"""Ollama's wording for a request field of the wrong JSON type.

Ollama decodes each body with Go's encoding/json and answers the decoder's error as it is
(``{"error": "json: cannot unmarshal number into Go struct field ShowRequest.model of type
string"}``): the JSON kind received, the innermost Go struct, the field's path from the
root without list indexes, and the Go type expected. Go reports the first such error in the
body's order. :func:`go_type_error` writes that message from pydantic's errors, using the
Go types of Ollama's ``api/types.go`` (:data:`GO_TYPES`). Fields whose Go type decodes
itself (``format``, ``keep_alive``, ``think``, embed ``input``) have no entry: their errors
keep the validation handler's ``<field>: <problem>`` form, which names the field too.
"""
from __future__ import annotations

from typing import Any, Optional

from llmserve.entrypoints.openai.validation_errors import Problem, dotted, problems_of, resolve_unions

# Go struct of each request model, and the Go type of each field (api/types.go). Lists are
# "[]<element>"; an element of a list is named by its element type, as Go names it.
GO_STRUCTS: dict[str, str] = {
    "OllamaChatRequest": "ChatRequest", "OllamaGenerateRequest": "GenerateRequest",
    "OllamaEmbedRequest": "EmbedRequest", "OllamaEmbeddingsRequest": "EmbeddingRequest",
    "OllamaShowRequest": "ShowRequest", "OllamaPullRequest": "PullRequest", "OllamaPushRequest": "PushRequest",
    "OllamaDeleteRequest": "DeleteRequest", "OllamaCopyRequest": "CopyRequest",
}
_OPTIONS = "map[string]interface {}"
_GENERATE_COMMON = {"model": "string", "stream": "bool", "options": _OPTIONS, "truncate": "bool",
                    "shift": "bool", "logprobs": "bool", "top_logprobs": "int"}
_PULL_PUSH = {"model": "string", "insecure": "bool", "username": "string", "password": "string", "stream": "bool",
              "name": "string"}
GO_TYPES: dict[str, dict[str, str]] = {
    "ChatRequest": {**_GENERATE_COMMON, "messages": "[]api.Message", "tools": "api.Tools"},
    "GenerateRequest": {**_GENERATE_COMMON, "prompt": "string", "suffix": "string", "system": "string",
                        "template": "string", "context": "[]int", "raw": "bool", "images": "[]api.ImageData"},
    "Message": {"role": "string", "content": "string", "thinking": "string", "images": "[]api.ImageData",
                "tool_calls": "[]api.ToolCall", "tool_name": "string", "tool_call_id": "string"},
    "EmbedRequest": {"model": "string", "truncate": "bool", "dimensions": "int", "options": _OPTIONS},
    "EmbeddingRequest": {"model": "string", "prompt": "string", "options": _OPTIONS},
    "ShowRequest": {"model": "string", "system": "string", "template": "string", "verbose": "bool",
                    "options": _OPTIONS, "name": "string"},
    "PullRequest": _PULL_PUSH,
    "PushRequest": _PULL_PUSH,
    "DeleteRequest": {"model": "string", "name": "string"},
    "CopyRequest": {"source": "string", "destination": "string"},
    "ToolCall": {"id": "string", "function": "api.ToolCallFunction"},
    "ToolCallFunction": {"index": "int", "name": "string", "arguments": "api.ToolCallFunctionArguments"},
    "Tool": {"type": "string", "function": "api.ToolFunction"},
    "ToolFunction": {"name": "string", "description": "string"},
}
# Go types that are structs of GO_TYPES (a path going into one names it as Go's innermost
# struct)
STRUCT_OF_TYPE = {"api.Message": "Message", "api.ToolCall": "ToolCall", "api.ToolCallFunction": "ToolCallFunction",
                  "api.Tool": "Tool", "api.ToolFunction": "ToolFunction"}

# pydantic error types that say "not this type" (Go's UnmarshalTypeError)
_TYPE_ERRORS = frozenset({"string_type", "int_type", "int_parsing", "int_from_float", "float_type",
                          "float_parsing", "bool_type", "bool_parsing", "list_type", "dict_type", "model_type",
                          "model_attributes_type", "union_type"})


def _go_kind(value: Any, go_type: str) -> str:
    """The JSON kind as Go's decoder names it: ``number 1.5`` for a non-integral number
    into an integer type (Go quotes the literal), else number/string/bool/array/object."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return f"number {value!r}" if go_type == "int" and isinstance(value, float) else "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _at(body: Any, path: list[Any]) -> Any:
    for item in path:
        body = body[item]
    return body


def _go_field(struct: str, path: list[Any]) -> Optional[tuple[str, str]]:
    """(innermost Go struct, Go type) of the field at ``path`` (the client's keys and
    indexes); None when a step has no Go type here (the caller keeps its own message)."""
    go_type: Optional[str] = None
    for item in path:
        if isinstance(item, int):
            if not go_type or not go_type.startswith("[]"):
                return None
            go_type = go_type[2:]  # an element: named by its type
            continue
        if go_type is not None:  # a key inside a value: only inside a struct of GO_TYPES
            if go_type not in STRUCT_OF_TYPE:
                return None
            struct = STRUCT_OF_TYPE[go_type]
        go_type = GO_TYPES.get(struct, {}).get(item)
        if go_type is None:
            return None
    return (struct, go_type) if go_type else None


def go_type_error(model_name: str, errors: list[dict[str, Any]], body: Any) -> Optional[tuple[str, str]]:
    """Ollama's (message, field) for the first error in the body's order when it is a
    value of the wrong JSON type, as Go's encoding/json writes it; None otherwise.

    model_name: the pydantic request model's class name (GO_STRUCTS); errors: pydantic's
    ``errors()`` (locations without FastAPI's ``body``); body: the parsed JSON body."""
    struct = GO_STRUCTS.get(model_name)
    if struct is None:
        return None
    if not isinstance(body, dict):
        return f"json: cannot unmarshal {_go_kind(body, '')} into Go value of type api.{struct}", ""
    problems = resolve_unions(problems_of(errors, body))
    keys = list(body)
    first = min(problems, key=lambda p: keys.index(p.path[0]) if p.path and p.path[0] in keys else len(keys),
                default=None)
    if first is None or first.type not in _TYPE_ERRORS or not first.path:
        return None
    return _message(struct, first, body)


def _message(struct: str, problem: Problem, body: Any) -> Optional[tuple[str, str]]:
    try:
        value = _at(body, problem.path)
    except (KeyError, IndexError, TypeError):
        return None
    found = _go_field(struct, problem.path)
    if found is None or value is None:  # Go leaves a field alone on null: not this error
        return None
    inner, go_type = found
    field = ".".join(str(p) for p in problem.path if not isinstance(p, int))
    return (f"json: cannot unmarshal {_go_kind(value, go_type)} into Go struct field {inner}.{field} "
            f"of type {go_type}", dotted(problem.path))
