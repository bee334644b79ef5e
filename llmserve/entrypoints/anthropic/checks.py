"""The request rules of Anthropic's Messages API that its field types alone do not say
(each a 400 ``invalid_request_error`` there, so a client written against Anthropic gets
the same answer here, naming the field):

- ``thinking``: ``type`` one of ``enabled``, ``adaptive``, ``between_tools``,
  ``disabled``; ``enabled`` needs ``budget_tokens``, an integer >= 1024 and (on
  ``/v1/messages``) less than ``max_tokens``, the request's own value before any clamp;
  ``display``, when given, is a string and only with ``enabled`` or ``adaptive``. Its
  vocabulary grows with Anthropic's betas (``summarized`` and ``omitted`` in
  ``anthropic.types.ThinkingConfigEnabledParam``; Claude Code 2.1.332 sends ``updates``
  with the beta ``thinking-display-updates-2026-08-18``, and refused, it retried twice and
  dropped the field), and it only says how the client shows the thinking, which this server
  returns as the reasoning parser finds it whatever the value: a value not in
  :data:`THINKING_DISPLAYS` is accepted and logged once, not refused. Thinking on (any
  type but ``disabled``) with a ``tool_choice`` that forces a call (``any``, ``tool``) is
  Anthropic's "Thinking may not be enabled when tool_choice forces tool use." (here the
  enforced call's grammar would also leave no room for the reasoning before it).
- Tool turns: a ``tool_use`` block's ``id`` matches ``^[a-zA-Z0-9_-]+$`` and is unique in
  the request; a ``tool_result`` block answers a ``tool_use`` of the previous turn (an
  assistant turn), at most once; the turn after an assistant turn with ``tool_use``
  blocks begins with a ``tool_result`` for each of them, before any other block
  (Anthropic: "Each `tool_use` block must have a corresponding `tool_result` block in the
  next message"). A turn is a run of consecutive messages of one role (Anthropic combines
  them); ``role: "system"`` messages inside ``messages`` (Claude Code's) are left out. An
  assistant turn with ``tool_use`` blocks that ends the conversation is a continuation
  and needs no result.

- ``role: "system"`` inside ``messages``: Anthropic's mid-conversation system message
  (no beta header; Claude Code sends one after its first user message, and Anthropic's
  guide appends one after an assistant turn, where a new instruction starts to apply) is
  accepted anywhere after the first message. As the first message it is a 400 about the
  role: the top-level ``system`` is the place for instructions that apply from the start
  (``messages: Unexpected role "system". The Messages API accepts a top-level `system`
  parameter, not "system" as an input message role.``).
- Contents: every message but a final assistant one (a prefill) has content with
  non-whitespace text where it is text ("text content blocks must contain non-whitespace
  text"), whether given as a string or as text blocks.
- A final assistant message (a prefill) does not end with whitespace ("final assistant
  content cannot end with trailing whitespace"). With thinking on (any ``thinking.type``
  but ``disabled``), a final assistant message with text and no ``tool_use`` block is
  refused: Anthropic's extended thinking does not take a prefill (its docs; its API wants
  a final assistant message to start with a thinking block then), and here the
  continuation would skip the reasoning the client asked for.
- ``stop_sequences``: no empty string (it would stop before the first token).
- Text: every string of the request (message contents, text blocks, ``system``, tool
  inputs, schemas, descriptions...) is valid Unicode; JSON's ``"\\ud800"`` escape gives a
  lone surrogate that no tokenizer can encode, refused naming the string's path
  (``messages.0.content.1.text``) with the OpenAI routes' words (``tokenizer.check_encodable``).

Raises SamplingParamsError (400) with ``param`` the Anthropic path of the fault
(``thinking.budget_tokens``, ``messages.3.content.0``...).
"""
from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any, Optional, Sequence

from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_texts as check_texts_of

THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")
THINKING_DISPLAYS = ("summarized", "omitted", "updates")  # the values known here (see the module docstring)
MIN_BUDGET_TOKENS = 1024  # Anthropic's floor for thinking.budget_tokens
TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")
logger = logging.getLogger("llmserve.entrypoints.anthropic")


@functools.lru_cache(maxsize=64)
def _warn_unknown_display(display: str) -> None:
    """Log a ``thinking.display`` value not known here once per value (the cache bounds it)."""
    logger.warning("thinking.display %r is not one of %s known to this server; it is accepted and has no effect "
                   "(the thinking is returned as the reasoning parser finds it).", display, ", ".join(THINKING_DISPLAYS))


