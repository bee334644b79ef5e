"""``llama3_json``: Llama 3.x JSON tool calls (vLLM's ``Llama3JsonToolParser``): the output
starts with ``<|python_tag|>`` or ``{`` and holds ``{"name": ..., "parameters": {...}}``
objects separated by ``;``. Any other output is content."""
from __future__ import annotations

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser, ToolParserManager
from llmserve.tool_parsers.json_scan import scan_call_object, skip_ws


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    """Calls as JSON objects after an optional ``<|python_tag|>``."""

    bot_token = "<|python_tag|>"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(self.bot_token):
            i = skip_ws(text, i + len(self.bot_token))
        elif not rest.startswith("{"):
            undecided = not final and self.bot_token.startswith(rest)  # "" or a partial tag
            return ScanResult(content="" if undecided else text)
        result = ScanResult()
        while i < len(text) and text[i] == "{":
            call, end = scan_call_object(text, i)
            result.calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        return result
