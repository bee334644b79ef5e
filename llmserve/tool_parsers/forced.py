"""Parsers of the outputs that ``tool_choice: "required"`` and a named tool choice force
through structured outputs (vLLM's ``required`` / named paths): a JSON list of
``{"name", "parameters"}`` objects, or the named function's arguments object alone."""
from __future__ import annotations

from typing import Any

from llmserve.parsing_types import ExtractedToolCallInformation, FunctionCall, ToolCall
from llmserve.tool_parsers.abstract_tool_parser import (ScanResult, ToolParser, canonical_arguments,
                                                      streamed_arguments)
from llmserve.tool_parsers.json_scan import RawCall, scan_call_list, skip_ws, value_end


class RequiredToolParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``."""

    holds_calls_until_end = False  # the grammar keeps it valid JSON: each call streams as it grows

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

    holds_calls_until_end = False

    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        if i >= len(text):  # the call starts with the output's first character
            return ScanResult()
        complete = value_end(text, i) is not None
        return ScanResult(calls=[RawCall(self.name, text, complete)])

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """The whole output is the call's arguments, also when ``max_tokens`` cut it
        (vLLM's named tool choice; the streamed deltas carry the same text), not content."""
        scan = self.scan(model_output, final=True)
        if not scan.calls:  # nothing but whitespace
            return super().extract_tool_calls(model_output, request)
        raw = scan.calls[0]
        args = canonical_arguments(raw) if raw.complete else None
        call = ToolCall(id=self.make_tool_call_id(),
                        function=FunctionCall(name=self.name, arguments=streamed_arguments(raw) if args is None else args))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)
