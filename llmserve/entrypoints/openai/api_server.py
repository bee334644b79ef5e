"""The OpenAI-compatible HTTP server (vLLM's ``entrypoints/openai/api_server.py``).

``build_app(args)`` makes the FastAPI app (routes, CORS, API-key auth, X-Request-Id,
exception handlers turning every error into the OpenAI error body);
``init_app_state(engine_client, app.state, args)`` puts the engine and the handlers on
``app.state``; ``run_server(args)`` starts an AsyncLLM and serves until SIGINT/SIGTERM
(in-flight requests get ``--timeout-graceful-shutdown`` seconds to finish; those still
running then end with finish_reason "abort", streams with their last chunk and
``[DONE]``), then shuts the engine process down. If the EngineCore dies, the server
hands the error to the requests in flight (503, or an error chunk in a stream), shuts
itself down the same way and ``run_server`` returns exit code 1, so that a supervisor
(systemd, Kubernetes) restarts it, as vLLM does.

Run: ``llmserve serve [MODEL]`` or ``python -m llmserve.entrypoints.openai.api_server``.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import sys
import uuid
from typing import Any, Awaitable, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

import llmserve
from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_engine import error_response_from_exception, make_error
from llmserve.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
from llmserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

REQUEST_ID_SCOPE_KEY = "llmserve.request_id"
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

router = APIRouter()


# ----------------------------------------------------------------------------- responses
def json_response(model: Any, status_code: int = 200) -> Response:
    """A pydantic model as strict JSON (no NaN/Infinity: logprobs are clamped upstream)."""
    return Response(content=model.model_dump_json(), status_code=status_code, media_type="application/json")


def error_json(exc: BaseException) -> Response:
    status, body = error_response_from_exception(exc)
    return json_response(body, status)


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


def _request_id(raw_request: Request) -> Optional[str]:
    return raw_request.scope.get(REQUEST_ID_SCOPE_KEY)


def _result_response(result: Any) -> Response:
    if result is None:  # client went away
        return Response(status_code=499)
    if hasattr(result, "model_dump_json"):
        return json_response(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ----------------------------------------------------------------------------- routes
@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine runs, 503 once it is dead."""
    try:
        await raw_request.app.state.engine_client.check_health()
    except EngineDeadError as e:
        return json_response(make_error(f"The engine is dead: {e}", 503, err_type="EngineDeadError"), 503)
    return Response(status_code=200)


