"""``GET /health`` (an engine serves), ``GET /ready`` (readiness), ``GET /version``, ``GET /metrics``
(open even with an API key: see ``server_utils.PUBLIC_PATHS``)."""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

import llmserve
from llmserve.engine.exceptions import EngineDeadError, EngineStartError
from llmserve.entrypoints.openai.admission import (ENGINE_RESTART_RETRY_AFTER_S, engine_healing,
                                                   engine_restarting_error, engine_stalled_error, readiness_error)
from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import error_json, json_response

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

router = APIRouter()

HEALTH_OK = b'{"status":"ok"}'


def _restarting_response() -> Response:
    response = json_response(engine_restarting_error(), 503)
    response.headers["Retry-After"] = str(ENGINE_RESTART_RETRY_AFTER_S)
    return response


@router.get("/health")
@router.get("/v1/health")  # llama-server's alias
async def health(raw_request: Request) -> Response:
    """200 ``{"status": "ok"}`` only while an engine serves; otherwise 503 with the OpenAI
    error body: the engine is dead (no self-heal, or its restart budget spent), a self-heal
    restart is under way (``EngineRestartingError``, ``Retry-After``: the old process is
    gone and the new one not up; 200 again once it is), or the engine has made no progress
    for ``--engine-stall-timeout`` seconds while requests are in flight (with self-heal the
    healer then kills and restarts it). A load balancer routes traffic away on these and
    an orchestrator sees a dead engine, never a 200 in front of it (vLLM answers 503 for a
    dead engine; case C71). A liveness probe that restarts the server should allow a
    restart's few seconds (``failureThreshold`` x ``periodSeconds``). 503 with
    ``Retry-After`` too while an engine ended by a level-2 sleep cannot be started again
    (its last start failed, e.g. the model file is gone): the next request or
    ``/wake_up`` tries again, so it turns 200 by itself once the cause is fixed. A sleeping
    engine not yet woken is healthy. ``/ready`` adds the admission limits. vLLM answers an
    empty 200; a JSON body lets clients and the OpenAPI document agree on what it is."""
    engine = raw_request.app.state.engine_client
    try:
        await engine.check_health()
    except EngineStartError as e:  # ended by a level-2 sleep and cannot start: not alive, not final
        return error_json(e)  # the one mapping: 503, its Retry-After
    except EngineDeadError as e:
        return json_response(make_error(f"The engine is dead: {e}", 503, err_type="EngineDeadError"), 503)
    if engine_healing(engine):
        return _restarting_response()
    stalled = engine_stalled_error(raw_request.app.state)
    if stalled is not None:
        return json_response(stalled, 503)
    return Response(content=HEALTH_OK, media_type="application/json")


@router.get("/ready")
async def ready(raw_request: Request) -> Response:
    """Readiness, for load balancers: 200 ``{"ready": true}`` when a new request would be
    admitted now; 503 with the OpenAI error body (and ``Retry-After`` when over the
    admission limit or healing) while the server starts, drains, is over its admission
    limit, its engine is being restarted by self-heal, or is dead or stalled."""
    engine = getattr(raw_request.app.state, "engine_client", None)
    if engine is not None and engine_healing(engine):
        return _restarting_response()
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
