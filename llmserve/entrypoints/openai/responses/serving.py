"""``/v1/responses`` (OpenAI's Responses API; vLLM's ``OpenAIServingResponses``).

A request becomes chat messages (``instructions`` as the system message, the stored
conversation of ``previous_response_id``, then ``input``: input_items.py), rendered by
the one renderer with the function tools; sampling, structured outputs (``text.format``)
and tool/reasoning parsing are chat's (``tool_calling.py``, the same
``--enable-auto-tool-choice`` / ``--tool-call-parser`` / ``--reasoning-parser`` flags).
The output becomes ``reasoning``, ``message`` and ``function_call`` items
(streaming.py); ``max_output_tokens`` reached is ``status: "incomplete"`` with
``incomplete_details.reason == "max_output_tokens"``.

State (store.py): ``store`` (default true) keeps the response and its conversation in a
bounded in-process store (``--responses-store-max-entries``, oldest evicted first) for
``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``;
``background: true`` answers ``queued`` at once and runs in a task that
``POST /v1/responses/{id}/cancel`` aborts (``cancelled``). With ``stream: true`` too, the
task writes the events into the response's log and the request follows that log: a
client that disconnects leaves the response running, and ``GET
/v1/responses/{id}?stream=true&starting_after=N`` (OpenAI's way to resume) gives the
events after N, live until the terminal one.

Errors before a response starts are raised (404 unknown model or response id, 400
naming the field); a stream that fails later ends with an ``error`` event and
``response.failed``. A prompt that does not fit the context is a 400 (vLLM's body, ``code:
400``), but when streamed it is in-band, as OpenAI sends it: ``response.created``, then
``response.failed`` with ``code: "context_length_exceeded"`` (Codex CLI looks for it
only there, to say it ran out of room and compact). A generation the engine cut off
(finish reason "abort": server shutdown) is ``failed`` with a ``server_error``, never a
completed or incomplete answer: a 500 when not streamed, ``response.failed`` when streamed. A client that disconnects
aborts its engine request, as on chat (not a background one); every stored stream's
log still ends with a terminal event (``response.failed`` with ``status: "cancelled"``
for one cut short), so a replay never hangs up without one.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import re
import urllib.parse
from typing import Any, AsyncGenerator, Optional, Union

from llmserve.entrypoints.openai.chat_completion.tool_calling import (
    OutputParsing,
    ToolPlan,
    check_tools,
    setup_output_parsing,
)
from llmserve.entrypoints.openai.common.errors import check_finished_normally, error_response_from_exception, \
    in_band_code
from llmserve.entrypoints.openai.common.serving import GenerateBaseServing, aclose_all, merge_started, renamed_param
from llmserve.entrypoints.openai.common.structured import JsonSchemaResponseFormat, ResponseFormat, \
    structured_outputs_params
from llmserve.entrypoints.openai.responses.input_items import (
    UNSUPPORTED_TOOLS_DROP,
    UNSUPPORTED_TOOLS_POLICIES,
    ChatToolsView,
    check_call_ids,
    resolve_item_references,
    input_messages,
    output_messages,
    to_chat_tool_choice,
    to_chat_tools,
    unsupported_tools,
)
from llmserve.entrypoints.openai.responses.listing import ResponseItemList, page, stored_input_items
from llmserve.entrypoints.openai.responses.protocol import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ReasoningItem,
    ResponseError,
    ResponsesInputTokens,
    ResponsesInputTokensRequest,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from llmserve.entrypoints.openai.responses.store import ResponsesStore, StoredResponse
from llmserve.entrypoints.openai.logprobs import build_chat_logprobs
from llmserve.entrypoints.openai.responses.streaming import MAX_LOGGED_EVENTS, EventLog, OutputBuilder, \
    response_logprobs
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import ContextLengthExceededError, SamplingParams, SamplingParamsError
from llmserve.tokenizer import check_texts

logger = logging.getLogger("llmserve.entrypoints.openai")

# engine / renderer field -> Responses field, for the ``param`` of a 400
PARAM_NAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
               "structured_outputs": "text.format", "response_format": "text.format", "logprobs": "top_logprobs"}


@functools.lru_cache(maxsize=256)
def _warn_dropped_tool(label: str) -> None:
    """Log a dropped tool once per label (Codex sends the same tools every turn)."""
    logger.warning("Responses: the tool %r cannot run on this server (only function tools can); it is left out "
                   "of the prompt (--responses-unsupported-tools drop; the response header %s names it).",
                   label, DROPPED_TOOLS_HEADER)


DROPPED_TOOLS_HEADER = "x-llmserve-dropped-tools"
MAX_DROPPED_TOOLS_HEADER_CHARS = 4096
# Characters a label keeps as they are: visible ASCII (RFC 9110's VCHAR; h11 refuses a
# value that ends in a space, so spaces are escaped too) but '%' (the escape itself) and
# ',' (the separator between labels)
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7f) if chr(c) not in "%,")


def dropped_tools_header(labels: list[str]) -> str:
    """The ``x-llmserve-dropped-tools`` value: the labels joined with ',', each
    percent-encoded (UTF-8, ``urllib.parse.unquote`` reverses it) outside visible ASCII
    and for '%' and ','; at most MAX_DROPPED_TOOLS_HEADER_CHARS characters. A label is the
    client's own tool type and name: sent raw, a newline or control character made h11
    refuse the header after the request had run (an empty reply to the client) and a
    character beyond latin-1 was a 400 with Python's codec text."""
    value = ",".join(urllib.parse.quote(label, safe=_HEADER_SAFE) for label in labels)
    if len(value) <= MAX_DROPPED_TOOLS_HEADER_CHARS:
        return value
    value = value[:MAX_DROPPED_TOOLS_HEADER_CHARS]
    escape = value.rfind("%", len(value) - 2)  # never end inside a %XX escape
    return value[:escape] if escape >= 0 else value


