"""The common stream (chat or completion chunk objects from the handlers' ``wire=False``
seam) -> Ollama's responses: NDJSON lines while streaming, one object otherwise.

Ollama's objects (``docs/api.md``): every line has ``model``, ``created_at`` (RFC 3339,
UTC) and ``done``; a partial line carries ``message`` (``/api/chat``: role, content,
thinking, tool_calls) or ``response`` / ``thinking`` (``/api/generate``); the last line
has ``done: true``, ``done_reason`` ("stop", "length"), ``prompt_eval_count`` /
``eval_count`` (tokens) and ``total_duration``, ``load_duration``,
``prompt_eval_duration`` (until the first output), ``eval_duration`` (the rest), in
nanoseconds; a templated ``/api/generate`` puts ``context`` on it (the token ids of
the prompt's text and the answer, which the next request may send back). Tool calls go out whole, with their arguments as an object, in one line
before the last (Ollama sends each call when it is complete). With ``logprobs`` each line
carries its tokens' ``logprobs`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``:
Ollama's api.Logprob), the one object all of them. An error after the stream
started is one line ``{"error": "<message>"}``; so is a generation cut off before it finished
(finish reason "abort": the server shut down), which ``"stream": false`` answers with
Ollama's error body (HTTP 500) rather than ``done_reason: "stop"``.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional

from llmserve.entrypoints.openai.common.errors import check_finished_normally, error_response_from_exception

logger = logging.getLogger("llmserve.entrypoints.ollama")

# OpenAI finish reasons -> Ollama's done_reason (a finished tool call is "stop" there).
# Any other finish reason ("abort" on shutdown) is an error: deltas() raises it.
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def created_at() -> str:
    """Now as Ollama writes it: RFC 3339 in UTC with microseconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ndjson(obj: dict[str, Any]) -> bytes:
    """One NDJSON line."""
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class StreamError(RuntimeError):
    """An error a handler's stream reported in-band (its message, for the NDJSON line)."""


def error_message(exc: BaseException) -> str:
    """The message the one error mapping gives ``exc`` (the same text as a 4xx body)."""
    if isinstance(exc, StreamError):
        return str(exc)
    return error_response_from_exception(exc)[1].error.message


@dataclass
class _ToolCall:
    id: Optional[str] = None
    name: str = ""
    arguments: str = ""


@dataclass
class RunStats:
    """What one generation reported: times (``time.monotonic_ns``), token counts, the
    finish reason and the tool calls assembled from their streamed fragments."""

    start_ns: int = field(default_factory=time.monotonic_ns)
    first_ns: Optional[int] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: Optional[str] = None
    calls: dict[int, _ToolCall] = field(default_factory=dict)

    def add_fragments(self, fragments: list[Any]) -> None:
        for frag in fragments:
            call = self.calls.setdefault(frag.index, _ToolCall())
            call.id = frag.id or call.id
            if frag.function is not None:
                call.name += frag.function.name or ""
                call.arguments += frag.function.arguments or ""

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in Ollama's shape: ``{"id", "function": {"index", "name",
        "arguments": {...}}}``. Raises ValueError when the model's arguments are not a
        JSON object (a forced call cut off by the budget)."""
        out = []
        for index in sorted(self.calls):
            call = self.calls[index]
            try:
                args = json.loads(call.arguments or "{}")
            except ValueError as e:
                raise ValueError(f"the model's call of tool {call.name!r} was cut off or is not valid JSON "
                                 "(raise options.num_predict)") from e
            if not isinstance(args, dict):
                raise ValueError(f"the model's call of tool {call.name!r} has arguments that are not an object")
            out.append({"id": call.id, "function": {"index": index, "name": call.name, "arguments": args}})
        return out

    def final_fields(self) -> dict[str, Any]:
        """The last line's statistics (durations in nanoseconds)."""
        end = time.monotonic_ns()
        first = self.first_ns if self.first_ns is not None else end
        return {"done_reason": DONE_REASONS.get(self.finish_reason or "stop", self.finish_reason),
                "total_duration": end - self.start_ns, "load_duration": 0,
                "prompt_eval_count": self.prompt_tokens, "prompt_eval_duration": first - self.start_ns,
                "eval_count": self.output_tokens, "eval_duration": end - first}


def _token_logprob(token: str, logprob: float, token_bytes: Optional[list[int]] = None) -> dict[str, Any]:
    """Ollama's api.TokenLogprob; ``bytes`` defaults to the token's UTF-8 (Ollama's
    stringToByteInts) and is left out when empty, as Go's omitempty does."""
    out: dict[str, Any] = {"token": token, "logprob": logprob}
    token_bytes = token_bytes if token_bytes is not None else list(token.encode("utf-8"))
    if token_bytes:
        out["bytes"] = token_bytes
    return out


def _choice_logprobs(choice: Any, top: int) -> list[dict[str, Any]]:
    """The logprobs of one chunk's choice as Ollama's api.Logprob list (empty when none
    were asked for): a chat choice's ``logprobs.content``, or a completion choice's
    parallel lists (its alternatives are a token -> logprob map, which holds the sampled
    token besides the best ``top``: cut to ``top`` and left out at 0, as Ollama does)."""
    logprobs = getattr(choice, "logprobs", None)
    if logprobs is None:
        return []
    out = []
    if hasattr(logprobs, "content"):  # chat
        for entry in logprobs.content or []:
            item = _token_logprob(entry.token, entry.logprob, entry.bytes)
            if entry.top_logprobs and top:
                item["top_logprobs"] = [_token_logprob(t.token, t.logprob, t.bytes) for t in entry.top_logprobs[:top]]
            out.append(item)
        return out
    for token, logprob, alternatives in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        item = _token_logprob(token, logprob if logprob is not None else 0.0)
        if alternatives and top:
            best = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top]
            item["top_logprobs"] = [_token_logprob(t, lp) for t, lp in best]
        out.append(item)
    return out


