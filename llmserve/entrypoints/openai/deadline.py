"""Per-request deadlines: the ``X-Request-Timeout`` header (beyond vLLM, which has none).

A client sends ``X-Request-Timeout: <seconds>`` (a positive number, fractions allowed, at
most :data:`MAX_REQUEST_TIMEOUT_S`) on any generation or pooling route. The deadline runs
from the request's arrival at the server, so time spent waiting for admission, rendering
and in the engine's queue all counts. At the deadline the request is aborted wherever it
is (waiting in the engine's queue, prefilling or decoding) and its response ends as an
aborted request does in vLLM:

- finish_reason ``"abort"``, the text and tokens generated so far kept (none when it
  never ran), status 200; the same in a stream (the last chunk carries the reason, then
  ``[DONE]``) and in a plain JSON response, and ``usage`` counts the tokens kept.

Why ``"abort"``: OpenAI has no reason for a timeout, and ``"length"`` would tell a client
that its token budget ran out (it may ask to continue); ``"abort"`` is the reason vLLM
gives a request ended early by the server (``AsyncLLM.abort``, PR 22283), which vLLM's
clients already handle, and the official ``openai`` clients accept any string there.
A pooling request has no partial result: past its deadline it fails with 408 (see
:class:`RequestDeadlineExceeded`).

The header is a header, not a body field, so a proxy or an SDK's ``extra_headers`` can
set it without touching the body and the same name works on every route. The admission
middleware parses it and sets :func:`current_deadline` for the handler's task.
"""
from __future__ import annotations

import asyncio
import contextvars
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional, TypeVar

from llmserve.sampling_params import SamplingParamsError

T = TypeVar("T")

REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"
# One day: a larger value is a client bug (milliseconds sent as seconds, say), not a deadline.
MAX_REQUEST_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class Deadline:
    """When a request must end: ``at`` in ``time.monotonic()`` seconds; ``on_expire`` is
    called once if it is reached (the server counts it in /metrics)."""

    at: float
    on_expire: Optional[Callable[[], None]] = None

    def remaining(self) -> float:
        """Seconds left (<= 0 once passed)."""
        return self.at - time.monotonic()


# The current request's deadline, set by the admission middleware for the request's task
# (the handler's tasks copy the context).
_DEADLINE: contextvars.ContextVar[Optional[Deadline]] = contextvars.ContextVar("llmserve_request_deadline",
                                                                              default=None)


class RequestDeadlineExceeded(Exception):
    """A request without a partial result (pooling) ran past its ``X-Request-Timeout``.
    Answered with 408 and the OpenAI error body (``param`` the header's name)."""

    status_code = 408
    param = REQUEST_TIMEOUT_HEADER


def parse_request_timeout(value: Optional[str]) -> Optional[float]:
    """Seconds of an ``X-Request-Timeout`` header value (None when absent).

    Raises SamplingParamsError (a 400, ``param`` "X-Request-Timeout") unless the value is
    a finite number in (0, MAX_REQUEST_TIMEOUT_S]."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not (0.0 < seconds <= MAX_REQUEST_TIMEOUT_S):  # also false for NaN
        raise SamplingParamsError(
            f"{REQUEST_TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}], "
            f"got {value[:40]!r}.", REQUEST_TIMEOUT_HEADER)
    return seconds


def current_deadline() -> Optional[Deadline]:
    """The current request's deadline, or None."""
    return _DEADLINE.get()


def set_deadline(deadline: Optional[Deadline]) -> contextvars.Token:
    """Set the current request's deadline; returns the token for :func:`reset_deadline`."""
    return _DEADLINE.set(deadline)


def reset_deadline(token: contextvars.Token) -> None:
    _DEADLINE.reset(token)


async def with_deadline(gen: AsyncGenerator[T, None], abort: Callable[[], Awaitable[Any]],
                        deadline: Deadline) -> AsyncGenerator[T, None]:
    """The items of ``gen`` (an engine request's outputs); at the deadline ``abort()``
    is called once (``AsyncLLM.abort``: the request's last output then has finish_reason
    "abort" and its tokens so far) and ``deadline.on_expire()``.

    The timer starts right before ``gen`` is first advanced: AsyncLLM registers the
    request before its first suspension, so an abort due at once still finds it. Closing
    this generator closes ``gen`` (which aborts the request if it still runs)."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Task] = []  # a reference, so the abort task is not collected

    def expire() -> None:
        if deadline.on_expire is not None:
            deadline.on_expire()
        pending.append(loop.create_task(abort()))

    handle = loop.call_later(max(0.0, deadline.remaining()), expire)
    try:
        async for item in gen:
            yield item
    finally:
        handle.cancel()
        await gen.aclose()