MAX_EVENT_LOGS = 64  # streamed responses whose events GET ...?stream=true can replay


def _renamed(e: SamplingParamsError, names: dict[str, str]) -> SamplingParamsError:
    """``e`` with the Responses API's name for its field (``messages`` -> ``input``,
    ``max_tokens`` -> ``max_output_tokens``), in ``param`` and in the message
    (:func:`renamed_param`)."""
    return renamed_param(e, names)


_CHAT_ALLOWED_TOOLS = "tool_choice.allowed_tools"


def _flat_choice_param(e: SamplingParamsError) -> SamplingParamsError:
    """``e`` named as Responses names an ``allowed_tools`` choice's fields (flat:
    ``tool_choice.mode``, ``tool_choice.tools.0``), not as the chat path checked them
    (``tool_choice.allowed_tools.mode``); other errors unchanged."""
    param = e.param or ""
    if not param.startswith(_CHAT_ALLOWED_TOOLS + "."):
        return e
    return SamplingParamsError(str(e).replace(_CHAT_ALLOWED_TOOLS + ".", "tool_choice."),
                               param.replace(_CHAT_ALLOWED_TOOLS + ".", "tool_choice.", 1))


_CHAT_TOOL_PATH = re.compile(r"tools\[(\d+)\](?:\.function)?")


def _flat_tool_param(e: SamplingParamsError, kept: list[int]) -> SamplingParamsError:
    """``e`` named as Responses names a function tool's fields (flat, at the tool's index
    in the request: ``tools[2].name``), not as the chat path checked them
    (``tools[0].function.name`` in the function tools kept, ``kept``: their indexes in
    the request); other errors unchanged."""
    param = e.param or ""

    def flat(match: re.Match) -> str:
        k = int(match.group(1))
        return f"tools[{kept[k] if k < len(kept) else k}]"

    if not _CHAT_TOOL_PATH.match(param):
        return e
    return SamplingParamsError(_CHAT_TOOL_PATH.sub(flat, str(e)), _CHAT_TOOL_PATH.sub(flat, param, count=1))


async def _raise_at_first(exc: BaseException) -> AsyncGenerator[Any, None]:
    """A stand-in for a generation's outputs that fails at its first step with ``exc``
    (an error found before the stream, reported in it by :meth:`_stream`)."""
    raise exc
    yield  # (never reached: the yield makes this an async generator)


class ResponsesJob:
    """One prepared request: the response skeleton, the prompt, the params, the output
    parsing and the conversation so far (chat messages, for the store)."""

    def __init__(self, request: ResponsesRequest, response: ResponsesResponse, prompt: Optional[RenderedPrompt],
                 params: SamplingParams, parsing: OutputParsing, gen_kwargs: dict[str, Any],
                 messages: list[dict[str, Any]]) -> None:
        self.request, self.response, self.prompt, self.params = request, response, prompt, params
        self.parsing, self.gen_kwargs, self.messages = parsing, gen_kwargs, messages
        self.want_logprobs = request.include_output_logprobs
        self.input_items: list[dict[str, Any]] = []


