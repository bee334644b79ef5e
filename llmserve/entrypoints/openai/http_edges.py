"""The server's edges: bounded request bodies, timeouts for incomplete requests, and a
JSON answer (the OpenAI error body, with the X-Request-Id) for every way a request can
end badly.

- :class:`BodyLimitMiddleware`: reads every request body whole before any route (or
  admission control) sees the request, then replays it: ``--max-request-body-bytes`` (413
  when Content-Length says so, else as soon as the streamed bytes pass it; the rest of the
  body is discarded first, within bounds, so the client is not reset mid-send); ``--timeout-request-body`` (408 unless the whole body has arrived that many
  seconds after the headers: a deadline for the body, not for each read, so a one-byte
  drip cannot hold a connection); ``--min-request-body-rate`` (408 for a body slower than
  that many bytes per second after a short grace); ``--max-request-bodies-per-client``
  (unfinished bodies one client address may have; past it, the longest-unfinished one is
  cut with 429 once it has been unfinished for ``BODY_CUT_GRACE_S``). Starlette's own ``RequestBodyLimitMiddleware`` answers in plain text and
  only once the route reads the body; this one answers in JSON before any route runs.
- :class:`EdgeGuardMiddleware`: whatever escapes the app (an error, the cancellation of
  a request cut by the end of a graceful shutdown, a client that went away) ends as a
  JSON response when none was started, without uvicorn's plain-text 500 and traceback.
- :func:`h11_protocol_with_header_timeout`: uvicorn's h11 protocol that closes, with a
  JSON 408, a connection whose request headers are not complete within
  ``--timeout-request-headers`` (uvicorn only times out idle keep-alive connections), and
  refuses, with a JSON 429, a connection beyond ``--max-connections-per-client`` open
  connections from one client address.

These limits follow Apache's mod_reqtimeout (``RequestReadTimeout body=20,MinRate=500``)
and nginx's ``limit_conn`` (connections per address); vLLM leaves them to a proxy.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from llmserve.entrypoints.openai.common.errors import error_response_from_exception, make_error

logger = logging.getLogger("llmserve.entrypoints.openai")

# Answers that end the connection: the rest of the request is never read.
_CLOSE = {"Connection": "close"}


class RequestBodyTooLarge(HTTPException):
    """413: the request body is larger than ``--max-request-body-bytes``."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this server's limit of {limit} bytes "
                              f"(--max-request-body-bytes).", headers=dict(_CLOSE))


class RequestBodyTimeout(HTTPException):
    """408: the whole body did not arrive within ``--timeout-request-body`` seconds."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"The request body was not received within {timeout_s:g} s of its headers "
                              f"(--timeout-request-body).", headers=dict(_CLOSE))


# Seconds a body may send nothing before --min-request-body-rate applies (a slow start,
# a lost first segment); the whole-body deadline still bounds it.
BODY_RATE_GRACE_S = 2.0
DEFAULT_MIN_REQUEST_BODY_RATE = 500.0  # bytes/s: Apache mod_reqtimeout's default MinRate
DEFAULT_MAX_REQUEST_BODIES_PER_CLIENT = 64  # unfinished bodies of one client address
# Seconds a body is spared by --max-request-bodies-per-client. Every body counts as
# unfinished until its request task has run once, so a burst of honest requests from one
# address (a proxy, a benchmark at concurrency 128) passes the limit for a moment: without
# this grace 57-64 of 128 concurrent small streaming requests were cut with 429
# (SmolLM2 server, 2-core machine). A drip is still cut once it has dripped this long.
BODY_CUT_GRACE_S = 2.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 512  # open connections of one client address
# A body over the limit is read and thrown away, up to this many bytes past the limit and
# for at most this many seconds, before its 413 is sent: a server that answers and closes
# with request bytes still unread makes the kernel reset the connection, and a client that
# sends its whole body before it reads (Python's http.client, curl without Expect) saw
# "Connection reset by peer" instead of the 413. nginx discards such a body the same way.
# A body larger still (or slower) is answered and cut as before.
MAX_DISCARDED_BODY_BYTES = 64 * 1024 * 1024
MAX_DISCARD_S = 10.0


class _BodyCut(Exception):
    """A body the middleware stops reading: the answer's status, message and headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


