"""Anthropic Messages request -> the common chat request (``ChatCompletionRequest``).

Only the mapping lives here; templates, tool-call and reasoning parsing, structured
outputs and sampling are the chat path's. Rules (Anthropic's documented meaning):

- ``system`` (a string or text blocks) and ``role: "system"`` messages inside
  ``messages`` (Claude Code sends one; anywhere but first: ``checks.py``) become
  system messages, in place.
- Text blocks become the message's text (joined with newlines); ``tool_use`` blocks of an
  assistant message become its ``tool_calls``; ``tool_result`` blocks of a user message
  become ``tool`` messages (``tool_call_id``) before that message's remaining text.
- ``thinking`` / ``redacted_thinking`` blocks sent back in assistant turns are dropped
  (templates leave earlier turns' reasoning out of the prompt too); a ``compaction``
  block sent back is read as its summary's text (``compaction.py``).
- Plain-text ``document`` blocks (source ``text``, or ``content``: a string or text
  blocks) and ``search_result`` blocks, in a user message or a ``tool_result``, become
  text: their title (and a document's ``context``, a search result's ``source``) on lines
  before the text. ``image`` blocks and documents of other sources (PDF as ``base64``,
  ``url``, ``file``) are a 400 naming the block (no vision model runs); so is any block
  type this server does not know.
- Every block's fields take Anthropic's JSON types (:data:`BLOCK_FIELD_TYPES`, a
  document's source too), dropped blocks included: ``"is_error": "yes"`` or
  ``"thinking": 5`` is a 400 naming the field and the value's kind, never the value.
- ``tool_reference`` blocks in a ``tool_result``'s content (a tool search's answer,
  Claude Code's ``ToolSearch``) load the tool they name: a tool with
  ``defer_loading: true`` is shown to the model only once one names it (Anthropic's tool
  search), and the block reads as ``Tool loaded: <name>``. ``tool_addition`` /
  ``tool_removal`` blocks (beta mid-conversation tool changes, Claude Code 2.1.332's)
  offer or withdraw the tool their ``tool_reference`` names, and read as ``Tool
  available: <name>`` / ``Tool removed: <name>``; the tools offered are those at the end
  of the conversation (a chat template lists tools once). A change naming no tool of
  ``tools`` is a 400 (``tool_reference_unresolved``).
- ``tools``: client tools (``input_schema``) become function tools; server tools
  (``web_search_*``, ``bash_*``, ...) and ``mcp_servers`` are a 400 naming them, as is a name outside
  ``^[a-zA-Z0-9_-]{1,64}$`` or an invalid schema (``tools.<i>.name`` / ``.input_schema``).
- ``tool_choice``: ``auto`` -> "auto", ``any`` -> "required", ``tool`` -> the named
  function, ``none`` -> "none"; ``disable_parallel_tool_use`` -> ``parallel_tool_calls``.
  Tools without a ``tool_choice`` on a server without auto tool parsing
  (``--enable-auto-tool-choice --tool-call-parser``) are shown to the template and the
  answer is text (Anthropic's default ``auto`` lets the model answer without a tool);
  an explicit ``auto`` there is a 400 naming ``tool_choice``.
- ``thinking``: ``enabled``/``adaptive``/``between_tools`` ->
  ``chat_template_kwargs.enable_thinking`` true, ``disabled`` -> false (the reasoning
  parser splits the output; without one the template's switch is all it does).
  ``budget_tokens`` is checked as Anthropic checks it (``checks.py``), not enforced.
- Anthropic's rules between fields and turns (``thinking.budget_tokens`` against
  ``max_tokens``, every ``tool_result`` answering a ``tool_use`` of the previous turn...)
  are ``checks.py``'s; the values of the fields accepted with no effect (``metadata``,
  ``service_tier``, ``cache_control``...) are ``accepted_fields.py``'s.
- ``output_config.format`` (``{"type": "json_schema", "schema"}``) -> a JSON-schema
  ``response_format`` (structured outputs); ``output_config.effort`` is ignored (no
  effort switch on a local model).
- A final assistant message with text (no ``tool_use``) is a prefill: rendered open
  (the chat path's ``continue_final_message``), the answer is its continuation only;
  an empty one is dropped (the answer opens the turn). Not with thinking on (``checks.py``).
- ``stop_sequences`` -> ``stop``; ``temperature``, ``top_p``, ``top_k`` as they are
  (Anthropic's SDK 2.x no longer has them as arguments; they still travel in the body).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from llmserve.entrypoints.anthropic import compaction
from llmserve.entrypoints.anthropic.accepted_fields import check_accepted_fields
from llmserve.entrypoints.anthropic.checks import (check_contents, check_forced_tools, check_prefill,
                                                   check_stop_sequences, check_system_messages, check_texts,
                                                   check_thinking, check_tool_turns)
from llmserve.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from llmserve.entrypoints.assistant_prefill import continuation_fields
from llmserve.entrypoints.chat_utils import check_json_types
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.chat_completion.tool_calling import TOOL_NAME_RE
from llmserve.entrypoints.openai.common.protocol import StreamOptions
from llmserve.sampling_params import SamplingParamsError
from llmserve.structured_output.grammar import json_schema_error

_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_TOOL_CHANGES = frozenset({"tool_addition", "tool_removal"})  # read by chat_tools, shown as a line
_MEDIA_BLOCKS = frozenset({"image", "document", "container_upload"})
# The JSON types of each content block's fields (Anthropic's ``*BlockParam`` types), checked
# where given and not null: the blocks stay plain JSON in the request model, so a field of
# the wrong type ("is_error": "yes", "thinking": 5) was read as something else or dropped
# unread (200) where Anthropic answers 400. Blocks of types not here are refused or dropped.
_STR, _BOOL, _OBJ, _LIST = (str,), (bool,), (dict,), (list,)
BLOCK_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "text": {"text": _STR, "citations": _LIST},
    "image": {"source": _OBJ},
    "document": {"source": _OBJ, "title": _STR, "context": _STR, "citations": _OBJ},
    "search_result": {"source": _STR, "title": _STR, "content": _LIST, "citations": _OBJ},
    "tool_use": {"id": _STR, "name": _STR, "input": _OBJ},
    "tool_result": {"tool_use_id": _STR, "content": (str, list), "is_error": _BOOL},
    "thinking": {"thinking": _STR, "signature": _STR},
    "redacted_thinking": {"data": _STR},
    "compaction": {"content": _STR, "encrypted_content": _STR, "signature": _STR, "tool_changes": _LIST},
    "tool_reference": {"tool_name": _STR},
    "tool_addition": {"tool": _OBJ},
    "tool_removal": {"tool": _OBJ},
}
# a document's source, by its type
DOCUMENT_SOURCE_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "text": {"media_type": _STR, "data": _STR},
    "content": {"content": (str, list)},
    "base64": {"media_type": _STR, "data": _STR},
    "url": {"url": _STR},
}
_THINKING_TYPES = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise SamplingParamsError(f"{where}.text: a text block needs a string `text`.", where)
    return text


def _block_type(block: Any, where: str) -> str:
    """The ``type`` of the content block at ``where`` (``messages.<i>.content.<j>``,
    ``system.<j>``, ``...content.<k>`` inside a tool_result). Blocks reach this module as
    plain JSON values, so a block that is not an object, or whose ``type`` is missing or
    not a string, is refused here, before any code hashes or compares it (a list ``type``
    was a 500 ``unhashable type``, a number inside a tool_result's content list a 500
    ``'int' object has no attribute 'get'``). Raises SamplingParamsError naming the block
    or its ``type`` (Anthropic answers such bodies with a 400 naming the path too)."""
    if not isinstance(block, dict):
        raise SamplingParamsError(f"{where}: a content block must be an object with a string `type`; got "
                                  f"{json.dumps(block)[:80]}.", where)
    kind = block.get("type")
    if not isinstance(kind, str):
        got = "none was given" if kind is None else f"got {json.dumps(kind)[:80]}"
        raise SamplingParamsError(f"{where}.type: a content block needs a string `type`; {got}.", f"{where}.type")
    check_json_types(block, BLOCK_FIELD_TYPES.get(kind, {}), where)
    source = block.get("source")
    if kind == "document" and isinstance(source, dict):
        check_json_types(source, {"type": _STR}, f"{where}.source")
        check_json_types(source, DOCUMENT_SOURCE_TYPES.get(source.get("type"), {}), f"{where}.source")
    return kind


def _refuse_block(kind: str, where: str) -> SamplingParamsError:
    if kind in _MEDIA_BLOCKS:
        return SamplingParamsError(f"{where}: {kind} blocks are not supported: this server runs a text-only model "
                                   "(send the content as text).", where)
    return SamplingParamsError(f"{where}: content blocks of type {kind!r} are not supported here (supported: "
                               "text, plain-text document, search_result, tool_use, tool_result, thinking, "
                               "compaction, tool_addition, tool_removal).", where)


def _optional_text(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if value is not None and not isinstance(value, str):
        raise SamplingParamsError(f"{where}.{key} must be a string.", f"{where}.{key}")
    return value or ""


def _titled(block: dict[str, Any], keys: tuple[str, ...], body: str, where: str) -> str:
    """``body`` under the block's ``keys`` (``title``...) that are set, one line each."""
    return "\n".join(t for t in [*(_optional_text(block, k, where) for k in keys), body] if t)


