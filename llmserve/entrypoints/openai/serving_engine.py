"""Shared logic of the OpenAI handlers (vLLM's ``OpenAIServing``): model check, prompt
tokenization and validation against the context, error bodies, SSE framing, merging
the output streams of several prompts.

Handlers raise exceptions; :func:`error_response_from_exception` maps each to its HTTP
status and OpenAI error body (the app's exception handlers and the SSE streams both use
it), so every error looks the same wherever it happens.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Sequence, TypeVar

from llmserve.engine.exceptions import EngineDeadError, EngineGenerateError
from llmserve.entrypoints.openai.logprobs import TokenFormatter
from llmserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from llmserve.entrypoints.openai.serving_models import ModelNotFoundError, OpenAIServingModels
from llmserve.sampling_params import SamplingParams, SamplingParamsError
from llmserve.tokenizer import check_encodable

logger = logging.getLogger("llmserve.entrypoints.openai")

T = TypeVar("T")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type_for(status_code: int) -> str:
    """OpenAI/vLLM error ``type`` for an HTTP status (e.g. 404 -> "NotFoundError")."""
    return _ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")


def make_error(message: str, status_code: int = 400, param: Optional[str] = None,
               err_type: Optional[str] = None) -> ErrorResponse:
    """Build the OpenAI error body ``{"error": {message, type, param, code}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type or error_type_for(status_code),
                                         param=param, code=status_code))


def error_response_from_exception(exc: BaseException) -> tuple[int, ErrorResponse]:
    """Map an exception to (HTTP status, error body).

    ModelNotFoundError -> 404; SamplingParamsError / ValueError -> 400 (``param`` from
    the exception when it has one); NotImplementedError -> 501; EngineDeadError -> 503;
    EngineGenerateError and anything else -> 500 (message hidden behind the class name
    for unexpected errors, which are logged with their traceback).
    """
    if isinstance(exc, ModelNotFoundError):
        return 404, make_error(str(exc), 404, "model")
    if isinstance(exc, EngineDeadError):
        return 503, make_error(f"The engine is not running: {exc}", 503, err_type="EngineDeadError")
    if isinstance(exc, (SamplingParamsError, ValueError, OverflowError)):
        return 400, make_error(str(exc) or exc.__class__.__name__, 400, getattr(exc, "param", None))
    if isinstance(exc, NotImplementedError):
        return 501, make_error(str(exc) or "Not implemented", 501)
    if isinstance(exc, EngineGenerateError):
        return 500, make_error(f"The request failed in the engine: {exc}", 500)
    logger.error("Unexpected error while serving a request", exc_info=exc)
    return 500, make_error(f"Internal server error ({exc.__class__.__name__}: {exc})", 500)


def sse(data: str) -> str:
    """One Server-Sent Event: a single ``data: <payload>`` line and a blank line."""
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(exc: BaseException) -> str:
    """The SSE event sent when a stream fails after it started (vLLM's behaviour)."""
    _, body = error_response_from_exception(exc)
    return sse(body.model_dump_json())


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


async def _anext(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


async def _aclose(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:  # still running in a cancelled task: it closes itself
            pass


class OpenAIServing:
    """Base of the chat, completion and tokenization handlers.

    Args:
      engine_client: the AsyncLLM (``model_config``, ``tokenizer``, ``generate``,
        ``generation_config_defaults``).
      models: the served model names.
      log_requests: log each request's id, prompt length and sampling params.
    """

    request_id_prefix = "cmpl"

    def __init__(self, engine_client: Any, models: OpenAIServingModels, *, log_requests: bool = False):
        self.engine_client = engine_client
        self.models = models
        self.model_config = engine_client.model_config
        self.max_model_len: int = self.model_config.max_model_len
        self.vocab_size: int = self.model_config.vocab_size
        self.tokenizer = engine_client.tokenizer
        self.default_sampling_params: dict[str, Any] = dict(
            getattr(engine_client, "generation_config_defaults", None) or {})
        self.token_formatter = TokenFormatter(self.tokenizer)
        self.log_requests = log_requests

    # ---- ids, tokens -----------------------------------------------------------
    def new_request_id(self, base: Optional[str] = None) -> str:
        """``<prefix>-<X-Request-Id or random uuid>``."""
        return f"{self.request_id_prefix}-{base or random_uuid()}"

    def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of ``text`` (list[int]). Raises SamplingParamsError naming ``param`` for
        text that is not valid Unicode (lone surrogates)."""
        check_encodable(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        """Raise SamplingParamsError unless every id is an int in [0, vocab_size)."""
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise SamplingParamsError(
                    f"{param}: token id {t!r} is out of vocabulary (valid ids are 0..{self.vocab_size - 1}).",
                    param)
        return list(ids)

    def resolve_max_tokens(self, prompt_len: int, requested: Optional[int], default: Optional[int],
                           what: str, max_tokens_param: str = "max_tokens") -> int:
        """The output budget of one prompt, checked against ``max_model_len``.

        requested: the user's max_tokens (None: not given). default: the budget when not
        given (None: the rest of the context). Returns tokens to generate (an int >= 0).
        Raises SamplingParamsError naming the context limit and both token counts when
        the prompt leaves no room for output or prompt + requested exceeds the limit
        (vLLM's message; never a negative number).
        """
        limit = self.max_model_len
        if prompt_len == 0:
            raise SamplingParamsError(f"The {what} cannot be empty.", what)
        if prompt_len >= limit:
            raise SamplingParamsError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens in the {what}, which leaves no room for output tokens. "
                f"Please reduce the length of the {what}.", what)
        if requested is not None:
            if prompt_len + requested > limit:
                raise SamplingParamsError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
                    f"completion). Please reduce the length of the {what} or completion.", max_tokens_param)
            return requested
        room = limit - prompt_len
        gen_default = self.default_sampling_params.get("max_tokens",
                                                       self.default_sampling_params.get("max_new_tokens"))
        budget = [v for v in (default, gen_default) if v is not None]
        return min([room] + budget)

    # ---- engine ----------------------------------------------------------------
    def generate(self, prompt_ids: list[int], prompt_text: Optional[str], params: SamplingParams,
                 request_id: str, priority: int = 0) -> AsyncGenerator[Any, None]:
        """Start one engine request (its async generator of RequestOutput).

        The engine id is ``request_id`` plus a random suffix, so two clients sending the
        same X-Request-Id at once never collide in the engine."""
        request_id = f"{request_id}-{random_uuid()[:8]}"
        if self.log_requests:
            logger.info("Received request %s: prompt_tokens=%d, params=%s", request_id,
                        len(prompt_ids), params)
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if prompt_text is not None:
            prompt["prompt"] = prompt_text
        return self.engine_client.generate(prompt, params, request_id, priority=priority)

    @staticmethod
    def engine_params(params: SamplingParams) -> SamplingParams:
        """The params sent to the engine: a request for 0 tokens (scoring the prompt,
        e.g. echo + logprobs) runs 1 step and the server drops the token it made."""
        if params.max_tokens == 0:
            params = params.clone()
            params.max_tokens = 1
            params.min_tokens = 0
        return params

