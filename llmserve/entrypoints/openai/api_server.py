"""The OpenAI-compatible HTTP server (vLLM's ``entrypoints/openai/api_server.py``).

- ``build_app(args)``: the FastAPI app; each endpoint family is mounted by its own
  ``register_*_api_routers(app)`` (one folder per endpoint under ``entrypoints/openai/``
  with its protocol, serving and router parts), plus CORS, API-key auth, X-Request-Id
  and the exception handlers that turn every error into the OpenAI error body.
- ``build_async_engine_client(args)`` / ``build_async_engine_client_from_engine_args``:
  async context managers yielding the EngineClient (AsyncLLM); on exit they shut it
  down within ``--shutdown-timeout``.
- ``init_app_state(engine_client, app.state, args)``: the engine client, the served
  models, the online renderer (``--renderer-num-workers`` threads) and the tokenization
  handler; ``init_generate_state`` adds the chat, completion and responses handlers.
- ``run_server(args)``: serves until SIGINT/SIGTERM (graceful, see ``launcher``) or the
  engine's death; returns 0, or ``ENGINE_DEAD_EXIT_CODE`` (1) when the engine died, so
  that a supervisor (systemd, Kubernetes) restarts it, as vLLM does.

Run: ``llmserve serve [MODEL]`` or ``python -m llmserve.entrypoints.openai.api_server``.
"""
from __future__ import annotations

if __name__ == "__main__":  # this process is the server: transformers without torch (issue 31)
    from llmserve.torch_hiding import import_transformers_without_torch

    import_transformers_without_torch()

import argparse
import asyncio
import contextlib
import logging
import sys
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import llmserve
from llmserve.engine_args import AsyncEngineArgs, UsageContext
from llmserve.gc_utils import freeze_gc_heap
from llmserve.entrypoints.anthropic.api_router import (ANTHROPIC_ERROR_SHAPE, ANTHROPIC_FIT_CHECKS, ANTHROPIC_MODEL_CHECKS,
                                                      register_anthropic_api_routers)
from llmserve.entrypoints.ollama.api_router import OLLAMA_BODY_CHECKS, OLLAMA_ERROR_SHAPE, register_ollama_api_routers
from llmserve.entrypoints.launcher import bind_listening_socket, check_uds_path, serve_http
from llmserve.entrypoints.openai.admission import AdmissionMiddleware, make_admission_controller
from llmserve.entrypoints.openai.admission_precheck import Prechecks, openai_fit_checks, openai_model_checks
from llmserve.entrypoints.openai.basic.api_router import register_basic_api_routers
from llmserve.entrypoints.openai.chat_completion.api_router import register_chat_api_routers
from llmserve.entrypoints.openai.chat_completion.stored import register_stored_chat_api_routers
from llmserve.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from llmserve.entrypoints.openai.cli_args import flag_message, make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.completion.api_router import register_completion_api_routers
from llmserve.entrypoints.openai.common.limits import PromptCharLimit, longest_token_chars
from llmserve.entrypoints.openai.completion.serving import OpenAIServingCompletion
from llmserve.entrypoints.openai.infill.api_router import register_infill_api_routers
from llmserve.entrypoints.openai.classify.api_router import register_classify_api_routers
from llmserve.entrypoints.openai.classify.serving import OpenAIServingClassification
from llmserve.entrypoints.openai.embeddings.api_router import register_embeddings_api_routers
from llmserve.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from llmserve.entrypoints.openai.dp_rank import DataParallelRankMiddleware
from llmserve.entrypoints.openai.error_shapes import ErrorShape, ErrorShapeMiddleware
from llmserve.entrypoints.openai.json_depth import JsonDepthMiddleware
from llmserve.entrypoints.openai.frontend import (add_edge_middleware, add_frontend_routes, configure_handlers,
                                                  fastapi_kwargs, uvicorn_kwargs)
