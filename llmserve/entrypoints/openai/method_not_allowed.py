"""405 Method Not Allowed with an ``Allow`` header that lists every method of the path, and
HEAD answered on every GET route (:class:`HeadAsGetMiddleware`).

Starlette answers a 405 from the first route whose path matches, so with one route per
method on the same path (``GET`` and ``DELETE /v1/responses/{response_id}``) its
``Allow`` named only the first route's methods. RFC 9110 section 15.5.6: the ``Allow``
header of a 405 lists the methods the target resource supports; here, the union over
every route of the app whose path pattern matches.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable, MutableMapping

from fastapi import FastAPI, Request
from fastapi.routing import iter_route_contexts
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import json_response


def allowed_methods(routes: Iterable[Any], path: str) -> list[str]:
    """The HTTP methods (sorted, upper case) of every route among ``routes`` whose path
    pattern matches ``path`` (the route path, after ``--root-path``); [] when none does.
    Routes without methods (mounts, websockets) are skipped."""
    methods: set[str] = set()
    for route in iter_route_contexts(list(routes)):
        regex = getattr(route, "path_regex", None)
        if route.methods and regex is not None and regex.match(path):
            methods.update(m.upper() for m in route.methods)
    return sorted(methods)


async def method_not_allowed(request: Request, exc: StarletteHTTPException) -> Response:
    """The 405 answer: the OpenAI error body naming the method and the allowed ones, and
    ``Allow`` with every method of the path (whatever the raising route put there is
    replaced)."""
    methods = allowed_methods(request.app.routes, get_route_path(request.scope))
    if not methods:  # raised by a handler, not by the router: keep its own header
        methods = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
    allow = ", ".join(methods)
    message = f"Method {request.method} is not allowed on {request.url.path}" + (f"; allowed: {allow}." if allow else ".")
    response = json_response(make_error(message, 405), 405)
    if allow:
        response.headers["Allow"] = allow
    return response


def install_method_not_allowed_handler(app: FastAPI) -> None:
    """Answer every 405 with :func:`method_not_allowed` (a status handler: it takes
    precedence over the app's HTTPException handler for this status only)."""
    app.add_exception_handler(405, method_not_allowed)


class HeadAsGetMiddleware:
    """HEAD on a path with a GET route and no HEAD route is served as that GET with the
    body left out: the same status and header fields (``Content-Length`` included), as
    RFC 9110 section 9.3.2 asks. FastAPI's routes answer only the methods they list
    (Starlette's own ``Route`` adds HEAD to GET; ``APIRoute`` does not), so ``HEAD /`` was a
    405: Claude Code 2.1.197 sends it before its first request, and Ollama's Go client
    checks the server with it (``Heartbeat``). ``router``: the app's router, read on each
    HEAD request (routes added after the middleware count)."""

    def __init__(self, app: Callable[..., Awaitable[None]], router: Any) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        methods = allowed_methods(self.router.routes, get_route_path(scope))
        if "GET" not in methods or "HEAD" in methods:
            return await self.app(scope, receive, send)

        async def headers_only(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
