"""Chat messages -> prompt text through the model's chat template (vLLM's ``chat_utils``).

The template writes every special token itself, so the rendered text is tokenized with
``add_special_tokens=False`` by default (vLLM's online-chat rule; see vLLM PR #5278).
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from llmserve.entrypoints.system_messages import (normalize_system_messages, render_with_inline_systems,
                                                   template_names_role)
from llmserve.sampling_params import SamplingParamsError

# Keyword arguments of apply_chat_template that callers may not override through
# ``chat_template_kwargs``.
_RESERVED_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "return_dict", "return_tensors", "tools",
})


# Content part types whose text the model reads, and the field holding it.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
# Content part types the OpenAI APIs define that a text-only model refuses: an error may
# name these; any other value the client sent is not quoted back (it may be anything).
_KNOWN_NON_TEXT_PARTS = frozenset({"image_url", "input_image", "input_audio", "audio_url", "video_url",
                                   "file", "input_file", "image", "document", "thinking"})


def part_type_words(kind: Any) -> str:
    """How an error names a content part's ``type``: ``of type 'image_url'`` for a part
    type the OpenAI APIs define, else ``of this type`` (a client's value is not echoed)."""
    return f"of type {kind!r}" if isinstance(kind, str) and kind in _KNOWN_NON_TEXT_PARTS else "of this type"
_JSON_TYPE_NAMES = ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string"),
                    ((int, float), "a number"))