from llmserve.entrypoints.openai.openapi import install_openapi
from llmserve.entrypoints.openai.method_not_allowed import HeadAsGetMiddleware, install_method_not_allowed_handler
from llmserve.entrypoints.openai.models.api_router import register_models_api_routers
from llmserve.entrypoints.openai.models.lora import start_lora_adapters
from llmserve.entrypoints.openai.models.lora_router import register_lora_api_routers
from llmserve.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
from llmserve.entrypoints.openai.multi_api_server import run_api_servers
from llmserve.entrypoints.openai.multi_model import build_extra_engine_clients, init_multi_model_state
from llmserve.entrypoints.openai.kv_event_sources import register_kv_event_sources_api_routers
from llmserve.entrypoints.openai.render import register_render_api_routers
from llmserve.entrypoints.openai.request_timelines.api_router import register_request_timeline_api_routers
from llmserve.entrypoints.openai.request_timelines.labels import RequestLabelsMiddleware
from llmserve.entrypoints.openai.responses.api_router import register_responses_api_routers
from llmserve.entrypoints.openai.responses.serving import OpenAIServingResponses
from llmserve.entrypoints.openai.responses.store import DEFAULT_STORE_MAX_ENTRIES
from llmserve.entrypoints.openai.sagemaker.api_router import SAGEMAKER_BODY_CHECKS, register_sagemaker_api_routers
from llmserve.entrypoints.openai.score.api_router import register_score_api_routers
from llmserve.entrypoints.openai.score.serving import OpenAIServingScores
from llmserve.entrypoints.openai.server_utils import (
    AuthenticationMiddleware,
    RequestIdMiddleware,
    install_exception_handlers,
)
from llmserve.entrypoints.openai.speech_to_text.api_router import (SPEECH_TO_TEXT_BODY_CHECKS,
                                                                   register_speech_to_text_api_routers)
from llmserve.entrypoints.openai.speech_to_text.serving import OpenAIServingSpeechToText
from llmserve.entrypoints.openai.tokenize.api_router import register_tokenize_api_routers
from llmserve.entrypoints.openai.tokenize.serving import OpenAIServingTokenization
from llmserve.entrypoints.openai.vllm_compat_args import expand_config_file
from llmserve.entrypoints.renderer import AsyncRenderer, Renderer
from llmserve.entrypoints.openai.tenants import make_keyring, watch_tenant_models
from llmserve.entrypoints.openai.tenant_quotas import TenantQuotaMiddleware
from llmserve.entrypoints.web.webui import register_webui_routes

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

ENGINE_DEAD_EXIT_CODE = 1

# The event loop shares the GIL with the renderer's threads. Each time it wants the GIL
# back it may wait a whole switch interval per busy thread (CPython's default is 5 ms),
# and one HTTP request needs it several times. 1 ms keeps /health and the streams
# responsive while templates render (measured with 64 slow chat templates on 4 renderer
# threads: median /health latency 63 ms at 5 ms, 17 ms at 1 ms). Set in the server
# process only; it costs nothing while no other thread wants the GIL.
SERVER_SWITCH_INTERVAL_S = 0.001

# Each endpoint family's router registration, in mounting order.
API_ROUTER_REGISTRARS = (
    register_basic_api_routers,
    register_models_api_routers,
    register_chat_api_routers,
    register_completion_api_routers,
    register_infill_api_routers,
    register_tokenize_api_routers,
    register_render_api_routers,
    register_stored_chat_api_routers,  # after render: POST .../render is not a stored id
    register_kv_event_sources_api_routers,
    register_responses_api_routers,
    register_embeddings_api_routers,
    register_sagemaker_api_routers,
    register_score_api_routers,
    register_classify_api_routers,
    register_speech_to_text_api_routers,
    register_anthropic_api_routers,
    register_ollama_api_routers,
    register_request_timeline_api_routers,
)

# The error bodies of the front doors that speak another API than OpenAI's (each
# ErrorShape names its paths); every other path answers OpenAI's body.
ERROR_SHAPES: tuple[ErrorShape, ...] = (ANTHROPIC_ERROR_SHAPE, OLLAMA_ERROR_SHAPE)
# Each front door's first checks, run on a request admission would refuse (admission_precheck.py)
PRECHECKS = Prechecks(by_model={**openai_model_checks(), **ANTHROPIC_MODEL_CHECKS},
                      by_path={**OLLAMA_BODY_CHECKS, **SAGEMAKER_BODY_CHECKS, **SPEECH_TO_TEXT_BODY_CHECKS},
                      fits={**openai_fit_checks(), **ANTHROPIC_FIT_CHECKS})


