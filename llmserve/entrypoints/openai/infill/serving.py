"""llama-server's native generation routes over the completion handler: ``POST /infill``
(fill-in-the-middle) and ``POST /completion``.

``/infill``'s prompt is built from the model's FIM tokens as llama-server builds it
(fim.py); a model without FIM tokens is a 400 naming ``input_suffix``. ``/completion``
tokenizes ``prompt`` as llama-server does (``tokenize_mixed`` with ``add_special`` and
``parse_special``: the tokenizer's BOS when the prompt starts with text, and special-token
text such as ``<|im_start|>`` read as those tokens). Either then runs on the same engine
(``OpenAIServingCompletion``'s ``generate``, so X-Request-Timeout, logging and
cancellation apply); a budget beyond the room the prompt leaves is cut to it (llama-server
stops at the context's end); an engine rejection (a prompt that fills the context, an empty
prompt, a token id outside the vocabulary) is a 400 before anything is sent.
"""
from __future__ import annotations

import math
from typing import Any, AsyncGenerator, Optional, Union

from llmserve.entrypoints.openai.common.errors import error_response_from_exception
from llmserve.entrypoints.openai.common.request_metrics import llama_timings
from llmserve.entrypoints.openai.common.serving import aclose_all, grammar_from_first_token, merge_started, renamed_param, sse
from llmserve.entrypoints.openai.infill.fim import gguf_path_of, infill_layout, require_fim_tokens
from llmserve.entrypoints.openai.infill.protocol import InfillRequest, InfillResponse, LlamaCompletionRequest, \
    LlamaSamplingRequest, llama_settings
from llmserve.entrypoints.openai.logprobs import finite_logprob
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.sampling_params import ContextLengthExceededError
from llmserve.tokenizer import check_encodable