def _document_text(block: dict[str, Any], where: str) -> str:
    """The text of a plain-text ``document`` block (source ``text``: ``data``; source
    ``content``: a string or text blocks) under its title and context. Raises
    SamplingParamsError naming the block for another source (a PDF, a URL, a file id):
    their content needs a model that reads them."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif kind == "content" and isinstance(source.get("content"), (str, list)):
        content = source["content"]
        body = content if isinstance(content, str) else system_text(content, f"{where}.source.content")
    else:
        got = json.dumps(kind)[:40] if kind is not None else "no"
        raise SamplingParamsError(f"{where}: document blocks with {got} source are not supported: this server runs "
                                  'a text-only model (send plain text as source {"type": "text", "media_type": '
                                  '"text/plain", "data": ...}).', where)
    return _titled(block, ("title", "context"), body, where)


def _search_result_text(block: dict[str, Any], where: str) -> str:
    """The text of a ``search_result`` block: its title and source, then its text blocks."""
    content = block.get("content")
    if not isinstance(content, list):
        raise SamplingParamsError(f"{where}.content: a search_result block needs a list of text blocks.",
                                  f"{where}.content")
    return _titled(block, ("title", "source"), system_text(content, f"{where}.content"), where)


# Blocks a text-only model reads as text (user messages and tool results), besides ``text``.
_TEXT_LIKE = {"document": _document_text, "search_result": _search_result_text}


def _read_block(kind: str, block: dict[str, Any], where: str) -> str:
    """The text of a ``text``, plain-text ``document`` or ``search_result`` block;
    SamplingParamsError naming the block for any other kind."""
    if kind == "text":
        return _block_text(block, where)
    if kind in _TEXT_LIKE:
        return _TEXT_LIKE[kind](block, where)
    raise _refuse_block(kind, where)


def system_text(system: Any, where: str = "system") -> str:
    """The text of ``system`` (a string, or text blocks joined with newlines)."""
    if isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        kind = _block_type(block, f"{where}.{j}")
        if kind != "text":
            raise _refuse_block(kind, f"{where}.{j}")
        texts.append(_block_text(block, f"{where}.{j}"))
    return "\n".join(texts)


def _tool_reference_text(block: dict[str, Any], where: str) -> str:
    """A ``tool_reference`` block (a tool search's answer, inside a ``tool_result``) as the
    line the model reads; the tool's definition is loaded into ``tools`` (:func:`chat_tools`)."""
    name = block.get("tool_name")
    if not isinstance(name, str):
        raise SamplingParamsError(f"{where}.tool_name: a tool_reference block needs the string `tool_name` of a "
                                  "tool in `tools`.", f"{where}.tool_name")
    return f"Tool loaded: {name}"


def _tool_result_part(block: Any, where: str) -> str:
    """One block of a ``tool_result``'s content list as text."""
    kind = _block_type(block, where)
    if kind == "tool_reference":
        return _tool_reference_text(block, where)
    return _read_block(kind, block, where)


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        at = f"{where}.content"
        text = "\n".join(_tool_result_part(b, f"{at}.{k}") for k, b in enumerate(content))
    else:
        raise SamplingParamsError(f"{where}.content must be a string or a list of text blocks.", where)
    return f"Error: {text}" if block.get("is_error") is True else text


def _tool_use_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise SamplingParamsError(f"{where}: a tool_use block needs a string `id` and `name`.", where)
    if not isinstance(args, dict):
        raise SamplingParamsError(f"{where}.input must be an object.", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _message_to_chat(i: int, role: str, content: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (compaction summaries first, each as its
    own user turn, so that a history made of one is no assistant prefill; then tool
    results, as their own ``tool`` messages; then the rest). A message of compaction
    blocks only adds nothing else (a failed one, content null, nothing at all)."""
    where = f"messages.{i}.content"
    if role == "system":
        return [{"role": "system", "content": system_text(content, where)}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results, summaries = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text" or (kind in _TEXT_LIKE and role == "user"):
            texts.append(_read_block(kind, block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use_call(block, at))
        elif kind == "compaction":  # a summary sent back (compaction.py)
            summaries.append({"role": "user", "content": compaction.block_text(block)})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise SamplingParamsError(f"{at}: a tool_result block needs a string `tool_use_id`.", at)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _tool_result_text(block, at)})
        elif kind in _TOOL_CHANGES:
            verb = "available" if kind == "tool_addition" else "removed"
            texts.append(f"Tool {verb}: {_tool_change_name(block, at)}")
        elif kind not in _DROPPED_BLOCKS:
            raise _refuse_block(kind, at)
    out = [m for m in summaries if m["content"]] + results
    if texts or calls or not (results or summaries):
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_messages(request: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """``system`` + ``messages`` as the chat request's messages. Raises
    SamplingParamsError naming the block (``messages.<i>.content.<j>``)."""
    out: list[dict[str, Any]] = []
    if request.system is not None:
        text = system_text(request.system)
        if text:
            out.append({"role": "system", "content": text})
    for i, msg in enumerate(request.messages):
        out.extend(_message_to_chat(i, msg.role, msg.content))
    return out


def _check_tool(tool: Any, i: int) -> None:
    """A client tool's ``name`` (Anthropic's ``^[a-zA-Z0-9_-]{1,64}$``) and
    ``input_schema`` (a valid JSON schema), named by their Anthropic path (the chat
    path's own check would name ``tools[i].function...``, a field the client never sent)."""
    if not TOOL_NAME_RE.match(tool.name):
        raise SamplingParamsError(f"tools.{i}.name must be 1-64 letters, digits, '_' or '-'.", f"tools.{i}.name")
    err = json_schema_error(tool.input_schema)
    if err is not None:
        raise SamplingParamsError(f"tools.{i}.input_schema is not a valid JSON schema {err}", f"tools.{i}.input_schema")


class ToolReferenceUnresolvedError(SamplingParamsError):
    """A ``tool_reference`` names no tool of ``tools``: a 400 whose Anthropic body
    carries ``error.details.error_code`` ``tool_reference_unresolved`` (the SDK's
    ToolReferenceUnresolvedError)."""

    code = "tool_reference_unresolved"


def _tool_change_name(block: dict[str, Any], where: str) -> str:
    """The tool name a ``tool_addition`` / ``tool_removal`` block (beta
    ``mid-conversation-tool-changes-2026-07-01``) names: its ``tool`` must be
    ``{"type": "tool_reference", "name": ...}``. Raises SamplingParamsError naming
    ``<where>.tool`` for another shape: MCP references need the MCP connector and inline
    ``tool_definition``s the ``inline-tools`` beta, neither served here (declare the tool
    in ``tools``, with ``defer_loading`` to offer it later)."""
    tool = block.get("tool")
    if not isinstance(tool, dict) or tool.get("type") != "tool_reference" or not isinstance(tool.get("name"), str):
        raise SamplingParamsError(f"{where}.tool: only {{\"type\": \"tool_reference\", \"name\": ...}} naming a tool "
                                  "in `tools` is supported here (no MCP connector, no inline tool definitions).",
                                  f"{where}.tool")
    return tool["name"]


def tool_changes(messages: Any) -> list[tuple[bool, str, str]]:
    """The conversation's changes to the tools offered, in order: ``(added, name, path)``
    for each ``tool_reference`` in a ``tool_result``'s content (added; ``tool_name``),
    ``tool_addition`` (added) and ``tool_removal`` (withdrawn) block of ``messages``
    (AnthropicMessageParam); path: the field naming the tool. Raises SamplingParamsError
    for a tool change of another shape (:func:`_tool_change_name`)."""
    changes: list[tuple[bool, str, str]] = []
    for i, message in enumerate(messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
            at = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _TOOL_CHANGES:
                changes.append((kind == "tool_addition", _tool_change_name(block, at), f"{at}.tool.name"))
            inner = block.get("content") if kind == "tool_result" else None
            for k, part in enumerate(inner if isinstance(inner, list) else ()):
                if isinstance(part, dict) and part.get("type") == "tool_reference" \
                        and isinstance(part.get("tool_name"), str):
                    changes.append((True, part["tool_name"], f"{at}.content.{k}.tool_name"))
    return changes


def _loaded_tools(request: AnthropicCountTokensRequest) -> list[tuple[int, Any]]:
    """``(index, tool)`` of the tools offered to the model at the end of the conversation:
    every tool without ``defer_loading: true``, then the conversation's tool changes in
    order (:func:`tool_changes`): a ``tool_reference`` in a tool result (Anthropic's tool
    search; Claude Code's ``ToolSearch`` answers with them) or a ``tool_addition`` offers
    the tool it names, a ``tool_removal`` withdraws it. Raises SamplingParamsError naming
    ``tools.<i>.defer_loading`` (not a boolean) or ToolReferenceUnresolvedError naming the
    field of a change that names no tool of ``tools``."""
    tools = list(enumerate(request.tools or ()))
    for i, tool in tools:
        if tool.defer_loading is not None and not isinstance(tool.defer_loading, bool):
            raise SamplingParamsError(f"tools.{i}.defer_loading: must be a boolean.", f"tools.{i}.defer_loading")
    names = {tool.name for _, tool in tools}
    offered = {tool.name for _, tool in tools if tool.defer_loading is not True}
    for added, name, where in tool_changes(request.messages):
        if name not in names:
            raise ToolReferenceUnresolvedError(f"{where}: names no tool in `tools` (a tool that a tool_reference, "
                                               "tool_addition or tool_removal names must be declared there; "
                                               "defer_loading keeps it out until then).", where)
        if added:
            offered.add(name)
        else:
            offered.discard(name)
    return [(i, tool) for i, tool in tools if tool.name in offered]


def chat_tools(request: AnthropicCountTokensRequest) -> Optional[list[dict[str, Any]]]:
    """The client tools the model is shown (:func:`_loaded_tools`: a tool with
    ``defer_loading: true`` only once a ``tool_reference`` loads it) as OpenAI function
    tools. Raises SamplingParamsError naming
    ``tools.<i>`` for a server tool or a missing ``input_schema``, and ``mcp_servers``
    when it lists any: Anthropic's MCP connector (beta ``mcp-client-*``) has the API
    call those servers' tools, which this server does not do (the field was an ignored
    unknown one, so the model answered without the tools the client meant it to have)."""
    if (request.model_extra or {}).get("mcp_servers"):
        raise SamplingParamsError("mcp_servers: the MCP connector is not available on this server (it does not call "
                                  "MCP servers); connect to them on the client and send their tools in `tools`.",
                                  "mcp_servers")
    if not request.tools:
        return None
    tools = []
    for i, tool in _loaded_tools(request):
        if tool.type not in (None, "custom"):
            raise SamplingParamsError(f"tools.{i}: the server tool {tool.type!r} ({tool.name!r}) is not available "
                                      "on this server; only client tools (with `input_schema`) are.", f"tools.{i}")
        if tool.input_schema is None:
            raise SamplingParamsError(f"tools.{i}.input_schema: a client tool needs an `input_schema`.",
                                      f"tools.{i}.input_schema")
        _check_tool(tool, i)
        if any(t["function"]["name"] == tool.name for t in tools):  # named here, not as the chat path's tools[i].function
            raise SamplingParamsError(f"tools.{i}.name: tool names must be unique.", f"tools.{i}.name")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        tools.append({"type": "function", "function": fn})
    return tools or None


def chat_tool_choice(choice: Optional[dict[str, Any]], has_tools: bool,
                     auto_tools: bool) -> tuple[Optional[Any], Optional[bool]]:
    """``(tool_choice, parallel_tool_calls)`` of the chat request. auto_tools: whether
    the server parses tool calls on its own (``--enable-auto-tool-choice``). Raises
    SamplingParamsError naming the field: ``disable_parallel_tool_use`` takes a JSON
    boolean only, as Anthropic checks it (``"true"`` or 1 was silently read as false)."""
    if choice is None:
        return (("auto" if auto_tools else "none") if has_tools else None), None
    kind = choice.get("type")
    check_json_types(choice, {"type": (str,), "name": (str,), "disable_parallel_tool_use": (bool,)}, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    parallel = False if disable is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise SamplingParamsError("tool_choice.name: a tool choice of type 'tool' needs the tool's `name`.",
                                      "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise SamplingParamsError("tool_choice.type must be one of 'auto', 'any', 'tool', 'none'.", "tool_choice.type")


def thinking_kwargs(thinking: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The chat template's ``enable_thinking`` for ``thinking`` (None: not given), once
    ``checks.check_thinking`` has passed it."""
    if thinking is None:
        return None
    return {"enable_thinking": _THINKING_TYPES[thinking["type"]]}


def response_format(output_config: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The chat ``response_format`` of ``output_config.format`` (None: free text).
    ``effort``, ignored, is still a string when given (a number was taken)."""
    check_json_types(output_config or {}, {"format": _OBJ, "effort": _STR}, "output_config")
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise SamplingParamsError('output_config.format must be {"type": "json_schema", "schema": {...}}.',
                                  "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat_request(request: AnthropicCountTokensRequest, *, auto_tools: bool,
                    max_tokens: Optional[int] = None) -> ChatCompletionRequest:
    """The common chat request of a messages (or count_tokens) request. max_tokens: the
    (clamped) output budget. A stream asks for usage on every chunk (Anthropic's
    ``message_start`` carries the input tokens). A final assistant message with text is
    a prefill: the template leaves it open and the answer continues it
    (``assistant_prefill.continuation_fields``), as Anthropic continues one. Raises
    SamplingParamsError naming the Anthropic field."""
    check_texts(request)
    check_accepted_fields(request)
    messages = chat_messages(request)
    check_system_messages(request.messages)
    check_contents(request.messages)
    check_tool_turns(request.messages)
    check_thinking(request.thinking, request.max_tokens if isinstance(request, AnthropicMessagesRequest) else None)
    check_forced_tools(request.thinking, request.tool_choice)
    check_prefill(request.messages, request.thinking)
    check_stop_sequences(getattr(request, "stop_sequences", None))
    tools = chat_tools(request)
    choice, parallel = chat_tool_choice(request.tool_choice, bool(tools), auto_tools)
    fields: dict[str, Any] = dict(model=request.model, messages=messages, tools=tools,
                                  tool_choice=choice, chat_template_kwargs=thinking_kwargs(request.thinking),
                                  **continuation_fields(messages))
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    if isinstance(request, AnthropicMessagesRequest):
        fields.update(max_tokens=max_tokens if max_tokens is not None else request.max_tokens,
                      stop=request.stop_sequences, temperature=request.temperature, top_p=request.top_p,
                      top_k=request.top_k, stream=bool(request.stream),
                      response_format=response_format(request.output_config))
        if request.stream:
            fields["stream_options"] = StreamOptions(include_usage=True, continuous_usage_stats=True)
    return ChatCompletionRequest(**fields)
