"""Ollama's API on the OpenAI server's port: thin routes over ``serving.py`` / ``info.py``.

``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``,
``POST /api/chat``, ``POST /api/generate``, ``POST /api/embed``, ``POST /api/embeddings``.
The server serves the models it was started with, so Ollama's model management routes
change nothing (``manage.py``): ``/api/pull`` of a served model succeeds at once (clients
that pull before they chat go on), of another is Ollama's 404; ``/api/push``,
``/api/delete`` and ``/api/copy`` are Ollama's 404 for an unknown model and 501 for a
served one; ``/api/create`` and ``/api/blobs`` answer 501. Each says what to do instead. Errors take
Ollama's body ``{"error": "<message>"}`` through :data:`OLLAMA_ERROR_SHAPE` (registered in
``api_server.ERROR_SHAPES``), whoever produced them; streams are NDJSON
(``application/x-ndjson``), as Ollama's.
"""
from __future__ import annotations

import json
import re
from typing import Any, NoReturn, Optional, TypeVar

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

import llmserve
from llmserve.entrypoints.ollama import info
from llmserve.entrypoints.ollama.go_errors import GO_STRUCTS, go_type_error
from llmserve.entrypoints.ollama.go_json import zero_nulls
from llmserve.entrypoints.ollama.manage import copy_model, delete_model, not_available, pull_model, push_model
from llmserve.entrypoints.ollama.protocol import (OllamaChatRequest, OllamaCopyRequest, OllamaDeleteRequest,
                                                  OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                                                  OllamaPullRequest, OllamaPushRequest, OllamaShowRequest)
from llmserve.entrypoints.ollama.serving import (check_chat, check_generate, serve_chat, serve_embed, serve_embeddings,
                                                 serve_generate, served_name)
from llmserve.entrypoints.openai.error_shapes import ErrorShape
from llmserve.entrypoints.openai.server_utils import request_id_of, with_cancellation
from llmserve.entrypoints.openai.tenants import tenant_sees_model
from llmserve.sampling_params import SamplingParamsError

router = APIRouter()
T = TypeVar("T", bound=BaseModel)
NDJSON = "application/x-ndjson"
# The User-Agent prefix of VS Code's Copilot Chat (Ollama's routes.go treats it apart in /api/show).
COPILOT_CHAT_USER_AGENT = "GitHubCopilotChat/"
UNSUPPORTED = {"/api/create": "POST", "/api/blobs/{digest}": "POST"}


