"""``hermes``: Hermes/Qwen tool calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(vLLM's ``Hermes2ProToolParser``). Text before the first ``<tool_call>`` is content."""
from __future__ import annotations

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser, ToolParserManager, held_back
from llmserve.tool_parsers.json_scan import scan_call_object, skip_ws


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    """Calls between ``<tool_call>`` and ``</tool_call>`` (the closing tag may be missing
    at the end of the output)."""

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> ScanResult:
        start = text.find(self.tool_call_start_token)
        if start < 0:
            keep = 0 if final else held_back(text, self.tool_call_start_token)
            return ScanResult(content=text[:len(text) - keep])
        result = ScanResult(content=text[:start])
        while start >= 0:
            i = skip_ws(text, start + len(self.tool_call_start_token))
            if i >= len(text) or text[i] != "{":
                break
            call, end = scan_call_object(text, i)
            result.calls.append(call)
            if end is None:
                break
            start = text.find(self.tool_call_start_token, end)
        return result