async def send_error(send: Any, status: int, message: str, *, param: Optional[str] = None,
                     headers: Optional[dict[str, str]] = None) -> None:
    """Send a complete JSON error response (the OpenAI error body) on a raw ASGI ``send``."""
    body = make_error(message, status, param).model_dump_json().encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


@dataclass(eq=False)
class _Body:
    """One request body being received: when it began, bytes so far, and a future a
    newer body of the same client sets to cut this one (the per-client limit)."""

    started: float
    received: int = 0
    cut: Optional[asyncio.Future] = field(default=None)


class BodyLimitMiddleware:
    """Pure ASGI middleware that receives each request body whole, within bounds, before
    the app sees the request, then replays the received messages to it (so admission
    control counts a request only once its body has arrived: an unfinished body holds no
    waiting slot). Requests without a body (no Content-Length, no Transfer-Encoding) pass
    as they are.

    max_body_bytes: the most body bytes (0: no limit); a Content-Length above it gets a
      413 at once (the body is never read), a streamed body the 413 when it passes it.
    body_timeout_s: seconds from the headers to the body's last byte (0: no deadline);
      past it, 408.
    min_body_rate: bytes per second the body must average once ``BODY_RATE_GRACE_S``
      has passed (0: no floor); below it, 408.
    max_bodies_per_client: unfinished bodies one client address may have (0: no bound);
      a new one past it cuts that address's longest-unfinished bodies with 429, those
      unfinished for ``BODY_CUT_GRACE_S`` or more (an honest client's body arrives in
      milliseconds, so it is the drips that are cut, even when every client shares one
      address behind a proxy, and a burst of fresh bodies is never cut).
    path_limits: path prefix -> its own body limit (the audio uploads).
    state: the app state; its ``admission`` controller (when set) counts the bodies
      being received, for /metrics.
    Every refusal is the OpenAI error body with ``Connection: close``; a 413's body is
    read and thrown away first (:func:`discard_body`, bounded by MAX_DISCARDED_BODY_BYTES
    and MAX_DISCARD_S) unless the client asked ``Expect: 100-continue``, so that the
    client reads the 413 rather than a connection reset.
    """

    def __init__(self, app: Any, max_body_bytes: int, body_timeout_s: float = 0.0,
                 path_limits: Optional[dict[str, int]] = None, min_body_rate: float = 0.0,
                 max_bodies_per_client: int = 0, state: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.min_body_rate = min_body_rate
        self.max_bodies_per_client = max_bodies_per_client
        # Path prefix -> its own limit (the audio uploads: --max-audio-file-bytes + form).
        self.path_limits = path_limits or {}
        self.state = state
        self.clock = clock
        # Client address -> its unfinished bodies, oldest first (dicts keep insertion order).
        self.receiving: dict[str, dict[_Body, None]] = collections.defaultdict(dict)

    def _limit(self, scope: dict) -> int:
        limit = self.max_body_bytes
        if limit and self.path_limits:
            path = scope.get("path", "")
            limit = next((max(limit, v) for p, v in self.path_limits.items() if path.startswith(p)), limit)
        return limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit(scope)
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if limit and length is not None and length.isdigit() and int(length) > limit:
            # a client that sent ``Expect: 100-continue`` waits for the answer before it
            # sends the body: answered at once (reading would ask it for the body)
            expects = headers.get("expect", "").lower() == "100-continue"
            if not expects and int(length) <= limit + MAX_DISCARDED_BODY_BYTES:
                await discard_body(receive, int(length), self._discard_s())
            return await send_error(send, 413, str(RequestBodyTooLarge(limit).detail), headers=_CLOSE)
        if (length is None or length == "0") and "transfer-encoding" not in headers:
            return await self.app(scope, receive, send)  # no body to wait for
        try:
            messages = await self._receive_body(scope, receive, limit)
        except _BodyCut as cut:
            if cut.status == 413:  # a streamed body past the limit: the rest is read and thrown away first
                await discard_body(receive, limit + MAX_DISCARDED_BODY_BYTES, self._discard_s())
            return await send_error(send, cut.status, cut.message, headers=cut.headers)
        if messages is None:
            return  # the client went away before its body ended: nobody to answer
        await self.app(scope, _replay(messages, receive), send)

    def _discard_s(self) -> float:
        """Seconds an over-limit body may take to be discarded (MAX_DISCARD_S, or the
        body deadline when that is shorter)."""
        return min(MAX_DISCARD_S, self.body_timeout_s) if self.body_timeout_s else MAX_DISCARD_S

    async def _receive_body(self, scope: dict, receive: Any, limit: int) -> Optional[list[dict]]:
        """The body's messages, once the last has arrived; None when the client
        disconnected first. Raises _BodyCut for a body over a bound."""
        client = (scope.get("client") or ("", 0))[0] or ""
        body = _Body(self.clock())
        self._register(client, body)
        try:
            messages: list[dict] = []
            while True:
                message = await self._next(receive, body)
                if message["type"] != "http.request":
                    return None
                body.received += len(message.get("body", b""))
                if limit and body.received > limit:
                    raise _BodyCut(413, str(RequestBodyTooLarge(limit).detail), dict(_CLOSE))
                messages.append(message)
                if not message.get("more_body", False):
                    return messages
        finally:
            self._unregister(client, body)

    async def _next(self, receive: Any, body: _Body) -> dict:
        """The next message, or _BodyCut at the deadline, the rate floor or a cut."""
        wait = self._wait_s(body)
        if body.cut is None and wait is None:
            return await receive()
        task = asyncio.ensure_future(receive())
        waiters = {task} if body.cut is None else {task, body.cut}
        try:
            done, _ = await asyncio.wait(waiters, timeout=None if wait is None else max(wait, 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():  # cut, timed out, or this request cancelled (shutdown)
                task.cancel()
        if task in done:
            return task.result()
        if body.cut is not None and body.cut.done():
            raise body.cut.result()
        raise self._too_slow(body)

    def _wait_s(self, body: _Body) -> Optional[float]:
        """Seconds until the body's deadline or its rate floor, whichever is first."""
        ends = []
        if self.body_timeout_s:
            ends.append(body.started + self.body_timeout_s)
        if self.min_body_rate:
            ends.append(body.started + BODY_RATE_GRACE_S + body.received / self.min_body_rate)
        return min(ends) - self.clock() if ends else None

    def _too_slow(self, body: _Body) -> _BodyCut:
        elapsed = self.clock() - body.started
        rate_end = (BODY_RATE_GRACE_S + body.received / self.min_body_rate) if self.min_body_rate else None
        if self.body_timeout_s and (rate_end is None or self.body_timeout_s <= rate_end):
            return _BodyCut(408, str(RequestBodyTimeout(self.body_timeout_s).detail), dict(_CLOSE))
        return _BodyCut(408, f"The request body arrived slower than {self.min_body_rate:g} bytes/s "
                             f"(--min-request-body-rate): {body.received} bytes in {elapsed:.1f} s.", dict(_CLOSE))

    def _register(self, client: str, body: _Body) -> None:
        bodies = self.receiving[client]
        bodies[body] = None
        limit = self.max_bodies_per_client
        if limit:
            body.cut = asyncio.get_running_loop().create_future()
            self._cut_oldest(bodies, limit, body.started)
        self._report(+1)

    @staticmethod
    def _cut_oldest(bodies: dict[_Body, None], limit: int, now: float) -> None:
        """Cut (429) one address's longest-unfinished bodies, oldest first, while it has
        more than ``limit``, sparing those younger than ``BODY_CUT_GRACE_S``: a burst of
        honest requests is not cut for arriving together."""
        for oldest in list(bodies):  # oldest first; the newest body is last, never cut here
            if len(bodies) <= limit or now - oldest.started < BODY_CUT_GRACE_S:
                return
            if oldest.cut is not None and not oldest.cut.done():
                oldest.cut.set_result(_BodyCut(
                    429, f"Too many unfinished request bodies from this client address (more than {limit}, "
                         f"--max-request-bodies-per-client); the slowest was cut.",
                    {**_CLOSE, "Retry-After": "1"}))
            bodies.pop(oldest, None)  # cut: no longer counts against the new ones

    def _unregister(self, client: str, body: _Body) -> None:
        bodies = self.receiving.get(client)
        if bodies is not None:
            bodies.pop(body, None)  # already gone when it was cut for a newer one
            if not bodies:
                del self.receiving[client]
        self._report(-1)

    def _report(self, delta: int) -> None:
        controller = getattr(self.state, "admission", None) if self.state is not None else None
        if controller is not None:
            controller.body_receiving(delta)


async def discard_body(receive: Any, max_bytes: int, timeout_s: float) -> bool:
    """Read the rest of a request body and throw it away, up to ``max_bytes`` (counting
    what is read here) and ``timeout_s`` seconds; True when the body ended within both
    (the connection can then close without a reset), False otherwise (or when the client
    left)."""
    loop = asyncio.get_running_loop()
    end, read = loop.time() + timeout_s, 0
    while True:
        left = end - loop.time()
        if left <= 0 or read > max_bytes:
            return False
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True


def _replay(messages: list[dict], receive: Any) -> Any:
    """A ``receive`` that returns the buffered body messages, then the real ones (the
    disconnect a streaming route waits for)."""
    pending = collections.deque(messages)

    async def replay() -> dict:
        if pending:
            return pending.popleft()
        return await receive()

    return replay


class EdgeGuardMiddleware:
    """Pure ASGI middleware (inside the X-Request-Id middleware, so its answers carry the
    header): nothing escapes to uvicorn, which would answer a plain-text 500 and log a
    traceback.

    - an HTTPException (413/408 raised while reading the body) -> its JSON answer;
    - the request task cancelled (uvicorn's graceful shutdown ran out) -> 503 JSON
      "the server is shutting down", one log line;
    - the client gone (ClientDisconnect) -> nothing to answer;
    - any other error -> its JSON answer (500 for an unexpected one, logged once with
      its traceback by the error mapping).
    When the response had already started, the connection is left to close.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            logger.warning("%s %s cut by the server's shutdown", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, 503, "The server is shutting down; retry the request.", headers=_CLOSE)
        except ClientDisconnect:
            return
        except HTTPException as e:
            if not started:
                await send_error(send, e.status_code, str(e.detail), headers=dict(e.headers or {}))
        except Exception as e:
            if started:
                logger.warning("%s %s failed after its response started: %r", scope.get("method"),
                               scope.get("path"), e)
                return
            status, body = error_response_from_exception(e)
            await send_error(send, status, body.error.message, param=body.error.param)


def _raw_error(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response (the OpenAI body) that closes the connection."""
    body = make_error(message, status).model_dump_json().encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {uuid.uuid4().hex}\r\n{extra}connection: close\r\n\r\n")
    return head.encode() + body


def _timeout_response(timeout_s: float) -> bytes:
    return _raw_error(408, "Request Timeout", f"The request headers were not received within {timeout_s:g} s "
                                              f"(--timeout-request-headers).")


def _too_many_connections_response(limit: int) -> bytes:
    return _raw_error(429, "Too Many Requests", f"Too many open connections from this client address (at most "
                                                f"{limit}, --max-connections-per-client). Retry later.",
                      "retry-after: 1\r\n")


def h11_protocol_with_header_timeout(header_timeout_s: float, max_connections_per_client: int = 0) -> type:
    """uvicorn's H11Protocol whose connections must complete each request's headers
    within ``header_timeout_s`` seconds of connecting (or of the previous response), else
    they get a JSON 408 and are closed: a client that connects and sends nothing, or
    half a header block, does not hold a connection forever (0: no header deadline).
    Idle keep-alive connections keep uvicorn's own ``timeout_keep_alive``.
    ``max_connections_per_client``: open connections one client address may hold (0: no
    bound, nginx's ``limit_conn``); one more gets a JSON 429 with ``Retry-After`` and is
    closed. The counts live in this class (one per server), not in a module global."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_by_client: collections.Counter = collections.Counter()

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: Optional[asyncio.TimerHandle] = None
        _client_key: Optional[str] = None  # the address this connection counts against
        open_connections = open_by_client  # client address -> open connections (for tests)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None and header_timeout_s:
                self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.write(_timeout_response(header_timeout_s))
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections_per_client:
                key = (self.client or ("", 0))[0] or ""
                if open_by_client[key] >= max_connections_per_client:
                    transport.write(_too_many_connections_response(max_connections_per_client))
                    transport.close()
                    return
                self._client_key = key
                open_by_client[key] += 1
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._client_key is None and max_connections_per_client:
                return  # refused at connect: its bytes are never parsed
            super().data_received(data)
            if self._waiting_for_headers():
                self._arm()  # part of the next request's headers: its clock runs
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle now: uvicorn's keep-alive timeout applies until new bytes

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            if self._client_key is not None:
                open_by_client[self._client_key] -= 1
                if open_by_client[self._client_key] <= 0:
                    del open_by_client[self._client_key]
                self._client_key = None
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
