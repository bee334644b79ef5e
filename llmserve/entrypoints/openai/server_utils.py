"""HTTP plumbing shared by the routers: JSON and SSE responses, cancellation on client
disconnect, the X-Request-Id and API-key middleware, and the exception handlers that
turn every error into the OpenAI error body (through ``error_response_from_exception``).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel
from fastapi.exceptions import RequestValidationError
from starlette._utils import get_route_path
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.tenant_context import reset_current_tenant, set_current_tenant
from llmserve.entrypoints.openai.common.errors import error_response_from_exception, make_error
from llmserve.entrypoints.openai.tenants import KeyRing, set_tenant
from llmserve.entrypoints.openai.validation_errors import dotted, human, problems_of, resolve_unions
from llmserve.entrypoints.web.webui import ASSETS_PREFIX, WEBUI_PUBLIC_PATHS

REQUEST_ID_SCOPE_KEY = "llmserve.request_id"
# The routes that answer without an API key (exact paths, after --root-path): the probes
# (liveness, readiness, SageMaker's /ping), the version (also Ollama's /api/version), the
# static API documents, and, as in vLLM, /metrics and /load, which Prometheus scrapers and
# load balancers poll without credentials and which carry counts only, never a prompt, an
# output or a stored object; and the built-in page's files (``/``, ``/live``, ``/webui/...``:
# the page asks for the key and sends it to the data routes). Every other path (the engine routes, the stored responses,
# /invocations, /tokenizer_info, any route added later, an unknown path) needs the key.
PUBLIC_PATHS = frozenset({
    "/health", "/v1/health", "/ready", "/ping", "/version", "/api/version", "/metrics", "/load",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
}) | WEBUI_PUBLIC_PATHS


def json_response(model: Any, status_code: int = 200) -> Response:
    """A pydantic model as strict JSON (no NaN/Infinity: logprobs are clamped upstream)."""
    return Response(content=model.model_dump_json(), status_code=status_code, media_type="application/json")


def error_json(exc: BaseException) -> Response:
    """The JSON error response of an exception (status and body from the one mapping);
    a 503 whose exception has an int ``retry_after`` (EngineStartError) carries it as
    ``Retry-After``."""
    status, body = error_response_from_exception(exc)
    response = json_response(body, status)
    retry_after = getattr(exc, "retry_after", None)  # EngineStartError: the next request tries again
    if status == 503 and isinstance(retry_after, int):
        response.headers["Retry-After"] = str(retry_after)
    return response


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(request: Request, work: Awaitable[Any]) -> Optional[Any]:
    """Run ``work`` (a handler coroutine) until it finishes or the client disconnects.

    On disconnect the handler task is cancelled, which closes its engine generators and
    so aborts the request in the engine; returns None then. The request body must have
    been read already (FastAPI reads it before calling the route).
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        listener.cancel()
        raise
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # cancelled (or failed while cancelling): nobody to tell
        pass
    return None


def request_id_of(raw_request: Request) -> Optional[str]:
    """The request's X-Request-Id (set by RequestIdMiddleware)."""
    return raw_request.scope.get(REQUEST_ID_SCOPE_KEY)


async def json_or_499(request: Request, work: Awaitable[Any]) -> Response:
    """``work``'s result as JSON, run under :func:`with_cancellation`: a client that goes
    away aborts the request's engine work (a 30,000-document rerank whose client had
    timed out held the next request 11 s) and gets 499."""
    result = await with_cancellation(request, work)
    return Response(status_code=499) if result is None else json_response(result)


