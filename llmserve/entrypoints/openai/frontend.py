"""How vLLM's frontend flags shape the app, the handlers and uvicorn (see
:mod:`llmserve.entrypoints.openai.vllm_compat_args` for the flags themselves):

- :func:`fastapi_kwargs`: ``--root-path``, ``--disable-fastapi-docs``.
- :func:`add_frontend_routes`: ``/load`` (``--enable-server-load-tracking``),
  ``/tokenizer_info`` (``--enable-tokenizer-info-endpoint``), ``--middleware``.
- :func:`configure_handlers`: usage flags, ``--response-role``,
  ``--return-tokens-as-token-ids``, ``--max-log-len`` on the chat/completion handlers.
- :func:`uvicorn_kwargs`: ``--uds``, SSL, ``--h11-max-incomplete-event-size``,
  ``--timeout-keep-alive``, ``--timeout-request-headers``, ``--log-config-file``.
- :func:`add_http_edge_args` / :func:`add_edge_middleware`: the request-body limit and
  the body/header timeouts (see :mod:`~llmserve.entrypoints.openai.http_edges`).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging.config
from typing import Any

from fastapi import FastAPI

from llmserve.entrypoints.openai.chat_completion.tool_args import configure_tool_calling
from llmserve import envs
from llmserve.entrypoints.openai.common.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from llmserve.entrypoints.openai.common.usage import UsageOptions
from llmserve.entrypoints.openai.http_edges import (BODY_CUT_GRACE_S, BODY_RATE_GRACE_S,
                                                    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                                                    DEFAULT_MAX_REQUEST_BODIES_PER_CLIENT,
                                                    DEFAULT_MIN_REQUEST_BODY_RATE, BodyLimitMiddleware,
                                                    EdgeGuardMiddleware, h11_protocol_with_header_timeout)
from llmserve.entrypoints.openai.logprobs import TokenFormatter
from llmserve.entrypoints.openai.server_load import register_server_load_api_routers
from llmserve.entrypoints.openai.tokenize.tokenizer_info import register_tokenizer_info_api_router


class TokenIdFormatter(TokenFormatter):
    """Logprob tokens as ``token_id:N`` (vLLM's ``--return-tokens-as-token-ids``); the
    bytes are those of that string, as vLLM sends them."""

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode("utf-8"))


def fastapi_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``FastAPI(...)`` arguments of the flags: root path, and no docs routes when
    ``--disable-fastapi-docs``."""
    kwargs: dict[str, Any] = {"root_path": getattr(args, "root_path", None) or ""}
    if getattr(args, "disable_fastapi_docs", False):
        kwargs.update(openapi_url=None, docs_url=None, redoc_url=None)
    return kwargs


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"--middleware: {path!r} is not an import path like 'package.module.name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware: cannot import {path!r} ({e})") from None


def add_frontend_routes(app: FastAPI, args: argparse.Namespace) -> None:
    """Mount ``/load`` (counting when ``--enable-server-load-tracking``), ``/tokenizer_info``
    when enabled, and each ``--middleware`` (a class: ``app.add_middleware``; a function:
    ``app.middleware("http")``, as vLLM). Raises ValueError for an unimportable middleware."""
    register_server_load_api_routers(app, bool(getattr(args, "enable_server_load_tracking", False)))
    from llmserve.entrypoints.openai.sleep_mode import register_sleep_mode_routers

    register_sleep_mode_routers(app, args)
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        register_tokenizer_info_api_router(app)
    for path in getattr(args, "middleware", None) or []:
        obj = _import(path)
        if inspect.isclass(obj):
            app.add_middleware(obj)
        elif inspect.iscoroutinefunction(obj):
            app.middleware("http")(obj)
        else:
            raise ValueError(f"--middleware: {path!r} is neither a class nor an async function")


def configure_handlers(state: Any, args: argparse.Namespace) -> None:
    """Apply the usage, role, token-format and log-length flags to the generation handlers
    on ``state`` (those that exist)."""
    usage = UsageOptions.from_args(args)
    as_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
    for name in ("openai_serving_chat", "openai_serving_completion", "openai_serving_responses"):
        handler = getattr(state, name, None)
        if handler is None:
            continue
        handler.usage_options = usage
        handler.max_log_len = getattr(args, "max_log_len", None)
        handler.enable_per_request_metrics = bool(getattr(args, "enable_per_request_metrics", False))
        if name == "openai_serving_chat":
            handler.response_role = getattr(args, "response_role", None) or "assistant"
        if name in ("openai_serving_chat", "openai_serving_responses"):  # the same tool/reasoning flags
            configure_tool_calling(handler, args)
        if as_ids and hasattr(handler, "token_formatter"):
            handler.token_formatter = TokenIdFormatter(handler.tokenizer)


