"""``GET /kv_event_sources`` and ``GET /get_server_info``: what a KV-aware router asks a
worker to index its KV cache from the worker's own KV events, with no per-worker flags.

vllm-router 0.1.17's ``kv_aware`` policy, given only ``--worker-urls``, asks each worker
``/get_server_info`` for the cache identity (``model_id``; ``kv_block_size``, without
which it indexes nothing) and ``/kv_event_sources`` for one ZMQ publisher per
data-parallel rank (endpoint, replay endpoint, topic; distributed/kv_events.py
``kv_event_sources``), then subscribes to each and routes a request to the rank whose
cache holds the longest prefix of its tokens (``X-data-parallel-rank``). Before these
routes it logged "cannot create cache identity ... no subscribers" and routed by load
only; its static ``--kv-event-source`` flags read only the empty topic.

Shapes are the ones that router reads (checked against its binary's discovery: a JSON
object keyed by the rank as a string, every entry field present; vLLM's own drafts of
``/kv_event_sources`` answer a list, which that router fails to parse). Both need the
API key like any route not in ``server_utils.PUBLIC_PATHS`` (vllm-router sends its
``--api-key``).
"""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse

from llmserve.distributed.kv_events import kv_event_sources
from llmserve.entrypoints.openai.dp_rank import served_ranks

router = APIRouter()


@router.get("/kv_event_sources")
async def get_kv_event_sources(raw_request: Request) -> JSONResponse:
    """The KV event publishers of the ranks this server serves (all with internal load
    balancing, its own with external, this node's with hybrid): ``{}`` when KV events
    are off."""
    engine = raw_request.app.state.engine_client
    return JSONResponse(kv_event_sources(getattr(engine, "vllm_config", None), served_ranks(engine)))


@router.get("/get_server_info")
async def get_server_info(raw_request: Request) -> JSONResponse:
    """The worker's identity for a router's KV index: ``model_id`` (the first served
    model name, what requests name), ``model_path`` (the model as loaded),
    ``worker_type`` "regular", ``kv_block_size`` and ``effective_attention_block_size``
    (tokens per KV block: the ``block_size`` of every ``BlockStored``; left out for an
    engine client without a ``vllm_config``, as a router then indexes nothing)."""
    state = raw_request.app.state
    info = {"model_id": state.openai_serving_models.base_model_paths[0].name,
            "model_path": state.engine_client.model_config.model, "worker_type": "regular"}
    config = getattr(state.engine_client, "vllm_config", None)
    if config is not None:
        info["kv_block_size"] = info["effective_attention_block_size"] = config.cache_config.block_size
    return JSONResponse(info)


def register_kv_event_sources_api_routers(app: FastAPI) -> None:
    """Mount /kv_event_sources and /get_server_info."""
    app.include_router(router)
