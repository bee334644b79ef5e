"""The chat path's stream objects -> Anthropic's Messages stream events.

Anthropic's sequence (https://docs.anthropic.com/en/api/messages-streaming):
``message_start`` (the message with empty content and the input usage), then per content
block ``content_block_start``, ``content_block_delta``s (``thinking_delta``,
``text_delta`` or ``input_json_delta``) and ``content_block_stop``, with one ``ping``
after the first block starts; then ``message_delta`` (``stop_reason``,
``stop_sequence``, the final usage) and ``message_stop``. An error after the stream
started is an ``error`` event (Anthropic's error body), and the stream ends there; so is a
generation cut off before it finished (finish reason "abort": server shutdown), as
``api_error``, instead of ``message_delta`` with ``end_turn``.

Each SSE event is ``event: <type>`` + ``data: <json>``. ``message_start`` waits for the
engine's first output (already there when the stream starts), so that its usage carries
the prefix-cache hits.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable, Optional

from llmserve.entrypoints.anthropic.protocol import AnthropicUsage, CacheCreation, anthropic_error_body
from llmserve.entrypoints.openai.common.errors import check_finished_normally, error_response_from_exception


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """One Anthropic SSE event."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def tool_use_id(call_id: Optional[str]) -> str:
    """The ``tool_use`` block id of a chat tool call: Anthropic's form, ``toolu_01`` and 22
    base-62 characters (``toolu_01A09q90qw90lq917835lq9``), not the chat path's
    ``chatcmpl-tool-<hex>``. The same call id always gives the same block id (its 128
    bits, or a hash of another form); an id already in Anthropic's form is kept, and no
    id gets a random one. A client sends it back as it got it (``tool_use.id``,
    ``tool_result.tool_use_id``), and the chat path takes any id."""
    if call_id is not None and call_id.startswith("toolu_"):
        return call_id
    if call_id is None:
        n = uuid.uuid4().int
    else:
        tail = call_id.rsplit("-", 1)[-1]
        n = int(tail, 16) if len(tail) == 32 and all(c in "0123456789abcdef" for c in tail) else \
            int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest()[:16], "big")
    digits = []
    for _ in range(22):  # 62**22 > 2**128
        n, r = divmod(n, 62)
        digits.append(_BASE62[r])
    return "toolu_01" + "".join(reversed(digits))


@dataclass(frozen=True)
class CacheWrites:
    """A request that asked for caching (a ``cache_control`` breakpoint) on a server whose
    prefix cache is on: ``block_size``: the KV block size in tokens (the cache keeps
    whole blocks); ``ttl``: its last breakpoint's (``"5m"`` or ``"1h"``)."""

    block_size: int
    ttl: str = "5m"