def build_app(args: argparse.Namespace) -> FastAPI:
    """The FastAPI app: every endpoint family's routers, the exception handlers,
    X-Request-Id, API-key auth (when ``args.api_key``), CORS (outermost, so 401s carry
    CORS headers too)."""
    app = FastAPI(title="llmserve OpenAI-compatible API", version=llmserve.__version__, **fastapi_kwargs(args))
    for register in API_ROUTER_REGISTRARS:
        register(app)
    add_frontend_routes(app, args)  # /load, /tokenizer_info, --middleware
    register_lora_api_routers(app, args)  # /v1/load_lora_adapter... when run-time updating is allowed
    register_webui_routes(app, args)  # the built-in page at / and /live (--no-webui: off)
    app.add_middleware(JsonDepthMiddleware)  # innermost: JSON nested past MAX_JSON_DEPTH is a 400
    app.add_middleware(HeadAsGetMiddleware, router=app.router)  # HEAD on every GET route (inside auth)
    app.add_middleware(DataParallelRankMiddleware)  # X-data-parallel-rank for the handlers (dp_rank.py)
    # 429/503 + deadlines, before any body is parsed; a request it refuses gets its own 400 first
    app.add_middleware(AdmissionMiddleware, state=app.state, prechecks=PRECHECKS, router=app.router)
    # a tenant over its quota: 429 before admission (a malformed request: its own 400 first)
    app.add_middleware(TenantQuotaMiddleware, state=app.state, prechecks=PRECHECKS, router=app.router)
    install_exception_handlers(app)
    install_method_not_allowed_handler(app)  # 405: Allow lists every method of the path
    add_edge_middleware(app, args)  # body limit, JSON for whatever escapes; inside X-Request-Id
    install_openapi(app, args)  # 400 not 422, the error body, /health's JSON, the limits
    app.add_middleware(RequestLabelsMiddleware)  # tenant, ids, traceparent for timelines (inside auth)
    app.add_middleware(RequestIdMiddleware)
    if getattr(args, "api_key", None) or getattr(args, "api_keys_file", None):
        app.state.keyring = make_keyring(args)  # init_app_state checks its allowed_models (watch_tenant_models)
        app.add_middleware(AuthenticationMiddleware, keyring=app.state.keyring)
    app.add_middleware(ErrorShapeMiddleware, shapes=ERROR_SHAPES)  # outside auth: 401s reshaped too
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
        expose_headers=["X-Request-Id"],
    )
    return app


