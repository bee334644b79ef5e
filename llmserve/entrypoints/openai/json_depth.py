"""The one depth guard over request bodies: JSON nested deeper than ``MAX_JSON_DEPTH``
levels is a 400 naming the top-level field it is under, before any route parses or
recurses over it (issue 26: a ``response_format`` or tool schema nested ~450 levels, or
deep JSON to ``/invocations``, was a 500 RecursionError from jsonschema, ``_hoist_defs``
or Jinja).

The depth is measured on the raw bytes (no parse, no recursion; C-speed passes): escapes
are dropped, quotes toggle "inside a string", and the running sum of ``[{`` (+1) and
``]}`` (-1) outside strings is the nesting depth. Schemas given as
JSON *text* (``structured_outputs.json``) are bounded where they are parsed
(``structured_output/grammar.py``), with the same limit.

The same middleware refuses an integer with more digits than Python reads from text
(``int_max_str_digits``, 4300): a 400 naming where it is (``max_tokens``,
``logit_bias.50256``, ``prompt[2]``) on every route, in each API's own error body,
rather than FastAPI's "There was an error parsing the body" without a field.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any, Optional

import numpy as np
from starlette.datastructures import Headers

from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.common.limits import MAX_JSON_DEPTH
from llmserve.gc_utils import release_free_heap
from llmserve.structured_output.backend_import import prepare_grammar_backend

# After a request body this large (bytes) the heap's free pages are handed back to the OS.
TRIM_AFTER_BODY_BYTES = 1 << 20
_trimming = False

# the bytes the depth depends on: quotes, brackets and the colons that end a key
_KEPT = b'"[]{}:'
_DROP = bytes(b for b in range(256) if b not in _KEPT)
# byte -> +1 for an opening bracket, -1 for a closing one, 0 otherwise
_BRACKETS = np.zeros(256, dtype=np.int8)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1


def body_too_deep(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Optional[str]:
    """For a JSON body nested deeper than ``max_depth`` levels (the body's own object is
    level 1): the top-level field the deep part is under ("" when it is not under one,
    e.g. a top-level array); None when the body is within the bound. Invalid JSON is
    measured the same way (the parser then reports it). C-speed passes only: escapes
    dropped (``\\\\`` then ``\\"``), everything but quotes, brackets and colons
    deleted, then numpy on what is left."""
    if body.count(b"[") + body.count(b"{") <= max_depth:  # cheap: cannot be that deep
        return None
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    raw = np.frombuffer(unescaped.translate(None, _DROP), dtype=np.uint8)
    quotes = raw == ord('"')
    in_string = np.logical_xor.accumulate(quotes)  # True from an opening quote to before its closing one
    depth = np.cumsum(np.where(in_string, 0, _BRACKETS[raw]), dtype=np.int32)
    past = np.flatnonzero(depth > max_depth)
    if past.size == 0:
        return None
    pos = int(past[0])
    colons = np.flatnonzero((raw[:pos] == ord(":")) & ~in_string[:pos] & (depth[:pos] == 1))
    if colons.size == 0:
        return ""
    key_end = int(np.count_nonzero(quotes[:colons[-1]])) - 1  # the key's closing quote, counted
    return _nth_string(unescaped, key_end)


def _nth_string(unescaped: bytes, closing: int) -> str:
    """The text between quote number ``closing - 1`` and ``closing`` (0-based) of the
    unescaped body: a key, for the error message (its escapes dropped, cut to 128)."""
    at = np.flatnonzero(np.frombuffer(unescaped, dtype=np.uint8) == ord('"'))
    if closing < 1 or closing >= at.size:
        return ""
    return unescaped[at[closing - 1] + 1:at[closing]].decode("utf-8", "replace")[:128]


class _LongInteger:
    """What :func:`long_integer_field`'s parse puts where an over-long integer was."""


def _digit_limit() -> int:
    """Python's bound on the digits of an integer read from text (``int_max_str_digits``,
    4300 by default; 0: none)."""
    getter = getattr(sys, "get_int_max_str_digits", None)
    return getter() if getter is not None else 0


def json_path(parts: list[Any]) -> str:
    """A location in a JSON value as a client writes it: keys joined by dots, list
    indexes in brackets (``logit_bias.50256``, ``prompt[2]``, ``tools[0].function.name``)."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _path_to(value: Any, target: Any) -> Optional[list[Any]]:
    """The keys and indexes from ``value`` to the object ``target`` (by identity), found
    iteratively (depth is bounded before this runs); None when it is not there."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((child, [*path, key]) for key, child in reversed(list(items)))
    return None


def long_integer_field(body: bytes, limit: Optional[int] = None) -> Optional[str]:
    """For a JSON body holding an integer with more digits than Python reads (``limit``,
    default ``int_max_str_digits``): where it is (:func:`json_path`; "" at the root), else
    None. Without it the JSON parser's ValueError was FastAPI's bare "There was an error
    parsing the body", naming no field. A linear scan for such a run of digits first (the
    lookbehind starts a match only at a run's first digit); only a body that has one is
    parsed, with long integers read as a marker, to find the first."""
    limit = _digit_limit() if limit is None else limit
    if not limit or len(body) <= limit or re.search(rb"(?<![0-9])[0-9]{%d}" % (limit + 1), body) is None:
        return None
    marker = _LongInteger()

    def parse_int(text: str) -> Any:
        return marker if len(text.lstrip("-")) > limit else int(text)

    try:
        value = json.loads(body, parse_int=parse_int)
    except (ValueError, RecursionError):  # not JSON for another reason: the route's parser says so
        return None
    path = _path_to(value, marker)
    return None if path is None else json_path(path)


def _is_json(headers: Headers) -> bool:
    """JSON bodies and bodies without a content type (``/invocations`` clients); never
    uploads (multipart audio) or forms."""
    ctype = headers.get("content-type", "").lower()
    return not ctype or "json" in ctype


class JsonDepthMiddleware:
    """Pure ASGI middleware: reads a JSON request body whole, answers 400 (OpenAI's error
    body, ``param`` the top-level field, code 400) when it nests more than ``max_depth``
    levels, else replays the body to the app unchanged (later messages, such as the
    client's disconnect, pass through). A body that may ask for a grammar first waits for
    xgrammar's first import, made off the event loop (``structured_output/backend_import.py``). The body size is bounded before this runs
    (``BodyLimitMiddleware``, outside it)."""

    def __init__(self, app: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH") \
                or not _is_json(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        chunks, message = [], {"type": "http.request", "body": b"", "more_body": True}
        while message["type"] == "http.request" and message.get("more_body", False):
            message = await receive()
            chunks.append(message.get("body", b""))
        if message["type"] != "http.request":  # the client left mid-body: let the app see it
            return await self.app(scope, _replay([message], receive), send)
        body = b"".join(chunks)
        field = body_too_deep(body, self.max_depth)
        if field is not None:
            return await _refuse(send, field, self.max_depth)
        field = long_integer_field(body)
        if field is not None:
            return await _refuse_long_integer(send, field)
        await prepare_grammar_backend(body)  # xgrammar's first import, off the event loop
        try:
            await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                           send)
        finally:
            if len(body) >= TRIM_AFTER_BODY_BYTES:
                del body, chunks
                await _release_heap()


async def _release_heap() -> None:
    """glibc keeps the freed chunks of a large body's parse (100k prompts: +16-24 MiB of
    RSS per request, measured) resident: hand them back (``malloc_trim``, in a thread, after
    the response has gone; one at a time)."""
    global _trimming
    if _trimming:
        return
    _trimming = True
    try:
        await asyncio.get_running_loop().run_in_executor(None, release_free_heap)
    finally:
        _trimming = False


def _replay(messages: list[dict], receive: Any) -> Any:
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed


async def _refuse(send: Any, field: str, max_depth: int) -> None:
    where = f"`{field}`" if field else "The request body"
    await _send_400(send, f"{where} is nested too deeply: at most {max_depth} levels of JSON arrays and objects "
                          "are accepted in a request body.", field or None)


def long_integer_message(field: str) -> str:
    """The 400's words for an over-long integer at ``field`` (never the number itself)."""
    where = f"`{field}`" if field else "The request body"
    return (f"{where}: the integer has more than {_digit_limit()} digits, more than this server reads from JSON; "
            "send a smaller number.")


async def _refuse_long_integer(send: Any, field: str) -> None:
    await _send_400(send, long_integer_message(field), field or None)


async def _send_400(send: Any, message: str, param: Optional[str]) -> None:
    """A whole 400 response in OpenAI's error body (reshaped on the other APIs' paths by
    ErrorShapeMiddleware, outside this one)."""
    body = make_error(message, 400, param).model_dump_json().encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

