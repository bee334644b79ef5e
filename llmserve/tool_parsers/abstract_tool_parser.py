"""The tool-parser interface and registry (vLLM's ``ToolParser`` / ``ToolParserManager``).

A parser turns a model's text into OpenAI tool calls, whole (:meth:`ToolParser.
extract_tool_calls`) or streamed (:meth:`ToolParser.extract_tool_calls_streaming`). Here
each parser only describes its format, in one method, :meth:`ToolParser.scan`: the
content text and the calls (name, raw JSON arguments) visible in a text so far. Both
extraction methods derive from it, and the streaming one is a pure function of
``previous_text`` and ``current_text`` (the difference of their scans), so a stream split
anywhere gives the same content and the same calls as the whole text. The free-text
formats hold their calls back until the output ends (``holds_calls_until_end``): a call
the model broke (bad JSON inside the markers, an object never closed) makes the whole
output content, and a stream that had already sent its name could not take it back.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from llmserve.parser_registry import ParserRegistry
from llmserve.parsing_types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from llmserve.tool_parsers.json_scan import RawCall, canonical_json_prefix

logger = logging.getLogger(__name__)


@dataclass
class ScanResult:
    """``content``: the text that is surely content (text that may still turn out to
    start a tool call is held back unless the scan is final); ``calls``: the calls seen."""

    content: str = ""
    calls: list[RawCall] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``
    (text that may be the start of the marker, so not yet content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def canonical_arguments(call: RawCall) -> Optional[str]:
    """The call's arguments as canonical JSON text (``json.dumps(args,
    ensure_ascii=False)``), or None when they are not one complete JSON object. A call
    without arguments gets ``{}``. Arguments the model wrote as a JSON string holding the
    object (``"arguments": "{\\"city\\": \\"Oslo\\"}"``, as Granite 4 does) are that
    object, and an empty string is ``{}``: sent on as a string, clients decoded a string
    and dropped the arguments (vLLM PR 54964)."""
    raw = call.args.strip() or "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, str):
        raw = value.strip() or "{}"
        try:
            value = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return canonical_json_prefix(raw)


def streamed_arguments(call: RawCall) -> str:
    """The argument text streamed for ``call`` so far ({} for a finished call that has
    none, as :func:`canonical_arguments`). Arguments written as a JSON string are held
    back until the call is complete, then sent whole as the object they hold."""
    if call.args.lstrip().startswith('"'):
        return (canonical_arguments(call) or "") if call.complete else ""
    args = canonical_json_prefix(call.args)
    return "{}" if not args and call.complete else args


class ToolParser:
    """Base of the tool parsers (vLLM's interface).

    tokenizer: the model's tokenizer (special-token ids, when a format needs them).
    Subclasses implement :meth:`scan`; ``adjust_request`` keeps special tokens in the
    text when the format's markers are special tokens.
    """

    # Markers that are special tokens must survive detokenization.
    keeps_special_tokens = False
    # Free-text formats (the model may write a broken call): a stream sends the calls only
    # once the output has ended and the whole output holds valid ones, so that streamed and
    # whole outputs agree (a malformed call is content with finish "stop" either way).
    # The forced formats, whose JSON a grammar enforces, stream each call as it grows.
    holds_calls_until_end = True

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        # vLLM's streaming state, kept for callers that read it
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self._ids: dict[int, str] = {}

    @property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    def adjust_request(self, request: Any) -> Any:
        """Called before generation: formats whose markers are special tokens ask the
        detokenizer to keep them (vLLM's ``skip_special_tokens = False``)."""
        if self.keeps_special_tokens and getattr(request, "tools", None) and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    # ---- the one format-specific method -------------------------------------------
    def scan(self, text: str, final: bool) -> ScanResult:
        """Content and calls in ``text``. ``final``: the text is complete, so nothing is
        held back. Must be monotone: the scan of a prefix never contradicts a longer
        text's (content a prefix, calls' names equal, args prefixes)."""
        raise NotImplementedError

    def make_tool_call_id(self) -> str:
        """A new tool-call id (vLLM's ``chatcmpl-tool-<hex>``)."""
        return make_tool_call_id()

    # ---- whole output ---------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """The calls in a whole output. A call that is incomplete or whose arguments are
        not a JSON object makes the whole output content (vLLM's parsers do the same)."""
        scan = self.scan(model_output, final=True)
        calls = []
        for raw in scan.calls:
            args = canonical_arguments(raw) if raw.complete else None
            if raw.name is None or args is None:
                return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
            calls.append(ToolCall(id=self.make_tool_call_id(), function=FunctionCall(name=raw.name, arguments=args)))
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=scan.content or None)

    # ---- streaming ------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> Optional[DeltaMessage]:
        """The delta between the scans of ``previous_text`` and ``current_text``: new
        content, the first fragment of each call whose name just became known (index,
        id, type, name, arguments so far), and argument fragments of calls already
        started; with :attr:`holds_calls_until_end`, content only (the calls come from
        :meth:`flush_streaming`). None when nothing new is certain yet."""
        return self._diff(self._streamed(self.scan(previous_text, final=False)),
                          self._streamed(self.scan(current_text, final=False)))

    def _streamed(self, scan: ScanResult) -> ScanResult:
        """What of a scan a stream sends before the output ends."""
        return ScanResult(content=scan.content) if self.holds_calls_until_end else scan

    def flush_streaming(self, text: str, request: Any = None) -> Optional[DeltaMessage]:
        """At the end of a stream: what the final scan of ``text`` adds (text held back
        because it might have started a call, the calls held back, arguments whose last
        token was pending). When no call was streamed and the whole text holds no valid
        one, the text held back is content, as :meth:`extract_tool_calls` says."""
        if type(self).scan is ToolParser.scan:
            # A vLLM-style plugin parser (its own extract_* methods, no scan): vLLM's
            # streaming has no flush, its streaming method already sent everything.
            return None
        before = self._streamed(self.scan(text, final=False))
        if all(c.name is None for c in before.calls) and not self.extract_tool_calls(text, request).tools_called:
            rest = text[len(before.content):] if text.startswith(before.content) else ""
            return DeltaMessage(content=rest) if rest else None
        return self._diff(before, self.scan(text, final=True))

    def _diff(self, before: ScanResult, after: ScanResult) -> Optional[DeltaMessage]:
        content = after.content[len(before.content):] if after.content.startswith(before.content) else ""
        deltas = []
        for i, call in enumerate(after.calls):
            if call.name is None:
                continue
            old = before.calls[i] if i < len(before.calls) else None
            args = streamed_arguments(call)
            if old is None or old.name is None:
                self._ids[i] = self.make_tool_call_id()
                self._track(i, call.name, args)
                deltas.append(DeltaToolCall(index=i, id=self._ids[i], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=args)))
                continue
            sent = streamed_arguments(old)
            if len(args) > len(sent) and args.startswith(sent):
                self._track(i, call.name, args)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[len(sent):])))
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    def _track(self, index: int, name: str, args: str) -> None:
        while len(self.streamed_args_for_tool) <= index:
            self.streamed_args_for_tool.append("")
            self.prev_tool_call_arr.append({})
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index] = {"name": name, "arguments": args}
        self.current_tool_id = index
        self.current_tool_name_sent = True


class ToolParserManager(ParserRegistry):
    """Registry of tool parsers by name (vLLM's ``ToolParserManager``)."""

    kind = "tool parser"
    _registry: dict[str, type[ToolParser]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class registered as ``name``. Raises KeyError naming the known ones."""
        return cls._lookup(name)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """``--tool-parser-plugin``: import a file that registers parsers with
        ``@ToolParserManager.register_module(...)`` (vLLM's name). Raises ValueError."""
        cls.import_plugin(plugin_path)


ToolParserFactory = Callable[[Any], ToolParser]
