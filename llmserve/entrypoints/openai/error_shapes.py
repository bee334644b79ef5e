"""Each API's own error body on the routes of that API (one server, several front doors).

Every error in the server is produced once, as the OpenAI body ``{"error": {"message",
"type", "param", "code"}}`` (``common/errors.py``). A front door that speaks another API
(Anthropic Messages under ``/v1/messages``, Ollama under ``/api/``) registers an
:class:`ErrorShape`: its path prefixes and a function from (status, OpenAI error info) to
its own body. :class:`ErrorShapeMiddleware` rewrites the JSON error responses of those
paths, whoever produced them (validation, auth, admission, body limits, handlers), so no
producer needs to know which API it is answering. On the paths no front door owns
(``/v1/models``, shared by OpenAI's and Anthropic's clients, and unknown paths), a request
carrying a front door's ``client_header`` (``anthropic-version``) gets that door's body, so
the ``anthropic`` SDK's ``models.retrieve`` of an unknown id raises its NotFoundError with
the message. Streams that already started report their errors in-band in their own
format (each endpoint's job). An API whose responses
carry the request's id under its own names (``request_id_header``, ``request_id_field``:
Anthropic's ``request-id`` header on every response and ``request_id`` in error bodies,
which its SDKs read as ``_request_id`` / ``APIStatusError.request_id``) gets the id
RequestIdMiddleware echoes as ``X-Request-Id``, set here first so that a 401 from
authentication, outside RequestIdMiddleware, carries one too.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

# (HTTP status, the OpenAI error object {"message", "type", "param", "code"}) -> body
ShapeFn = Callable[[int, dict[str, Any]], Any]


@dataclass(frozen=True)
class ErrorShape:
    """The error body of one API: ``prefixes`` (paths, after the root path, that belong to
    it; a prefix ending in ``/`` covers a folder, else the path itself and its sub-paths)
    and ``shape`` (status and the OpenAI error object -> that API's JSON body);
    ``request_id_header`` / ``request_id_field``: the response header and error-body key
    that carry the request's id in that API (None: none); ``client_header``: a header
    only this API's clients send (Anthropic's SDKs: ``anthropic-version`` on every call),
    which gives the request this API's body on the paths no API owns: the routes both
    APIs share (``/v1/models``, ``/v1/models/{id}``) and unknown paths."""

    prefixes: tuple[str, ...]
    shape: ShapeFn
    request_id_header: Optional[str] = None
    request_id_field: Optional[str] = None
    client_header: Optional[str] = None

    def sent_by_client(self, scope: dict) -> bool:
        """Whether the request carries ``client_header`` (lower case), the header this
        API's clients send on every call."""
        if self.client_header is None:
            return False
        name = self.client_header.encode("latin-1")
        return any(k.lower() == name for k, _ in scope.get("headers") or [])

    def covers(self, path: str) -> bool:
        """Whether ``path`` is one of this API's routes."""
        return any(path.startswith(p) if p.endswith("/") else (path == p or path.startswith(p + "/"))
                   for p in self.prefixes)


def _path_of(scope: dict) -> str:
    root = scope.get("root_path", "") or ""
    path = scope.get("path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _reshaped(body: bytes, status: int, shape: ErrorShape, request_id: Optional[str]) -> Optional[bytes]:
    """The body in ``shape``'s form (with the request id under its field), or None when it
    is not an OpenAI error body."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    info = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(info, dict) or "message" not in info:
        return None
    new = shape.shape(status, info)
    if shape.request_id_field and request_id and isinstance(new, dict):
        new[shape.request_id_field] = request_id
    return json.dumps(new, ensure_ascii=False).encode()


def _request_id(scope: dict) -> str:
    """The request's id (the client's X-Request-Id, else a new one), kept in the scope
    for RequestIdMiddleware."""
    from llmserve.entrypoints.openai.server_utils import REQUEST_ID_SCOPE_KEY

    rid = scope.get(REQUEST_ID_SCOPE_KEY)
    if not rid:
        sent = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = sent.decode("latin-1") if sent else uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = rid
    return rid


class ErrorShapeMiddleware:
    """Pure ASGI middleware: JSON error responses (status >= 400) on a registered API's
    paths are rewritten into that API's error body; everything else passes untouched.
    Placed outside authentication and admission, so their 401/429s are reshaped too."""

    def __init__(self, app: Any, shapes: Sequence[ErrorShape] = ()) -> None:
        self.app = app
        self.shapes = tuple(shapes)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        shape = None
        if scope["type"] == "http" and self.shapes:
            path = _path_of(scope)
            shape = next((s for s in self.shapes if s.covers(path)), None)
            if shape is None:  # a shared route: the body of the API whose client asks
                shape = next((s for s in self.shapes if s.sent_by_client(scope)), None)
        if shape is None:
            return await self.app(scope, receive, send)
        request_id = _request_id(scope) if shape.request_id_header or shape.request_id_field else None
        await self.app(scope, receive, _ReshapingSend(send, shape, request_id))


class _ReshapingSend:
    """A ``send`` that holds back a JSON error response until its body is complete, then
    sends it reshaped (with a corrected Content-Length)."""

    def __init__(self, send: Any, shape: ErrorShape, request_id: Optional[str] = None) -> None:
        self.send, self.shape, self.request_id = send, shape, request_id
        self.start: Optional[dict] = None
        self.chunks: list[bytes] = []

    @staticmethod
    def _is_json_error(message: dict) -> bool:
        if message.get("status", 200) < 400:
            return False
        headers = dict((k.lower(), v) for k, v in message.get("headers", []))
        return headers.get(b"content-type", b"").startswith(b"application/json")

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            if self.shape.request_id_header and self.request_id:
                message = {**message, "headers": [*message.get("headers", []), (
                    self.shape.request_id_header.encode("latin-1"), self.request_id.encode("latin-1"))]}
            if self._is_json_error(message):
                self.start = message
                return
            return await self.send(message)
        if self.start is None or message["type"] != "http.response.body":
            return await self.send(message)
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        await self._flush()

    async def _flush(self) -> None:
        body = b"".join(self.chunks)
        new = _reshaped(body, self.start["status"], self.shape, self.request_id)
        if new is not None:
            body = new
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