def add_http_edge_args(group: argparse._ArgumentGroup) -> None:
    """The flags that bound what one connection may hold: body size, keep-alive (uvicorn's
    ``timeout_keep_alive``; vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and the header and
    body read timeouts."""
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="Largest request body in bytes; a larger one gets 413 before it is parsed "
                            "(0: no limit).")
    group.add_argument("--max-audio-file-bytes", type=int, default=25 * 1024 * 1024,
                       help="Largest audio file /v1/audio/transcriptions and /translations accept, in bytes "
                            "(OpenAI's 25 MB); a larger one is a 400 naming `file`. The request body limit "
                            "(--max-request-body-bytes) applies first.")
    group.add_argument("--timeout-keep-alive", type=float,
                       default=float(envs.get("LLMSERVE_HTTP_TIMEOUT_KEEP_ALIVE", "5")),
                       help="Seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive; "
                            "default: $LLMSERVE_HTTP_TIMEOUT_KEEP_ALIVE or $VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else 5).")
    group.add_argument("--timeout-request-headers", type=float, default=30.0,
                       help="Seconds a connection may take to send a request's headers (from connecting, or "
                            "from its first byte after a response) before it gets 408 and is closed (0: never).")
    group.add_argument("--timeout-request-body", type=float, default=30.0,
                       help="Seconds from a request's headers to the last byte of its body: a body not complete "
                            "by then gets 408 and the connection is closed (a deadline for the whole body, not "
                            "for each read; 0: none).")
    group.add_argument("--min-request-body-rate", type=float, default=DEFAULT_MIN_REQUEST_BODY_RATE,
                       help="Bytes per second a request body must average once its first "
                            f"{BODY_RATE_GRACE_S:g} s have passed, else 408 and the connection is closed (Apache "
                            "mod_reqtimeout's MinRate; 0: no floor).")
    group.add_argument("--max-request-bodies-per-client", type=int, default=DEFAULT_MAX_REQUEST_BODIES_PER_CLIENT,
                       help="Unfinished request bodies one client address may have at once; one more cuts that "
                            "address's longest-unfinished body with 429 once it has been unfinished for "
                            f"{BODY_CUT_GRACE_S:g} s (0: no bound).")
    group.add_argument("--max-connections-per-client", type=int, default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                       help="Open connections one client address may hold; one more gets 429 with Retry-After and "
                            "is closed (nginx's limit_conn; 0: no bound).")


def check_http_edge_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for a negative limit or timeout."""
    for name in ("max_request_body_bytes", "max_audio_file_bytes", "timeout_keep_alive", "timeout_request_headers", "timeout_request_body",
                 "min_request_body_rate", "max_request_bodies_per_client", "max_connections_per_client"):
        value = getattr(args, name, 0)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


def add_edge_middleware(app: FastAPI, args: argparse.Namespace) -> None:
    """The body limit and the edge guard (call before the X-Request-Id middleware, so
    their answers carry the header)."""
    app.add_middleware(BodyLimitMiddleware,
                       max_body_bytes=int(getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)),
                       body_timeout_s=float(getattr(args, "timeout_request_body", 0.0) or 0.0),
                       min_body_rate=float(getattr(args, "min_request_body_rate", 0.0) or 0.0),
                       max_bodies_per_client=int(getattr(args, "max_request_bodies_per_client", 0) or 0),
                       state=app.state,  # its admission controller counts the bodies being received
                       # An audio upload may reach --max-audio-file-bytes (+ 1 MiB of form fields).
                       path_limits={"/v1/audio/": int(getattr(args, "max_audio_file_bytes", 0) or 0) + (1 << 20)})
    app.add_middleware(EdgeGuardMiddleware)


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` arguments of the flags (only those that were set)."""
    kwargs: dict[str, Any] = {"timeout_keep_alive": getattr(args, "timeout_keep_alive", 5)}
    per_client = int(getattr(args, "max_connections_per_client", 0) or 0)
    if getattr(args, "timeout_request_headers", 0) or per_client:
        # uvicorn's h11 protocol plus a header deadline and a per-address connection bound
        # (httptools, when installed, would have neither)
        kwargs["http"] = h11_protocol_with_header_timeout(float(getattr(args, "timeout_request_headers", 0) or 0),
                                                          per_client)
    if getattr(args, "uds", None):
        kwargs["uds"] = args.uds
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, name, None):
            kwargs[name] = getattr(args, name)
    if getattr(args, "ssl_keyfile", None) or getattr(args, "ssl_certfile", None):
        kwargs["ssl_cert_reqs"] = args.ssl_cert_reqs
    if getattr(args, "h11_max_incomplete_event_size", None):
        # httptools (uvicorn's pick when installed) has no such limit: use h11 to honour it
        kwargs.setdefault("http", "h11")
        kwargs["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
    if getattr(args, "log_config_file", None):
        with open(args.log_config_file, encoding="utf-8") as f:
            log_config = json.load(f)
        logging.config.dictConfig(log_config)
        kwargs["log_config"] = log_config
    return kwargs