def check_thinking(thinking: Optional[dict[str, Any]], max_tokens: Optional[int]) -> None:
    """Anthropic's rules for ``thinking`` (see the module docstring). ``max_tokens``: the
    request's output budget as sent (None on count_tokens, which has none)."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise SamplingParamsError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}; got {kind!r}.",
                                  "thinking.type")
    _check_display(thinking.get("display"), kind)
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        got = "none was given" if budget is None else f"got {json.dumps(budget)}"
        raise SamplingParamsError(f"thinking.budget_tokens: thinking of type 'enabled' needs an integer "
                                  f"budget_tokens (>= {MIN_BUDGET_TOKENS}); {got}.",
                                  "thinking.budget_tokens")
    if budget < MIN_BUDGET_TOKENS:
        raise SamplingParamsError(f"thinking.budget_tokens must be >= {MIN_BUDGET_TOKENS}; got {budget}.",
                                  "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise SamplingParamsError(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                  f"({max_tokens}): thinking tokens count toward max_tokens.",
                                  "thinking.budget_tokens")


FORCING_TOOL_CHOICES = ("any", "tool")


def check_forced_tools(thinking: Optional[dict[str, Any]], tool_choice: Optional[dict[str, Any]]) -> None:
    """No thinking with a tool choice that forces a call (module docstring); raises
    SamplingParamsError naming ``tool_choice``. Runs after check_thinking."""
    if thinking is None or thinking.get("type") == "disabled" or tool_choice is None:
        return
    if tool_choice.get("type") in FORCING_TOOL_CHOICES:
        raise SamplingParamsError("Thinking may not be enabled when tool_choice forces tool use (tool_choice type "
                                  f"{json.dumps(tool_choice.get('type'))}; use \"auto\" or \"none\", or disable "
                                  "thinking).", "tool_choice")


def _check_display(display: Any, kind: str) -> None:
    """``thinking.display``: absent, or a string with type ``enabled`` / ``adaptive``; an
    unknown string is logged, not refused (see the module docstring)."""
    if display is None:
        return
    if not isinstance(display, str) or kind not in ("enabled", "adaptive"):
        raise SamplingParamsError(f"thinking.display must be a string such as {', '.join(THINKING_DISPLAYS)} "
                                  f"(with type 'enabled' or 'adaptive'); got {json.dumps(display)} with type "
                                  f"{kind!r}.", "thinking.display")
    if display not in THINKING_DISPLAYS:
        _warn_unknown_display(display)


def _blocks(turn: Sequence[tuple[int, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(path, block)`` of every content block of a turn's messages, in order (a string
    content is one text block)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i, m in turn:
        if isinstance(m.content, str):
            out.append((f"messages.{i}.content", {"type": "text"}))
        else:
            out.extend((f"messages.{i}.content.{j}", block) for j, block in enumerate(m.content))
    return out


def _tool_use_ids(turn: Sequence[tuple[int, Any]], seen: dict[str, str]) -> list[str]:
    """The ``tool_use`` ids of an assistant turn, checked (pattern, unique across the
    request: ``seen`` maps each id to where it was first used)."""
    ids = []
    for at, block in _blocks(turn):
        if block.get("type") != "tool_use":
            continue
        call_id = block.get("id")
        if not isinstance(call_id, str) or not TOOL_USE_ID.fullmatch(call_id):
            raise SamplingParamsError(f"{at}.id: a tool_use id must be a non-empty string of letters, digits, "
                                      f"'_' or '-' (^[a-zA-Z0-9_-]+$); got {call_id!r}.", f"{at}.id")
        if call_id in seen:
            raise SamplingParamsError(f"{at}: `tool_use` ids must be unique; {call_id!r} is already used at "
                                      f"{seen[call_id]}.", at)
        seen[call_id] = at
        ids.append(call_id)
    return ids


def _check_results(turn: Sequence[tuple[int, Any]], open_ids: Sequence[str]) -> None:
    """A user turn after a turn whose tool_use ids are ``open_ids`` (empty: none): its
    tool_result blocks answer those ids, once each, before any other block."""
    answered: set[str] = set()
    other = None  # the first block that is not a tool_result
    for at, block in _blocks(turn):
        if block.get("type") != "tool_result":
            other = other or at
            continue
        use_id = block.get("tool_use_id")
        if use_id not in open_ids:
            raise SamplingParamsError(f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {use_id!r}. "
                                      "Each `tool_result` block must have a corresponding `tool_use` block in the "
                                      "previous message.", at)
        if use_id in answered:
            raise SamplingParamsError(f"{at}: a second `tool_result` for tool_use_id {use_id!r}; each `tool_use` "
                                      "has exactly one result.", at)
        if other is not None:
            raise SamplingParamsError(f"{at}: `tool_result` blocks must come first in the message, before any other "
                                      f"block ({other} comes before it).", at)
        answered.add(use_id)
    _check_answered(turn[0][0], open_ids, answered)


def _check_answered(i: int, open_ids: Sequence[str], answered: set[str]) -> None:
    missing = [x for x in open_ids if x not in answered]
    if missing:
        raise SamplingParamsError(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately "
                                  f"after: {', '.join(missing)}. Each `tool_use` block must have a corresponding "
                                  "`tool_result` block in the next message.", f"messages.{i}")


def _turns(messages: Sequence[Any]) -> list[list[tuple[int, Any]]]:
    """The conversation's turns: runs of consecutive messages of one role (Anthropic
    combines them), ``role: "system"`` messages left out; each ``(index, message)``."""
    turns: list[list[tuple[int, Any]]] = []
    for i, m in enumerate(messages):
        if m.role == "system":
            continue
        if turns and turns[-1][0][1].role == m.role:
            turns[-1].append((i, m))
        else:
            turns.append([(i, m)])
    return turns


def check_tool_turns(messages: Sequence[Any]) -> None:
    """Anthropic's pairing of ``tool_use`` and ``tool_result`` blocks (see the module
    docstring) over the request's messages (AnthropicMessageParam)."""
    seen: dict[str, str] = {}
    open_ids: list[str] = []  # tool_use ids of the previous turn (an assistant turn)
    for turn in _turns(messages):
        if turn[0][1].role == "assistant":
            open_ids = _tool_use_ids(turn, seen)
        else:
            _check_results(turn, open_ids)
            open_ids = []


