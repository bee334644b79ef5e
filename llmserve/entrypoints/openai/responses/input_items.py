"""Responses input items and tools -> the chat shapes the one renderer and the chat
tool machinery take (vLLM's ``construct_input_messages`` / ``convert_tool_responses_to_
completions_format``).

- input items -> chat messages: ``message`` items (string content, or ``input_text`` /
  ``output_text`` / ``refusal`` parts) keep their role; consecutive ``function_call``
  items become one assistant message with ``tool_calls``; ``function_call_output``
  becomes a ``tool`` message; ``reasoning`` items are left out of the prompt (chat
  templates drop earlier turns' reasoning).
- flat function tools (``{"type": "function", "name", "parameters"}``) and
  ``{"type": "function", "name"}`` tool choices -> chat's nested ``function`` form.
- output items -> the assistant messages a follow-up (``previous_response_id``) sees.
- ``item_reference`` items (``{"type": "item_reference", "id"}``) -> the stored item of
  that id (an output or input item of a stored response), before anything else reads the
  input (:func:`resolve_item_references`).

Every problem is a SamplingParamsError naming ``input``, ``tools`` or ``tool_choice``; a
field of an item or content part of the wrong JSON type (:data:`ITEM_FIELD_TYPES`) names
itself (``input.0.id``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from llmserve.entrypoints.chat_utils import check_json_types, part_type_words
from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.sampling_params import SamplingParamsError

# The JSON types of each input item's fields (OpenAI's ``ResponseInputItemParam`` types),
# checked where given and not null (param ``input.<i>.<field>``): the items stay plain JSON
# in the request model, so a field read by nobody here ("id": 5) or of the wrong type was
# taken (200) where OpenAI answers 400.
_STR = (str,)
ITEM_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "message": {"id": _STR, "role": _STR, "status": _STR, "content": (str, list)},
    "function_call": {"id": _STR, "call_id": _STR, "name": _STR, "arguments": _STR, "status": _STR},
    "function_call_output": {"id": _STR, "call_id": _STR, "output": (str, list), "status": _STR},
    "reasoning": {"id": _STR, "summary": (list,), "content": (list,), "encrypted_content": _STR,
                  "status": _STR},
    "item_reference": {"id": _STR},
}
PART_FIELD_TYPES = {"text": _STR, "refusal": _STR, "annotations": (list,), "logprobs": (list,)}

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = ("user", "assistant", "system", "developer")


@dataclass
class ChatToolsView:
    """The tool fields of a Responses request in chat's shape, for
    ``tool_calling.check_tools`` / ``ToolPlan`` / the parsers (which read ``tools``,
    ``tool_choice``, ``parallel_tool_calls``, ``include_reasoning``,
    ``chat_template_kwargs``, ``skip_special_tokens``)."""

    tools: Optional[list[dict[str, Any]]]
    tool_choice: Optional[Union[str, dict[str, Any]]]
    parallel_tool_calls: Optional[bool] = True
    include_reasoning: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    skip_special_tokens: bool = True


# ``--responses-unsupported-tools``: what a tool the server cannot run becomes
UNSUPPORTED_TOOLS_DROP = "drop"
UNSUPPORTED_TOOLS_REJECT = "reject"
UNSUPPORTED_TOOLS_POLICIES = (UNSUPPORTED_TOOLS_DROP, UNSUPPORTED_TOOLS_REJECT)


def tool_label(tool: Any) -> str:
    """How a tool is named in warnings, errors and the dropped-tools header: its type,
    plus its name where it has one (``web_search``, ``namespace:multi_agent_v1``,
    ``custom:apply_patch``, ``mcp:<server_label>``)."""
    if not isinstance(tool, dict):
        return type(tool).__name__
    kind = str(tool.get("type"))
    name = tool.get("name") or tool.get("server_label")
    return f"{kind}:{name}" if isinstance(name, str) and name else kind


def unsupported_tools(tools: Optional[list[Any]]) -> list[str]:
    """Labels (:func:`tool_label`) of the tools that are not function tools: hosted
    tools (``web_search``, ``image_generation``, ``file_search``, ``code_interpreter``,
    ``mcp``...), ``local_shell``, ``namespace`` groups and ``custom`` (free-form) tools.
    The server runs none of them and a function-calling model cannot call them."""
    return [tool_label(t) for t in tools or () if not (isinstance(t, dict) and t.get("type") == "function")]


def to_chat_tools(tools: Optional[list[Any]], policy: str = UNSUPPORTED_TOOLS_REJECT,
                  ) -> Optional[list[dict[str, Any]]]:
    """Function tools in chat's form (``{"type": "function", "function": {...}}``).
    Another tool type is left out with ``policy`` "drop" (the caller reports it), else
    raises SamplingParamsError (``tools``) naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            if policy == UNSUPPORTED_TOOLS_DROP:
                continue
            raise SamplingParamsError(
                f"tools[{i}]: tools of type {tool_label(tool)!r} cannot run on this server (only 'function' tools "
                "can); leave it out, or start the server with --responses-unsupported-tools drop.", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def to_chat_tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name": N}`` -> chat's ``{"type": "function", "function":
    {"name": N}}``; ``{"type": "allowed_tools", "mode", "tools": [{"type": "function",
    "name"}]}`` -> chat's ``allowed_tools`` form (its names checked by the chat path's
    ``check_tools``); strings pass. Raises SamplingParamsError (``tool_choice``) for
    other forms (hosted tool types)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools = choice.get("tools")
        chat_tools = [{"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                      for t in tools] if isinstance(tools, list) else tools
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": chat_tools}}
    raise SamplingParamsError("tool_choice: must be \"none\", \"auto\", \"required\", {\"type\": \"function\", "
                              "\"name\": \"my_function\"} or {\"type\": \"allowed_tools\", \"mode\", \"tools\"}.",
                              "tool_choice")


def _content_text(content: Any, i: int, field: str = "content") -> str:
    """The text of item ``i``'s ``field`` (a string, or a list of text parts). Raises
    SamplingParamsError naming the exact path (``input[0].content[1].text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SamplingParamsError(f"input[{i}].{field} must be a string or a list of content parts.",
                                  f"input[{i}].{field}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _TEXT_PARTS:
            check_json_types(part, PART_FIELD_TYPES, f"input.{i}.content.{j}")
        # a list or object `type` is unhashable: looked up as it came, it was a 500
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise SamplingParamsError(f"input[{i}].{field}[{j}]: content part {part_type_words(kind)} is not supported "
                                      "(this model takes text only: input_text).", f"input[{i}].{field}[{j}].type")
        if not isinstance(part.get(key), str):
            raise SamplingParamsError(f"input[{i}].{field}[{j}] needs a string `{key}`.",
                                      f"input[{i}].{field}[{j}].{key}")
        texts.append(part[key])
    return "\n".join(texts)


def _str_field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise SamplingParamsError(f"input[{i}] of type {item.get('type')!r} needs a string `{name}`.",
                                  f"input[{i}].{name}")
    return value


def input_messages(items: Union[str, list[Any]]) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise SamplingParamsError(f"input[{i}] must be an object.", f"input[{i}]")
        check_json_types(item, {"type": _STR}, f"input.{i}")
        kind = item.get("type", "message")
        check_json_types(item, ITEM_FIELD_TYPES.get(kind, {}), f"input.{i}")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise SamplingParamsError(f"input[{i}].role must be one of {list(_ROLES)}.", f"input[{i}].role")
            messages.append({"role": role, "content": _content_text(item.get("content"), i)})
        elif kind == "function_call":
            args = _str_field(item, "arguments", i)
            try:
                json.loads(args)
            except ValueError:
                raise SamplingParamsError(f"input[{i}].arguments is not valid JSON.", f"input[{i}].arguments") from None
            call = {"id": _str_field(item, "call_id", i), "type": "function",
                    "function": {"name": _str_field(item, "name", i), "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, i, "output")
            messages.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            for k, part in enumerate(item.get("summary") or ()):
                if not isinstance(part, dict):
                    raise SamplingParamsError(f"input.{i}.summary.{k}: must be an object.", f"input.{i}.summary.{k}")
                check_json_types(part, {"type": _STR, "text": _STR}, f"input.{i}.summary.{k}")
            continue
        else:
            raise SamplingParamsError(f"input[{i}]: items of type {kind!r} are not supported (message, "
                                      "function_call, function_call_output and reasoning are).", f"input[{i}].type")
    return messages


def resolve_item_references(items: Union[str, list[Any], None],
                            find: Callable[[str], Optional[dict[str, Any]]]) -> Union[str, list[Any], None]:
    """``items`` with each ``item_reference`` item replaced by the stored item it names
    (``find``: item id -> the item as JSON, None when no stored response of the caller
    has it); ``items`` itself when it holds none. Raises SamplingParamsError (param
    ``input.<i>.id``) for a reference without a string id, ItemNotFoundError (404, as
    OpenAI answers "Item with id ... not found") for an unknown one."""
    if not isinstance(items, list) or not any(isinstance(i, dict) and i.get("type") == "item_reference"
                                              for i in items):
        return items
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            out.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str):
            raise SamplingParamsError(f"input.{i}.id: an item_reference needs the string id of a stored item.",
                                      f"input.{i}.id")
        found = find(item_id)
        if found is None:
            raise ItemNotFoundError(i)
        out.append(found)
    return out


class ItemNotFoundError(NotFoundError):
    """An ``item_reference`` whose id no stored response of the caller holds (never
    stored, ``store: false``, deleted or evicted): 404 naming ``input.<i>.id``; the id is
    not quoted back."""

    def __init__(self, index: int) -> None:
        super().__init__(f"input.{index}.id: no stored item has this id (items of responses created with store: "
                         "false, deleted or evicted are not kept); send the item itself instead of a reference.",
                         f"input.{index}.id")


# A call id short and plain enough to quote back in an error (OpenAI's message names it);
# a longer or odd one is left out, so a client's value is never echoed at length.
_QUOTABLE_CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_call_ids(history: list[dict[str, Any]], items: Union[str, list[Any]]) -> None:
    """Every ``function_call_output`` item of ``items`` (a request's ``input``, already
    read by :func:`input_messages`) answers a tool call made in the conversation: a
    ``function_call`` item of the same input, or an assistant tool call of the
    ``previous_response_id`` chain (``history``, chat messages).

    Raises SamplingParamsError (param ``input``) for the first that answers none, as
    OpenAI's Responses API does ("No tool call found for function call output with
    call_id ..."); without the check the orphan output was rendered as a tool turn
    answering nothing."""
    if isinstance(items, str):
        return
    known = {call.get("id") for m in history for call in m.get("tool_calls") or ()}
    known.update(item.get("call_id") for item in items if item.get("type") == "function_call")
    for i, item in enumerate(items):
        call_id = item.get("call_id")
        if item.get("type") == "function_call_output" and call_id not in known:
            quoted = f" {call_id}" if _QUOTABLE_CALL_ID.fullmatch(call_id) else ""
            raise SamplingParamsError(
                f"No tool call found for function call output with call_id{quoted} (input[{i}]): send the "
                "function_call item it answers in input, or continue the response that made the call "
                "with previous_response_id.", "input")  # OpenAI's param for it


def output_messages(output: list[Any]) -> list[dict[str, Any]]:
    """The assistant turn(s) of a response's output items, as chat messages (text and
    tool calls in one assistant message; reasoning left out)."""
    text, calls = "", []
    for item in output:
        if item.type == "message":
            text += "".join(c.text for c in item.content)
        elif item.type == "function_call":
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
