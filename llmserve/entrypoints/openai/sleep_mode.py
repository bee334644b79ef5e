"""vLLM's sleep-mode dev endpoints: ``POST /sleep?level=1|2``, ``POST /wake_up`` (optional
repeated ``tags`` query parameter: "weights", "kv_cache") and ``GET /is_sleeping`` ->
``{"is_sleeping": bool}``.

As in vLLM they exist only on a development server (``VLLM_SERVER_DEV_MODE=1``, or
``LLMSERVE_SERVER_DEV_MODE=1``) started with ``--enable-sleep-mode`` (or
``--sleep-idle-seconds``). A sleep while requests are in flight is refused with 400 (the
engine does not abort or pause them); bad levels and tags are 400s naming the field.
``/health`` and ``/metrics`` answer without waking the engine; the next generation request
wakes it (EngineCore.add_request; after level 2, which ends the engine process, AsyncLLM
starts a new one: llmserve/engine/sleep_process.py). When that start fails, the request
or wake gets 503 with Retry-After (EngineStartError) and /health and /ready answer 503
until a start succeeds.

Also vLLM's dev-mode ``POST /reset_prefix_cache`` (any dev-mode server, sleep mode or not):
the engine forgets its cached prefix blocks between steps and KV-event subscribers get
AllBlocksCleared (200, empty body); while requests hold blocks it cannot, and answers 400
saying so (vLLM logs a warning and answers 200, which leaves a caller unaware).
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

from llmserve import envs
from llmserve.entrypoints.openai.server_utils import error_json
from llmserve.sampling_params import SamplingParamsError
from llmserve.worker.sleep_mode import check_tags

router = APIRouter()
dev_router = APIRouter()


async def _call(raw_request: Request, method: str, *args: Any) -> Any:
    engine = raw_request.app.state.engine_client
    fn = getattr(engine, method, None)
    if fn is None:
        raise ValueError(f"{method} is not supported by this server's engine client")
    return await fn(*args)


@router.post("/sleep")
async def sleep(raw_request: Request, level: str = "1") -> Response:
    """Put the engine to sleep (200, empty body); 400 for a bad ``level`` or a busy engine."""
    try:
        if level.strip() not in ("1", "2"):
            raise SamplingParamsError("level must be 1 or 2.", "level")
        await _call(raw_request, "sleep", int(level))
    except Exception as e:  # noqa: BLE001 - mapped by the one error function (ValueError: 400)
        return error_json(e)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(raw_request: Request, tags: Optional[list[str]] = Query(None)) -> Response:
    """Wake the engine (200, empty body); 400 for an unknown tag."""
    try:
        try:
            check_tags(tags)
        except ValueError as e:
            raise SamplingParamsError(str(e), "tags") from None
        await _call(raw_request, "wake_up", tags)
    except Exception as e:  # noqa: BLE001
        return error_json(e)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> Response:
    try:
        asleep = await _call(raw_request, "is_sleeping")
    except Exception as e:  # noqa: BLE001
        return error_json(e)
    return JSONResponse({"is_sleeping": bool(asleep)})


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request) -> Response:
    """Drop the prefix cache (200, empty body); 400 while requests hold KV blocks."""
    try:
        if not await _call(raw_request, "reset_prefix_cache"):
            raise ValueError("The prefix cache was not reset: requests still hold KV cache blocks. "
                             "Retry when the server is idle.")
    except Exception as e:  # noqa: BLE001 - mapped by the one error function (ValueError: 400)
        return error_json(e)
    return Response(status_code=200)


def dev_mode() -> bool:
    """``VLLM_SERVER_DEV_MODE`` / ``LLMSERVE_SERVER_DEV_MODE`` is 1 or true."""
    return (envs.get("LLMSERVE_SERVER_DEV_MODE", "0") or "0").strip().lower() in ("1", "true")


def register_sleep_mode_routers(app: FastAPI, args: Any) -> None:
    """On a dev-mode server: ``/reset_prefix_cache``, and the three sleep routes when sleep
    mode is on."""
    if not dev_mode():
        return
    app.include_router(dev_router)
    if getattr(args, "enable_sleep_mode", False) or getattr(args, "sleep_idle_seconds", None):
        app.include_router(router)
