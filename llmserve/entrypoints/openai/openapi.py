"""``/openapi.json`` as the server really answers (FastAPI documents a 422 it never sends,
since the exception handlers answer validation errors with 400).

:func:`install_openapi` post-processes FastAPI's document once: every operation's 422
becomes a 400 with the OpenAI error body (:class:`ErrorResponse`), POST operations
document 413 (the body limit) and 408 (the body timeout), and a ``default`` response
with the same body covers the other errors any route can give (401 with an API key,
404 for an unknown model, 429/503 under load or while the engine is down). The
streaming routes document ``text/event-stream`` next to JSON, ``/metrics`` the
Prometheus text format, ``/health`` its JSON body. The operations of another API's front
door (an ErrorShape of the app's ErrorShapeMiddleware: Anthropic's ``/v1/messages``,
Ollama's ``/api/``) document that API's error body instead of OpenAI's.

The server's limits (:func:`server_limits`: body size, body and header timeouts, the
prompt and list limits, the admission bounds, the ``X-Request-Timeout`` header's range)
are in ``info["x-llmserve-limits"]`` (name -> value, unit, flag) and, as text, in
``info.description``; the 408/413 descriptions give this server's values, and the
generation and pooling routes document the ``X-Request-Timeout`` header. The per-field
limits are pydantic's ``maxItems`` / ``maxLength`` in the schemas.
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from llmserve.engine_defaults import parse_bytes
from llmserve.entrypoints.openai.common import limits as L
from llmserve.entrypoints.openai.common.protocol import ErrorResponse
from llmserve.entrypoints.openai.deadline import MAX_REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_HEADER
from llmserve.entrypoints.openai.error_shapes import ErrorShapeMiddleware
from llmserve.entrypoints.openai.server_load import TRACKED_PATHS

ERROR_REF = "#/components/schemas/ErrorResponse"
# Routes whose 200 may be an SSE stream (``"stream": true``).
STREAMING_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/responses")


class HealthResponse(BaseModel):
    """``GET /health``'s 200 body: ``{"status": "ok"}``, only while an engine serves (a
    dead, restarting or stalled engine is a 503 with the error body)."""

    status: str


# The serve flags that bound a request: (args attribute, unit, what it bounds). Present
# ones are documented with their value; 0 means "no limit" for each of them.
FLAG_LIMITS: tuple[tuple[str, str, str], ...] = (
    ("max_request_body_bytes", "bytes", "largest request body (larger: 413)"),
    ("max_audio_file_bytes", "bytes", "largest audio file of /v1/audio/* (larger: 400 naming `file`)"),
    ("timeout_request_headers", "seconds", "time to send a request's headers (then 408, connection closed)"),
    ("timeout_request_body", "seconds", "from the headers to the body's last byte (then 408, connection closed)"),
    ("min_request_body_rate", "bytes/second", "average rate a request body must keep (then 408, connection closed)"),
    ("max_request_bodies_per_client", "requests", "unfinished request bodies per client address (then 429)"),
    ("max_connections_per_client", "connections", "open connections per client address (then 429, closed)"),
    ("timeout_keep_alive", "seconds", "idle keep-alive connection lifetime"),
    ("request_chat_template_timeout", "seconds",
     "render time of a request's own chat_template (with --trust-request-chat-template)"),
    ("request_chat_template_memory", "bytes", "memory of a request chat_template's render"),
    ("max_waiting_requests", "requests", "requests waiting for the engine before new ones get 429 (-1: unbounded)"),
    ("max_queue_delay", "seconds", "predicted queue wait above which a new request gets 429"),
    ("max_model_len", "tokens", "context length: prompt plus output"),
)
# The fixed per-request limits (common/limits.py): name -> (value, unit, what).
FIXED_LIMITS: dict[str, tuple[Any, str, str]] = {
    "max_prompts_per_request": (L.MAX_PROMPTS_PER_REQUEST, "prompts", "`prompt` / `input` list length"),
    "max_prompt_token_ids": (L.MAX_PROMPT_TOKEN_IDS, "tokens", "token ids in one prompt given as ids"),
    "max_messages": (L.MAX_MESSAGES, "messages", "`messages` per request"),
    "max_content_parts": (L.MAX_CONTENT_PARTS, "parts", "content parts per message"),
    "max_n": (L.MAX_N, "choices", "`n`"),
    "max_stop_strings": (L.MAX_STOP_STRINGS, "strings", "`stop` strings"),
    "max_request_timeout": (MAX_REQUEST_TIMEOUT_S, "seconds", f"largest `{REQUEST_TIMEOUT_HEADER}` header value"),
}


def server_limits(app: FastAPI, args: Any = None) -> dict[str, dict[str, Any]]:
    """The limits a client of ``app`` meets: name -> ``{"value", "unit", "description"}``
    (plus ``"flag"`` for a serve flag's). ``args``: the parsed serve flags (None: only the
    fixed limits). Once the app state is set up, ``max_prompt_chars`` (the characters,
    whitespace included, past which a prompt is refused before tokenizing) and the served
    context length are added from it."""
    out: dict[str, dict[str, Any]] = {}
    for attr, unit, what in FLAG_LIMITS:
        value = getattr(args, attr, None) if args is not None else None
        if isinstance(value, str) and unit == "bytes":  # a size flag ("512MiB")
            value = parse_bytes(value)
        if value is not None:
            out[attr] = {"value": value, "unit": unit, "description": what, "flag": "--" + attr.replace("_", "-")}
    for name, (value, unit, what) in FIXED_LIMITS.items():
        out[name] = {"value": value, "unit": unit, "description": what}
    admission = getattr(getattr(app.state, "admission", None), "config", None)
    for attr, unit, what in FLAG_LIMITS:  # the admission bounds as applied (a default computed from the engine)
        if attr not in out and getattr(admission, attr, None) is not None:
            out[attr] = {"value": getattr(admission, attr), "unit": unit, "description": what,
                         "flag": "--" + attr.replace("_", "-")}
    models = getattr(app.state, "openai_serving_models", None)
    if getattr(models, "max_model_len", None):
        out["max_model_len"] = {"value": models.max_model_len, "unit": "tokens",
                                "description": "context length: prompt plus output", "flag": "--max-model-len"}
    prompt_limit = getattr(getattr(getattr(app.state, "openai_serving_render", None), "renderer", None),
                           "prompt_limit", None)
    if getattr(prompt_limit, "limit", None):
        out["max_prompt_chars"] = {"value": prompt_limit.limit, "unit": "characters",
                                   "description": "prompt text (whitespace included) refused before tokenizing"}
    return out


def _fmt(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _limits_text(limits: dict[str, dict[str, Any]]) -> str:
    lines = ["Limits of this server (also in `x-llmserve-limits`; 0 means none):"]
    for name, lim in limits.items():
        flag = f" (`{lim['flag']}`)" if "flag" in lim else ""
        lines.append(f"- {name}: {_fmt(lim['value'])} {lim['unit']}{flag}, {lim['description']}")
    return "\n".join(lines)


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}


def _limit(limits: dict[str, dict[str, Any]], name: str) -> str:
    value = limits.get(name, {}).get("value")
    return f" ({_fmt(value)} {limits[name]['unit']} here)" if isinstance(value, (int, float)) and value else ""


def _timeout_header() -> dict[str, Any]:
    return {"name": REQUEST_TIMEOUT_HEADER, "in": "header", "required": False,
            "description": "Seconds from arrival after which the request is aborted (finish_reason `abort`).",
            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_REQUEST_TIMEOUT_S}}


def _fix_operation(path: str, method: str, op: dict[str, Any],
                   limits: Optional[dict[str, dict[str, Any]]] = None) -> None:
    limits = limits or {}
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    if method in ("post", "put", "patch"):
        responses["400"] = _error("Bad request: invalid JSON or fields (the OpenAI error body names `param`).")
        responses["408"] = _error("The request body did not arrive in time (--timeout-request-body"
                                  f"{_limit(limits, 'timeout_request_body')}).")
        responses["413"] = _error("The request body is larger than --max-request-body-bytes"
                                  f"{_limit(limits, 'max_request_body_bytes')}.")
    if method == "post" and path in TRACKED_PATHS:
        op.setdefault("parameters", []).append(_timeout_header())
    responses.setdefault("default", _error("Any other error, with the OpenAI error body."))
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in STREAMING_PATHS:
        ok.setdefault("content", {"application/json": {"schema": {}}})
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path in ("/health", "/v1/health"):
        ok["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/HealthResponse"}}}


def _schema_of(value: Any) -> dict[str, Any]:
    """A JSON Schema that a body shaped like the sample ``value`` satisfies: the same keys
    (all required) and value types; a null sample value is left unconstrained."""
    if isinstance(value, dict):
        return {"type": "object", "required": sorted(value),
                "properties": {k: _schema_of(v) for k, v in value.items()}}
    kinds = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"))
    return next(({"type": name} for kind, name in kinds if isinstance(value, kind)), {})


def error_shapes_of(app: FastAPI) -> tuple[Any, ...]:
    """The ErrorShapes the app's ErrorShapeMiddleware applies (its own configuration)."""
    return next((tuple(m.kwargs.get("shapes", ())) for m in app.user_middleware if m.cls is ErrorShapeMiddleware), ())