def check_system_messages(messages: Sequence[Any]) -> None:
    """No ``role: "system"`` message of ``messages`` (AnthropicMessageParam) comes before
    the first user or assistant message (see the module docstring); raises
    SamplingParamsError naming ``messages.<i>.role`` otherwise."""
    for i, m in enumerate(messages):
        if m.role != "system":
            return
        raise SamplingParamsError(
            f'messages.{i}.role: Unexpected role "system" as the first message. A system message inside '
            '`messages` is a mid-conversation system message and comes after a user or assistant message; '
            "instructions for the whole conversation go in the top-level `system` parameter.", f"messages.{i}.role")


def check_contents(messages: Sequence[Any]) -> None:
    """Anthropic's emptiness rules (see the module docstring) over the request's messages
    (AnthropicMessageParam); ``role: "system"`` messages (Claude Code's) are not checked."""
    last = len(messages) - 1
    for i, m in enumerate(messages):
        if m.role == "system":
            continue
        prefill = i == last and m.role == "assistant"
        if not m.content and not prefill:
            raise SamplingParamsError(f"messages.{i}: all messages must have non-empty content except for the "
                                      "optional final assistant message.", f"messages.{i}")
        if prefill and _final_text(m.content) != _final_text(m.content).rstrip():
            raise SamplingParamsError(f"messages.{i}: final assistant content cannot end with trailing "
                                      "whitespace.", f"messages.{i}")
        if isinstance(m.content, str) and m.content and not m.content.strip() and not prefill:
            raise SamplingParamsError(f"messages.{i}: text content blocks must contain non-whitespace text.",
                                      f"messages.{i}")
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            text = block.get("text") if block.get("type") == "text" else None
            if isinstance(text, str) and not text.strip():
                at = f"messages.{i}.content.{j}.text"
                what = "be non-empty" if text == "" else "contain non-whitespace text"
                raise SamplingParamsError(f"{at}: text content blocks must {what}.", at)


def check_prefill(messages: Sequence[Any], thinking: Optional[dict[str, Any]]) -> None:
    """No prefill with thinking on (module docstring): raises SamplingParamsError naming
    ``messages.<i>``, the final message, when ``thinking`` is on and the final message
    (AnthropicMessageParam) is the assistant's with text and no ``tool_use`` block. A
    final assistant message with tool_use blocks is a tool turn, not a prefill. Runs after
    check_thinking and the block mapping (every block an object with a string type)."""
    if thinking is None or thinking.get("type") == "disabled" or not messages or messages[-1].role != "assistant":
        return
    content = messages[-1].content
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if any(b.get("type") == "tool_use" for b in blocks) or not any(b.get("type") == "text" and b.get("text")
                                                                   for b in blocks):
        return
    at = f"messages.{len(messages) - 1}"
    raise SamplingParamsError(f"{at}: a final assistant message (a prefill) cannot be continued with thinking "
                              f"enabled (thinking type {json.dumps(thinking.get('type'))}): extended thinking does "
                              "not support prefilling the reply. Disable thinking, or end the conversation with a "
                              "user message.", at)


def _final_text(content: Any) -> str:
    """The text a message ends with: a string content, or its last block's text ("" when
    that block is not text)."""
    if isinstance(content, str):
        return content
    last = content[-1] if content else {}
    return last.get("text") or "" if last.get("type") == "text" else ""


def check_stop_sequences(stop_sequences: Optional[Sequence[str]]) -> None:
    """No empty stop sequence (named ``stop_sequences.<i>``, not the chat field ``stop``)."""
    for i, seq in enumerate(stop_sequences or ()):
        if seq == "":
            raise SamplingParamsError(f"stop_sequences.{i}: a stop sequence cannot be empty.", f"stop_sequences.{i}")


# The request fields whose strings reach the prompt or the engine (``metadata`` does not).
TEXT_FIELDS = ("model", "system", "messages", "tools", "tool_choice", "stop_sequences", "thinking",
               "output_config")


def check_texts(request: Any) -> None:
    """Every string of the request (an AnthropicCountTokensRequest or its subclass) in
    TEXT_FIELDS, object keys too, is valid Unicode: SamplingParamsError naming the path of
    the first one holding a lone surrogate (``messages.0.content``, ``tools.1.input_schema.
    properties.q.description``) and its position in that string, as the OpenAI routes name
    theirs (``tokenizer.check_texts``, the one walker for all routes)."""
    check_texts_of([(name, getattr(request, name, None)) for name in TEXT_FIELDS])
