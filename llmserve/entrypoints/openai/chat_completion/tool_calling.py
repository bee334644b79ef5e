"""Tools and reasoning in chat completions (vLLM's ``OpenAIServingChat`` tool and
reasoning paths).

- :func:`check_tools`: validates ``tools`` and ``tool_choice`` as vLLM/OpenAI do (400s
  naming the field) and normalises them: tools without a choice mean ``"auto"``,
  ``"required"`` with no tools means ``"none"``, and OpenAI's ``allowed_tools`` choice
  (:func:`allowed_tools`) becomes its mode over the allowed tools only.
- :class:`ToolPlan`: what one request needs: the tools handed to the chat template, the
  JSON schema that ``"required"`` or a named choice forces through structured outputs,
  and the parser of the output.
- :class:`ChoiceOutputParser`: one choice's output, whole or streamed: reasoning first
  (``--reasoning-parser``), then tool calls in the content after it.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from llmserve.entrypoints.chat_utils import json_type_name
from llmserve.parsing_types import DeltaMessage, DeltaToolCall, ToolCall
from llmserve.sampling_params import SamplingParamsError, StructuredOutputsParams
from llmserve.structured_output.grammar import json_schema_error
from llmserve.tool_parsers.abstract_tool_parser import canonical_arguments

# OpenAI's rule for function names.
TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _check_schema(schema: Any, i: int) -> None:
    where = f"tools[{i}].function.parameters"
    if not isinstance(schema, dict):
        raise SamplingParamsError(f"{where} must be a JSON schema object, not {json_type_name(schema)}.", where)
    err = json_schema_error(schema)
    if err is not None:
        raise SamplingParamsError(f"{where} is not a valid JSON schema {err}", where)


def check_tool(tool: Any, i: int) -> str:
    """Validate ``tools[i]`` (a function tool: name, description, parameters schema,
    strict); returns its name. Raises SamplingParamsError whose ``param`` is the exact
    field at fault, as OpenAI names it (``tools[0].function.name``,
    ``tools[0].function.parameters``...); the client's value is never quoted back."""
    if not isinstance(tool, dict):
        raise SamplingParamsError(f"tools[{i}] must be an object, not {json_type_name(tool)}.", f"tools[{i}]")
    if tool.get("type", "function") != "function":
        raise SamplingParamsError(f"tools[{i}].type: only tools of type 'function' are supported.",
                                  f"tools[{i}].type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        got = "it is missing" if fn is None else f"got {json_type_name(fn)}"
        raise SamplingParamsError(f"tools[{i}].function must be an object with a 'name' ({got}).",
                                  f"tools[{i}].function")
    name = fn.get("name")
    where = f"tools[{i}].function.name"
    if name is None:
        raise SamplingParamsError(f"Missing required parameter: '{where}'.", where)
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        got = f"got {json_type_name(name)}" if not isinstance(name, str) else \
            "got an empty string" if not name else f"got a string of {len(name)} characters that does not match"
        raise SamplingParamsError(f"{where} must be 1-64 letters, digits, '_' or '-' ({got}).", where)
    for key, kind in (("description", str), ("strict", bool)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            noun = "a string" if kind is str else "a boolean"
            raise SamplingParamsError(f"tools[{i}].function.{key} must be {noun}, not {json_type_name(fn[key])}.",
                                      f"tools[{i}].function.{key}")
    if fn.get("parameters") is not None:
        _check_schema(fn["parameters"], i)
    return name


def allowed_tools(tools: Optional[list[Any]], names: list[str], choice: dict[str, Any]) -> tuple[list[Any], str]:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools": [{"type":
    "function", "function": {"name"}}]}}`` tool choice (chat's form; the Responses form is
    mapped to it) as ``(the allowed tools, mode)``: the model sees and may call only the
    allowed tools, ``mode`` "auto" (it may answer without a call) or "required". ``tools``
    were checked (``names``: theirs). Raises SamplingParamsError naming the field."""
    if tools is None:
        raise SamplingParamsError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    spec = choice.get("allowed_tools")
    where = "tool_choice.allowed_tools"
    if not isinstance(spec, dict):
        raise SamplingParamsError(f"{where}: must be an object with `mode` and `tools`.", where)
    mode = spec.get("mode")
    if mode not in ("auto", "required"):
        raise SamplingParamsError(f"{where}.mode: must be 'auto' or 'required'.", f"{where}.mode")
    wanted = spec.get("tools")
    if not isinstance(wanted, list) or not wanted:
        raise SamplingParamsError(f"{where}.tools: must be a non-empty list of tools.", f"{where}.tools")
    allowed = set()
    for k, item in enumerate(wanted):
        fn = item.get("function") if isinstance(item, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise SamplingParamsError(f"{where}.tools.{k}: must be a function tool named as one of `tools`.",
                                      f"{where}.tools.{k}")
        allowed.add(name)
    return [t for t, n in zip(tools, names) if n in allowed], mode


def check_tools(request: Any) -> None:
    """Validate and normalise ``request.tools`` / ``request.tool_choice`` (vLLM's
    ``check_tool_usage``). Raises SamplingParamsError naming ``tools`` or ``tool_choice``."""
    tools, choice = request.tools, request.tool_choice
    names: list[str] = []
    if tools is not None:
        names = [check_tool(t, i) for i, t in enumerate(tools)]
        for i, name in enumerate(names):
            if name in names[:i]:
                where = f"tools[{i}].function.name"
                raise SamplingParamsError(f"{where}: function names must be unique (tools[{names.index(name)}] "
                                          "has the same name).", where)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        request.tools, request.tool_choice = tools, choice = allowed_tools(tools, names, choice)
    if choice is None:
        if tools:
            request.tool_choice = "auto"
        return
    if choice == "none":
        return
    if tools is None:
        raise SamplingParamsError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise SamplingParamsError('tool_choice: must be "none", "auto", "required" or a named tool. '
                                      f"{_CHOICE_USAGE}", "tool_choice")
        if choice == "required" and not tools:  # OpenAI: nothing to require
            request.tool_choice, request.tools = "none", None
        return
    # named by the field at fault, never echoing the value (validation_errors.py's rule)
    kind = choice.get("type", "function")
    if kind != "function":
        raise SamplingParamsError(f"tool_choice.type: must be 'function'. {_CHOICE_USAGE}", "tool_choice.type")
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise SamplingParamsError(f"tool_choice.function: must be an object, not {json_type_name(fn)}. "
                                  f"{_CHOICE_USAGE}", "tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        got = "none was given" if name is None else "got an empty string" if name == "" else \
            f"got {json_type_name(name)}"
        raise SamplingParamsError(f"tool_choice.function.name: must be the name of one of `tools` ({got}). "
                                  f"{_CHOICE_USAGE}", "tool_choice.function.name")
    if name not in names:
        raise SamplingParamsError("The tool named in `tool_choice` (tool_choice.function.name) does not match any "
                                  "of the specified `tools`.", "tool_choice")


def _hoist_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its ``$defs``, which move into ``defs`` (a forced schema nests
    each tool's parameters, and ``#/$defs/...`` references resolve from the root)."""
    if "$defs" not in schema:
        return schema
    schema = dict(schema)
    for k, v in schema.pop("$defs").items():
        if k in defs and defs[k] != v:
            raise SamplingParamsError(f"tools: the $defs entry {k!r} is defined differently by two tools.", "tools")
        defs[k] = v
    return schema


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of
    ``{"name": <a tool's name>, "parameters": <its parameters>}`` (at most one item
    when ``parallel_tool_calls`` is false)."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        fn = tool["function"]
        options.append({
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": _hoist_defs(fn.get("parameters") or EMPTY_PARAMETERS, defs)},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolPlan:
    """One request's tool handling.

    mode: None (no tools), "none", "auto", "required" or "named"; named: the forced
    function's name; template_tools: the tools the chat template sees (None: none);
    schema: the JSON schema structured outputs must enforce (required/named).
    """

    mode: Optional[str] = None
    named: Optional[str] = None
    template_tools: Optional[list[dict[str, Any]]] = None
    schema: Optional[dict[str, Any]] = None

    @classmethod
    def of(cls, request: Any, *, enable_auto_tools: bool, tool_parser_cls: Any,
           exclude_tools_when_tool_choice_none: bool = False) -> "ToolPlan":
        """The plan of a checked request. Raises SamplingParamsError (``tool_choice``)
        for ``"auto"`` on a server started without ``--enable-auto-tool-choice
        --tool-call-parser`` (vLLM's 400)."""
        tools, choice = request.tools, request.tool_choice
        if not tools and choice in (None, "none"):
            return cls()
        if choice == "auto" and not (enable_auto_tools and tool_parser_cls is not None):
            raise SamplingParamsError('"auto" tool choice requires --enable-auto-tool-choice and '
                                      "--tool-call-parser to be set", "tool_choice")
        template_tools = None if (choice == "none" and exclude_tools_when_tool_choice_none) else \
            copy.deepcopy(tools)
        if choice in ("none", "auto"):
            return cls(mode=choice, template_tools=template_tools)
        if choice == "required":
            return cls(mode="required", template_tools=template_tools,
                       schema=required_schema(tools, request.parallel_tool_calls is not False))
        name = choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return cls(mode="named", named=name, template_tools=template_tools,
                   schema=copy.deepcopy(fn.get("parameters") or EMPTY_PARAMETERS))

    @property
    def parses_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def make_tool_parser(self, tokenizer: Any, tool_parser_cls: Any) -> Any:
        """A fresh parser for one choice (None when tool calls are not parsed)."""
        from llmserve.tool_parsers.forced import NamedToolParser, RequiredToolParser

        if self.mode == "auto":
            return tool_parser_cls(tokenizer)
        if self.mode == "required":
            return RequiredToolParser(tokenizer)
        if self.mode == "named":
            return NamedToolParser(tokenizer, self.named)
        return None


@dataclass
class ParsedOutput:
    """A whole choice's message parts."""

    reasoning: Optional[str] = None
    content: Optional[str] = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChoiceOutputParser:
    """Parses one choice's output: ``reasoning_parser`` (None: no reasoning, or it
    ended in the prompt) splits reasoning from content; ``tool_parser`` (None: no
    parsing) finds the calls in that content. ``max_calls`` (1 when the request sets
    ``parallel_tool_calls: false``) keeps the first calls only."""

    def __init__(self, reasoning_parser: Any, tool_parser: Any, request: Any, max_calls: Optional[int] = None):
        self.reasoning_parser = reasoning_parser
        self.include_reasoning = getattr(request, "include_reasoning", True) is not False
        self.tool_parser = tool_parser
        self.request = request
        self.max_calls = max_calls
        self.text = ""  # the output so far
        self.content = ""  # its content part so far (after the reasoning)
        self.tools_streamed = False

    # ---- whole output --------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        """The message parts of a whole output."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text, self.request)
            reasoning = reasoning if self.include_reasoning else None
        self.content = content or ""  # what the tool parser scans (OutputParsing.check_forced)
        if self.tool_parser is None or content is None:
            return ParsedOutput(reasoning, content)
        info = self.tool_parser.extract_tool_calls(content, self.request)
        if not info.tools_called:
            return ParsedOutput(reasoning, content)
        return ParsedOutput(reasoning, info.content, info.tool_calls[:self.max_calls])

    # ---- streaming -----------------------------------------------------------------
    def feed(self, delta_text: str) -> Optional[DeltaMessage]:
        """The delta that ``delta_text`` adds to the message (None: nothing certain yet)."""
        previous, self.text = self.text, self.text + delta_text
        if self.reasoning_parser is None:
            return self._content_delta(delta_text)
        rd = self.reasoning_parser.extract_reasoning_streaming(previous, self.text, delta_text, [], [], [])
        return self._merge(rd, rd.content if rd is not None else None)

    def flush(self) -> Optional[DeltaMessage]:
        """At the end of the output: what was held back."""
        out = None
        if self.reasoning_parser is not None:
            rd = self.reasoning_parser.flush_streaming(self.text)
            out = self._merge(rd, rd.content if rd is not None else None)
        if self.tool_parser is not None:
            out = join_deltas(out, self._limit(self.tool_parser.flush_streaming(self.content, self.request)))
        return out

    def _merge(self, rd: Optional[DeltaMessage], content: Optional[str]) -> Optional[DeltaMessage]:
        keep = rd is not None and rd.reasoning and self.include_reasoning
        reasoning = DeltaMessage(reasoning=rd.reasoning) if keep else None
        return join_deltas(reasoning, self._content_delta(content) if content else None)

    def _content_delta(self, delta: str) -> Optional[DeltaMessage]:
        previous, self.content = self.content, self.content + delta
        if self.tool_parser is None:
            return DeltaMessage(content=delta) if delta else None
        return self._limit(self.tool_parser.extract_tool_calls_streaming(
            previous, self.content, delta, [], [], [], self.request))

    def _limit(self, dm: Optional[DeltaMessage]) -> Optional[DeltaMessage]:
        if dm is None or not dm.tool_calls:
            return dm
        calls = [c for c in dm.tool_calls if self.max_calls is None or c.index < self.max_calls]
        self.tools_streamed = self.tools_streamed or bool(calls)
        if not calls and not dm.content:
            return None
        return DeltaMessage(content=dm.content, tool_calls=calls or None)


class ForcedToolCallCutError(SamplingParamsError):
    """A forced tool call (``tool_choice`` "required" or a named function) that the token
    budget cut before the call was complete: the request fails (as in vLLM) rather than
    hand a client grammar text as content or a call whose arguments are not JSON. HTTP
    400 naming ``max_tokens`` (or ``max_completion_tokens``); in a stream, an error event."""

    def __init__(self, param: str = "max_tokens") -> None:
        super().__init__(f"tool_choice forces a tool call, but {param} ended the output before the call was "
                         f"complete: raise {param} (the call's JSON must fit in it).", param)


def forced_call_complete(parser: "ChoiceOutputParser") -> bool:
    """Whether the content so far holds at least one call and every call is complete
    JSON (for a forced choice: what a cut output must have to count as a valid call)."""
    tool_parser = parser.tool_parser
    scan = tool_parser.scan(parser.content, final=True)
    return bool(scan.calls) and all(c.complete and canonical_arguments(c) is not None for c in scan.calls)


class OutputParsing:
    """The output parsing of one request: ``make_parser`` (None: outputs pass as
    content) builds each choice's ChoiceOutputParser; streamed choices keep theirs."""

    def __init__(self, plan: ToolPlan, make_parser: Optional[Any], max_tokens_param: str = "max_tokens",
                 cut_call_fails: bool = True) -> None:
        self.plan = plan
        self.make_parser = make_parser
        self.active = make_parser is not None
        self.max_tokens_param = max_tokens_param  # named in ForcedToolCallCutError
        # False (Anthropic's and Ollama's front doors): a forced call cut by the budget ends
        # as any cut output, finish "length" (Anthropic: stop_reason max_tokens with the
        # incomplete call; Ollama: done_reason length), as those APIs document it
        self.cut_call_fails = cut_call_fails
        self._streams: dict[int, ChoiceOutputParser] = {}

    def check_forced(self, parser: "ChoiceOutputParser", finish_reason: Optional[str]) -> None:
        """Raise ForcedToolCallCutError when a forced choice ended by ``length`` without a
        complete call (unless ``cut_call_fails`` is False)."""
        if self.cut_call_fails and self.plan.mode in ("required", "named") and finish_reason == "length" \
                and parser.tool_parser is not None and not forced_call_complete(parser):
            raise ForcedToolCallCutError(self.max_tokens_param)

    def parse_whole(self, text: str, finish_reason: Optional[str]) -> ParsedOutput:
        """A whole choice's parts (``make_parser().parse``), checked as ``check_forced``."""
        parser = self.make_parser()
        parsed = parser.parse(text)  # keeps the content part on the parser: split once
        self.check_forced(parser, finish_reason)
        return parsed

    def finish_reason(self, finish_reason: Optional[str], tools_called: bool) -> Optional[str]:
        """``tool_calls`` when an ``auto`` or ``required`` choice stopped after calling
        tools (a named choice stops with ``stop``, as vLLM)."""
        if tools_called and finish_reason == "stop" and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def stream_delta(self, index: int, text: str, finish: Optional[str]) -> tuple[Optional[DeltaMessage],
                                                                                  Optional[str]]:
        """Choice ``index``'s delta for new ``text`` (flushed when ``finish`` is set) and
        its finish reason."""
        parser = self._streams.get(index)
        if parser is None:
            parser = self._streams[index] = self.make_parser()
        delta = parser.feed(text)
        if finish is not None:
            self.check_forced(parser, finish)
            delta = join_deltas(delta, parser.flush())
            finish = self.finish_reason(finish, parser.tools_streamed)
        return delta, finish


def join_deltas(a: Optional[DeltaMessage], b: Optional[DeltaMessage]) -> Optional[DeltaMessage]:
    """Two deltas of one step as one (reasoning, content and calls concatenated)."""
    if a is None or b is None:
        return a or b
    calls: list[DeltaToolCall] = list(a.tool_calls or []) + list(b.tool_calls or [])
    return DeltaMessage(reasoning=((a.reasoning or "") + (b.reasoning or "")) or None,
                        content=((a.content or "") + (b.content or "")) or None, tool_calls=calls or None)


def setup_output_parsing(handler: Any, request: Any, plan: ToolPlan, params: Any, prompt_ids: list[int],
                         ) -> tuple[Optional[Any], dict[str, Any]]:
    """Set up tool-call and reasoning parsing of the output (vLLM's chat paths), for
    the chat and Responses handlers alike.

    handler: has ``tokenizer``, ``tool_parser_cls`` and ``reasoning_parser_cls`` (the
    flags). Puts the forced schema of ``required``/named tool choices on ``params``
    (structured outputs) and keeps special tokens for parsers whose markers are special
    tokens. Returns a factory of one ChoiceOutputParser per choice (None when nothing is
    parsed) and the ``reasoning_ended`` / ``reasoning_parser_kwargs`` arguments of
    ``AsyncLLM.generate``.
    """
    if plan.schema is not None:
        params.structured_outputs = StructuredOutputsParams(json=plan.schema)
    if plan.mode == "auto" and handler.tool_parser_cls.keeps_special_tokens:
        params.skip_special_tokens = False
    reasoner, gen_kwargs = None, {}
    if handler.reasoning_parser_cls is not None:
        kwargs = reasoning_kwargs(request)
        reasoner = handler.reasoning_parser_cls(handler.tokenizer, **kwargs)
        ended = reasoner.is_reasoning_end(prompt_ids)
        # The grammar applies to what the parser will call content: from the first token
        # when the prompt closed the reasoning, or when the request switched thinking off
        # (a template may do that without writing the end marker, and then the model never
        # writes it either: waiting for it left JSON schemas and forced tool calls
        # unenforced, case C59).
        gen_kwargs = {"reasoning_ended": ended or not reasoner.reasoning_by_default() or not request.include_reasoning,
                      "reasoning_parser_kwargs": kwargs}
        if ended:  # the template closed the reasoning (e.g. enable_thinking false): all content
            reasoner = None
    if reasoner is None and not plan.parses_tools:
        return None, gen_kwargs
    max_calls = 1 if request.parallel_tool_calls is False else None
    return (lambda: ChoiceOutputParser(reasoner, plan.make_tool_parser(handler.tokenizer, handler.tool_parser_cls),
                                       request, max_calls)), gen_kwargs


def reasoning_kwargs(request: Any) -> dict[str, Any]:
    """vLLM's ``reasoning_parser_kwargs``: the request's chat template kwargs."""
    return {"chat_template_kwargs": dict(request.chat_template_kwargs or {})}
