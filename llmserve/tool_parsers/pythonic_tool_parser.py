"""``pythonic``: tool calls as a Python list of calls, ``[f(a=1), g(b="x")]`` (vLLM's
``PythonicToolParser``, Llama 3.2/4 style). Keyword values must be Python literals; they
become the JSON arguments. Output that is not such a list is content."""
from __future__ import annotations

import ast
import json
import re
from typing import Optional

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser, ToolParserManager
from llmserve.tool_parsers.json_scan import RawCall, skip_ws

_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _closing_paren(text: str, i: int) -> Optional[int]:
    """``text[i]`` is ``(``: the index of its matching ``)``, skipping Python string
    literals and nested brackets; None while the text ends before it."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c in "'\"":
            q3 = text[j:j + 3] in ("'''", '"""')
            quote = text[j:j + 3] if q3 else c
            k = j + len(quote)
            while k < n and not text.startswith(quote, k):
                k += 2 if text[k] == "\\" else 1
            if k >= n:
                return None
            j = k + len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return None


def _call_arguments(source: str) -> Optional[str]:
    """JSON text of the keyword arguments of one call expression, or None when it is
    not a call with literal keyword arguments only."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        return json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError):
        return None


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    """Calls in a Python list literal (the whole output)."""

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ScanResult(content=text if final else "")
        if text[i] != "[":
            return ScanResult(content=text)
        result = ScanResult()
        i = skip_ws(text, i + 1)
        while i < len(text):
            m = _NAME.match(text, i)
            if m is None:
                break
            j = skip_ws(text, m.end())
            if j >= len(text) or text[j] != "(":
                if j < len(text):  # a name not followed by "(": not a call list
                    result.calls.append(RawCall(None))
                break
            # A call is shown once it is complete and its arguments are literals, so a
            # stream never names a call that the whole output would reject.
            close = _closing_paren(text, j)
            args = _call_arguments(text[i:close + 1]) if close is not None else None
            if args is None:
                result.calls.append(RawCall(None))
                break
            call = RawCall(m.group(), args, True)
            result.calls.append(call)
            i = skip_ws(text, close + 1)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text) and text[i] == "]":
                break
            elif i < len(text):
                call.complete = False  # junk after a call: not a call list
                break
        return result