def _choice_parts(choice: Any, stats: RunStats) -> tuple[str, str]:
    """(content, thinking) of one chunk's choice; tool-call fragments go to ``stats``."""
    delta = getattr(choice, "delta", None)
    if delta is None:  # a completion chunk
        return choice.text or "", ""
    if delta.tool_calls:
        stats.add_fragments(delta.tool_calls)
        if stats.first_ns is None:
            stats.first_ns = time.monotonic_ns()
    return delta.content or "", delta.reasoning or ""


async def deltas(chunks: AsyncIterator[Any], stats: RunStats,
                 top_logprobs: int = 0) -> AsyncGenerator[tuple[str, str, list[dict[str, Any]]], None]:
    """(content, thinking, logprobs) pieces of the handler's chunk objects, in order
    (``top_logprobs``: alternatives per token the request asked for);
    finish reason, usage and tool calls are kept in ``stats``. Raises RequestAbortedError at the
    end when the generation was cut off (finish reason "abort": server shutdown), so the
    stream ends with an ``{"error"}`` line and ``"stream": false`` with an error body."""
    async for chunk in chunks:
        if not chunk.choices:  # the last chunk: the usage
            if chunk.usage is not None:
                stats.prompt_tokens = chunk.usage.prompt_tokens
                stats.output_tokens = chunk.usage.completion_tokens or 0
            continue
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            stats.finish_reason = choice.finish_reason
        content, thinking = _choice_parts(choice, stats)
        logprobs = _choice_logprobs(choice, top_logprobs)
        if content or thinking or logprobs:
            if stats.first_ns is None:
                stats.first_ns = time.monotonic_ns()
            yield content, thinking, logprobs
    check_finished_normally(stats.finish_reason, stats.output_tokens)


class OllamaWire:
    """How one route writes its objects: ``chat`` (``message``) or generate
    (``response`` / ``thinking``), for the served ``model`` name, with up to
    ``top_logprobs`` alternatives per token when logprobs were asked for."""

    def __init__(self, model: str, chat: bool, top_logprobs: int = 0):
        self.model, self.chat, self.top_logprobs = model, chat, top_logprobs
        # the answer's text -> Ollama's ``context`` on the last object (a templated
        # /api/generate; None: no context)
        self.context_of: Optional[Callable[[str], Awaitable[list[int]]]] = None

    def partial(self, content: str, thinking: str = "", tool_calls: Optional[list] = None,
                done: bool = False, logprobs: Optional[list] = None) -> dict[str, Any]:
        """One object with the given output parts (``done`` false unless told)."""
        obj: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            obj["message"] = message
        else:
            obj["response"] = content
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = done
        if logprobs:
            obj["logprobs"] = logprobs
        return obj

    def final(self, stats: RunStats, content: str = "", thinking: str = "",
              tool_calls: Optional[list] = None, logprobs: Optional[list] = None) -> dict[str, Any]:
        """The last object: ``done: true`` with the statistics."""
        return {**self.partial(content, thinking, tool_calls, done=True, logprobs=logprobs), **stats.final_fields()}

    def loaded(self, keep_alive: Any = None) -> dict[str, Any]:
        """Ollama's answer to a request with nothing to generate (an empty prompt or no
        messages, which Ollama clients send to load a model): ``done_reason: "load"``, or
        "unload" with ``keep_alive`` 0 (the model stays loaded here all the same)."""
        unload = keep_alive in (0, "0") or (isinstance(keep_alive, str) and keep_alive.strip("0") in ("s", "m", "h"))
        return {**self.partial(""), "done": True, "done_reason": "unload" if unload else "load"}

    async def lines(self, chunks: AsyncGenerator[Any, None], stats: RunStats) -> AsyncGenerator[bytes, None]:
        """The NDJSON stream; an error after the start is a last ``{"error"}`` line."""
        try:
            answer = []
            async for content, thinking, logprobs in deltas(chunks, stats, self.top_logprobs):
                answer.append(content)
                yield ndjson(self.partial(content, thinking, logprobs=logprobs))
            calls = stats.tool_calls()
            if calls:
                yield ndjson(self.partial("", tool_calls=calls))
            yield ndjson(await self._with_context(self.final(stats), "".join(answer)))
        except Exception as e:  # the stream already started: report in-band, as Ollama does
            logger.warning("Ollama stream failed: %s", e)
            yield ndjson({"error": error_message(e)})
        finally:
            await chunks.aclose()

    async def whole(self, chunks: AsyncGenerator[Any, None], stats: RunStats) -> dict[str, Any]:
        """The one object of ``"stream": false``. Errors are raised (answered as 4xx/5xx)."""
        contents, thoughts, logprobs = [], [], []
        try:
            async for content, thinking, token_logprobs in deltas(chunks, stats, self.top_logprobs):
                contents.append(content)
                thoughts.append(thinking)
                logprobs.extend(token_logprobs)
        finally:
            await chunks.aclose()
        answer = "".join(contents)
        return await self._with_context(self.final(stats, answer, "".join(thoughts), stats.tool_calls(), logprobs),
                                        answer)

    async def _with_context(self, last: dict[str, Any], answer: str) -> dict[str, Any]:
        """The last object with its ``context`` (when this route gives one)."""
        if self.context_of is not None:
            last["context"] = await self.context_of(answer)
        return last
