"""``GET /load`` and the in-flight request count behind it (vLLM's
``--enable-server-load-tracking`` / ``server_load_metrics``).

vLLM counts the requests of the routes that use the accelerator (generation, pooling,
transcription) from the moment the route starts until its response, streamed or not, has
been sent; ``/load`` answers ``{"server_load": N}`` (0 when tracking is off).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse

# vLLM's @load_aware_call routes, plus this server's Responses, SageMaker and Anthropic
# Messages routes.
TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/audio/transcriptions",
    "/v1/audio/translations", "/pooling", "/classify", "/v1/classify", "/score", "/v1/score", "/rerank",
    "/v1/rerank", "/v2/rerank", "/invocations", "/v1/messages", "/infill",  # llama.cpp's FIM
    "/completion", "/completions", "/embedding",  # llama.cpp's native completion and embedding
    "/chat/completions", "/embeddings", "/reranking", "/v1/reranking",  # llama.cpp's aliases
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",  # Ollama's
})

router = APIRouter()


@router.get("/load")
async def get_server_load_metrics(raw_request: Request) -> JSONResponse:
    """``{"server_load": <in-flight tracked requests>}``."""
    return JSONResponse({"server_load": getattr(raw_request.app.state, "server_load_metrics", 0)})


class ServerLoadMiddleware:
    """Pure ASGI middleware: ``app.state.server_load_metrics`` counts the POSTs to
    :data:`TRACKED_PATHS` being served; a request leaves the count when its last byte
    is sent, it fails, or the client goes away."""

    def __init__(self, app: Any, state: Any):
        self.app = app
        self.state = state
        state.server_load_metrics = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "") or ""
        path = scope["path"][len(root):] if root and scope["path"].startswith(root) else scope["path"]
        if path not in TRACKED_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load_metrics -= 1


def register_server_load_api_routers(app: FastAPI, enable_tracking: bool = False) -> None:
    """Mount ``/load``; count requests when ``enable_tracking``."""
    app.state.server_load_metrics = 0
    app.include_router(router)
    if enable_tracking:
        app.add_middleware(ServerLoadMiddleware, state=app.state)
