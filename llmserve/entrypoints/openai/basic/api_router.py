"""``GET /health``, ``GET /version``, ``GET /metrics`` (open even with an API key)."""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

import llmserve
from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import json_response

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

router = APIRouter()

HEALTH_OK = b'{"status":"ok"}'


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 ``{"status": "ok"}`` while the engine runs, 503 with the OpenAI error body once
    it is dead (vLLM answers an empty 200; a JSON body lets clients and the OpenAPI
    document agree on what it is)."""
    try:
        await raw_request.app.state.engine_client.check_health()
    except EngineDeadError as e:
        return json_response(make_error(f"The engine is dead: {e}", 503, err_type="EngineDeadError"), 503)
    return Response(content=HEALTH_OK, media_type="application/json")


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
    """Mount /health, /version and /metrics."""
    app.include_router(router)
