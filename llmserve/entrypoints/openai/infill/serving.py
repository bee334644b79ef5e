"""``POST /infill`` (llama-server's fill-in-the-middle), over the completion handler.

The prompt is built from the model's FIM tokens as llama-server builds it (fim.py); the
request then runs as one completion on the same engine (``OpenAIServingCompletion``'s
``generate``, so X-Request-Timeout, logging and cancellation apply). A model without FIM
tokens is a 400 naming ``input_suffix``; an engine rejection (context length) is a 400
before anything is sent.
"""
from __future__ import annotations

from typing import Any, AsyncGenerator, Optional, Union

from llmserve.entrypoints.openai.common.errors import error_response_from_exception
from llmserve.entrypoints.openai.common.serving import aclose_all, merge_started, sse
from llmserve.entrypoints.openai.infill.fim import gguf_path_of, infill_prompt, require_fim_tokens
from llmserve.entrypoints.openai.infill.protocol import InfillRequest, InfillResponse
from llmserve.entrypoints.renderer import RenderedPrompt
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


async def _prompt(handler: Any, request: InfillRequest) -> tuple[RenderedPrompt, list[int]]:
    fim = require_fim_tokens(handler.tokenizer, gguf_path_of(handler.model_config), "input_suffix")
    _check_text(request)
    ids = await handler.renderer.run_in_pool(
        infill_prompt, handler.tokenizer, fim, request.input_prefix, request.input_suffix, request.extra_chunks(),
        request.prompt, handler.max_model_len)
    return RenderedPrompt(None, ids), fim.stop_token_ids


async def create_infill(handler: Any, request: InfillRequest, request_id: Optional[str] = None,
                        ) -> Union[InfillResponse, AsyncGenerator[str, None]]:
    """Serve one ``/infill`` request on ``handler`` (an OpenAIServingCompletion): the
    InfillResponse, or (``stream``) an async generator of ``data:`` events. Raises
    SamplingParamsError (400 naming the field), ModelNotFoundError (404), EngineDeadError."""
    model_name = handler._check_model(request)
    prompt, stop_ids = await _prompt(handler, request)
    params = request.to_sampling_params(handler.default_sampling_params, stop_ids)
    gens = [handler.generate(prompt, params, handler.new_request_id(request_id))]
    merged = merge_started(await handler.start_generation(gens), gens)
    if request.stream:
        return _stream(handler, request, model_name, prompt, merged, gens)
    try:
        final = None
        async for _, res in merged:
            final = res
    finally:
        await merged.aclose()
        await aclose_all(gens)
    out = final.outputs[0]
    return InfillResponse(
        content=out.text, tokens=list(out.token_ids) if request.return_tokens else [], stop=True, model=model_name,
        tokens_predicted=len(out.token_ids), tokens_evaluated=len(prompt.token_ids),
        tokens_cached=final.num_cached_tokens or 0, prompt=_prompt_text(handler, prompt),
        stop_type=_stop_type(out.finish_reason, out.stop_reason),
        stopping_word=out.stop_reason if isinstance(out.stop_reason, str) else "")


def _prompt_text(handler: Any, prompt: RenderedPrompt) -> str:
    return handler.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


async def _stream(handler: Any, request: InfillRequest, model_name: str, prompt: RenderedPrompt, merged: Any,
                  gens: list[Any]) -> AsyncGenerator[str, None]:
    predicted = 0
    try:
        async for _, res in merged:
            out = res.outputs[0]
            predicted += len(out.token_ids)
            done = out.finish_reason is not None
            chunk = InfillResponse(
                content=out.text, tokens=list(out.token_ids) if request.return_tokens else [], stop=done,
                model=model_name, tokens_predicted=predicted, tokens_evaluated=len(prompt.token_ids),
                tokens_cached=res.num_cached_tokens or 0, stop_type=_stop_type(out.finish_reason, out.stop_reason),
                stopping_word=out.stop_reason if isinstance(out.stop_reason, str) else "",
                prompt=_prompt_text(handler, prompt) if done else None)
            yield sse(chunk.model_dump_json(exclude_none=True))
    except Exception as e:  # the stream already started: llama-server's in-band error event
        _, body = error_response_from_exception(e)
        yield sse(body.model_dump_json())
    finally:
        await merged.aclose()
        await aclose_all(gens)
