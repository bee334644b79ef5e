"""``GET /health``, ``GET /ready``, ``GET /version``, ``GET /metrics`` (open even with an API key)."""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

import llmserve
from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.admission import engine_stalled_error, readiness_error
from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import json_response

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

router = APIRouter()

HEALTH_OK = b'{"status":"ok"}'


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """Liveness: 200 ``{"status": "ok"}`` while the engine runs; 503 with the OpenAI error
    body once it is dead, or when it has made no progress for ``--engine-stall-timeout``
    seconds while requests are in flight (vLLM answers an empty 200; a JSON body lets
    clients and the OpenAPI document agree on what it is)."""
    try:
        await raw_request.app.state.engine_client.check_health()
    except EngineDeadError as e:
        return json_response(make_error(f"The engine is dead: {e}", 503, err_type="EngineDeadError"), 503)
    stalled = engine_stalled_error(raw_request.app.state)
    if stalled is not None:
        return json_response(stalled, 503)
    return Response(content=HEALTH_OK, media_type="application/json")


@router.get("/ready")
async def ready(raw_request: Request) -> Response:
    """Readiness, for load balancers: 200 ``{"ready": true}`` when a new request would be
    admitted now; 503 with the OpenAI error body (and ``Retry-After`` when over the
    admission limit) while the server starts, drains, is over its admission limit, or
    its engine is dead or stalled."""
    not_ready = readiness_error(raw_request.app.state)
    if not_ready is None:
        return Response(content=b'{"ready":true}', media_type="application/json")
    body, retry_after = not_ready
    response = json_response(body, 503)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


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


def register_basic_api_routers(app: FastAPI) -> None:
    """Mount /health, /ready, /version and /metrics."""
    app.include_router(router)