@router.get("/version")
async def version() -> Response:
    return Response(content=f'{{"version":"{llmserve.__version__}"}}', media_type="application/json")


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """Prometheus text format of the engine metrics (running/waiting gauges refreshed
    from the engine at scrape time when it answers within a second)."""
    state = raw_request.app.state
    stat_logger = getattr(state, "stat_logger", None)
    if stat_logger is None:
        return Response(content=b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    engine = state.engine_client
    get_stats = getattr(engine, "get_engine_stats", None)
    if get_stats is not None and not engine.errored:
        try:
            stat_logger.set_engine_stats(await asyncio.wait_for(get_stats(), timeout=1.0))
        except Exception as e:  # a busy or dead engine: serve the last recorded values
            logger.debug("engine stats unavailable at scrape: %s", e)
    return Response(content=stat_logger.render(), media_type=stat_logger.content_type)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return json_response(raw_request.app.state.openai_serving_models.show_available_models())


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
    return _result_response(await with_cancellation(
        raw_request, handler.create_chat_completion(request, _request_id(raw_request))))


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
    return _result_response(await with_cancellation(
        raw_request, handler.create_completion(request, _request_id(raw_request))))


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return json_response(await raw_request.app.state.openai_serving_tokenization.create_tokenize(request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return json_response(await raw_request.app.state.openai_serving_tokenization.create_detokenize(request))


@router.post("/v1/responses")
async def create_responses(request: ResponsesRequest, raw_request: Request) -> Response:
    await raw_request.app.state.openai_serving_tokenization.check_responses(request)
    raise NotImplementedError("/v1/responses is not supported yet")  # check_responses always raises


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    await raw_request.app.state.openai_serving_tokenization.check_embeddings(request)
    raise NotImplementedError("/v1/embeddings is not supported yet")  # check_embeddings always raises


# ----------------------------------------------------------------------------- middleware
class RequestIdMiddleware:
    """Pure ASGI middleware: echo the client's ``X-Request-Id`` (or a new uuid) in the
    response headers and expose it to the routes (engine request ids are built from it)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = rid

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        await self.app(scope, receive, send_with_id)


class AuthenticationMiddleware:
    """Pure ASGI middleware: require ``Authorization: Bearer <api key>`` on /v1/* and the
    tokenizer routes (constant-time comparison); /health, /metrics, /version stay open;
    CORS preflight (OPTIONS) passes. A bad or missing key gets 401 with the OpenAI body."""

    def __init__(self, app: Any, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode("utf-8") for k in api_keys]

    def _authorized(self, scope: dict) -> bool:
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode("utf-8")
        ok = False
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "") or ""
        path = scope["path"][len(root):] if root and scope["path"].startswith(root) else scope["path"]
        if path.startswith(_PROTECTED_PREFIXES) and not self._authorized(scope):
            body = make_error("Invalid or missing API key. Send 'Authorization: Bearer <key>'.", 401,
                              err_type="AuthenticationError")
            response = json_response(body, 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------- app
def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error")
            parts.append(f"Invalid JSON in the request body: {detail or msg}")
            continue
        if not loc:
            parts.append(f"The request body must be a JSON object with the request fields ({msg}).")
            continue
        if param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}")
    return "; ".join(parts) or "Invalid request.", param


def _install_exception_handlers(app: FastAPI) -> None:
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return json_response(make_error(message, 400, param), 400)

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        response = json_response(make_error(detail, exc.status_code), exc.status_code)
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    async def on_error(_: Request, exc: Exception) -> Response:
        return error_json(exc)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    for exc_type in (ValueError, LookupError, NotImplementedError, EngineDeadError, Exception):
        app.add_exception_handler(exc_type, on_error)


def build_app(args: argparse.Namespace) -> FastAPI:
    """The FastAPI app: routes, exception handlers, X-Request-Id, API-key auth (when
    ``args.api_key``), CORS (outermost, so 401s carry CORS headers too)."""
    app = FastAPI(title="llmserve OpenAI-compatible API", version=llmserve.__version__,
                  root_path=getattr(args, "root_path", None) or "")
    app.include_router(router)
    _install_exception_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    if getattr(args, "api_key", None):
        app.add_middleware(AuthenticationMiddleware, api_keys=[args.api_key])
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
        expose_headers=["X-Request-Id"],
    )
    return app


async def init_app_state(engine_client: Any, state: Any, args: argparse.Namespace,
                         stat_logger: Any = None) -> None:
    """Put the engine, the served model names and one handler per endpoint family on
    ``state`` (all sharing ``engine_client``). ``stat_logger``: the PrometheusStatLogger
    registered with the engine (served at /metrics)."""
    model_config = engine_client.model_config
    names = list(model_config.served_model_name or getattr(args, "served_model_name", None) or [args.model])
    models = OpenAIServingModels([BaseModelPath(n, model_config.model) for n in names], model_config.max_model_len)
    log_requests = not getattr(args, "disable_log_requests", True)
    chat_template = getattr(args, "chat_template", None)
    state.engine_client = engine_client
    state.stat_logger = stat_logger
    state.openai_serving_models = models
    state.openai_serving_chat = OpenAIServingChat(engine_client, models, chat_template=chat_template,
                                                  log_requests=log_requests)
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models, log_requests=log_requests)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine_client, models,
                                                                  chat_template=chat_template)


def _make_uvicorn_server(config: Any, on_drain_timeout: Optional[Callable[[], Awaitable[Any]]] = None) -> Any:
    """A uvicorn Server that handles SIGINT/SIGTERM as a graceful shutdown and then
    returns (stock uvicorn re-raises the signal after serving, which would kill the
    process before the engine is shut down).

    ``on_drain_timeout``: awaited half a second before the graceful-shutdown period
    (``config.timeout_graceful_shutdown``) runs out, to end the requests still in flight
    cleanly (``AsyncLLM.abort_all``: streams get a last chunk with finish_reason "abort"
    and ``[DONE]``) instead of having uvicorn cancel their tasks mid-response."""
    import contextlib
    import signal
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):  # noqa: ANN001, ANN202
            grace = self.config.timeout_graceful_shutdown
            task = None
            if on_drain_timeout is not None and grace is not None:
                async def _end_in_flight() -> None:
                    await asyncio.sleep(max(grace - 0.5, 0.0))
                    try:
                        await on_drain_timeout()
                    except Exception:
                        logger.exception("aborting in-flight requests at shutdown failed")
                task = asyncio.create_task(_end_in_flight())
            try:
                await super().shutdown(sockets)
            finally:
                if task is not None:
                    task.cancel()

    return _Server(config)


ENGINE_DEAD_EXIT_CODE = 1


async def _shutdown_when_engine_dies(server: Any, engine: Any) -> None:
    """Wait for the engine to die, then ask uvicorn to shut down (``server.should_exit``).

    By then the requests in flight hold their EngineDeadError and end with a 503 or an
    error chunk within the graceful-shutdown period; until the listening socket closes,
    new requests and /health get 503."""
    err = await engine.wait_for_engine_death()
    logger.error("EngineCore died (%s); shutting down the API server",
                 str(err).removeprefix("EngineCore died: "))
    server.should_exit = True


async def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve until SIGINT/SIGTERM or the engine's death, then shut
    the engine down. Returns the process exit code: 0 after a signal,
    ``ENGINE_DEAD_EXIT_CODE`` (1) when the server stopped because the engine died."""
    import uvicorn

    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.engine_args import AsyncEngineArgs, UsageContext
    from llmserve.metrics.prometheus import PrometheusStatLogger

    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    stat_logger = PrometheusStatLogger(config)
    engine = AsyncLLM.from_engine_config(config, log_requests=not engine_args.disable_log_requests,
                                         log_stats=not engine_args.disable_log_stats,
                                         stat_loggers=[stat_logger])
    try:
        app = build_app(args)
        await init_app_state(engine, app.state, args, stat_logger=stat_logger)
        host = args.host if args.host is not None else "0.0.0.0"
        server = _make_uvicorn_server(uvicorn.Config(
            app, host=host, port=args.port, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=args.timeout_graceful_shutdown, timeout_keep_alive=5),
            on_drain_timeout=engine.abort_all)
        logger.info("Serving %s on http://%s:%d (OpenAI API at /v1)", ", ".join(config.model_config.served_model_name),
                    host, args.port)
        watchdog = asyncio.create_task(_shutdown_when_engine_dies(server, engine))
        try:
            await server.serve()
        finally:
            watchdog.cancel()
    finally:
        engine.shutdown()
        logger.info("Engine shut down.")
    if engine.errored:
        logger.error("Exiting with code %d: the engine died.", ENGINE_DEAD_EXIT_CODE)
        return ENGINE_DEAD_EXIT_CODE
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m llmserve.entrypoints.openai.api_server [flags]``."""
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        validate_parsed_serve_args(args)
        code = asyncio.run(run_server(args))
    except ValueError as e:  # a bad flag or model: one line, not a traceback
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
