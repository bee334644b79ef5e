"""``GET /v1/requests``: the caller's queued, running and recently finished requests and
the state of the engines its key may use; ``GET /v1/requests/{request_id}/timeline``: one
request's events. Both are scoped to the caller's tenant (another tenant's request is a
404; a key's ``allowed_models`` limits the engines it sees) and, like every route not on
``PUBLIC_PATHS``, need the API key when one is set."""
from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.openai.tenants import tenant_name_of, tenant_sees_model

router = APIRouter()


def _served_names(serving_models: Any) -> list[str]:
    """The names a model's requests may use: its served names and its LoRA adapters."""
    if serving_models is None:
        return []
    return list(serving_models.model_names) + list(getattr(serving_models, "lora_names", []))


def _engines(state: Any) -> list[tuple[Any, list[str]]]:
    """``(engine client, the model names it serves)`` of every engine of the server: one
    per model on an ``--extra-model`` server (``state.model_registry``), else the one."""
    registry = getattr(state, "model_registry", None)
    if registry is not None:
        return [(m.engine_client, _served_names(m.state.openai_serving_models)) for m in registry.models]
    return [(state.engine_client, _served_names(getattr(state, "openai_serving_models", None)))]


def _stores(raw_request: Request) -> list[Any]:
    """The RequestTimelines of every engine this server serves (one per model)."""
    stores = (getattr(engine, "request_timelines", None) for engine, _ in _engines(raw_request.app.state))
    return [s for s in stores if s is not None]


def _visible_stores(raw_request: Request) -> list[Any]:
    """The RequestTimelines of the engines the caller's key may use: those serving a model
    (or adapter) in its ``allowed_models``, every engine for a key without that limit.
    ``GET /v1/requests`` shows only their engine state, as ``/v1/models`` and ``/api/ps``
    list only those models: a key allowed no model sees no engine (the fresh-user trial
    found the server-wide totals shown to it)."""
    visible = []
    for engine, names in _engines(raw_request.app.state):
        store = getattr(engine, "request_timelines", None)
        if store is not None and any(tenant_sees_model(raw_request, n) for n in names):
            visible.append(store)
    return visible


def _merge_engine(summaries: list[dict]) -> dict:
    """Several engines' summaries as one: counts and totals summed, the fullest KV cache.
    No summary (a key that may use no model): the sum over no engine, all 0, now."""
    if len(summaries) == 1:
        return summaries[0]
    out = {k: sum(s[k] for s in summaries) for k in ("num_running", "num_waiting", "batch_size",
                                                      "prompt_tokens_total", "generation_tokens_total")}
    out["kv_cache_usage"] = max((s["kv_cache_usage"] for s in summaries), default=0.0)
    out["time"] = max((s["time"] for s in summaries), default=time.time())
    return out


@router.get("/v1/requests")
async def list_requests(raw_request: Request, limit: Optional[int] = Query(None, ge=1)) -> Response:
    """``{"object": "list", "data": [row...], "engine": {...}}`` (rows: TimelineRecord.summary):
    every queued and running request of the caller's tenant, then its finished ones,
    newest first, at most ``limit`` of those (default: the whole ring). ``engine``: the
    state of the engines serving the models the caller's key may use, summed
    (:func:`_visible_stores`; all 0 for a key that may use none); ``{}`` when timelines
    are off. A ``limit`` below 1 or not an integer is a 400 naming ``limit``."""
    tenant = tenant_name_of(raw_request)
    stores = _stores(raw_request)
    records = [rec for store in stores for rec in store.list(tenant)]
    if limit is not None:
        live = [r for r in records if r.finish_time is None]
        done = sorted((r for r in records if r.finish_time is not None), key=lambda r: r.finish_time, reverse=True)
        records = live + done[:limit]
    rows = [rec.summary() for rec in records]
    engine = _merge_engine([s.engine_summary() for s in _visible_stores(raw_request)]) if stores else {}
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
