"""The one mapping from exceptions to HTTP statuses and OpenAI error bodies.

Handlers raise exceptions; :func:`error_response_from_exception` maps each to its HTTP
status and body (the app's exception handlers and the SSE streams both use it), so every
error looks the same wherever it happens.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

from llmserve.engine.exceptions import EngineDeadError, EngineGenerateError, EngineStartError
from llmserve.entrypoints.openai.common.protocol import ErrorInfo, ErrorResponse
from llmserve.entrypoints.openai.deadline import REQUEST_TIMEOUT_HEADER, RequestDeadlineExceeded, current_deadline
from llmserve.entrypoints.openai.models.serving import ModelNotFoundError
from llmserve.lora.errors import LoRANotFoundError
from llmserve.sampling_params import ContextLengthExceededError, SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.openai")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class NotFoundError(LookupError):
    """A resource named by the request (other than the model) does not exist, e.g. a
    stored response id: HTTP 404 with ``param`` (OpenAI's NotFoundError)."""

    code: Optional[str] = None  # a string code for the body's ``code`` (None: the status)

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


# The finish reasons of a generation that ended as the request asked (its stop, its
# budget, a tool call). Any other ("abort": the server shut down or the engine aborted it;
# "error") cut it off: the APIs without a finish reason of their own for that (Anthropic
# Messages, Ollama) answer with RequestAbortedError instead of a normal end.
NORMAL_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})


class RequestAbortedError(EngineGenerateError):
    """A generation cut off before it finished (finish reason ``finish_reason``, e.g.
    "abort" on server shutdown); ``output_tokens``: the tokens made before. HTTP 500
    (Anthropic: api_error; Ollama: ``{"error"}``), or the stream's in-band error."""

    def __init__(self, finish_reason: str, output_tokens: Optional[int] = None) -> None:
        after = f" after {output_tokens} output tokens" if output_tokens is not None else ""
        super().__init__(f"The generation was cut off before it finished (finish reason {finish_reason!r}: "
                         f"the server is shutting down, or the engine aborted the request){after}; "
                         "retry the request")
        self.finish_reason = finish_reason


def check_finished_normally(finish_reason: Optional[str], output_tokens: Optional[int] = None) -> None:
    """Raise RequestAbortedError when ``finish_reason`` is set and not a normal end
    (NORMAL_FINISH_REASONS), or RequestDeadlineExceeded (408) when the abort was the
    request's own ``X-Request-Timeout`` running out; None (not finished yet) passes."""
    if finish_reason is None or finish_reason in NORMAL_FINISH_REASONS:
        return
    deadline = current_deadline()
    if finish_reason == "abort" and deadline is not None and deadline.remaining() <= 0:
        after = f" after {output_tokens} output tokens" if output_tokens is not None else ""
        raise RequestDeadlineExceeded(f"The request ran past its {REQUEST_TIMEOUT_HEADER} and was stopped{after}.")
    raise RequestAbortedError(finish_reason, output_tokens)


def error_type_for(status_code: int) -> str:
    """OpenAI/vLLM error ``type`` for an HTTP status (e.g. 404 -> "NotFoundError")."""
    return _ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")


# OpenAI's ``code`` for a prompt that does not fit the context, as a Responses stream's
# ``response.failed`` carries it. Codex CLI 0.171.0 tests exactly this value there
# (codex-api sse/responses.rs ``is_context_window_error``) to say "ran out of room in the
# model's context window" and compact; a 400 before the stream it prints raw whatever its
# code. The HTTP error bodies keep vLLM's numeric code (``code: 400``), which clients
# switching from vLLM and the context-length cases (C12, C13) read.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def make_error(message: str, status_code: int = 400, param: Optional[str] = None,
               err_type: Optional[str] = None, code: Optional[str] = None) -> ErrorResponse:
    """Build the OpenAI error body ``{"error": {message, type, param, code}}``; ``code``:
    OpenAI's string code, else the HTTP status (vLLM's). A lone surrogate a message
    quotes from the request (an unknown ``model`` such as ``"a\\ud800b"``) becomes U+FFFD,
    as JSON decoders such as Go's read it: the body must be valid UTF-8 to be sent at all
    (it was a 400 with pydantic's "Error serializing to JSON" text instead)."""
    message = _LONE_SURROGATE.sub("\ufffd", message)
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type or error_type_for(status_code),
                                         param=param, code=code or status_code))


def in_band_code(exc: BaseException, body: ErrorResponse) -> Any:
    """The ``code`` of an error reported inside a started Responses stream (its ``error``
    event and ``response.failed``): ``"context_length_exceeded"`` for a prompt over the
    context (what OpenAI streams and Codex CLI looks for), else the body's code."""
    return CONTEXT_LENGTH_EXCEEDED if isinstance(exc, ContextLengthExceededError) else body.error.code


def _string_code(exc: BaseException) -> Optional[str]:
    """The exception's string ``code`` attribute (None: none, or not a string)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else None


def error_response_from_exception(exc: BaseException) -> tuple[int, ErrorResponse]:
    """Map an exception to (HTTP status, error body).

    ModelNotFoundError, NotFoundError, LoRANotFoundError -> 404; RequestDeadlineExceeded -> 408;
    SamplingParamsError (ContextLengthExceededError among them: its in-band code is
    :func:`in_band_code`'s) /
    ValueError -> 400 (``param`` from the exception when it has one, and its string ``code`` when it has one:
    the message-threads errors); NotImplementedError -> 400 (an unsupported feature:
    never a 5xx, which the official clients retry twice); EngineDeadError -> 503 (EngineStartError: type "EngineStartError", its
    ``Retry-After`` added by server_utils.error_json);
    RequestAbortedError (a generation cut off) -> 500 with its own message; other
    EngineGenerateError and anything else -> 500 (unexpected errors are logged with
    their traceback).
    """
    if isinstance(exc, ModelNotFoundError):
        return 404, make_error(str(exc), 404, "model")
    if isinstance(exc, (NotFoundError, LoRANotFoundError)):
        return 404, make_error(str(exc.args[0]), 404, exc.param, code=getattr(exc, "code", None))
    if isinstance(exc, RequestDeadlineExceeded):
        return 408, make_error(str(exc), 408, exc.param)
    if isinstance(exc, EngineStartError):
        return 503, make_error(f"The engine is not running: {exc}", 503, err_type="EngineStartError")
    if isinstance(exc, EngineDeadError):
        return 503, make_error(f"The engine is not running: {exc}", 503, err_type="EngineDeadError")
    if isinstance(exc, (SamplingParamsError, ValueError, OverflowError)):
        return 400, make_error(str(exc) or exc.__class__.__name__, 400, getattr(exc, "param", None),
                               code=_string_code(exc))
    if isinstance(exc, NotImplementedError):
        return 400, make_error(str(exc) or "This feature is not supported by this server.", 400,
                               getattr(exc, "param", None))
    if isinstance(exc, RequestAbortedError):
        return 500, make_error(str(exc), 500, err_type="RequestAbortedError")
    if isinstance(exc, EngineGenerateError):
        return 500, make_error(f"The request failed in the engine: {exc}", 500)
    logger.error("Unexpected error while serving a request", exc_info=exc)
    return 500, make_error(f"Internal server error ({exc.__class__.__name__}: {exc})", 500)
