"""``GET /health`` (liveness), ``GET /ready`` (readiness), ``GET /version``, ``GET /metrics``
(open even with an API key: see ``server_utils.PUBLIC_PATHS``)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

import llmserve
from llmserve.engine.exceptions import EngineDeadError, EngineStartError
from llmserve.entrypoints.openai.admission import engine_stalled_error, readiness_error
from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import error_json, json_response

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

router = APIRouter()

HEALTH_OK = b'{"status":"ok"}'
HEALTH_HEALING = b'{"status":"healing"}'
# A restart loads the model again: seconds, not minutes, for the models served here.
HEALING_RETRY_AFTER_S = 5


def _engines(engine_client: Any) -> list[Any]:
    """The engine clients behind the app's (several with ``--extra-model``: EngineGroup)."""
    return list(getattr(engine_client, "engines", None) or [engine_client])


def engine_healing(engine_client: Any) -> bool:
    """Whether a self-heal restart (``--restart-engine-on-failure``) of one of the engines
    is under way: the old process is gone, the new one not yet up (self_heal.EngineHealer)."""
    return any(getattr(getattr(e, "healer", None), "restarting", False) for e in _engines(engine_client))


def engine_self_heals(engine_client: Any) -> bool:
    """Whether every engine heals itself (restarts a dead or stalled process in place), so a
    stall is the healer's to end (it kills and restarts the process) and not a reason to
    restart the whole server."""
    return all(getattr(e, "healer", None) is not None for e in _engines(engine_client))


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """Liveness (a probe that fails this restarts the server): 200 ``{"status": "ok"}``
    while the engine runs, 200 ``{"status": "healing"}`` while a self-heal restart is
    under way (restarting the server would only lose the requests being resumed); 503
    with the OpenAI error body once the engine is dead for good (no self-heal, or its
    restart budget spent), or when it has made no progress for ``--engine-stall-timeout``
    seconds while requests are in flight and it will not heal itself (without
    ``--restart-engine-on-failure``; with it, the healer kills and restarts a stalled
    engine). 503 with ``Retry-After`` too while an engine ended by a level-2 sleep cannot be
    started again (its last start failed, e.g. the model file is gone): no engine is alive
    then, as after a death, but the next request or ``/wake_up`` tries again, so it turns
    200 by itself once the cause is fixed. A sleeping engine not yet woken is healthy.
    Readiness (may it get traffic now) is ``/ready``. vLLM answers an empty 200;
    a JSON body lets clients and the OpenAPI document agree on what it is."""
    engine = raw_request.app.state.engine_client
    try:
        await engine.check_health()
    except EngineStartError as e:  # ended by a level-2 sleep and cannot start: not alive, not final
        return error_json(e)  # the one mapping: 503, its Retry-After
    except EngineDeadError as e:
        return json_response(make_error(f"The engine is dead: {e}", 503, err_type="EngineDeadError"), 503)
    if engine_healing(engine):
        return Response(content=HEALTH_HEALING, media_type="application/json")
    stalled = engine_stalled_error(raw_request.app.state)
    if stalled is not None and not engine_self_heals(engine):
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
        response = json_response(make_error("Not ready: the engine is restarting (self-heal); requests in flight "
                                            "resume when it is up.", 503, err_type="EngineRestartingError"), 503)
        response.headers["Retry-After"] = str(HEALING_RETRY_AFTER_S)
        return response
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