# ----------------------------------------------------------------------------- engine client
@contextlib.asynccontextmanager
async def build_async_engine_client(
    args: argparse.Namespace, *, usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
    stat_loggers: Optional[list] = None, client_config: Optional[dict[str, Any]] = None,
) -> AsyncIterator[Any]:
    """``async with build_async_engine_client(args) as engine_client``: the AsyncLLM of
    the parsed serve flags (see :func:`build_async_engine_client_from_engine_args`)."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    async with build_async_engine_client_from_engine_args(
            engine_args, usage_context=usage_context, stat_loggers=stat_loggers,
            client_config=client_config) as engine_client:
        yield engine_client


@contextlib.asynccontextmanager
async def build_async_engine_client_from_engine_args(
    engine_args: AsyncEngineArgs, *, usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
    stat_loggers: Optional[list] = None, client_config: Optional[dict[str, Any]] = None,
) -> AsyncIterator[Any]:
    """Start an AsyncLLM (its EngineCore process) for ``engine_args`` and yield it; on
    exit (normal, exception or cancellation) ``engine_client.shutdown(timeout=
    engine_args.shutdown_timeout)``.

    stat_loggers: stat logger instances; a PrometheusStatLogger (served at /metrics,
    labelled with this server's data-parallel rank) is added when none is given.
    client_config: ``client_addresses``/``client_count``/``client_index`` for AsyncLLM
    (one of several API servers, see multi_api_server.py). Raises ValueError for bad
    arguments or an unknown model.
    """
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.metrics.prometheus import PrometheusStatLogger

    config = engine_args.create_engine_config(usage_context)
    loggers = list(stat_loggers or [])
    if not any(isinstance(sl, PrometheusStatLogger) for sl in loggers):
        pc = config.parallel_config  # the first rank this server's engines run (hybrid LB: the node's)
        first = pc.data_parallel_rank if pc.data_parallel_external_lb else \
            pc.data_parallel_start_rank if pc.data_parallel_hybrid_lb else 0
        loggers.append(PrometheusStatLogger(config, engine_index=first))
    # vLLM's name is from_vllm_config; engines that predate it have from_engine_config.
    make = getattr(AsyncLLM, "from_vllm_config", None) or AsyncLLM.from_engine_config
    # The prompt-length limit (init_app_state) decodes the whole vocabulary, ~0.2 s: done
    # in the tokenizer's thread while the engine loads, not after (its result is memoized).
    engine_client = make(config, log_requests=not engine_args.disable_log_requests,
                         log_stats=not engine_args.disable_log_stats, stat_loggers=loggers,
                         on_tokenizer=longest_token_chars, **(client_config or {}))
    try:
        yield engine_client
    finally:
        # The server drained or aborted its requests already; the engine process gets
        # --shutdown-timeout seconds to exit (0: its default of 5 s) before it is killed.
        engine_client.shutdown(timeout=engine_args.shutdown_timeout or None)


# ----------------------------------------------------------------------------- app state
def _prometheus_logger(engine_client: Any) -> Any:
    from llmserve.metrics.prometheus import PrometheusStatLogger

    return next((sl for sl in getattr(engine_client, "stat_loggers", ()) if isinstance(sl, PrometheusStatLogger)),
                None)


def _import_torch_for_pooling(model_config: Any) -> None:
    """Import torch now when the model pools (``runner == "pooling"``): its outputs reach
    this process as tensors (engine/serial.py decodes them with torch), so the import is
    paid at start, as before issue 31, not by the first /v1/embeddings request (~2-3 s on
    2 cores). A generating model's server never imports torch."""
    if getattr(model_config, "runner", "generate") == "pooling":
        import torch  # noqa: F401


async def init_app_state(engine_client: Any, state: Any, args: argparse.Namespace,
                         stat_logger: Any = None) -> None:
    """Put on ``state``: the engine client, the served model names, the online renderer
    (``--chat-template``, ``--renderer-num-workers`` threads), the tokenization and
    embeddings handlers, then the generation handlers (:func:`init_generate_state`).

    stat_logger: the PrometheusStatLogger served at /metrics (default: the one among
    the engine client's ``stat_loggers``). Raises ValueError for a bad chat template or
    renderer_num_workers.
    """
    model_config = engine_client.model_config
    _import_torch_for_pooling(model_config)
    names = list(model_config.served_model_name or getattr(args, "served_model_name", None) or [args.model])
    models = OpenAIServingModels([BaseModelPath(n, model_config.model) for n in names], model_config.max_model_len)
    state.lora_adapters = await start_lora_adapters(engine_client, names, getattr(args, "lora_modules", None))
    models.lora = [state.lora_adapters] if state.lora_adapters is not None else []
    log_requests = not getattr(args, "disable_log_requests", True)
    renderer = Renderer(engine_client.tokenizer, getattr(args, "chat_template", None),
                        PromptCharLimit.for_tokenizer(engine_client.tokenizer, model_config.max_model_len))
    state.engine_client = engine_client
    state.stat_logger = stat_logger if stat_logger is not None else _prometheus_logger(engine_client)
    state.admission = make_admission_controller(engine_client, args, state.stat_logger)
    state.openai_serving_models = models
    state.openai_serving_render = AsyncRenderer.from_args(renderer, args)  # + request-template sandbox
    state.openai_serving_tokenization = OpenAIServingTokenization(
        engine_client, models, state.openai_serving_render, log_requests=log_requests)
    state.openai_serving_embedding = OpenAIServingEmbedding(engine_client, models, state.openai_serving_render,
                                                            log_requests=log_requests)
    state.openai_serving_scores = OpenAIServingScores(engine_client, models, state.openai_serving_render,
                                                      log_requests=log_requests)
    state.openai_serving_classification = OpenAIServingClassification(
        engine_client, models, state.openai_serving_render, log_requests=log_requests)
    state.max_audio_file_bytes = getattr(args, "max_audio_file_bytes", None)
    state.openai_serving_transcription = OpenAIServingSpeechToText(
        engine_client, models, log_requests=log_requests,
        **({"max_audio_file_bytes": state.max_audio_file_bytes} if state.max_audio_file_bytes else {}))
    await init_generate_state(engine_client, state, args)
    watch_tenant_models(state)  # warn about allowed_models not served (app state only: it has the keyring)


async def init_generate_state(engine_client: Any, state: Any, args: argparse.Namespace) -> None:
    """Put the generation handlers on ``state`` (chat, completion, responses), sharing
    ``state.openai_serving_models`` and ``state.openai_serving_render``."""
    models, renderer = state.openai_serving_models, state.openai_serving_render
    log_requests = not getattr(args, "disable_log_requests", True)
    state.openai_serving_chat = OpenAIServingChat(engine_client, models, renderer, log_requests=log_requests)
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models, renderer,
                                                              log_requests=log_requests)
    state.openai_serving_responses = OpenAIServingResponses(
        engine_client, models, renderer, log_requests=log_requests,
        store_max_entries=getattr(args, "responses_store_max_entries", None) or DEFAULT_STORE_MAX_ENTRIES,
        unsupported_tools=getattr(args, "responses_unsupported_tools", None) or "drop")
    configure_handlers(state, args)