def _stop_type(finish_reason: Optional[str], stop_reason: Any) -> Optional[str]:
    """llama-server's ``stop_type``: "word" (a stop string), "limit" (the budget), "eos"."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return "limit"
    return "word" if isinstance(stop_reason, str) else "eos"


def _check_text(request: InfillRequest) -> None:
    for name in ("input_prefix", "input_suffix"):
        value = getattr(request, name)
        for piece in [value] if isinstance(value, str) else value:
            if isinstance(piece, str):
                check_encodable(piece, name)
    for chunk in request.input_extra:
        check_encodable(chunk.text, "input_extra")
        check_encodable(chunk.filename, "input_extra")
    check_encodable(request.prompt, "prompt")


async def _prompt(handler: Any, request: InfillRequest) -> tuple[RenderedPrompt, list[int], str]:
    """The infill prompt, the FIM stop ids, and the field a too-long prompt is blamed on."""
    fim = require_fim_tokens(handler.tokenizer, gguf_path_of(handler.model_config), "input_suffix")
    _check_text(request)
    layout = await handler.renderer.run_in_pool(
        infill_layout, handler.tokenizer, fim, request.input_prefix, request.input_suffix, request.extra_chunks(),
        request.prompt, handler.max_model_len)
    return RenderedPrompt(None, layout.token_ids), fim.stop_token_ids, layout.largest_field()


async def create_infill(handler: Any, request: InfillRequest, request_id: Optional[str] = None,
                        ) -> Union[InfillResponse, AsyncGenerator[str, None]]:
    """Serve one ``/infill`` request on ``handler`` (an OpenAIServingCompletion): the
    InfillResponse, or (``stream``) an async generator of ``data:`` events. Raises
    SamplingParamsError (400 naming the field), ModelNotFoundError (404), EngineDeadError.
    A prompt too long for the context names the field holding most of its tokens
    (``input_prefix``, ``input_suffix``, ``input_extra`` or ``prompt``): the engine's 400
    names its own ``prompt``, which on /infill is only the text after the prefix."""
    model_name = handler._check_model(request)
    prompt, stop_ids, largest = await _prompt(handler, request)
    try:
        result = await _run(handler, request, model_name, [prompt], stop_ids, request_id)
    except ContextLengthExceededError as e:
        raise renamed_param(e, {"prompt": largest}) from None
    return result[0] if isinstance(result, list) else result


def _completion_ids(tokenizer: Any, prompt: Union[str, list[Union[int, str]]]) -> list[int]:
    """llama.cpp's ``tokenize_mixed(prompt, add_special=true, parse_special=true)``: text
    pieces with special-token text parsed, special tokens added to a leading text piece only."""
    pieces = [prompt] if isinstance(prompt, str) else prompt
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids.extend(tokenizer.encode(piece, add_special_tokens=i == 0))
        else:
            ids.append(piece)
    return ids


async def create_llama_completion(handler: Any, request: LlamaCompletionRequest, request_id: Optional[str] = None,
                                  ) -> Union[InfillResponse, list[InfillResponse], AsyncGenerator[str, None]]:
    """Serve one ``/completion`` request on ``handler`` (an OpenAIServingCompletion): an
    InfillResponse, a list of them (several prompts, in their order; one prompt's answer
    is an object, as llama-server sends it), or (``stream``) an
    async generator of ``data:`` events (each with its prompt's ``index``). Raises
    SamplingParamsError (400 naming the field), ModelNotFoundError (404), EngineDeadError."""
    model_name = handler._check_model(request)
    prompts = request.prompts()
    for prompt in prompts:
        for piece in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(piece, str):
                check_encodable(piece, "prompt")
    rendered = [RenderedPrompt(None, await handler.renderer.run_in_pool(_completion_ids, handler.tokenizer, p))
                for p in prompts]
    result = await _run(handler, request, model_name, rendered, [], request_id)
    return result[0] if isinstance(result, list) and len(result) == 1 else result


def _fitted(handler: Any, params: Any, prompt: RenderedPrompt) -> Any:
    """``params`` with ``max_tokens`` cut to the room ``prompt`` leaves in the context, as
    llama-server stops a prediction at the context's end rather than refusing it (the
    Anthropic and Ollama routes clamp their budgets the same way, context_room.py; here the
    prompt is already tokens). A prompt that leaves no room is left to the engine's 400
    naming ``prompt``."""
    room = handler.max_model_len - len(prompt.token_ids)
    if params.max_tokens is None or room < 1 or params.max_tokens <= room:
        return params
    fitted = params.clone()
    fitted.max_tokens = room
    return fitted


async def _sampling_params(handler: Any, request: LlamaSamplingRequest, stop_ids: list[int]) -> Any:
    """``request``'s SamplingParams. With a ``logit_bias`` (whose text keys are tokenized)
    they are made in the renderer's pool, as every other tokenization of the request is,
    so a long text key does not hold the event loop."""
    def encode(text: str) -> list[int]:
        return handler.tokenizer.encode(text, add_special_tokens=False)

    if request.logit_bias is None:
        return request.to_sampling_params(handler.default_sampling_params, stop_ids, encode)
    return await handler.renderer.run_in_pool(request.to_sampling_params, handler.default_sampling_params,
                                              stop_ids, encode)


async def _run(handler: Any, request: LlamaSamplingRequest, model_name: str, prompts: list[RenderedPrompt],
               stop_ids: list[int], request_id: Optional[str],
               ) -> Union[list[InfillResponse], AsyncGenerator[str, None]]:
    """Run ``prompts`` together: every answer (in the prompts' order), or the stream."""
    params = await _sampling_params(handler, request, stop_ids)
    base = handler.new_request_id(request_id)
    gens = [handler.generate(p, _fitted(handler, params, p), base if len(prompts) == 1 else f"{base}-{i}",
                             **grammar_from_first_token(params))
            for i, p in enumerate(prompts)]
    # a schema or grammar the engine cannot compile: a 400 naming the field it came from
    names = {"structured_outputs": "json_schema" if request.json_schema is not None else "grammar",
             "logprobs": "n_probs"}
    merged = merge_started(await handler.start_generation(gens, names), gens)
    if request.stream:
        return _stream(handler, request, model_name, prompts, merged, gens, params)
    finals: list[Any] = [None] * len(prompts)
    try:
        async for i, res in merged:
            finals[i] = res
    finally:
        await merged.aclose()
        await aclose_all(gens)
    answers = []
    for i, (prompt, final) in enumerate(zip(prompts, finals)):
        out = final.outputs[0]
        answers.append(InfillResponse(
            index=i, content=out.text, tokens=list(out.token_ids) if request.return_tokens else [], stop=True,
            model=model_name, tokens_predicted=len(out.token_ids), tokens_evaluated=len(prompt.token_ids),
            tokens_cached=final.num_cached_tokens or 0, prompt=_prompt_text(handler, prompt),
            stop_type=_stop_type(out.finish_reason, out.stop_reason),
            stopping_word=out.stop_reason if isinstance(out.stop_reason, str) else "",
            timings=_timings(final, len(prompt.token_ids), len(out.token_ids)),
            completion_probabilities=_without_stop_word(handler, _probabilities(handler, request, out), out),
            generation_settings=_settings(handler, request, params, model_name)))
    return answers


def _piece(raw: bytes) -> str:
    """A token's bytes as text: an incomplete UTF-8 sequence at the end (the start of a
    character the next token finishes) left out, as llama-server writes ``token``."""
    for cut in range(len(raw), max(len(raw) - 4, -1), -1):
        try:
            return raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", errors="replace")


def _probabilities(handler: Any, request: LlamaSamplingRequest, out: Any) -> Optional[list[dict[str, Any]]]:
    """llama-server's ``completion_probabilities`` of ``out``'s tokens (None without
    ``n_probs``): per token its ``id``, ``token``, ``bytes`` and ``logprob`` with its
    ``n_probs`` likeliest alternatives in ``top_logprobs``, or ``prob`` and ``top_probs``
    with ``post_sampling_probs``. The numbers are the engine's (raw) logprobs; a -inf one
    is written -9999 (probability 0)."""
    if not request.n_probs:
        return None
    fmt, post = handler.token_formatter, request.post_sampling_probs

    def entry(tid: int, logprob: Optional[float]) -> dict[str, Any]:
        raw = fmt.raw_bytes(tid)
        value = finite_logprob(logprob)
        return {"id": tid, "token": _piece(bytes(raw)), "bytes": raw,
                **({"prob": math.exp(value)} if post else {"logprob": value})}

    result = []
    steps = list(out.logprobs or [])
    for i, tid in enumerate(out.token_ids):
        step = steps[i] if i < len(steps) else {}
        chosen = step.get(tid)
        ranked = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                      -finite_logprob(kv[1].logprob)))
        tops = [entry(t, lp.logprob) for t, lp in ranked[:request.n_probs]]
        result.append({**entry(tid, chosen.logprob if chosen is not None else None),
                       "top_probs" if post else "top_logprobs": tops})
    return result


