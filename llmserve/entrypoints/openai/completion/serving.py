"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``).

The prompt may be a string, a list of strings, a list of token ids or a list of
token-id lists; each prompt is one engine request, and choice ``p * n + j`` is the j-th
completion of prompt p (OpenAI's order). ``echo`` prepends the prompt text (and, with
``logprobs``, the prompt's logprobs, the first being null). ``max_tokens`` left out is
OpenAI's legacy default 16 (or the model's smaller default budget), clamped to the room
left in the context; a given ``max_tokens`` is checked by the engine.

Every prompt is validated by the engine before any response starts: one bad prompt
fails the request with a 400 and leaves nothing running.

A non-empty ``suffix`` is fill-in-the-middle: each prompt becomes llama-server's
``/infill`` prompt for ``input_prefix`` = the prompt (``infill/fim.py``), the model's FIM
pad/repo/sep tokens end it, and ``echo`` echoes the prompt as sent; a model without FIM
tokens is a 400 naming ``suffix``.
"""
from __future__ import annotations

import time
from typing import Any, AsyncGenerator, Optional, Union

from llmserve.entrypoints.openai.common.beam import beam_search_request
from llmserve.entrypoints.openai.common.request_metrics import ResponseTimings
from llmserve.entrypoints.openai.common.protocol import CompletionLogProbs
from llmserve.entrypoints.openai.common.usage import sum_cached_tokens
from llmserve.entrypoints.openai.common.serving import (
    SSE_DONE,
    GenerateBaseServing,
    aclose_all,
    grammar_from_first_token,
    merge_started,
    sse,
    sse_error,
)
from llmserve.entrypoints.openai.completion.protocol import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from llmserve.entrypoints.openai.infill.fim import FimTokens, gguf_path_of, infill_prompt, require_fim_tokens
from llmserve.entrypoints.openai.logprobs import TextOffsets, build_completion_logprobs, build_prompt_logprobs
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams, SamplingParamsError
from llmserve.tokenizer import check_encodable, check_texts


class _Prompt:
    """One prompt of a request: text (None for token ids), ids, params, echo text."""

    __slots__ = ("rendered", "text", "ids", "params", "zero_output", "echo_text")

    def __init__(self, rendered: RenderedPrompt):
        self.rendered = rendered
        self.text = rendered.text
        self.ids = rendered.token_ids
        self.params: Optional[SamplingParams] = None
        self.zero_output = False
        self.echo_text = ""


def _prompt_items(prompt: Any) -> list[Union[str, list[int]]]:
    """The request's ``prompt`` as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if len(prompt) == 0:
        raise SamplingParamsError("prompt cannot be empty.", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class OpenAIServingCompletion(GenerateBaseServing):
    """Handler of ``/v1/completions``."""

    request_id_prefix = "cmpl"

    def default_max_tokens(self, prompt_len: int, min_tokens: int = 0) -> int:
        """The budget of a request that leaves ``max_tokens`` out: OpenAI's legacy 16,
        or the model's default budget when smaller, raised to ``min_tokens``, clamped to
        the room left in the context (a min_tokens above the room is clamped with it,
        see ``to_sampling_params``). A prompt with no room left keeps 16, so the engine
        reports it."""
        budget = min(DEFAULT_MAX_TOKENS, self.default_sampling_params.get("max_tokens") or DEFAULT_MAX_TOKENS)
        budget = max(budget, min_tokens)
        room = self.max_model_len - prompt_len
        return min(budget, room) if room > 0 else budget

    async def _prepare(self, request: CompletionRequest, openai_budget: bool = True) -> tuple[str, list[_Prompt]]:
        model_name = self._check_model(request)
        if openai_budget:  # OpenAI's / vLLM's rule; Ollama's num_predict 0 is its own
            request.check_openai_budget()
        request.check()
        check_texts([("prompt", request.prompt)])  # a lone surrogate named at its item (prompt.1)
        items = _prompt_items(request.prompt)
        fim = None
        if request.suffix:  # fill-in-the-middle: each prompt is the text before the cursor
            fim = require_fim_tokens(self.tokenizer, gguf_path_of(self.model_config), "suffix")
            rendered = await self.renderer.run_in_pool(self._fim_prompts, fim, items, request.suffix)
        else:
            rendered = await self.renderer.render_prompts(items, add_special_tokens=request.add_special_tokens,
                                                          check_length=request.truncate_prompt_tokens is None)
        prompts = [_Prompt(self.truncate(r, request)) for r in rendered]
        for item, p in zip(items, prompts):
            max_tokens = request.max_tokens
            if max_tokens is None:
                max_tokens = self.default_max_tokens(len(p.ids), request.min_tokens or 0)
            p.params = request.to_sampling_params(max_tokens, self.default_sampling_params)
            if fim is not None:  # the FIM stop tokens end the middle, as in llama.cpp
                p.params.stop_token_ids = list(p.params.stop_token_ids or []) + fim.stop_token_ids
            p.zero_output = max_tokens == 0
            if request.echo:  # what the model saw; with FIM the prompt as sent (not the layout around it)
                text = item if fim is not None and isinstance(item, str) else p.text
                p.echo_text = text if text is not None else self.tokenizer.decode(p.ids, skip_special_tokens=False)
        return model_name, prompts

    def _fim_prompts(self, fim: FimTokens, items: list[Union[str, list[int]]], suffix: str) -> list[RenderedPrompt]:
        """The FIM prompt of each item (prefix text or ids) with ``suffix``: llama-server's
        ``/infill`` layout for ``input_prefix`` = the prompt, no ``input_extra``. The
        prompts carry no text (the ids are what the model sees)."""
        for item in items:
            if isinstance(item, str):
                check_encodable(item, "prompt")
        check_encodable(suffix, "suffix")
        return [RenderedPrompt(None, infill_prompt(self.tokenizer, fim, item, suffix, (), "", self.max_model_len,
                                                   ("prompt", "suffix"))) for item in items]

    async def create_completion(self, request: CompletionRequest, request_id: Optional[str] = None,
                                openai_budget: bool = True,
                                ) -> Union[CompletionResponse, AsyncGenerator[str, None]]:
        """Serve one request: a CompletionResponse, or (``stream``) an async generator of
        SSE strings. Errors before the stream starts are raised (ModelNotFoundError,
        SamplingParamsError/ValueError from the request or the engine's InputProcessor,
        EngineDeadError). ``openai_budget`` False (Ollama's raw generate) takes
        ``max_tokens`` 0 without ``echo`` (:meth:`CompletionRequest.check_openai_budget`)."""
        model_name, prompts = await self._prepare(request, openai_budget)
        request_id = self.new_request_id(request_id)
        created = int(time.time())
        max_len = self.model_config.max_model_len
        gens = [self.generate(p.rendered, self.engine_params(p.params), f"{request_id}-{i}", request.priority,
                              response_id=request_id,
                              beam_search_params=beam_search_request(request, p.params, max_len),
                              **grammar_from_first_token(p.params))
                for i, p in enumerate(prompts)]
        firsts = await self.start_generation(gens)
        merged = merge_started(firsts, gens)
        if request.stream:
            return self._stream(request, request_id, created, model_name, prompts, merged, gens)
        try:
            finals: list[Optional[RequestOutput]] = [None] * len(prompts)
            async for i, res in merged:
                _accumulate(finals, i, res)
        finally:
            await merged.aclose()
            await aclose_all(gens)
        return self._build_response(request, request_id, created, model_name, prompts, finals)

    # ---- non-streaming -----------------------------------------------------------
    def _build_response(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                        prompts: list[_Prompt], finals: list[Optional[RequestOutput]]) -> CompletionResponse:
        choices = []
        n = request.n or 1
        prompt_tokens = completion_tokens = 0
        for i, (p, res) in enumerate(zip(prompts, finals)):
            prompt_tokens += len(p.ids)
            if res is None:
                raise RuntimeError(f"request {request_id}-{i} ended without output")
            for out in sorted(res.outputs, key=lambda o: o.index):
                token_ids = [] if p.zero_output else list(out.token_ids)
                text = "" if p.zero_output else out.text
                completion_tokens += len(token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(request, p, res.prompt_logprobs, token_ids,
                                              [] if p.zero_output else (out.logprobs or []))
                prompt_logprobs = None
                if request.prompt_logprobs is not None:
                    prompt_logprobs = build_prompt_logprobs(self.formatter(request), p.ids, res.prompt_logprobs,
                                                            request.prompt_logprobs)
                choices.append(CompletionResponseChoice(
                    index=i * n + out.index,
                    text=p.echo_text + text,
                    logprobs=logprobs,
                    finish_reason="length" if p.zero_output else out.finish_reason,
                    stop_reason=None if p.zero_output else out.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=list(p.ids) if request.return_token_ids else None,
                    token_ids=token_ids if request.return_token_ids else None,
                ))
        timing = ResponseTimings(request, self.enable_per_request_metrics, single=len(choices) == 1)
        return CompletionResponse(
            id=request_id, created=created, model=model_name, choices=choices,
            usage=self.usage_options.usage(prompt_tokens, completion_tokens, sum_cached_tokens(finals)),
            **(timing.fields(finals[0], prompt_tokens, completion_tokens) if timing.active else {}))

    def _logprobs(self, request: CompletionRequest, p: _Prompt, prompt_logprobs: Optional[list],
                  token_ids: list[int], sample_logprobs: list, echo_prefix: bool = True,
                  offsets: Optional[TextOffsets] = None) -> CompletionLogProbs:
        """One choice's logprobs: the echoed prompt's (when ``echo_prefix``) then the
        generated tokens'; ``offsets`` carries a streamed choice's text offsets across chunks."""
        ids: list[int] = []
        tops: list[Any] = []
        if request.echo and echo_prefix:
            ids.extend(p.ids)
            pl = list(prompt_logprobs or [])
            tops.extend(pl + [None] * (len(p.ids) - len(pl)))
        ids.extend(token_ids)
        tops.extend(list(sample_logprobs) + [{}] * (len(token_ids) - len(sample_logprobs)))
        return build_completion_logprobs(self.formatter(request), ids, tops, request.logprobs or 0,
                                         offsets if offsets is not None else TextOffsets(self.text_formatter))

    # ---- streaming -------------------------------------------------------------
    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                      prompts: list[_Prompt], merged: AsyncGenerator[tuple[int, RequestOutput], None],
                      gens: list[Any]) -> AsyncGenerator[str, None]:
        n = request.n or 1
        opts = request.stream_options
        include_usage, continuous = self.usage_options.stream_usage(opts)
        num_cached = [0] * len(prompts)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        num_tokens = [0] * (len(prompts) * n)
        echoed = [False] * (len(prompts) * n)
        sent_ids = [False] * (len(prompts) * n)
        # each choice's logprobs.text_offset, kept across chunks (a character may span two)
        offsets = [TextOffsets(self.text_formatter) for _ in range(len(prompts) * n)]
        prompt_lps: list[Optional[list]] = [None] * len(prompts)
        timing = ResponseTimings(request, self.enable_per_request_metrics, single=len(num_tokens) == 1)
        try:
            async for i, res in merged:
                p = prompts[i]
                num_cached[i] = res.num_cached_tokens
                if res.prompt_logprobs is not None:
                    prompt_lps[i] = res.prompt_logprobs
                for out in res.outputs:
                    idx = i * n + out.index
                    token_ids = [] if p.zero_output else list(out.token_ids)
                    text = "" if p.zero_output else out.text
                    finish = out.finish_reason
                    if p.zero_output and finish is not None:
                        finish = "length"
                    stop_reason = None if p.zero_output else out.stop_reason
                    num_tokens[idx] += len(token_ids)
                    echo_now = request.echo and not echoed[idx]
                    if echo_now:
                        echoed[idx] = True
                        text = p.echo_text + text
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._logprobs(request, p, prompt_lps[i], token_ids,
                                                  [] if p.zero_output else (out.logprobs or []),
                                                  echo_prefix=echo_now, offsets=offsets[idx])
                    if (not text and finish is None and not (logprobs and logprobs.tokens)
                            and not (request.return_token_ids and token_ids)):
                        continue
                    usage = None
                    if continuous:
                        usage = self.usage_options.usage(prompt_tokens, sum(num_tokens), sum(num_cached))
                    ids_now = {}
                    if request.return_token_ids:  # vLLM: the prompt's ids in the choice's first chunk
                        ids_now = {"token_ids": token_ids, "prompt_token_ids": None if sent_ids[idx] else p.ids}
                        sent_ids[idx] = True
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model_name, usage=usage,
                        choices=[CompletionResponseStreamChoice(index=idx, text=text, logprobs=logprobs,
                                                                finish_reason=finish, stop_reason=stop_reason,
                                                                **ids_now)])
                    if finish is not None and timing.active:
                        chunk = chunk.model_copy(update=timing.fields(res, len(p.ids), num_tokens[idx]))
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[],
                    usage=self.usage_options.usage(prompt_tokens, sum(num_tokens), sum(num_cached)))
                yield sse(final.model_dump_json())
        except Exception as e:  # the stream already started: report in-band, as vLLM does
            yield sse_error(e)
        finally:
            await merged.aclose()
            await aclose_all(gens)
        yield SSE_DONE


def _accumulate(finals: list[Optional[RequestOutput]], i: int, res: RequestOutput) -> None:
    """Merge a FINAL_ONLY output of prompt i into ``finals`` (n>1 may arrive in parts)."""
    if finals[i] is None:
        finals[i] = res
    else:
        finals[i].add(res, aggregate=False)
