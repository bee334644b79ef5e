"""Parsers of the outputs that ``tool_choice: "required"`` and a named tool choice force
through structured outputs (vLLM's ``required`` / named paths): a JSON list of
``{"name", "parameters"}`` objects, or the named function's arguments object alone."""
from __future__ import annotations

from typing import Any

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser
from llmserve.tool_parsers.json_scan import RawCall, scan_call_list, skip_ws, value_end


class RequiredToolParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``."""

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ScanResult(content=text if final else "")
        if text[i] != "[":
            return ScanResult(content=text)
        calls, _ = scan_call_list(text, i)
        return ScanResult(calls=calls)


class NamedToolParser(ToolParser):
    """The output is the arguments object of the function ``name``."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        if i >= len(text):  # the call starts with the output's first character
            return ScanResult()
        complete = value_end(text, i) is not None
        return ScanResult(calls=[RawCall(self.name, text, complete)])