def _without_stop_word(handler: Any, probs: Optional[list[dict[str, Any]]], out: Any,
                       ) -> Optional[list[dict[str, Any]]]:
    """A whole answer's ``completion_probabilities`` without the stop word's tokens, as
    llama-server leaves them out (as many entries as the word has tokens alone, the text
    already leaving it out); a stream's events keep theirs, as llama-server's do."""
    if not probs or not isinstance(out.stop_reason, str) or out.finish_reason != "stop":
        return probs
    n = len(handler.tokenizer.encode(out.stop_reason, add_special_tokens=False))
    return probs[:max(len(probs) - n, 0)]


def _settings(handler: Any, request: LlamaSamplingRequest, params: Any, model_name: str) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of a finished answer: the sampling settings
    the request ran with (its fields, else the model's defaults, else llama-server's),
    under llama-server's names, with ``n_ctx`` and ``model``."""
    return {"n_ctx": handler.max_model_len, "model": model_name, **llama_settings(params), "stream": request.stream,
            "post_sampling_probs": request.post_sampling_probs}


def _timings(res: Any, num_prompt: int, num_generated: int) -> Optional[dict[str, Any]]:
    """llama-server's ``timings`` of a finished generation (prompt and predicted tokens,
    their milliseconds and rates), from its RequestOutput's metrics."""
    return llama_timings(getattr(res, "metrics", None), num_prompt, int(res.num_cached_tokens or 0), num_generated)


def _prompt_text(handler: Any, prompt: RenderedPrompt) -> str:
    return handler.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


async def _stream(handler: Any, request: LlamaSamplingRequest, model_name: str, prompts: list[RenderedPrompt],
                  merged: Any, gens: list[Any], params: Any) -> AsyncGenerator[str, None]:
    predicted = [0] * len(prompts)
    try:
        async for i, res in merged:
            out = res.outputs[0]
            predicted[i] += len(out.token_ids)
            done = out.finish_reason is not None
            chunk = InfillResponse(  # a stream's events always carry their token ids (llama-server)
                index=i, content=out.text, tokens=list(out.token_ids), stop=done,
                model=model_name, tokens_predicted=predicted[i], tokens_evaluated=len(prompts[i].token_ids),
                tokens_cached=res.num_cached_tokens or 0, stop_type=_stop_type(out.finish_reason, out.stop_reason),
                stopping_word=out.stop_reason if isinstance(out.stop_reason, str) else "",
                prompt=_prompt_text(handler, prompts[i]) if done else None,
                timings=_timings(res, len(prompts[i].token_ids), predicted[i]) if done else None,
                completion_probabilities=_probabilities(handler, request, out) if out.token_ids else None,
                generation_settings=_settings(handler, request, params, model_name) if done else None)
            yield sse(chunk.model_dump_json(exclude_none=True))
    except Exception as e:  # the stream already started: llama-server's in-band error event
        _, body = error_response_from_exception(e)
        yield sse(body.model_dump_json())
    finally:
        await merged.aclose()
        await aclose_all(gens)