def result_response(result: Any) -> Response:
    """A handler's result as a response: 499 when the client went away, JSON for a
    pydantic model, else an SSE stream of the async generator."""
    if result is None:  # client went away
        return Response(status_code=499)
    if hasattr(result, "model_dump_json"):
        return json_response(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class RequestIdMiddleware:
    """Pure ASGI middleware: echo the client's ``X-Request-Id`` (or a new uuid) in the
    response headers and expose it to the routes (engine request ids are built from it)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # an outer ErrorShapeMiddleware may have picked it already (error_shapes.py)
        rid = scope.get(REQUEST_ID_SCOPE_KEY) or Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = rid

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        await self.app(scope, receive, send_with_id)


class AuthenticationMiddleware:
    """Pure ASGI middleware: every path but :data:`PUBLIC_PATHS` needs one of the API keys
    (``--api-key``), sent as ``Authorization: Bearer <key>`` (OpenAI's clients, vLLM) or
    ``x-api-key: <key>`` (Anthropic's SDK). Protected by default, so a route added later
    is covered without being listed (vLLM checks only ``/v1`` prefixes, which left
    ``/invocations`` open). Keys are compared in constant time (SHA-256 digests, so not
    even the length leaks). CORS preflight (OPTIONS) passes. A bad or missing key gets
    401 with the OpenAI error body and ``WWW-Authenticate: Bearer``; a websocket is closed
    with code 1008 (policy violation) before it is accepted.

    Each key names a tenant (``keyring``: a :class:`~llmserve.entrypoints.openai.tenants.KeyRing`
    of ``--api-key`` and ``--api-keys-file``; plain ``api_keys`` are the default tenant):
    an authenticated request's tenant is ``request.state.tenant`` and the current tenant
    of engine/tenant_context.py for the engine's fair share."""

    def __init__(self, app: Any, api_keys: list[str] = (), keyring: Any = None):
        self.app = app
        self.keyring = keyring if keyring is not None else KeyRing(api_keys)

    def _tenant(self, scope: dict) -> Any:
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = [token.strip()] if scheme.lower() == "bearer" else []
        if "x-api-key" in headers:
            given.append(headers["x-api-key"].strip())
        return self.keyring.match(given)  # constant time in which key matched

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        if tenant is not None:
            set_tenant(scope, tenant)
            token = set_current_tenant(tenant)
            try:
                return await self.app(scope, receive, send)
            finally:
                reset_current_tenant(token)
        if _public(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "Invalid or missing API key."})
        body = make_error("Invalid or missing API key. Send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                          401, err_type="AuthenticationError")
        response = json_response(body, 401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _public(scope: dict) -> bool:
    """Whether the request's path (as the router matches it: starlette's own helper, the
    same --root-path rule) is on PUBLIC_PATHS; the page's files only to GET or HEAD them.
    Any GET/HEAD under the page's folder is public too, so a missing file there answers
    the static files' 404 rather than a 401 (that folder holds only the packaged files)."""
    path = get_route_path(scope)
    if scope.get("method") in ("GET", "HEAD") and path.startswith(ASSETS_PREFIX + "/"):
        return True
    return path in PUBLIC_PATHS and (path not in WEBUI_PUBLIC_PATHS or scope.get("method") in ("GET", "HEAD"))


# A validation error lists at most this many problems, each cut to MAX_PART_CHARS: one
# invalid 400 KB body (a long list of bad items) must not answer with a body as large.
MAX_VALIDATION_ERRORS = 5
MAX_PART_CHARS = 300


# The pathless errors that are about the body itself: no body at all ("missing" at the
# body's own location) or one that is not a JSON object (``[]``, ``"x"``, ``3``). Other
# pathless errors are checks of the whole object (a model validator): said as they are.
BODY_ERRORS = frozenset({"missing", "model_type", "model_attributes_type", "dict_type"})

# FastAPI's first location item says where a field came from; the field is what follows
# (a body field named "query", as rerank's, stays: only the first item is dropped).
_LOCATION_KINDS = ("body", "query", "path", "header", "cookie")


def _field_loc(loc: tuple) -> tuple:
    """A pydantic error location without FastAPI's leading source (``query.limit`` -> ``limit``)."""
    return loc[1:] if loc and loc[0] in _LOCATION_KINDS else loc


def _not_json_message(content_type: Optional[str]) -> str:
    """The 400 for a body FastAPI did not read as JSON: its Content-Type is not
    ``application/json`` (nor ``+json``), so the body reached validation as raw bytes,
    and pydantic's "valid dictionary" message hid why (a fresh-user trial sent
    ``text/plain``). The received type is named, cut to 100 characters."""
    received = f"`{content_type[:100]}`" if content_type else "none"
    return ("The request body must be JSON sent with `Content-Type: application/json` "
            f"(the Content-Type received: {received}).")


def _not_utf8_message(error: UnicodeDecodeError) -> str:
    """The 400 for a JSON body whose bytes are not UTF-8 (FastAPI raises its bare "There
    was an error parsing the body" from the UnicodeDecodeError of ``json.loads``; a
    fresh-user trial sent ``\\xff\\xfe`` inside a message and could not tell why). Names
    the byte offset and the byte, never more of the body. The bytes are decoded as UTF-8
    again for that: ``json.loads`` picks UTF-16 or UTF-32 for a body that opens with their
    byte-order mark or NUL bytes, and its error then named another byte and offset (a
    trial's ``\xff\xfe ...`` was told "byte 0x38 at offset 10")."""
    if isinstance(error.object, (bytes, bytearray)) and error.encoding.replace("-", "").lower() != "utf8":
        try:
            bytes(error.object).decode("utf-8")
        except UnicodeDecodeError as utf8_error:
            error = utf8_error
    bad = error.object[error.start:error.start + 1].hex()
    return (f"The request body is not valid UTF-8: byte 0x{bad} at offset {error.start} "
            f"({error.reason}); send JSON encoded as UTF-8.")


def required_fields(request: Request) -> list[str]:
    """The required body fields of the route that ``request`` matched (its pydantic body
    model's fields without a default, by the name a client writes); [] when the route has
    no single body model (``/invocations`` takes several shapes). A model whose required
    field is checked by its handler rather than its type (``/v1/embeddings``: ``input`` or
    ``messages``) names it in a ``REQUIRED_FIELDS`` class attribute."""
    return required_fields_of(body_model_of(request.scope.get("route")))


def body_model_of(route: Any) -> Optional[type[BaseModel]]:
    """The pydantic model of a FastAPI route's JSON body (None: the route has no single
    body model, or is no FastAPI route)."""
    field = getattr(route, "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def required_fields_of(model: Optional[type[BaseModel]]) -> list[str]:
    """The required fields of a body model (see :func:`required_fields`)."""
    if model is None:
        return []
    named = list(getattr(model, "REQUIRED_FIELDS", ()))
    return named + [f.alias or name for name, f in model.model_fields.items() if f.is_required()]


def _body_message(err_type: str, body: Any, required: list[str]) -> str:
    """The 400 of a body that is no JSON object: empty (``missing``), or null, an array,
    a string, a number; it names the route's required fields, since every one is missing."""
    if err_type == "missing":
        head = "The request body is empty: send a JSON object with the request fields"
    else:
        kind = {type(None): "null", list: "an array", str: "a string", bool: "a boolean"}.get(type(body), "a number")
        head = f"The request body must be a JSON object with the request fields, not {kind}"
    if not required:
        return head + "."
    names = ", ".join(f"`{name}`" for name in required)
    return f"{head} (required: {names})."


def _validation_message(exc: RequestValidationError, content_type: Optional[str] = None,
                        required: Optional[list[str]] = None) -> tuple[str, Optional[str]]:
    """The message and ``param`` of a pydantic validation error: ``<field>: <problem>`` for
    each problem, the field as the client wrote it (``stop.0``, ``messages.2.content``:
    no ``body`` source, no pydantic union-member labels), one union's problems cut to the
    member that matched best or to what the field accepts (validation_errors.py); ``param``
    is the first problem's field. The input values are never echoed back. A body that
    was not read as JSON (raw bytes: ``content_type`` is not a JSON type) is said so; one
    that is empty or not a JSON object names the route's ``required`` fields (the first
    is ``param``, as it is for ``{}``)."""
    body = getattr(exc, "body", None)
    found = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        from_body = bool(loc) and loc[0] == "body"
        found += problems_of([{**err, "loc": _field_loc(loc)}], body if from_body else None)
    problems = resolve_unions(found)
    parts, param = [], None
    for p in problems[:MAX_VALIDATION_ERRORS]:
        if p.type == "json_invalid":
            parts.append(f"Invalid JSON in the request body: {p.ctx.get('error') or p.msg}")
            continue
        if not p.path and isinstance(body, (bytes, bytearray)):
            parts.append(_not_json_message(content_type))
            continue
        named = p.ctx.get("param")
        if not p.path and named:  # a model-level check that names its field (NEVER_IGNORED_FIELDS)
            param = param or named
            parts.append(p.msg)
            continue
        if not p.path and p.type in BODY_ERRORS:
            parts.append(_body_message(p.type, body, required or []))
            param = param or (required[0] if required else None)
            continue
        if not p.path:  # a check of the whole object: its own words, no field to name
            parts.append(human(p.msg))
            continue
        if param is None:
            param = dotted(p.path)
        parts.append(f"{dotted(p.path)}: {human(p.msg)}")
    parts = [p if len(p) <= MAX_PART_CHARS else p[:MAX_PART_CHARS] + "..." for p in parts]
    if len(problems) > MAX_VALIDATION_ERRORS:
        parts.append(f"and {len(problems) - MAX_VALIDATION_ERRORS} more errors")
    return "; ".join(parts) or "Invalid request.", param


def validation_error_response(exc: RequestValidationError, content_type: Optional[str] = None,
                              required: Optional[list[str]] = None) -> Response:
    """The 400 of a body the route's model refused (see :func:`_validation_message`)."""
    message, param = _validation_message(exc, content_type, required)
    return json_response(make_error(message, 400, param), 400)


def http_exception_response(exc: StarletteHTTPException) -> Response:
    """The JSON error response of an HTTPException (its status, detail and headers)."""
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        detail = _not_utf8_message(exc.__cause__)
    response = json_response(make_error(detail, exc.status_code), exc.status_code)
    for k, v in (exc.headers or {}).items():
        response.headers[k] = v
    return response


def exception_response(exc: BaseException, content_type: Optional[str] = None,
                       required: Optional[list[str]] = None) -> Response:
    """The response the app's exception handlers give ``exc`` (for code that answers
    outside a route, such as admission's check of a body it would refuse);
    ``content_type`` and ``required`` (the body model's required fields) word a
    validation error."""
    if isinstance(exc, RequestValidationError):
        return validation_error_response(exc, content_type, required)
    if isinstance(exc, StarletteHTTPException):
        return http_exception_response(exc)
    return error_json(exc)


def install_exception_handlers(app: FastAPI) -> None:
    """Every error, raised anywhere, answers with the OpenAI error body and its status."""
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return validation_error_response(exc, request.headers.get("content-type"), required_fields(request))

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        return http_exception_response(exc)

    async def on_error(_: Request, exc: Exception) -> Response:
        return error_json(exc)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    for exc_type in (ValueError, LookupError, NotImplementedError, EngineDeadError, Exception):
        app.add_exception_handler(exc_type, on_error)