def ollama_error_body(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """Ollama's error body: ``{"error": "<message>"}`` (the status stays)."""
    return {"error": error.get("message", "")}


OLLAMA_ERROR_SHAPE = ErrorShape(prefixes=("/api/",), shape=ollama_error_body)


async def _body(raw_request: Request, model: type[T]) -> T:
    """The request body as ``model``, whatever its Content-Type: Ollama reads JSON from
    any body (its documented ``curl -d '{...}'`` sends a form content type). Valid JSON
    that pydantic's parser refuses (a lone UTF-16 surrogate escape, ``"\\ud800x"``) is read
    as Go's encoding/json reads it (:func:`_go_json`), and so is ``null`` anywhere (the
    field's zero value: go_json.py). An empty body is Ollama's 400 "missing request body".
    Invalid JSON or fields are a 400 naming them (the validation handler's message: invalid
    JSON keeps the first parser's, and says so when the body is not UTF-8 either)."""
    return parse_body(await raw_request.body(), model)


def parse_body(body: bytes, model: type[T]) -> T:
    """The body as ``model``, as :func:`_body` reads it (the same errors)."""
    if not body.strip():
        raise SamplingParamsError("missing request body", None)
    struct = GO_STRUCTS[model.__name__]
    body = zero_nulls(struct, body)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        if any(err.get("type") == "json_invalid" for err in e.errors()):
            repaired = _go_json(body)
            if repaired is not None:
                repaired = zero_nulls(struct, repaired)
                try:
                    return model.model_validate_json(repaired)
                except ValidationError as e2:
                    _refuse(model, e2.errors(), repaired)
            _refuse_not_utf8(body)
        _refuse(model, e.errors(), body)


def _refuse_not_utf8(body: bytes) -> None:
    """The 400 of a body that is not JSON even read as Go reads it and not UTF-8 either:
    an invalid byte outside any string (Go refuses that too; inside a string it becomes
    U+FFFD). Names the first invalid byte and its offset, not pydantic's position in a
    text it could not decode ("expected value at line 1 column 1"). Returns when the body
    is UTF-8 (its JSON error is said as it is)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SamplingParamsError(
            f"Invalid JSON in the request body: byte 0x{body[e.start:e.start + 1].hex()} at offset {e.start} is not "
            "UTF-8 and stands outside a string (invalid UTF-8 is read inside strings only, as U+FFFD, as Ollama "
            "reads it); send JSON encoded as UTF-8.", None) from None


def _refuse(model: type[BaseModel], errors: list[dict[str, Any]], body: bytes) -> NoReturn:
    """Raise the 400 of a body that ``model`` refused. A value of the wrong JSON type first
    (in the body's order) gets Go's decoder message, as Ollama answers it (go_errors.py:
    ``json: cannot unmarshal number into Go struct field ShowRequest.model of type
    string``); anything else gets the validation handler's ``<field>: <problem>`` message.
    The location gets FastAPI's ``body`` source and the parsed body goes with it, so the
    handler tells a field called like a pydantic label (``model``) from a label."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # invalid JSON: pydantic's json_invalid error says where
        parsed = None
    if parsed is not None:
        go = go_type_error(model.__name__, errors, parsed)
        if go is not None:
            raise SamplingParamsError(*go)
    located = [{**err, "loc": ("body", *err.get("loc", ()))} for err in errors]
    raise RequestValidationError(located, body=parsed)


# A UTF-16 surrogate code point left in a parsed string: Python's json pairs the valid
# high+low escapes into one character, so any left is a lone one.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _go_json(body: bytes) -> bytes | None:
    """``body`` re-encoded as strict UTF-8 JSON with each lone surrogate escape (and each
    invalid UTF-8 byte) replaced by U+FFFD, as Go's encoding/json (Ollama) decodes them;
    None when the body is not JSON for another reason (so the caller keeps the first
    parser's error). pydantic's parser (jiter) rejects ``"\\ud800"`` as "unexpected end
    of hex escape" although RFC 8259 allows it; only such bodies take this slower path."""
    try:
        value = json.loads(body.decode("utf-8", "replace"))  # NaN too, as pydantic's parser takes it
    except (ValueError, RecursionError):
        return None
    text = json.dumps(value, ensure_ascii=False)
    return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


def _respond(result: Any, headers: dict[str, str] | None = None) -> Response:
    """499 when the client went away, JSON for an object, else the NDJSON stream."""
    if result is None:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    return StreamingResponse(result, media_type=NDJSON, headers=headers)


@router.get("/api/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": info.OLLAMA_API_VERSION, "llmserve_version": llmserve.__version__})


@router.get("/api/tags")
async def tags(raw_request: Request) -> JSONResponse:
    return JSONResponse(_visible(raw_request, info.tags(raw_request.app.state)))


@router.get("/api/ps")
async def ps(raw_request: Request) -> JSONResponse:
    return JSONResponse(_visible(raw_request, info.ps(raw_request.app.state)))


def _visible(raw_request: Request, listing: dict) -> dict:
    """The listing without the models the caller's tenant may not call (``allowed_models``)."""
    return {**listing, "models": [m for m in listing["models"] if tenant_sees_model(raw_request, m["name"])]}


@router.post("/api/show")
async def show(raw_request: Request) -> JSONResponse:
    request = await _body(raw_request, OllamaShowRequest)
    model = request.model or request.name
    if not model:
        raise SamplingParamsError("model is required.", "model")
    # VS Code Copilot Chat names a model by model_info's general.basename (Ollama puts the
    # name the client asked for there, for that client only) and chats through /v1
    copilot = raw_request.headers.get("user-agent", "").startswith(COPILOT_CHAT_USER_AGENT)
    return JSONResponse(info.show(raw_request.app.state, model, copilot=copilot))


@router.post("/api/chat")
async def chat(raw_request: Request) -> Response:
    request = await _body(raw_request, OllamaChatRequest)
    result = await with_cancellation(raw_request, serve_chat(raw_request.app.state, request,
                                                             request_id_of(raw_request)))
    return _respond(*(result if result is not None else (None,)))


@router.post("/api/generate")
async def generate(raw_request: Request) -> Response:
    request = await _body(raw_request, OllamaGenerateRequest)
    return _respond(await with_cancellation(raw_request, serve_generate(raw_request.app.state, request,
                                                                        request_id_of(raw_request))))


@router.post("/api/embed")
async def embed(raw_request: Request) -> Response:
    request = await _body(raw_request, OllamaEmbedRequest)
    return _respond(await with_cancellation(raw_request, serve_embed(raw_request.app.state, request)))


@router.post("/api/embeddings")
async def embeddings(raw_request: Request) -> Response:
    request = await _body(raw_request, OllamaEmbeddingsRequest)
    return _respond(await with_cancellation(raw_request, serve_embeddings(raw_request.app.state, request)))


@router.post("/api/pull", include_in_schema=False)  # as the 501 routes were: nothing to document
async def pull(raw_request: Request) -> Response:
    return _respond(pull_model(raw_request.app.state, await _body(raw_request, OllamaPullRequest)))


@router.post("/api/push", include_in_schema=False)
async def push(raw_request: Request) -> Response:
    push_model(raw_request.app.state, await _body(raw_request, OllamaPushRequest))


@router.delete("/api/delete", include_in_schema=False)
async def delete(raw_request: Request) -> Response:
    delete_model(raw_request.app.state, await _body(raw_request, OllamaDeleteRequest))


@router.post("/api/copy", include_in_schema=False)
async def copy(raw_request: Request) -> Response:
    copy_model(raw_request.app.state, await _body(raw_request, OllamaCopyRequest))


def _unsupported(path: str) -> Any:
    async def route() -> None:
        raise HTTPException(501, not_available(path))
    return route


for _path, _method in UNSUPPORTED.items():
    router.add_api_route(_path, _unsupported(_path), methods=[_method], include_in_schema=False)


@router.head("/api/blobs/{digest}", include_in_schema=False)
async def blob_exists(digest: str) -> None:
    """``HEAD /api/blobs/<digest>``: Ollama's check before an upload (the Go client's
    ``ollama create``) answers 404 for a blob it lacks; no blob is stored here, so always
    404 (it was a 405, which that client reports as a failure of its own). The upload
    that follows is the 501 of ``POST /api/blobs``."""
    raise HTTPException(404, "blob not found: llmserve stores no blobs; " + not_available("/api/blobs/{digest}"))


async def _check_chat_body(state: Any, body: bytes, _content_type: Optional[str] = None) -> None:
    await check_chat(state, parse_body(body, OllamaChatRequest))


async def _check_generate_body(state: Any, body: bytes, _content_type: Optional[str] = None) -> None:
    await check_generate(state, parse_body(body, OllamaGenerateRequest))


def _check_embed_body(model: type[BaseModel]) -> Any:
    """The embedding routes' first checks: the body parsed, the model it names served
    (serve_embed / serve_embeddings, with their 404)."""
    async def check(state: Any, body: bytes, _content_type: Optional[str] = None) -> None:
        served_name(state, parse_body(body, model).model, pull_hint=True)
    return check


# Path -> the checks its route runs before rendering (admission_precheck.Prechecks.by_path):
# a request admission would refuse gets its own 400 first.
OLLAMA_BODY_CHECKS = {"/api/chat": _check_chat_body, "/api/generate": _check_generate_body,
                      "/api/embed": _check_embed_body(OllamaEmbedRequest),
                      "/api/embeddings": _check_embed_body(OllamaEmbeddingsRequest)}


def register_ollama_api_routers(app: FastAPI) -> None:
    """Mount Ollama's routes under /api/."""
    app.include_router(router)