def shutdown_app_state(state: Any) -> None:
    """Stop what ``init_app_state`` started (the renderer pool); the engine client is
    shut down by the context manager that built it."""
    for model_state in getattr(state, "served_models", None) or [state]:  # one per model (multi_model)
        renderer = getattr(model_state, "openai_serving_render", None)
        if renderer is not None:
            renderer.shutdown()


# ----------------------------------------------------------------------------- serving
async def run_server(args: argparse.Namespace, sock: Any = None,
                     client_config: Optional[dict[str, Any]] = None) -> int:
    """Start the engine and serve until SIGINT/SIGTERM or the engine's death, then shut
    the engine down. Returns the process exit code: 0 after a signal,
    ``ENGINE_DEAD_EXIT_CODE`` (1) when the server stopped because the engine died.
    sock / client_config: one of several API servers (``multi_api_server.py``): serve on
    this already-bound socket, over engines started by the launcher. Alone, the server
    binds its socket before the engine starts (``bind_listening_socket``; ValueError when
    the host/port cannot be bound)."""
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    if getattr(args, "uds", None):
        check_uds_path(args.uds)  # uvicorn binds it only after the model loaded
    elif sock is None:
        sock = bind_listening_socket(args.host, args.port)
    async with build_async_engine_client(args, client_config=client_config) as engine_client, \
            build_extra_engine_clients(args, build_async_engine_client_from_engine_args) as extras:
        app = build_app(args)
        if extras:  # --extra-model: one engine per model, chosen per request by `model`
            engine_client = await init_multi_model_state([(engine_client, args), *extras], app.state,
                                                         init_app_state)
        else:
            await init_app_state(engine_client, app.state, args)
        if client_config is not None:
            from llmserve.entrypoints.openai.multi_api_server import ApiServerIndexMiddleware

            app.add_middleware(ApiServerIndexMiddleware, index=client_config["client_index"])
        host = args.host if args.host is not None else "0.0.0.0"
        port = sock.getsockname()[1] if sock is not None else args.port  # --port 0: the one bound
        logger.info("Serving %s on http://%s:%d (OpenAI API at /v1)",
                    ", ".join(app.state.openai_serving_models.model_names), host, port)
        freeze_gc_heap("API server")  # no full-GC pauses of the event loop (gc_utils)
        engine_died = False
        try:
            engine_died = await serve_http(
                app, engine_client, host=host, port=args.port, log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_graceful_shutdown=args.shutdown_timeout or args.timeout_graceful_shutdown,
                sockets=[sock] if sock is not None else None, **uvicorn_kwargs(args))
        finally:
            shutdown_app_state(app.state)
    logger.info("Engine shut down.")
    if engine_died:
        logger.error("Exiting with code %d: the engine died.", ENGINE_DEAD_EXIT_CODE)
        return ENGINE_DEAD_EXIT_CODE
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m llmserve.entrypoints.openai.api_server [flags]``."""
    parser = make_arg_parser()
    args = parser.parse_args(expand_config_file(list(sys.argv[1:] if argv is None else argv), parser))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        validate_parsed_serve_args(args)
        code = run_api_servers(args, run_server)
    except ValueError as e:  # a bad flag or model: one line naming the flag typed, not a traceback
        parser.exit(2, f"{parser.prog}: error: {flag_message(str(e), parser)}\n")
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
