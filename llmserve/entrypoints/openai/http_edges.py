"""The server's edges: bounded request bodies, timeouts for incomplete requests, and a
JSON answer (the OpenAI error body, with the X-Request-Id) for every way a request can
end badly.

- :class:`BodyLimitMiddleware`: ``--max-request-body-bytes`` (413 before the body is
  read when Content-Length says so, else as soon as the streamed bytes pass it) and
  ``--timeout-request-body`` (408 when the client stops sending its body). Starlette's
  own ``RequestBodyLimitMiddleware`` answers in plain text and only once the route reads
  the body; this one answers in JSON before any route runs.
- :class:`EdgeGuardMiddleware`: whatever escapes the app (an error, the cancellation of
  a request cut by the end of a graceful shutdown, a client that went away) ends as a
  JSON response when none was started, without uvicorn's plain-text 500 and traceback.
- :func:`h11_protocol_with_header_timeout`: uvicorn's h11 protocol that closes, with a
  JSON 408, a connection whose request headers are not complete within
  ``--timeout-request-headers`` (uvicorn only times out idle keep-alive connections).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional

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
    """408: the client sent no part of its body for ``--timeout-request-body`` seconds."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"The request body was not received: no data for {timeout_s:g} s "
                              f"(--timeout-request-body).", headers=dict(_CLOSE))


async def send_error(send: Any, status: int, message: str, *, param: Optional[str] = None,
                     headers: Optional[dict[str, str]] = None) -> None:
    """Send a complete JSON error response (the OpenAI error body) on a raw ASGI ``send``."""
    body = make_error(message, status, param).model_dump_json().encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Pure ASGI middleware bounding the request body.

    max_body_bytes: the most body bytes (0: no limit). A Content-Length above it gets a
    413 at once (the body is never read); a chunked body is counted as it streams in and
    the read that passes the limit raises :class:`RequestBodyTooLarge` (FastAPI answers
    it through the app's HTTPException handler, so with the OpenAI body).
    body_timeout_s: the longest wait for the next part of an unfinished body (0: none);
    past it, :class:`RequestBodyTimeout` (408).
    """

    def __init__(self, app: Any, max_body_bytes: int, body_timeout_s: float = 0.0,
                 path_limits: Optional[dict[str, int]] = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        # Path prefix -> its own limit (the audio uploads: --max-audio-file-bytes + form).
        self.path_limits = path_limits or {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, timeout = self.max_body_bytes, self.body_timeout_s
        if limit and self.path_limits:
            path = scope.get("path", "")
            limit = next((max(limit, v) for p, v in self.path_limits.items() if path.startswith(p)), limit)
        length = Headers(scope=scope).get("content-length")
        if limit and length is not None and length.isdigit() and int(length) > limit:
            return await send_error(send, 413, str(RequestBodyTooLarge(limit).detail), headers=_CLOSE)
        received, done = 0, False

        async def bounded_receive() -> dict:
            nonlocal received, done
            if done:  # body complete: later receives wait for the disconnect, unbounded
                return await receive()
            try:
                message = await (asyncio.wait_for(receive(), timeout) if timeout else receive())
            except asyncio.TimeoutError:
                raise RequestBodyTimeout(timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit and received > limit:
                    raise RequestBodyTooLarge(limit)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        await self.app(scope, bounded_receive, send)


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


def _timeout_response(timeout_s: float) -> bytes:
    body = make_error(f"The request headers were not received within {timeout_s:g} s "
                      f"(--timeout-request-headers).", 408).model_dump_json().encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {uuid.uuid4().hex}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def h11_protocol_with_header_timeout(header_timeout_s: float) -> type:
    """uvicorn's H11Protocol whose connections must complete each request's headers
    within ``header_timeout_s`` seconds of connecting (or of the previous response), else
    they get a JSON 408 and are closed: a client that connects and sends nothing, or
    half a header block, does not hold a connection forever. Idle keep-alive connections
    keep uvicorn's own ``timeout_keep_alive``."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: Optional[asyncio.TimerHandle] = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
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
            self._arm()

        def data_received(self, data: bytes) -> None:
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
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