def json_type_name(value: Any) -> str:
    """A JSON value's type as a client reads it ("an object", "null", ...), never the value."""
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def content_to_text(content: Any, index: int) -> Optional[str]:
    """Text of a message's ``content``: a string as is; text parts joined with newlines
    (vLLM's behaviour); None stays None. Raises SamplingParamsError naming the part's
    field (``messages.<index>.content.<j>.text`` / ``.type``) for a text that is missing
    or not a string, a part without a type, or a part type other than text."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"messages.{index}.content.{j}"
        kind = part.get("type")
        if "type" not in part:
            raise SamplingParamsError(f"{where}: a content part needs a `type` (\"text\").", f"{where}.type")
        if not isinstance(kind, str):  # a value that is no type name (nor hashable, for the lookup below)
            raise SamplingParamsError(f"{where}.type: must be a string (\"text\"), not {json_type_name(kind)}.",
                                      f"{where}.type")
        if kind not in _TEXT_PARTS:
            raise SamplingParamsError(f"{where}: content part {part_type_words(kind)} is not supported "
                                      "(this model takes text only).", f"{where}.type")
        key = _TEXT_PARTS[kind]
        text = part.get(key)
        if key not in part:
            raise SamplingParamsError(f"{where}: a content part of type {kind!r} needs a `{key}` field "
                                      "(a string).", f"{where}.{key}")
        if not isinstance(text, str):
            raise SamplingParamsError(f"{where}.{key}: must be a string, not {json_type_name(text)}.",
                                      f"{where}.{key}")
        texts.append(text)
    return "\n".join(texts)


def parse_chat_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """Turn request messages (pydantic ChatMessageParam or dicts) into the plain dicts a
    chat template expects: ``{"role": str, "content": str, ...extra fields}``.

    Roles other than OpenAI's (system, developer, user, assistant, tool, function) pass
    through to the chat template as they are, as vLLM does (templates that know a custom
    role, e.g. "ipython", "document", render it); the server first refuses those its
    template does not name (:func:`check_custom_roles`).
    Raises SamplingParamsError (param "messages") for unsupported content parts or a
    role that is not a string.
    """
    out = []
    for i, msg in enumerate(messages):
        d = msg.model_dump(exclude_none=True) if hasattr(msg, "model_dump") else dict(msg)
        if not isinstance(d.get("role"), str):
            raise SamplingParamsError(f"messages[{i}].role must be a string.", "messages")
        text = content_to_text(d.get("content"), i)
        d["content"] = text if text is not None else ""
        if d["role"] == "assistant":
            _postprocess_assistant(d, i)
        out.append(d)
    return out


def check_custom_roles(messages: Iterable[Any], template: Any) -> None:
    """Refuse a message whose role is not one of OpenAI's and that ``template`` (the Jinja
    source that will render the request: a string, a dict of named templates or None)
    never names as a quoted string. vLLM hands any role to the template, which renders a
    role it knows (Llama 3.1's ``message.role == "ipython"``) and often prints an unknown
    one as it is (``<|im_start|>bogus``), where OpenAI answers 400. Raises
    SamplingParamsError naming ``messages.N.role``."""
    from llmserve.entrypoints.openai.common.protocol import OPENAI_ROLES
    source = template_source(None, template)
    for i, msg in enumerate(messages):
        role = getattr(msg, "role", None) if not isinstance(msg, dict) else msg.get("role")
        if not isinstance(role, str) or role in OPENAI_ROLES:
            continue
        if not template_names_role(source, role):
            raise SamplingParamsError(
                f"messages.{i}.role: must be 'system', 'developer', 'user', 'assistant', 'tool' or 'function', "
                f"or a custom role the model's chat template names (it names no '{role}').",
                f"messages.{i}.role")


def _postprocess_assistant(msg: dict[str, Any], index: int) -> None:
    """An assistant message as tool-aware templates expect it (vLLM's
    ``_postprocess_messages``): ``tool_calls: []`` means no calls (the key is dropped;
    Llama's template rejects an empty list), each call's JSON-text ``arguments`` become
    a dict (""/null: {}), and the reasoning is under both ``reasoning`` and
    ``reasoning_content`` (templates read one or the other).
    Raises SamplingParamsError (param "messages") for arguments that are not a JSON object."""
    calls = msg.get("tool_calls")
    if not calls:
        msg.pop("tool_calls", None)
    elif isinstance(calls, list):
        msg["tool_calls"] = [_template_tool_call(c, index, j) for j, c in enumerate(calls)]
    reasoning = msg.get("reasoning", msg.get("reasoning_content"))
    if isinstance(reasoning, str):
        msg["reasoning"] = msg["reasoning_content"] = reasoning


def check_json_types(obj: dict[str, Any], fields: dict[str, tuple[type, ...]], where: str) -> None:
    """Each of ``fields`` (key -> the Python types of its JSON types: ``(str,)``,
    ``(bool,)``, ``(dict,)``, ``(list,)``, ``(int, float)``...) that ``obj`` holds and is
    not null has one of them (a boolean is no number). For the nested objects a request
    keeps as plain JSON (chat's tool_calls history, Anthropic's content blocks, Responses'
    input items) and reads by hand, outside the strict request models. Raises
    SamplingParamsError naming ``<where>.<key>`` and the JSON types, never the value:
    "messages.1.tool_calls.0.id: must be a string, not a number."."""
    for key, types in fields.items():
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
            continue
        nouns = list(dict.fromkeys(json_type_name(kind()) for kind in types))  # in the order given
        at = f"{where}.{key}"
        raise SamplingParamsError(f"{at}: must be {' or '.join(nouns)}, not {json_type_name(value)}.", at)


_TOOL_CALL_TYPES = {"id": (str,), "type": (str,)}


def _template_tool_call(call: Any, index: int, j: int) -> Any:
    """Call ``j`` of message ``index`` with its ``arguments`` as a dict. OpenAI's
    ``ChatCompletionMessageToolCallParam``: ``id`` a string when given, ``type``
    "function" when given, ``function.name`` a string (required), ``arguments`` JSON text
    of an object, or an object (vLLM's leniency: its clients send one; the templates read
    a dict). A value of another type was passed to the template as it was. Raises
    SamplingParamsError naming ``messages.<index>.tool_calls.<j>.<field>``."""
    call_at = f"messages.{index}.tool_calls.{j}"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise SamplingParamsError(f"{call_at}: each call needs a 'function' object.", f"{call_at}.function")
    check_json_types(call, _TOOL_CALL_TYPES, call_at)
    if call.get("type") not in (None, "function"):
        raise SamplingParamsError(f"{call_at}.type: must be 'function'.", f"{call_at}.type")
    fn = dict(call["function"])
    args = fn.get("arguments")
    check_json_types(fn, {"name": (str,), "arguments": (str, dict)}, f"{call_at}.function")
    if fn.get("name") is None:
        raise SamplingParamsError(f"{call_at}.function.name: a call needs its function's name (a string).",
                                  f"{call_at}.function.name")
    if not args:
        fn["arguments"] = {}
    elif isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError as e:  # where it breaks, never the client's text (it may be long or private)
            where = f" ({e.msg} at character {e.pos})" if isinstance(e, json.JSONDecodeError) else ""
            raise SamplingParamsError(f"{call_at}.function.arguments: not valid JSON{where}.",
                                      f"{call_at}.function.arguments") from None
        if not isinstance(fn["arguments"], dict):
            raise SamplingParamsError(f"{call_at}.function.arguments: must be the JSON text of an object, not of "
                                      f"{json_type_name(fn['arguments'])}.", f"{call_at}.function.arguments")
    return {**call, "function": fn}


def render_chat_prompt(
    tokenizer: Any,
    messages: Iterable[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: Optional[str] = None,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
    tools: Optional[list[dict[str, Any]]] = None,
) -> str:
    """Render ``messages`` with the chat template into prompt text
    (:func:`conversation_for_template` then :func:`apply_chat_template`).

    Args:
      tokenizer: a HF tokenizer (``apply_chat_template``).
      chat_template: a literal template overriding the tokenizer's (None: the tokenizer's).
      chat_template_kwargs: extra template variables (reserved names are dropped).
      tools: tool definitions handed to the template (``tools`` variable), or None.
      continue_final_message: leave the last (assistant) message open so the model
        continues it, instead of closing it; may not be combined with
        ``add_generation_prompt`` (checked by the request).
    Returns: the prompt string (no tokenization).
    Raises: SamplingParamsError (400) when the template fails on these messages or the
      last message cannot be continued.
    """
    conversation = conversation_for_template(messages, continue_final_message)
    return apply_chat_template(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs, tools=tools)


def conversation_for_template(messages: Iterable[Any], continue_final_message: bool = False) -> list[dict[str, Any]]:
    """:func:`parse_chat_messages`, and a check that a message to continue is the
    assistant's. The result is plain data (picklable: the request-template sandbox gets it).
    Raises SamplingParamsError (param ``messages`` / ``continue_final_message``)."""
    conversation = parse_chat_messages(messages)
    if continue_final_message and (not conversation or conversation[-1]["role"] != "assistant"):
        raise SamplingParamsError(
            "continue_final_message requires the last message to be an assistant message.",
            "continue_final_message")
    return conversation


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, Any]], *, add_generation_prompt: bool,
                        continue_final_message: bool, chat_template: Optional[str],
                        chat_template_kwargs: Optional[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> str:
    """The template text of an already parsed ``conversation`` (transformers'
    ``apply_chat_template``, tokenize=False; its sandboxed Jinja environment), its system
    and developer messages fitted to the template first (:mod:`system_messages`: the
    billing line, ``developer`` as ``system``, non-leading system messages merged where
    the template refuses or drops them).
    Raises SamplingParamsError (param ``messages``) for any template error; the original
    exception (a MemoryError, say) is its ``__cause__``."""
    extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS}

    def render(messages: list[dict[str, Any]]) -> str:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, tools=tools, **extra)
        return rendered if isinstance(rendered, str) else rendered[0]  # some return a list for a batch

    conversation = normalize_system_messages(conversation, template_source(tokenizer, chat_template))
    try:
        return render_with_inline_systems(render, conversation)
    except Exception as e:  # jinja2 errors, template raise_exception(), bad final message
        raise SamplingParamsError(f"Chat template error: {e}", "messages") from e


def template_source(tokenizer: Any, chat_template: Any) -> str:
    """The Jinja source that renders a request: ``chat_template`` when given, else the
    tokenizer's (every named template of a dict, joined)."""
    template = chat_template if chat_template else getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template or ""]
    return "\n".join(t for t in sources if isinstance(t, str))
