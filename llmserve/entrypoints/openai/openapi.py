"""``/openapi.json`` as the server really answers (FastAPI documents a 422 it never sends,
since the exception handlers answer validation errors with 400).

:func:`install_openapi` post-processes FastAPI's document once: every operation's 422
becomes a 400 with the OpenAI error body (:class:`ErrorResponse`), POST operations
document 413 (the body limit) and 408 (the body timeout), and a ``default`` response
with the same body covers the other errors any route can give (401 with an API key,
404 for an unknown model, 429/503 under load or while the engine is down). The
streaming routes document ``text/event-stream`` next to JSON, ``/metrics`` the
Prometheus text format, ``/health`` its JSON body.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from llmserve.entrypoints.openai.common.protocol import ErrorResponse

ERROR_REF = "#/components/schemas/ErrorResponse"
# Routes whose 200 may be an SSE stream (``"stream": true``).
STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class HealthResponse(BaseModel):
    """``GET /health``'s body: ``{"status": "ok"}`` while the engine runs."""

    status: str


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}


def _fix_operation(path: str, method: str, op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    if method in ("post", "put", "patch"):
        responses["400"] = _error("Bad request: invalid JSON or fields (the OpenAI error body names `param`).")
        responses["408"] = _error("The request body did not arrive in time (--timeout-request-body).")
        responses["413"] = _error("The request body is larger than --max-request-body-bytes.")
    responses.setdefault("default", _error("Any other error, with the OpenAI error body."))
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in STREAMING_PATHS:
        ok.setdefault("content", {"application/json": {"schema": {}}})
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path == "/health":
        ok["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/HealthResponse"}}}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document of ``app`` (see the module docstring)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers or None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorResponse, HealthResponse):
        defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in defs.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = defs
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            if isinstance(op, dict):
                _fix_operation(path, method, op)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi` (built on first request, then cached) at /openapi.json."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

