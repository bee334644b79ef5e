"""``GET /v1/requests``: the caller's queued, running and recently finished requests and
the engine's state; ``GET /v1/requests/{request_id}/timeline``: one request's events.
Both are scoped to the caller's tenant (another tenant's request is a 404) and, like
every route not on ``PUBLIC_PATHS``, need the API key when one is set."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.openai.tenants import tenant_name_of

router = APIRouter()


def _stores(raw_request: Request) -> list[Any]:
    """The RequestTimelines of every engine this server serves (one per model)."""
    client = raw_request.app.state.engine_client
    engines = getattr(client, "engines", None) or [client]
    return [s for s in (getattr(e, "request_timelines", None) for e in engines) if s is not None]


def _merge_engine(summaries: list[dict]) -> dict:
    if len(summaries) == 1:
        return summaries[0]
    out = {k: sum(s[k] for s in summaries) for k in ("num_running", "num_waiting", "batch_size",
                                                      "prompt_tokens_total", "generation_tokens_total")}
    out["kv_cache_usage"] = max((s["kv_cache_usage"] for s in summaries), default=0.0)
    out["time"] = max((s["time"] for s in summaries), default=0.0)
    return out


@router.get("/v1/requests")
async def list_requests(raw_request: Request, limit: Optional[int] = Query(None, ge=1)) -> Response:
    """``{"object": "list", "data": [row...], "engine": {...}}`` (rows: TimelineRecord.summary):
    every queued and running request of the caller's tenant, then its finished ones,
    newest first, at most ``limit`` of those (default: the whole ring). A ``limit`` below
    1 or not an integer is a 400 naming ``limit``."""
    tenant = tenant_name_of(raw_request)
    stores = _stores(raw_request)
    records = [rec for store in stores for rec in store.list(tenant)]
    if limit is not None:
        live = [r for r in records if r.finish_time is None]
        done = sorted((r for r in records if r.finish_time is not None), key=lambda r: r.finish_time, reverse=True)
        records = live + done[:limit]
    rows = [rec.summary() for rec in records]
    engine = _merge_engine([s.engine_summary() for s in stores]) if stores else {}
    return JSONResponse({"object": "list", "data": rows, "engine": engine})


@router.get("/v1/requests/{request_id}/timeline")
async def request_timeline(request_id: str, raw_request: Request) -> Response:
    """One request's timeline (TimelineRecord.timeline); 404 NotFoundError when no
    record of the caller's tenant has that id (unknown, dropped from the ring, another
    tenant's, or timelines off)."""
    tenant = tenant_name_of(raw_request)
    for store in _stores(raw_request):
        rec = store.get(request_id, tenant)
        if rec is not None:
            return JSONResponse(rec.timeline())
    raise NotFoundError(f"No request with id '{request_id}' (recent requests only).", "request_id")


def register_request_timeline_api_routers(app: FastAPI) -> None:
    """Mount /v1/requests and /v1/requests/{request_id}/timeline."""
    app.include_router(router)
