"""Bases of the OpenAI handlers (vLLM's ``BaseServing`` / ``OpenAIServing`` and
``GenerateBaseServing``) and their shared stream helpers: SSE framing, starting several
engine generators, merging their outputs.

The handlers keep only the server's policy: the OpenAI field mapping to SamplingParams,
the model's generation-config defaults and OpenAI's default budgets. Validation of a
request against the model (empty prompt, vocabulary, context length, ``max_tokens`` when
unset, stop/EOS ids) belongs to the engine's InputProcessor, which raises a
SamplingParamsError from the first ``__anext__`` of ``AsyncLLM.generate``, before any
output; :meth:`GenerateBaseServing.start_generation` turns it into a 400 naming the
OpenAI field.
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, AsyncGenerator, AsyncIterator, Mapping, Optional, Sequence, TypeVar, Union

from llmserve.entrypoints.openai.common.beam import beam_sampling_params
from llmserve.entrypoints.openai.common.errors import error_response_from_exception, make_error
from llmserve.entrypoints.openai.common.protocol import ErrorResponse, random_uuid
from llmserve.engine.input_processor import truncate_prompt
from llmserve.entrypoints.openai.common.usage import UsageOptions
from llmserve.entrypoints.openai.deadline import current_deadline, with_deadline
from llmserve.entrypoints.openai.dp_rank import requested_data_parallel_rank
from llmserve.entrypoints.openai.request_timelines.labels import add_response_id
from llmserve.entrypoints.openai.logprobs import TokenFormatter, TokenIdFormatter
from llmserve.entrypoints.openai.models.lora import lora_call, select_lora
from llmserve.entrypoints.openai.models.serving import OpenAIServingModels
from llmserve.entrypoints.renderer import AsyncRenderer, RenderedPrompt
from llmserve.sampling_params import ContextLengthExceededError, SamplingParams, SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.openai")

T = TypeVar("T")


def sse(data: str) -> str:
    """One Server-Sent Event: a single ``data: <payload>`` line and a blank line."""
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(exc: BaseException) -> str:
    """The SSE event sent when a stream fails after it started (vLLM's behaviour)."""
    _, body = error_response_from_exception(exc)
    return sse(body.model_dump_json())


def default_sampling_params(engine_client: Any) -> dict[str, Any]:
    """The model's generation-config defaults under SamplingParams names (temperature,
    top_p, top_k, min_p, repetition_penalty, max_tokens), computed once by the model
    config (vLLM's ``ModelConfig.get_diff_sampling_param``). Engines built before that
    method existed expose ``generation_config_defaults`` (with ``max_new_tokens``)."""
    get_diff = getattr(engine_client.model_config, "get_diff_sampling_param", None)
    if callable(get_diff):
        return dict(get_diff() or {})
    defaults = dict(getattr(engine_client, "generation_config_defaults", None) or {})
    if "max_new_tokens" in defaults:
        defaults.setdefault("max_tokens", defaults.pop("max_new_tokens"))
    return defaults


class BaseServing:
    """Base of every OpenAI handler (vLLM's ``BaseServing``).

    Args:
      engine_client: the EngineClient (AsyncLLM): ``model_config``, ``tokenizer``, ``generate``.
      models: the served model names.
      log_requests: log each request's id, prompt length and sampling params.
    """

    supports_lora = True  # False: an adapter named in `model` is a 400 (never the base model)

    def __init__(self, engine_client: Any, models: OpenAIServingModels, *, log_requests: bool = False):
        self.engine_client = engine_client
        self.models = models
        self.model_config = engine_client.model_config
        self.max_model_len: int = self.model_config.max_model_len
        self.log_requests = log_requests

    def _check_model(self, request: Any) -> str:
        """The served name to report for ``request.model`` (None: the default model).
        Raises ModelNotFoundError (404) for a name this server does not serve. A LoRA
        adapter's name picks it for this request's engine calls (``models/lora.py``)."""
        name = self.models.resolve(getattr(request, "model", None))
        select_lora(self.models, name, self.supports_lora)
        return name

    @staticmethod
    def create_error_response(error: Union[str, BaseException], status_code: int = 400,
                              param: Optional[str] = None) -> ErrorResponse:
        """The OpenAI error body of an exception (status from the one mapping,
        ``error_response_from_exception``) or of a message with ``status_code``."""
        if isinstance(error, BaseException):
            return error_response_from_exception(error)[1]
        return make_error(error, status_code, param)


class GenerateBaseServing(BaseServing):
    """Base of the handlers that generate (chat, completions, responses).

    renderer: the server's AsyncRenderer (messages/prompts -> token ids in its pool).
    ``default_sampling_params``: the model's generation-config defaults.
    """

    request_id_prefix = "cmpl"
    usage_options = UsageOptions()  # --enable-prompt-tokens-details, --enable-force-include-usage
    enable_per_request_metrics = False  # --enable-per-request-metrics (vLLM's `metrics` on responses)
    max_log_len: Optional[int] = None  # --max-log-len

    def __init__(self, engine_client: Any, models: OpenAIServingModels, renderer: AsyncRenderer, *,
                 log_requests: bool = False):
        super().__init__(engine_client, models, log_requests=log_requests)
        self.renderer = renderer
        self.tokenizer = engine_client.tokenizer
        # text_formatter: the tokens' real text (text offsets); token_formatter: how the API
        # writes them (--return-tokens-as-token-ids replaces it)
        self.token_formatter = self.text_formatter = TokenFormatter(self.tokenizer)
        self.token_id_formatter = TokenIdFormatter()
        self.default_sampling_params = default_sampling_params(engine_client)

    def _check_model(self, request: Any) -> str:
        """As :meth:`BaseServing._check_model`, and a 400 naming ``model`` when the model
        does not generate (a pooling model), before any rendering: vLLM's advice to start
        it with ``--runner generate``."""
        name = super()._check_model(request)
        tasks = getattr(self.model_config, "supported_tasks", ("generate",))
        if "generate" not in tasks:
            if "classify" in tasks:  # a *ForSequenceClassification checkpoint has no LM head
                where = "/classify, /score, /rerank" if "score" in tasks else "/classify"
                advice = "Use a generative model."
            else:
                where = "/v1/embeddings, /pooling, /score, /rerank"
                advice = "Use a generative model, or start this one with `--runner generate`."
            raise SamplingParamsError(f"The model `{name}` does not generate text: it is served as a pooling model "
                                      f"for {list(tasks)} ({where}). {advice}", "model")
        return name

    def formatter(self, request: Any) -> Any:
        """How the request's logprobs write tokens: ``token_id:N`` with vLLM's
        ``return_tokens_as_token_ids``, else the token's text."""
        return self.token_id_formatter if request.return_tokens_as_token_ids else self.token_formatter

    def truncate(self, prompt: RenderedPrompt, request: Any) -> RenderedPrompt:
        """The prompt cut to the request's ``truncate_prompt_tokens`` on its
        ``truncation_side`` (the InputProcessor's rule, so offline and online agree); a
        cut prompt has no text (the ids are what the model sees and what is echoed).
        Raises SamplingParamsError (param ``truncate_prompt_tokens``)."""
        ids = truncate_prompt(prompt.token_ids, request.truncate_prompt_tokens, self.max_model_len,
                              request.truncation_side)
        return prompt if len(ids) == len(prompt.token_ids) else RenderedPrompt(None, ids)

    def new_request_id(self, base: Optional[str] = None) -> str:
        """``<prefix>-<X-Request-Id or random uuid>``."""
        return f"{self.request_id_prefix}-{base or random_uuid()}"

    def generate(self, prompt: RenderedPrompt, params: SamplingParams, request_id: str,
                 priority: int = 0, response_id: Optional[str] = None, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """One engine request (its async generator of RequestOutput; nothing runs until
        the first ``__anext__``). The engine id is ``request_id`` plus a random suffix,
        so two clients sending the same X-Request-Id at once never collide. kwargs:
        further ``AsyncLLM.generate`` arguments (``reasoning_ended``,
        ``reasoning_parser_kwargs``). Under an ``X-Request-Timeout`` deadline the request
        is aborted when it passes (its last output: finish_reason "abort", tokens so far;
        see ``deadline.py``). response_id: the id the client gets (default: ``request_id``),
        by which ``GET /v1/requests/{id}/timeline`` finds this request. An
        ``X-data-parallel-rank`` header pins it to that DP engine (not a beam search);
        a bad one raises SamplingParamsError (400 naming the header)."""
        engine_id = f"{request_id}-{random_uuid()[:8]}"
        add_response_id(engine_id, response_id or request_id)
        request_id = engine_id
        if self.log_requests:
            logger.info("Received request %s: prompt=%r, prompt_token_ids=%s, params=%s", request_id,
                        prompt.text[:self.max_log_len] if prompt.text is not None else None,
                        prompt.token_ids[:self.max_log_len], params)
        beam = kwargs.pop("beam_search_params", None)
        rank = requested_data_parallel_rank(self.engine_client)  # X-data-parallel-rank (dp_rank.py)
        if rank is not None and beam is None:
            kwargs["data_parallel_rank"] = rank
        if beam is not None:  # use_beam_search (common/beam.py): the engine's beam search
            gen = lora_call(self.engine_client.beam_search, prompt.to_engine_prompt(), request_id, beam,
                            sampling_params=beam_sampling_params(params), priority=priority)
        else:
            gen = lora_call(self.engine_client.generate, prompt.to_engine_prompt(), params, request_id,
                            priority=priority, **kwargs)
        deadline = current_deadline()
        if deadline is None:
            return gen
        return with_deadline(gen, lambda: self.engine_client.abort(request_id), deadline)

    @staticmethod
    def engine_params(params: SamplingParams) -> SamplingParams:
        """The params sent to the engine: the request's own. A request for 0 tokens
        (scoring the prompt, e.g. echo + logprobs) goes as it is: the engine runs its one
        step and outputs no token (OutputProcessor), so /metrics counts no generated
        token for it, as its usage does not."""
        return params

    async def start_generation(self, gens: Sequence[AsyncGenerator[T, None]],
                               param_names: Optional[Mapping[str, str]] = None) -> list[Optional[T]]:
        """Advance every generator to its first output, together, before any response
        starts: a prompt the engine rejects then fails the whole request with a 400 and
        nothing is left running (the other generators are cancelled and closed, which
        aborts their engine requests).

        param_names: engine field name -> OpenAI field name (e.g. ``{"prompt":
        "messages"}``) for the ``param`` of a SamplingParamsError.
        Returns each generator's first item (None if it ended without one).
        """
        try:
            return await first_items(gens)
        except SamplingParamsError as e:
            if param_names and e.param in param_names:
                raise renamed_param(e, param_names) from e
            raise


def renamed_param(e: SamplingParamsError, names: Mapping[str, str]) -> SamplingParamsError:
    """``e`` with the client's name for its field (engine field -> API field, e.g.
    ``max_tokens`` -> ``max_completion_tokens``), in ``param`` and in the message, so the
    two agree: a message that starts with the field (``prompt: ...``), and every
    whole-word mention of a field identifier (a name with ``_``: the engine's context-length
    400 says "reduce ... of max_tokens" whichever field was sent; plain words such as
    "prompt" stay prose, and so do sub-fields such as ``structured_outputs.json``).
    ``e`` unchanged when its param is not in ``names``."""
    if e.param not in names:
        return e
    message, name = str(e), names[e.param]
    if message.startswith(f"{e.param}:"):
        message = name + message[len(e.param):]
    if "_" in e.param:
        message = re.sub(rf"(?<![\w.`]){re.escape(e.param)}(?![\w`]|\.\w)", name, message)
    # A field in backticks is the identifier whatever its spelling (the context limit's
    # "`messages` holds N characters" is `input` on /v1/responses).
    message = message.replace(f"`{e.param}`", f"`{name}`")
    # A context overflow stays one: its code ("context_length_exceeded") is what clients test.
    kind = ContextLengthExceededError if isinstance(e, ContextLengthExceededError) else SamplingParamsError
    return kind(message, name)


async def _anext_or_none(it: AsyncIterator[T]) -> Optional[T]:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def first_items(gens: Sequence[AsyncGenerator[T, None]]) -> list[Optional[T]]:
    """The first item of each generator (None when one ends empty), fetched concurrently.

    The first exception (or a cancellation of the caller) cancels the others and closes
    every generator, then propagates.
    """
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_anext_or_none(g)) for g in gens]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await aclose_all(gens)
        raise


