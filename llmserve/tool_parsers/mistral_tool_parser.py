"""``mistral``: Mistral tool calls, ``[TOOL_CALLS]`` then a JSON list of
``{"name": ..., "arguments": {...}}`` (vLLM's ``MistralToolParser``; ids are 9
alphanumeric characters, as Mistral's templates require). Text before ``[TOOL_CALLS]`` is
content."""
from __future__ import annotations

import random
import string

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser, ToolParserManager, held_back
from llmserve.tool_parsers.json_scan import scan_call_list, skip_ws

_ALNUM = string.ascii_letters + string.digits


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """Calls in the JSON list after ``[TOOL_CALLS]``."""

    bot_token = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def make_tool_call_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def scan(self, text: str, final: bool) -> ScanResult:
        start = text.find(self.bot_token)
        if start < 0:
            keep = 0 if final else held_back(text, self.bot_token)
            return ScanResult(content=text[:len(text) - keep])
        i = skip_ws(text, start + len(self.bot_token))
        result = ScanResult(content=text[:start])
        if i < len(text) and text[i] == "[":
            result.calls, _ = scan_call_list(text, i)
        return result