def usage_of(usage: Any, writes: Optional[CacheWrites] = None) -> AnthropicUsage:
    """Anthropic's usage of the chat path's UsageInfo (None: all zeros).

    Anthropic splits a prompt in three: ``cache_read_input_tokens`` (read from the cache),
    ``cache_creation_input_tokens`` (written to it at the request's ``cache_control``
    breakpoints) and ``input_tokens`` (the rest); the three add up to the prompt, here as
    there, in ``message_start``, ``message_delta`` and the message alike. The prefix cache
    here is automatic, so what is honest to report is what it did:

    - reads: the prompt's prefix-cache hits (``prompt_tokens_details.cached_tokens``),
      with or without breakpoints: they were not computed again;
    - writes (``writes`` given: the request has a breakpoint and prefix caching is on):
      the prompt's whole KV blocks that were not read, since after the request the
      cache holds every whole block of the prompt and a later request reads them. They
      count after the last breakpoint too (the cache keeps those blocks as well), under
      ``cache_creation.ephemeral_<ttl>_input_tokens``; ``input_tokens`` is then the last,
      partial block (the cache keeps no partial block);
    - without a breakpoint (or with the prefix cache off) nothing is reported written,
      as Anthropic writes nothing then (the blocks kept anyway are the server's own
      business), and ``input_tokens`` is the prompt less its reads.
    """
    if usage is None:
        return AnthropicUsage()
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    prompt = usage.prompt_tokens
    written = max(0, prompt // writes.block_size * writes.block_size - cached) if writes is not None else 0
    by_ttl = {f"ephemeral_{writes.ttl if writes is not None else '5m'}_input_tokens": written}
    return AnthropicUsage(input_tokens=prompt - cached - written, output_tokens=usage.completion_tokens or 0,
                          cache_read_input_tokens=cached, cache_creation_input_tokens=written,
                          cache_creation=CacheCreation(**by_ttl))


def stop_reason_of(finish_reason: Optional[str], matched: Any, stop_sequences: Optional[list[str]],
                   tool_called: bool, clamped: bool = False) -> tuple[str, Optional[str]]:
    """``(stop_reason, stop_sequence)`` of a finished choice: ``tool_use`` when it
    called a tool, ``max_tokens`` when cut by the budget (``model_context_window_exceeded``
    when the budget was clamped to the context: ``clamped``), ``stop_sequence`` (and
    which) when one of the request's stop sequences ended it, else ``end_turn``."""
    if tool_called and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


class MessageStreamWriter:
    """Turns one request's ChatCompletionStreamResponse objects into Anthropic events.

    message_id / model: the message's ``id`` and ``model``; stop_sequences: the
    request's (to tell a stop sequence from the end of the turn); clamped: whether
    ``max_tokens`` was clamped to the room in the context; on_finish: called with the
    blocks sent (as JSON; a ``tool_use`` block's input as the ``partial_json`` text of its
    deltas) once the stream ended normally, before ``message_stop`` goes out (a message
    thread keeps them: ``threads.py``); writes: the request's cache writes, reported in
    the usage (:func:`usage_of`)."""

    def __init__(self, message_id: str, model: str, stop_sequences: Optional[list[str]], clamped: bool = False,
                 on_finish: Optional[Callable[[list[dict[str, Any]]], None]] = None,
                 writes: Optional[CacheWrites] = None):
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.clamped = clamped
        self.writes = writes
        self.on_finish = on_finish
        self.blocks: list[dict[str, Any]] = []  # what was sent, block by block
        self.started = False
        self.pinged = False
        self.index = -1  # the open block's index (-1: none open)
        self.block: Optional[tuple[str, Optional[int]]] = None  # ("text"|"thinking"|"tool_use", tool index)
        self.tool_called = False
        self.finish: Optional[str] = None
        self.matched: Any = None

    def _start(self, usage: Any) -> list[str]:
        if self.started:
            return []
        self.started = True
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_of(usage, self.writes).model_dump()}
        return [sse_event("message_start", {"message": message})]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        return [sse_event("content_block_stop", {"index": self.index})]

    def _open(self, key: tuple[str, Optional[int]], block: dict[str, Any]) -> list[str]:
        if self.block == key:
            return []
        events = self._close()
        self.block, self.index = key, self.index + 1
        self.blocks.append({k: v for k, v in block.items() if not (k == "input" and block["type"] == "tool_use")})
        events.append(sse_event("content_block_start", {"index": self.index, "content_block": block}))
        if not self.pinged:
            self.pinged = True
            events.append(sse_event("ping", {}))
        return events

    def _record(self, key: str, piece: str) -> None:
        block = self.blocks[-1]
        block[key] = block.get(key, "") + piece

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def _tool_events(self, call: Any) -> list[str]:
        events = []
        if call.id is not None or (call.function is not None and call.function.name):
            name = call.function.name if call.function is not None else ""
            self.tool_called = True
            events += self._open(("tool_use", call.index),
                                 {"type": "tool_use", "id": tool_use_id(call.id),
                                  "name": name or "", "input": {}})
        args = call.function.arguments if call.function is not None else None
        if args and self.block == ("tool_use", call.index):
            self._record("partial_json", args)
            events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events

    def chunk_events(self, chunk: Any) -> list[str]:
        """The events of one chunk (the first non-empty one also starts the message)."""
        if not chunk.choices:  # the last object: the usage
            return self._start(chunk.usage) + self.finish_events(chunk.usage)
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.role is not None and not (delta.content or delta.reasoning or delta.tool_calls):
            return []  # the opening role chunk: message_start waits for the first output's usage
        events = self._start(chunk.usage)
        if delta.reasoning:
            events += self._open(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
            self._record("thinking", delta.reasoning)
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._open(("text", None), {"type": "text", "text": ""})
            self._record("text", delta.content)
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or ():
            events += self._tool_events(call)
        if choice.finish_reason is not None:
            self.finish, self.matched = choice.finish_reason, choice.stop_reason
        return events

    def finish_events(self, usage: Any) -> list[str]:
        """``content_block_stop`` of the open block, ``message_delta``, ``message_stop``.
        Raises RequestAbortedError when the generation was cut off (finish reason "abort":
        server shutdown), which message_events turns into the ``error`` event."""
        check_finished_normally(self.finish, usage.completion_tokens if usage is not None else None)
        events = self._close()
        if not self.pinged:
            self.pinged = True
            events.append(sse_event("ping", {}))
        reason, sequence = stop_reason_of(self.finish, self.matched, self.stop_sequences, self.tool_called,
                                          self.clamped)
        # MessageDeltaUsage: the cumulative counts, without the breakdown by ttl
        final = usage_of(usage, self.writes).model_dump(exclude={"cache_creation"})
        if self.on_finish is not None:
            self.on_finish(self.blocks)
        events.append(sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                  "usage": final}))
        events.append(sse_event("message_stop", {}))
        return events


async def message_events(chunks: AsyncGenerator[Any, None], writer: MessageStreamWriter,
                         ) -> AsyncGenerator[str, None]:
    """The stream of one request as Anthropic SSE events; an error raised by ``chunks``
    after the start becomes an ``error`` event."""
    try:
        async for chunk in chunks:
            for event in writer.chunk_events(chunk):
                yield event
    except Exception as e:  # the stream already started: report it in-band (Anthropic's error event)
        status, body = error_response_from_exception(e)
        error = anthropic_error_body(status, body.error.model_dump())
        yield sse_event("error", {"error": error["error"]})
    finally:
        await chunks.aclose()