async def prepend(first: Optional[T], rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """``first`` (when not None) then the items of ``rest``; closing it closes ``rest``."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await _aclose(rest)


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(i, item)`` from several async iterators as items arrive.

    All iterators are advanced concurrently. The first exception is raised; on exit
    (exception, cancellation or close) every iterator still open is closed, which aborts
    its engine request.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Future, int] = {
        loop.create_task(_anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(_anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending.keys(), return_exceptions=True)
        for it in iterators:
            await _aclose(it)


def merge_started(firsts: Sequence[Optional[T]],
                  gens: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """:func:`merge_async_iterators` of generators already advanced by
    :func:`first_items` (their first items are yielded first)."""
    return merge_async_iterators(*(prepend(f, g) for f, g in zip(firsts, gens)))


async def aclose_all(gens: Sequence[Any]) -> None:
    """Close every generator (idempotent: closing a finished one does nothing)."""
    for g in gens:
        await _aclose(g)


async def _anext(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


async def _aclose(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:  # still running in a cancelled task: it closes itself
            pass


def grammar_from_first_token(params: SamplingParams) -> dict[str, Any]:
    """The ``AsyncLLM.generate`` argument that makes a completion's structured output
    apply from its first token. A completion's text is never split into reasoning and
    content, so under ``--reasoning-parser`` its grammar must not wait for an end-of-
    reasoning marker the prompt never opened: it did, and ``structured_outputs`` on
    /v1/completions (and llama-server's /completion) came back unconstrained with a 200 (vLLM issue 57726)."""
    return {"reasoning_ended": True} if params.structured_outputs is not None else {}