class OpenAIServingResponses(GenerateBaseServing):
    """Handler of ``/v1/responses`` (create, retrieve, delete, cancel)."""

    request_id_prefix = "resp"
    # set by configure_tool_calling from the flags, as on the chat handler
    enable_auto_tools = False
    tool_parser_cls: Any = None
    reasoning_parser_cls: Any = None
    exclude_tools_when_tool_choice_none = False

    def __init__(self, *args: Any, store_max_entries: int = 1000, unsupported_tools: str = UNSUPPORTED_TOOLS_DROP,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if unsupported_tools not in UNSUPPORTED_TOOLS_POLICIES:
            raise ValueError(f"responses_unsupported_tools must be one of {UNSUPPORTED_TOOLS_POLICIES}, "
                             f"got {unsupported_tools!r}")
        self.unsupported_tools = unsupported_tools
        self._event_logs: collections.deque = collections.deque()  # the newest MAX_EVENT_LOGS logs
        self.store = ResponsesStore(store_max_entries)
        self._background: set[asyncio.Task] = set()

    # ---- preparing -------------------------------------------------------------------
    def _text_format(self, request: ResponsesRequest) -> tuple[Any, dict[str, Any]]:
        """The StructuredOutputsParams of ``text.format`` or vLLM's ``structured_outputs``
        (None for text) and the ``text.format`` echo. Raises SamplingParamsError naming
        ``text.format``, or ``structured_outputs`` for that field and for both at once."""
        fmt = request.text.format if request.text is not None else None
        if request.structured_outputs is not None:
            if fmt is not None and fmt.type != "text":
                raise SamplingParamsError("Set either text.format (json_object / json_schema) or "
                                          "structured_outputs, not both.", "structured_outputs")
            return structured_outputs_params(None, request.structured_outputs), {"type": "text"}
        if fmt is None or fmt.type == "text":
            return None, {"type": "text"}
        if fmt.type == "json_schema" and (not fmt.name or fmt.schema_ is None):
            missing = "text.format.name" if not fmt.name else "text.format.schema"
            raise SamplingParamsError(f"text.format of type 'json_schema' needs a `name` and a `schema` "
                                      f"(missing: {missing}).", missing)
        rf = ResponseFormat(type=fmt.type, json_schema=JsonSchemaResponseFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict) if fmt.type == "json_schema" else None)
        try:
            params = structured_outputs_params(rf, None)
        except SamplingParamsError as e:
            raise _renamed(e, {**PARAM_NAMES, "response_format.json_schema.schema": "text.format.schema"}) from None
        return params, fmt.model_dump(by_alias=True, exclude_none=True)

    def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The stored conversation ``previous_response_id`` continues (a copy), [] without
        one; ResponseNotFoundError (404, param ``previous_response_id``) for an unknown id."""
        if request.previous_response_id is None:
            return []
        return list(self.store.get(request.previous_response_id, "previous_response_id").messages)

    async def _prompt(self, request: ResponsesRequest) -> tuple[RenderedPrompt, list[dict[str, Any]], Any, Any]:
        """Check and render the request's prompt: (prompt, conversation as chat messages,
        tools view, tool plan). ``input`` None (``/v1/responses/input_tokens`` only) adds
        no message. Raises SamplingParamsError naming the field, ResponseNotFoundError."""
        request.check()
        # a lone surrogate named at the client's field and position (input.0.content), not
        # at the rendered prompt's, which the error would otherwise call ``messages``
        check_texts([("instructions", request.instructions), ("input", request.input), ("tools", request.tools)])
        items = request.input if request.input is not None else []
        history = self._history(request)
        new_messages = input_messages(items)
        if not history and not new_messages:
            raise SamplingParamsError("input: give the input to count, or a previous_response_id.", "input")
        check_call_ids(history, items)
        for label in self.dropped_tools(request):
            _warn_dropped_tool(label)
        view = ChatToolsView(to_chat_tools(request.tools, self.unsupported_tools),
                             to_chat_tool_choice(request.tool_choice),
                             request.parallel_tool_calls, chat_template_kwargs=request.chat_template_kwargs)
        try:
            check_tools(view)
        except SamplingParamsError as e:
            kept = [i for i, t in enumerate(request.tools or ()) if isinstance(t, dict) and t.get("type") == "function"]
            raise _flat_tool_param(_flat_choice_param(e), kept) from None
        plan = ToolPlan.of(view, enable_auto_tools=self.enable_auto_tools, tool_parser_cls=self.tool_parser_cls,
                           exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        try:
            prompt = await self._render(request, system, history + new_messages, plan.template_tools)
        except SamplingParamsError as e:
            raise _renamed(e, PARAM_NAMES) from None
        return prompt, history + new_messages, view, plan

    async def count_input_tokens(self, request: ResponsesInputTokensRequest) -> ResponsesInputTokens:
        """``POST /v1/responses/input_tokens``: the tokens of the prompt ``/v1/responses``
        would render for ``request`` (OpenAI's ``responses.input_tokens.count``). Raises
        ModelNotFoundError / ResponseNotFoundError (404), SamplingParamsError (400)."""
        self._check_model(request)
        prompt = (await self._prompt(self._with_referenced_items(request)))[0]
        return ResponsesInputTokens(input_tokens=len(prompt.token_ids))

    def _with_referenced_items(self, request: ResponsesRequest) -> ResponsesRequest:
        """The request with its ``item_reference`` input items replaced by the stored
        items they name (input_items.resolve_item_references); itself when it has none."""
        items = resolve_item_references(request.input, self.store.find_item)
        return request if items is request.input else request.model_copy(update={"input": items})

    async def _prepare(self, request: ResponsesRequest, model_name: str, request_id: Optional[str]) -> ResponsesJob:
        """Check and render the request (everything that can fail before it runs)."""
        prompt, conversation, view, plan = await self._prompt(request)
        params = request.to_sampling_params(self.default_sampling_params)
        params.structured_outputs, text_echo = self._text_format(request)
        make_parser, gen_kwargs = setup_output_parsing(self, view, plan, params, prompt.token_ids)
        response = self._skeleton(request, model_name, request_id, params, text_echo)
        job = ResponsesJob(request, response, prompt, params, OutputParsing(plan, make_parser, "max_output_tokens"), gen_kwargs,
                           conversation)
        job.input_items = stored_input_items(request.input) if response.store else []
        return job

    def _unrendered_job(self, request: ResponsesRequest, model_name: str, request_id: Optional[str]) -> ResponsesJob:
        """The job of a streamed request whose input was refused as too long before it was
        rendered: its response skeleton and conversation (for the store), no prompt, enough
        for a stream that only fails (the same in-band context overflow as a rendered one)."""
        params = request.to_sampling_params(self.default_sampling_params)
        _, text_echo = self._text_format(request)
        response = self._skeleton(request, model_name, request_id, params, text_echo)
        job = ResponsesJob(request, response, None, params, OutputParsing(None, None, "max_output_tokens"), {},
                           self._history(request) + input_messages(request.input))
        job.input_items = stored_input_items(request.input) if response.store else []
        return job

    def _new_event_log(self) -> EventLog:
        """A log for a streamed, stored response. Past MAX_EVENT_LOGS logs the oldest
        finished ones are dropped (their responses stay stored, only the events go); a log
        still being written stays, since its request (or a background stream's client) is
        following it, so the count past the bound is at most the running streams."""
        log = EventLog()
        self._event_logs.append(log)
        excess = len(self._event_logs) - MAX_EVENT_LOGS
        if excess > 0:
            kept: collections.deque = collections.deque()
            for old in self._event_logs:
                if excess > 0 and old.done:
                    old.drop()
                    excess -= 1
                else:
                    kept.append(old)
            self._event_logs = kept
        return log

    def dropped_tools(self, request: ResponsesRequest) -> list[str]:
        """Labels of the request's tools this server leaves out (``--responses-unsupported-
        tools drop``; [] with ``reject``, where they are a 400): for the warning and the
        ``x-llmserve-dropped-tools`` header."""
        return unsupported_tools(request.tools) if self.unsupported_tools == UNSUPPORTED_TOOLS_DROP else []

    async def _render(self, request: ResponsesRequest, system: list[dict[str, Any]],
                      conversation: list[dict[str, Any]], tools: Any) -> RenderedPrompt:
        """The prompt of ``system + conversation``. With ``truncation: "auto"`` (OpenAI:
        "drop items from the beginning of the conversation"; vLLM truncates the prompt),
        the oldest conversation messages are dropped until the prompt leaves room for
        ``max_output_tokens`` (else one token) in ``max_model_len``; the instructions
        and the last message always stay, so a last message that alone does not fit is
        still the engine's context-length 400."""
        kwargs = {"tools": tools, "chat_template_kwargs": request.template_kwargs()}
        if request.truncation != "auto":
            return await self.renderer.render_chat(system + conversation, **kwargs)
        budget = self.max_model_len - (request.max_output_tokens or 1)

        async def render(start: int) -> RenderedPrompt:
            # a tool result without the assistant turn that called it is no conversation
            while start < len(conversation) - 1 and conversation[start]["role"] == "tool":
                start += 1
            last = start >= len(conversation) - 1  # the cheap length guard for what must fit alone
            return await self.renderer.render_chat(system + conversation[start:], check_length=last, **kwargs)

        prompt = await render(0)
        if len(prompt.token_ids) <= budget:
            return prompt
        lo, hi = 1, len(conversation) - 1  # the fewest dropped that fit: fewer messages, fewer tokens
        best = await render(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            candidate = await render(mid)
            if len(candidate.token_ids) <= budget:
                best, hi = candidate, mid
            else:
                lo = mid + 1
        return best

    def _skeleton(self, request: ResponsesRequest, model_name: str, request_id: Optional[str],
                  params: SamplingParams, text_echo: dict[str, Any]) -> ResponsesResponse:
        """The response object before any output: the request's settings echoed. Its id
        (the store key and the engine request's base id) is the store's own random one,
        never the client's ``request_id`` (X-Request-Id), which is only logged (with
        ``--enable-log-requests``)."""
        response_id = self.store.new_response_id()
        if request_id is not None and self.log_requests:
            logger.info("X-Request-Id %r: response %s", request_id[:128], response_id)
        return ResponsesResponse(
            id=response_id, model=model_name, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning,
            store=request.store is not False, background=bool(request.background), temperature=params.temperature,
            top_p=params.top_p, text={"format": text_echo}, tool_choice=request.tool_choice or "auto",
            tools=[t for t in request.tools or [] if not isinstance(t, dict) or t.get("type") == "function"],
            truncation=request.truncation or "disabled", user=request.user,
            metadata=request.metadata, top_logprobs=request.top_logprobs)

    def _start(self, job: ResponsesJob) -> list[Any]:
        return [self.generate(job.prompt, job.params, job.response.id, job.request.priority, **job.gen_kwargs)]

    def _check_input(self, job: ResponsesJob) -> None:
        """The engine's own checks of the prompt (context length, ...), without running it
        (a background request answers before its first token)."""
        check = getattr(self.engine_client, "input_processor", None)
        if check is None:
            return
        try:
            check.process_inputs(job.response.id, job.prompt.to_engine_prompt(), job.params.clone())
        except SamplingParamsError as e:
            raise _renamed(e, PARAM_NAMES) from None

    # ---- create ------------------------------------------------------------------------
    async def create_responses(self, request: ResponsesRequest, request_id: Optional[str] = None,
                               ) -> Union[ResponsesResponse, AsyncGenerator[str, None]]:
        """Serve ``POST /v1/responses``: the response object, or (``stream``) an async
        generator of SSE strings. Raises ModelNotFoundError / ResponseNotFoundError (404),
        SamplingParamsError (400 naming the field), EngineDeadError (503)."""
        model_name = self._check_model(request)
        request = self._with_referenced_items(request)
        try:
            job = await self._prepare(request, model_name, request_id)
        except ContextLengthExceededError as e:  # a text too long to render (limits.PromptCharLimit)
            if not request.stream:
                raise
            return self._stream(self._unrendered_job(request, model_name, request_id), _raise_at_first(e), [])
        if request.background:
            try:
                self._check_input(job)
            except ContextLengthExceededError:
                if not request.stream:
                    raise
                # streamed: the task's first step fails the same way, in-band (as below)
            job.response.status = "queued"
            entry = StoredResponse(job.response.model_copy(deep=True), input_items=job.input_items)
            if request.stream:
                return self._start_background_stream(job, entry)
            self._start_task(entry, self._run_background(job, entry))
            return entry.response.model_copy(deep=True)  # as it was queued (the task changes the stored one)
        gens = self._start(job)
        try:
            firsts = await self.start_generation(gens, PARAM_NAMES)
        except ContextLengthExceededError as e:
            if not request.stream:
                raise
            # OpenAI streams a prompt that does not fit as a response that fails (created, then
            # response.failed with code "context_length_exceeded"), and that event is the only
            # place Codex CLI recognises it (a 400 before the stream it prints raw, no compaction)
            return self._stream(job, _raise_at_first(e), [])
        merged = merge_started(firsts, gens)
        if request.stream:
            return self._stream(job, merged, gens)
        try:
            final = await self._collect(merged)
        finally:
            await merged.aclose()
            await aclose_all(gens)
        return self._finish(job, final)

    @staticmethod
    async def _collect(merged: Any) -> Optional[RequestOutput]:
        final: Optional[RequestOutput] = None
        async for _, res in merged:
            if final is None:
                final = res
            else:
                final.add(res, aggregate=False)
        return final

    def _finish(self, job: ResponsesJob, final: Optional[RequestOutput]) -> ResponsesResponse:
        """The finished response of a whole output (stored when ``store``)."""
        if final is None:
            raise RuntimeError(f"request {job.response.id} ended without output")
        out = final.outputs[0]
        builder = OutputBuilder()
        # vLLM: the output_text part carries the logprobs of every generated token
        logprobs = self._logprobs(job, out.token_ids, out.logprobs) if job.want_logprobs else None
        if job.parsing.active:
            parsed = job.parsing.parse_whole(out.text, out.finish_reason)
            from llmserve.entrypoints.openai.chat_completion.protocol import DeltaMessage

            builder.add(DeltaMessage(reasoning=parsed.reasoning, content=parsed.content), logprobs)
            for i, call in enumerate(parsed.tool_calls):
                builder.tool_call(i, call.id, call.function.name, call.function.arguments)
        else:
            builder.text(out.text, logprobs)
        check_finished_normally(out.finish_reason, len(out.token_ids))
        status, details = self._status(out.finish_reason)
        builder.finish("incomplete" if status == "incomplete" else "completed")
        response = job.response.model_copy(update={
            "status": status, "incomplete_details": details, "output": builder.items,
            "usage": self._usage(job, len(out.token_ids), final.num_cached_tokens, builder.items)})
        self._store(job, response)
        return response

    def _logprobs(self, job: ResponsesJob, token_ids: Any, logprobs: Any) -> list[dict[str, Any]]:
        """The ``output_text.logprobs`` entries of ``token_ids`` (chat's builder)."""
        return response_logprobs(build_chat_logprobs(self.token_formatter, list(token_ids), logprobs or [],
                                                     job.request.top_logprobs or 0).content)

    @staticmethod
    def _status(finish_reason: Optional[str]) -> tuple[str, Optional[IncompleteDetails]]:
        """completed, or incomplete (``max_output_tokens`` when the budget ran out). A
        generation cut off ("abort") never gets here: check_finished_normally made it failed."""
        if finish_reason == "length":
            return "incomplete", IncompleteDetails(reason="max_output_tokens")
        return "completed", None

    def _usage(self, job: ResponsesJob, output_tokens: int, cached: Optional[int], items: list[Any]) -> ResponseUsage:
        reasoning = "".join(c.text for it in items if isinstance(it, ReasoningItem) for c in it.content)
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        input_tokens, cached = len(job.prompt.token_ids), int(cached or 0)
        return ResponseUsage(input_tokens=input_tokens, input_tokens_details=InputTokensDetails(
            cached_tokens=cached, cache_write_tokens=max(input_tokens - cached, 0)), output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(reasoning_tokens, output_tokens)), total_tokens=input_tokens + output_tokens)

    def _store(self, job: ResponsesJob, response: ResponsesResponse) -> None:
        if not response.store:
            return
        entry = StoredResponse(response, job.messages + output_messages(response.output),
                               input_items=job.input_items)
        try:
            old = self.store.get(response.id)
            entry.task, entry.events = old.task, old.events
        except LookupError:
            pass
        self.store.put(entry)

    # ---- streaming -----------------------------------------------------------------------
    async def _stream(self, job: ResponsesJob, merged: Optional[Any], gens: list[Any],
                      background: Optional[tuple[OutputBuilder, EventLog]] = None) -> AsyncGenerator[str, None]:
        """The SSE strings of a streamed response, each also written to its log (stored
        responses). ``background``: the builder and log of a background stream, whose
        created/queued events are already written; its generation starts here (``merged``
        None), so an error before the first token is in-band too. However it ends (done,
        failed, client gone, task cancelled), a log ends with the terminal event."""
        builder, log = background or (OutputBuilder(stream=True), None)
        response = job.response
        num_tokens, cached, finish, ended = 0, 0, None, False

        def sent(events: list[str]) -> str:
            if log is not None:
                log.extend(events)
            return "".join(events)

        if background is None and response.store:
            log = self._new_event_log()  # replayed by GET ...?stream=true
            self.store.put(StoredResponse(response.model_copy(deep=True), list(job.messages),
                                          input_items=job.input_items, events=log))
        try:
            head = response.model_dump(mode="json")  # dumped once for both opening events
            opening = [] if background else builder.event("response.created", response=head)
            yield sent(opening + builder.event("response.in_progress", response=head))
            if merged is None:
                merged = merge_started(await self.start_generation(gens, PARAM_NAMES), gens)
            logprobs, parsed = None, job.parsing.active
            async for _, res in merged:
                cached = res.num_cached_tokens
                out = res.outputs[0]
                num_tokens += len(out.token_ids)
                finish = out.finish_reason
                if job.want_logprobs and out.token_ids:
                    logprobs = (logprobs or []) + self._logprobs(job, out.token_ids, out.logprobs)
                if parsed:  # logprobs ride on the next content text (reasoning/tool tokens have none)
                    delta, _ = job.parsing.stream_delta(0, out.text, finish)
                    events = builder.add(delta, logprobs)
                    if delta is not None and delta.content:
                        logprobs = None
                elif out.text or logprobs:  # the common case: one delta event, no models built
                    events = builder.text(out.text, logprobs)
                    logprobs = None
                else:
                    continue
                if events:  # one write per engine step, as chat's one chunk
                    yield sent(events)
            check_finished_normally(finish, num_tokens)  # cut off: the except below sends response.failed
            status, details = self._status(finish)
            closing = builder.finish("incomplete" if status == "incomplete" else "completed")
            response = response.model_copy(update={
                "status": status, "incomplete_details": details, "output": builder.items,
                "usage": self._usage(job, num_tokens, cached, builder.items)})
            self._store(job, response)
            ended = True  # the closing events are logged whole before the one write that may not arrive
            yield sent(closing + builder.response_event(f"response.{status}", response))
        except Exception as e:  # the stream already started: report in-band
            status, body = error_response_from_exception(e)
            code = in_band_code(e, body)
            error = builder.event("error", code=str(code), message=body.error.message,
                                  param=body.error.param)
            failed = response.model_copy(update={
                "status": "failed", "output": builder.items,
                "error": ResponseError.of(status, body.error.message, code)})
            self._store(job, failed)
            ended = True
            yield sent(error + builder.response_event("response.failed", failed))
        finally:
            if not ended:  # the client went away (its request is aborted) or the task was cancelled
                sent(self._cancelled(job, builder, response))
            if log is not None:
                log.close()
            if merged is not None:
                await merged.aclose()
            await aclose_all(gens)

    def _cancelled(self, job: ResponsesJob, builder: OutputBuilder, response: ResponsesResponse) -> list[str]:
        """The closing events of a stream cut short: its open item done as "incomplete",
        then ``response.failed`` carrying the response with ``status: "cancelled"`` and
        the output so far (OpenAI's event types have no ``response.cancelled``; failed is
        the terminal event of an unfinished one). The stored response becomes that one,
        unless it was deleted meanwhile."""
        events = builder.stop()
        cancelled = response.model_copy(update={"status": "cancelled", "output": builder.items})
        if response.id in self.store:
            self._store(job, cancelled)
        return events + builder.response_event("response.failed", cancelled)

    # ---- background ----------------------------------------------------------------------
    def _start_task(self, entry: StoredResponse, run: Any) -> None:
        """Run ``run`` (a coroutine) as ``entry``'s background task and store ``entry``."""
        entry.task = asyncio.get_running_loop().create_task(run)
        self._background.add(entry.task)
        entry.task.add_done_callback(self._background.discard)
        self.store.put(entry)

    def _start_background_stream(self, job: ResponsesJob, entry: StoredResponse) -> AsyncGenerator[str, None]:
        """``background`` with ``stream``: write response.created and response.queued to a
        new log, start the task that writes the rest, and answer with a follower of the log
        (its disconnect stops only the follower; the response keeps running)."""
        builder, log = OutputBuilder(stream=True), self._new_event_log()
        head = job.response.model_dump(mode="json")
        log.extend(builder.event("response.created", response=head) + builder.event("response.queued", response=head))
        entry.events = log
        job.response.status = "in_progress"  # the task's events and stored objects from here on
        self._start_task(entry, self._run_background_stream(job, entry, builder, log))

        def settle(_: asyncio.Task) -> None:  # a task cancelled before its first step never ran _stream
            if not log.done:
                log.extend(self._cancelled(job, builder, job.response))
                log.close()
        entry.task.add_done_callback(settle)
        return log.follow()

    async def _run_background_stream(self, job: ResponsesJob, entry: StoredResponse, builder: OutputBuilder,
                                     log: EventLog) -> None:
        """The task of a background stream: drive :meth:`_stream` to its end (the events
        go to the log; a cancel ends it with the cancelled terminal event)."""
        entry.response.status = "in_progress"
        stream = self._stream(job, None, self._start(job), (builder, log))
        try:
            async for _ in stream:
                pass
        except asyncio.CancelledError:
            pass  # cancel / DELETE: the stream already logged and stored the cancelled response
        finally:
            await stream.aclose()

    async def _run_background(self, job: ResponsesJob, entry: StoredResponse) -> None:
        entry.response.status = "in_progress"
        gens = self._start(job)
        merged = None
        try:
            merged = merge_started(await self.start_generation(gens, PARAM_NAMES), gens)
            self._finish(job, await self._collect(merged))
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
        except Exception as e:  # nobody waits on the task: the stored response says what failed
            status, body = error_response_from_exception(e)
            entry.response.status = "failed"
            entry.response.error = ResponseError.of(status, body.error.message, in_band_code(e, body))
        finally:
            if merged is not None:
                await merged.aclose()
            await aclose_all(gens)

    # ---- retrieve / delete / cancel ----------------------------------------------------
    def retrieve_responses(self, response_id: str, stream: bool = False, starting_after: Optional[int] = None,
                           ) -> Union[ResponsesResponse, AsyncGenerator[str, None]]:
        """``GET /v1/responses/{id}``: the response object, or with ``stream`` its SSE
        events again (those after sequence number ``starting_after``; a response still
        running goes on streaming live). Only a response created with ``stream: true`` has
        events to replay (OpenAI streams back only responses that were streamed): any
        other is a 400 naming ``stream``; a resume ends with the terminal event whether the
        response still runs or not. Raises ResponseNotFoundError (404), SamplingParamsError
        (400 naming ``stream`` or ``starting_after``: see :meth:`_resume_point`)."""
        entry = self.store.get(response_id)
        if starting_after is not None and not stream:
            raise SamplingParamsError("starting_after is only used with stream=true.", "starting_after")
        if not stream:
            return entry.response
        if entry.events is None:
            raise SamplingParamsError(
                f"Response '{response_id}' was not created with stream: true, so it has no events to stream; "
                "GET it without stream=true.", "stream")
        if not entry.events.replayable:
            raise SamplingParamsError(
                f"The events of response '{response_id}' are no longer kept (this server keeps those of the last "
                f"{MAX_EVENT_LOGS} finished streamed responses); GET it without stream=true.", "stream")
        return entry.events.follow(self._resume_point(response_id, entry.events, starting_after))

    @staticmethod
    def _resume_point(response_id: str, log: EventLog, starting_after: Optional[int]) -> int:
        """The sequence number a replay starts after (-1: from the first event). Raises
        SamplingParamsError (400 naming ``starting_after``, or ``stream`` for a whole
        replay) for a negative one, one past the last event written so far (a client
        resumes from a number it received), or one before what the log still keeps."""
        if starting_after is None:
            if log.first > 0:
                raise SamplingParamsError(
                    f"The first events of response '{response_id}' are no longer kept (up to "
                    f"{MAX_LOGGED_EVENTS} events a response): resume with starting_after >= {log.first - 1}.",
                    "stream")
            return -1
        if starting_after < 0:
            raise SamplingParamsError(f"starting_after must be a sequence number >= 0, got {starting_after}.",
                                      "starting_after")
        if starting_after >= log.count:
            raise SamplingParamsError(
                f"starting_after {starting_after} is past the last event of response '{response_id}' "
                f"(sequence number {log.count - 1}).", "starting_after")
        if starting_after + 1 < log.first:
            raise SamplingParamsError(
                f"The events of response '{response_id}' before sequence number {log.first} are no longer kept "
                f"(up to {MAX_LOGGED_EVENTS} events a response): resume with starting_after >= {log.first - 1}.",
                "starting_after")
        return starting_after

    def list_input_items(self, response_id: str, after: Optional[str] = None, limit: int = 20,
                         order: str = "desc") -> ResponseItemList:
        """``GET /v1/responses/{id}/input_items`` (listing.py). Raises
        ResponseNotFoundError (404), SamplingParamsError (400 naming the query field)."""
        return page(self.store.get(response_id).input_items, after, limit, order)

    def delete_responses(self, response_id: str) -> DeletedResponse:
        """``DELETE /v1/responses/{id}`` (a running background response is cancelled).
        Raises ResponseNotFoundError (404)."""
        entry = self.store.pop(response_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        return DeletedResponse(id=response_id)

    async def cancel_responses(self, response_id: str) -> ResponsesResponse:
        """``POST /v1/responses/{id}/cancel``: abort a queued or running background
        response (``cancelled``); a finished one is returned as it is. Raises
        ResponseNotFoundError (404), SamplingParamsError (400) for a response that was not
        created with ``background: true``."""
        entry = self.store.get(response_id)
        if entry.task is None:
            raise SamplingParamsError("Only background responses can be cancelled.", "response_id")
        if not entry.task.done():
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        return self.store.get(response_id).response if response_id in self.store else entry.response

