"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``).

Messages go through the renderer (chat template, ``add_generation_prompt`` opens the
assistant turn; ``continue_final_message`` leaves the last assistant message open
instead; tokenized without adding special tokens, the template wrote them).
``max_completion_tokens`` / ``max_tokens`` left out are left to the engine, which gives
the rest of the context (capped by the model's default budget).

Streaming follows OpenAI: the first chunk of each choice carries ``delta.role =
"assistant"``, every choice object has a ``finish_reason`` key (null until that choice's
last chunk), ``stream_options.include_usage`` adds a last chunk with ``choices: []`` and
the usage, and the stream ends with ``data: [DONE]``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncGenerator, Callable, Optional, Union

from llmserve.entrypoints.openai.chat_completion.openai_fields import template_kwargs
from llmserve.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from llmserve.entrypoints.openai.common.serving import (
    SSE_DONE,
    GenerateBaseServing,
    aclose_all,
    merge_started,
    sse,
    sse_error,
)
from llmserve.entrypoints.chat_utils import content_to_text
from llmserve.entrypoints.openai.common.beam import beam_search_request
from llmserve.entrypoints.openai.common.request_metrics import ResponseTimings
from llmserve.entrypoints.openai.common.usage import UsageOptions
from llmserve.entrypoints.openai.logprobs import build_chat_logprobs, build_prompt_logprobs
from llmserve.entrypoints.openai.chat_completion.tool_calling import (
    ChoiceOutputParser,
    OutputParsing,
    ToolPlan,
    setup_output_parsing,
)
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import check_texts


class OpenAIServingChat(GenerateBaseServing):
    """Handler of ``/v1/chat/completions``. The renderer holds the server's
    ``--chat-template``; a request's ``chat_template`` field overrides it."""

    request_id_prefix = "chatcmpl"
    response_role = "assistant"  # --response-role
    # set by configure_tool_calling from the flags (vLLM's names)
    enable_auto_tools = False  # --enable-auto-tool-choice
    tool_parser_cls: Any = None  # --tool-call-parser
    reasoning_parser_cls: Any = None  # --reasoning-parser
    exclude_tools_when_tool_choice_none = False  # --exclude-tools-when-tool-choice-none

    def response_role_of(self, request: ChatCompletionRequest) -> str:
        """The role of the reply (vLLM's ``get_chat_request_role``): ``--response-role``
        when the template opened a new turn, else the role of the continued message."""
        if request.add_generation_prompt or not request.messages:
            return self.response_role
        last = request.messages[-1]
        return (last.get("role") if isinstance(last, dict) else getattr(last, "role", None)) or self.response_role

    async def render(self, request: ChatCompletionRequest, tools: Optional[list[dict[str, Any]]] = None,
                     ) -> RenderedPrompt:
        """The request's messages (and ``tools``, for the template) as a prompt (text and
        token ids), rendered in the renderer's pool. Raises SamplingParamsError (param
        ``messages`` or the flag); a lone surrogate is named at its own field and
        position (``messages.0.content``), not at the rendered prompt's."""
        check_texts([("messages", request.messages), ("tools", request.tools)])
        return await self.renderer.render_chat(
            request.messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            chat_template_kwargs=template_kwargs(request), add_special_tokens=request.add_special_tokens,
            tools=tools, check_length=request.truncate_prompt_tokens is None)  # truncation may take a longer prompt

    def output_parsing(self, request: ChatCompletionRequest, plan: ToolPlan, params: SamplingParams,
                       prompt_ids: list[int]) -> tuple[Optional[Callable[[], ChoiceOutputParser]], dict[str, Any]]:
        """Set up tool-call and reasoning parsing of the output (vLLM's chat paths).

        Puts the forced schema of ``required``/named tool choices on ``params``
        (structured outputs) and keeps special tokens for parsers whose markers are
        special tokens. Returns a factory of one ChoiceOutputParser per choice (None
        when nothing is parsed) and the ``reasoning_ended`` /
        ``reasoning_parser_kwargs`` arguments of ``AsyncLLM.generate``.
        """
        return setup_output_parsing(self, request, plan, params, prompt_ids)

    async def create_chat_completion(self, request: ChatCompletionRequest, request_id: Optional[str] = None,
                                     *, wire: bool = True,
                                     ) -> Union[ChatCompletionResponse, AsyncGenerator[Any, None]]:
        """Serve one request: a ChatCompletionResponse, or (``stream``) an async generator
        of SSE strings. Errors before the stream starts are raised (ModelNotFoundError,
        SamplingParamsError/ValueError from the request, the renderer or the engine's
        InputProcessor, EngineDeadError).

        wire=False is the seam the other front doors (Anthropic Messages, Ollama) build on:
        a stream is then an async generator of ChatCompletionStreamResponse objects (the
        common deltas: content, reasoning, tool-call fragments, finish reasons, and a last
        object with ``choices == []`` and the usage), and an error after the start is
        raised from it instead of written in-band; each caller maps them to its own wire."""
        model_name = self._check_model(request)
        if wire:  # first: its bound (>= 1) is the one to name, not check()'s shared >= 0
            request.check_openai_budget()
        request.check()
        plan = ToolPlan.of(request, enable_auto_tools=self.enable_auto_tools, tool_parser_cls=self.tool_parser_cls,
                           exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none)
        prompt = self.truncate(await self.render(request, plan.template_tools), request)
        requested = request.requested_max_tokens()
        params = request.to_sampling_params(requested, self.default_sampling_params)
        make_parser, gen_kwargs = self.output_parsing(request, plan, params, prompt.token_ids)
        zero_output = requested == 0
        request_id = self.new_request_id(request_id)
        created = int(time.time())
        beam = beam_search_request(request, params, self.model_config.max_model_len)
        if beam is not None:
            gen_kwargs["beam_search_params"] = beam
        gens = [self.generate(prompt, self.engine_params(params), request_id, request.priority, **gen_kwargs)]
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        names = {"prompt": "messages", "max_tokens": max_param}
        if plan.schema is not None:  # a grammar the engine cannot build comes from the tools
            names["structured_outputs"] = "tools"
        firsts = await self.start_generation(gens, names)
        merged = merge_started(firsts, gens)
        parsing = OutputParsing(plan, make_parser, max_param, cut_call_fails=wire)
        # the other front doors always report the prefix-cache hits (Anthropic's cache_read_input_tokens)
        usage_options = self.usage_options if wire else dataclasses.replace(self.usage_options,
                                                                            enable_prompt_tokens_details=True)
        if request.stream:
            chunks = self.stream_chunks(request, request_id, created, model_name, prompt.token_ids, zero_output,
                                        merged, gens, parsing, always_usage=not wire, usage_options=usage_options)
            return self._sse(chunks) if wire else chunks
        final: Optional[RequestOutput] = None
        try:
            async for _, res in merged:
                if final is None:
                    final = res
                else:
                    final.add(res, aggregate=False)
        finally:
            await merged.aclose()
            await aclose_all(gens)
        if final is None:
            raise RuntimeError(f"request {request_id} ended without output")
        return self._build_response(request, request_id, created, model_name, prompt.token_ids, zero_output, final,
                                    parsing, usage_options)

    # ---- non-streaming -------------------------------------------------------------
    @staticmethod
    def echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the content of the last message when it is the
        assistant's (the one ``continue_final_message`` continues), prepended to the
        answer; "" otherwise."""
        last = request.messages[-1]
        if not request.echo or last.role != "assistant":
            return ""
        return content_to_text(last.content, len(request.messages) - 1) or ""

    def _build_response(self, request: ChatCompletionRequest, request_id: str, created: int,
                        model_name: str, prompt_ids: list[int], zero_output: bool,
                        final: RequestOutput, parsing: Optional["OutputParsing"] = None,
                        usage_options: Optional[UsageOptions] = None) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        fmt = self.formatter(request)
        echo = self.echo_text(request)
        for out in sorted(final.outputs, key=lambda o: o.index):
            token_ids = [] if zero_output else list(out.token_ids)
            completion_tokens += len(token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = build_chat_logprobs(fmt, token_ids, [] if zero_output else (out.logprobs or []),
                                               request.top_logprobs or 0)
            message = ChatMessage(role=self.response_role_of(request),
                                  content=echo + ("" if zero_output else out.text))
            finish_reason = "length" if zero_output else out.finish_reason
            if parsing is not None and parsing.active and not zero_output:
                parsed = parsing.parse_whole(out.text, out.finish_reason)
                content = echo + (parsed.content or "")
                message = ChatMessage(role=message.role, content=content or None, reasoning=parsed.reasoning,
                                      tool_calls=parsed.tool_calls)
                finish_reason = parsing.finish_reason(finish_reason, bool(parsed.tool_calls))
            choices.append(ChatCompletionResponseChoice(
                index=out.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=None if zero_output else out.stop_reason,
                token_ids=token_ids if request.return_token_ids else None,
            ))
        prompt_tokens = len(prompt_ids)
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = build_prompt_logprobs(fmt, prompt_ids, final.prompt_logprobs, request.prompt_logprobs)
        timing = ResponseTimings(request, self.enable_per_request_metrics, single=len(final.outputs) == 1)
        return ChatCompletionResponse(
            id=request_id, created=created, model=model_name, choices=choices,
            usage=(usage_options or self.usage_options).usage(prompt_tokens, completion_tokens,
                                                              final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=list(prompt_ids) if request.return_token_ids else None,
            **timing.fields(final, prompt_tokens, completion_tokens))

    # ---- streaming -------------------------------------------------------------------
    @staticmethod
    async def _sse(chunks: AsyncGenerator[ChatCompletionStreamResponse, None]) -> AsyncGenerator[str, None]:
        """The chunks as SSE events; an error after the start is reported in-band (as vLLM
        does), then ``data: [DONE]``."""
        try:
            async for resp in chunks:
                yield sse(resp.model_dump_json())
        except Exception as e:  # the stream already started
            yield sse_error(e)
        finally:
            await chunks.aclose()
        yield SSE_DONE

    async def stream_chunks(self, request: ChatCompletionRequest, request_id: str, created: int, model_name: str,
                            prompt_ids: list[int], zero_output: bool,
                            merged: AsyncGenerator[tuple[int, RequestOutput], None], gens: list[Any],
                            parsing: Optional["OutputParsing"] = None, always_usage: bool = False,
                            usage_options: Optional[UsageOptions] = None,
                            ) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
        """The stream's chunks as objects (see ``create_chat_completion(wire=False)``).
        always_usage: end with the usage chunk whatever ``stream_options`` says (the other
        front doors report usage at the end of every stream). usage_options: default the
        handler's (the flags)."""
        n = request.n or 1
        prompt_tokens = len(prompt_ids)
        fmt = self.formatter(request)
        echo = self.echo_text(request)
        return_ids = bool(request.return_token_ids)
        opts = request.stream_options
        usage_options = usage_options or self.usage_options
        include_usage, continuous = usage_options.stream_usage(opts)
        num_tokens = [0] * n
        num_cached = [0]
        timing = ResponseTimings(request, self.enable_per_request_metrics, single=n == 1)
        last: list[Optional[RequestOutput]] = [None]

        def usage_now() -> Any:
            return usage_options.usage(prompt_tokens, sum(num_tokens), num_cached[0])

        def chunk(choice: ChatCompletionResponseStreamChoice, first: bool = False) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                choices=[choice], usage=usage_now() if continuous else None,
                                                prompt_token_ids=list(prompt_ids) if first and return_ids else None)

        try:
            for i in range(n):  # vLLM: the prompt's ids ride on the first chunk only
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(role=self.response_role_of(request), content=""),
                    finish_reason=None), first=i == 0)
            if echo:
                for i in range(n):
                    yield chunk(ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo)))
            async for _, res in merged:
                num_cached[0] = res.num_cached_tokens
                last[0] = res
                for out in res.outputs:
                    token_ids = [] if zero_output else out.token_ids
                    text = "" if zero_output else out.text
                    finish = out.finish_reason
                    if zero_output and finish is not None:
                        finish = "length"
                    num_tokens[out.index] += len(token_ids)
                    logprobs = None
                    if request.logprobs and token_ids:
                        logprobs = build_chat_logprobs(fmt, token_ids, out.logprobs or [], request.top_logprobs or 0)
                    delta = DeltaMessage(content=text)
                    if parsing is not None and parsing.active and not zero_output:
                        delta, finish = parsing.stream_delta(out.index, text, finish)
                        if delta is None and finish is None and logprobs is None and not (return_ids and token_ids):
                            continue
                        delta = delta or DeltaMessage()
                    elif not text and finish is None and logprobs is None and not (return_ids and token_ids):
                        continue
                    resp = chunk(ChatCompletionResponseStreamChoice(
                        index=out.index, delta=delta, logprobs=logprobs,
                        finish_reason=finish, stop_reason=None if zero_output else out.stop_reason,
                        token_ids=list(token_ids) if return_ids else None))
                    if finish is not None and timing.active:
                        resp = resp.model_copy(update=timing.fields(res, prompt_tokens, num_tokens[out.index]))
                    yield resp
            if include_usage or always_usage:
                yield ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                   choices=[], usage=usage_now(),
                                                   **timing.fields(last[0], prompt_tokens, sum(num_tokens)))
        finally:
            await merged.aclose()
            await aclose_all(gens)
