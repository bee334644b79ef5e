"""Partial-JSON helpers shared by the tool-call parsers.

A model writes a tool call's JSON token by token, so a streaming parser sees prefixes of
it. Two pure functions of the text make streaming exact:

- :func:`canonical_json_prefix` turns (a prefix of) one JSON value into the longest
  prefix of its canonical form (``json.dumps(value, ensure_ascii=False)``, vLLM's
  formatting of tool-call arguments) that later text cannot change. It grows
  monotonically with the input, so the argument fragments streamed for every prefix
  concatenate to exactly the arguments of the finished call, whatever the split.
- :func:`value_end` and :func:`scan_call_object` find where values and the ``name`` /
  ``arguments`` members of a call object end in possibly incomplete text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_WS = " \t\r\n"
_SCALAR_CHARS = set("+-0123456789.eEtruefalsn")
_DELIMS = set(_WS + ",]}:")


def skip_ws(text: str, i: int) -> int:
    """Index of the first non-whitespace character at or after ``i``."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> Optional[int]:
    """``text[i]`` is a ``"``: the index just past the closing quote, or None if the
    string is not closed yet."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scalar_end(text: str, i: int) -> Optional[int]:
    """End of a number/true/false/null at ``i``, or None while it may still grow (no
    delimiter after it yet)."""
    j, n = i, len(text)
    while j < n and text[j] in _SCALAR_CHARS:
        j += 1
    return j if j < n and j > i and text[j] in _DELIMS else None


def value_end(text: str, i: int) -> Optional[int]:
    """The index just past the JSON value starting at ``text[i]`` (no leading
    whitespace), or None when the text ends inside it (or it is not JSON)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c not in "{[":
        return _scalar_end(text, i)
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            e = string_end(text, j)
            if e is None:
                return None
            j = e
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _partial_string(body: str) -> str:
    """Decode the complete escapes of an unterminated JSON string body (without its
    opening quote); stop before a split escape or half a surrogate pair."""
    out, j, n = [], 0, len(body)
    while j < n:
        c = body[j]
        if c != "\\":
            out.append(c)
            j += 1
            continue
        if j + 1 >= n:
            break
        if body[j + 1] != "u":
            try:
                out.append(json.loads('"' + body[j:j + 2] + '"'))
            except ValueError:
                break
            j += 2
            continue
        esc = body[j:j + 6]
        if len(esc) < 6:
            break
        try:
            ch = json.loads('"' + esc + '"')
        except ValueError:
            break
        if "\ud800" <= ch <= "\udbff":  # high surrogate: wait for its pair
            pair = body[j:j + 12]
            if len(pair) < 12:
                break
            try:
                ch = json.loads('"' + pair + '"')
            except ValueError:
                break
            j += 6
        out.append(ch)
        j += 6
    return "".join(out)


def canonical_json_prefix(raw: str) -> str:
    """The canonical text (``json.dumps(v, ensure_ascii=False)``) of the part of the JSON
    value in ``raw`` that is already certain: complete tokens, and the complete
    characters of a string being written. Text after the value is ignored; text that
    is not JSON stops the output where it starts.

    For a complete value the result equals ``json.dumps(json.loads(raw),
    ensure_ascii=False)`` (objects without duplicate keys); for any prefix ``p`` of
    ``raw``, ``canonical_json_prefix(p)`` is a prefix of ``canonical_json_prefix(raw)``.
    """
    out: list[str] = []
    depth, i, n = 0, skip_ws(raw, 0), len(raw)
    while i < n:
        c = raw[i]
        if c in "{[":
            out.append(c)
            depth += 1
            i += 1
        elif c in "}]":
            out.append(c)
            depth -= 1
            i += 1
            if depth <= 0:
                break
        elif c == ",":
            out.append(", ")
            i += 1
        elif c == ":":
            out.append(": ")
            i += 1
        elif c == '"':
            e = string_end(raw, i)
            if e is None:
                out.append('"' + json.dumps(_partial_string(raw[i + 1:]), ensure_ascii=False)[1:-1])
                break
            try:
                out.append(json.dumps(json.loads(raw[i:e]), ensure_ascii=False))
            except ValueError:
                break
            i = e
            if depth == 0:
                break
        elif c in _SCALAR_CHARS:
            e = _scalar_end(raw, i)
            if e is None:
                break
            try:
                out.append(json.dumps(json.loads(raw[i:e])))
            except ValueError:
                break
            i = e
            if depth == 0:
                break
        else:
            break
        i = skip_ws(raw, i)
    return "".join(out)


@dataclass
class RawCall:
    """One tool call as seen so far: ``name`` (None until its string is complete),
    ``args`` (the raw JSON text of its arguments, maybe partial) and whether the
    whole call is complete."""

    name: Optional[str]
    args: str = ""
    complete: bool = False


NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, i: int) -> tuple[RawCall, Optional[int]]:
    """Scan a ``{"name": ..., "arguments"|"parameters": {...}}`` object starting at
    ``text[i] == "{"``. Returns the call seen so far and the index past the object
    (None while incomplete). Members other than name and arguments are skipped."""
    call = RawCall(None)
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.complete = call.name is not None
            return call, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return call, None
        ke = string_end(text, j)
        if ke is None:
            return call, None
        key = json.loads(text[j:ke])
        j = skip_ws(text, ke)
        if j >= len(text) or text[j] != ":":
            return call, None
        j = skip_ws(text, j + 1)
        ve = value_end(text, j)
        if key in ARG_KEYS:
            call.args = text[j:ve] if ve is not None else text[j:]
        elif key in NAME_KEYS and ve is not None:
            try:
                name = json.loads(text[j:ve])
            except ValueError:
                return call, None
            call.name = name if isinstance(name, str) else None
        if ve is None:
            return call, None
        j = skip_ws(text, ve)
    return call, None


def scan_call_list(text: str, i: int) -> tuple[list[RawCall], Optional[int]]:
    """Scan a JSON list of call objects starting at ``text[i] == "["``. Returns the
    calls seen so far and the index past the list (None while incomplete)."""
    calls: list[RawCall] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        c = text[j]
        if c == "]":
            return calls, j + 1
        if c == ",":
            j = skip_ws(text, j + 1)
            continue
        if c != "{":
            return calls, None
        call, end = scan_call_object(text, j)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
    return calls, None
