"""``mistral``: Mistral tool calls, ``[TOOL_CALLS]`` then a JSON list of
``{"name": ..., "arguments": {...}}``, or (v11+ tokenizers) ``[TOOL_CALLS]name[ARGS]{...}``
per call (vLLM's ``MistralToolParser``; ids are 9
alphanumeric characters, as Mistral's templates require). Text before ``[TOOL_CALLS]`` is
content."""
from __future__ import annotations

import random
import string

from llmserve.tool_parsers.abstract_tool_parser import ScanResult, ToolParser, ToolParserManager, held_back
from llmserve.tool_parsers.json_scan import RawCall, scan_call_list, skip_ws, value_end

_ALNUM = string.ascii_letters + string.digits


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """Calls in the JSON list after ``[TOOL_CALLS]``."""

    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
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
        while start >= 0:  # v11+ tokenizers: [TOOL_CALLS]name[ARGS]{...}, repeated
            i = start + len(self.bot_token)
            args_at = text.find(self.args_token, i)
            if args_at < 0:
                break
            j = skip_ws(text, args_at + len(self.args_token))
            end = value_end(text, j) if j < len(text) else None
            result.calls.append(RawCall(text[i:args_at].strip(), text[j:end] if end else text[j:], end is not None))
            if end is None:
                break
            start = text.find(self.bot_token, end)
        return result