def _reshape_errors(op: dict[str, Any], shape: Any) -> None:
    """Document an operation of another API's front door (Anthropic, Ollama) with that API's
    error body: ErrorShapeMiddleware rewrites every JSON error there. Its schema is read off
    the body the shape makes of a sample OpenAI error."""
    sample = shape.shape(400, {"message": "m", "type": "invalid_request_error", "param": None, "code": 400})
    schema = _schema_of(sample)
    for status, response in op.get("responses", {}).items():
        if status == "default" or status[:1] in ("4", "5"):
            response["content"] = {"application/json": {"schema": schema}}
            text = response.get("description", "").replace("the OpenAI error body names `param`", "this API's error body")
            response["description"] = text.replace("the OpenAI error body", "this API's error body")


def build_openapi(app: FastAPI, args: Any = None) -> dict[str, Any]:
    """The document of ``app`` (see the module docstring); ``args``: the parsed serve
    flags, whose limits it documents."""
    limits = server_limits(app, args)
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers or None,
                         description=_limits_text(limits))
    schema["info"]["x-llmserve-limits"] = limits
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorResponse, HealthResponse):
        defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in defs.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = defs
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    shapes = error_shapes_of(app)
    for path, item in schema.get("paths", {}).items():
        shape = next((sh for sh in shapes if sh.covers(path)), None)
        for method, op in item.items():
            if isinstance(op, dict):
                _fix_operation(path, method, op, limits)
                if shape is not None:
                    _reshape_errors(op, shape)
    return schema


def install_openapi(app: FastAPI, args: Any = None) -> None:
    """Serve :func:`build_openapi` (built on first request, then cached) at /openapi.json."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, args)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

