"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's), and the
serve flags of LoRA serving (``--lora-modules``, ``--allow-runtime-lora-updating``).

As in vLLM the two routes exist only when run-time updating is allowed: vLLM's switch
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (or ``LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING``), or
the flag ``--allow-runtime-lora-updating``; otherwise they are 404s with the OpenAI
error body naming those switches. Success is vLLM's plain-text 200 (``Success: LoRA adapter 'x' added
successfully.``); errors are the OpenAI body from the one exception mapping.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve import envs
from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.openai.models.lora import LoRAAdapters, parse_lora_module
from llmserve.entrypoints.openai.models.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from llmserve.sampling_params import SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.openai")

RUNTIME_LORA_ENV = "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING"
router = APIRouter()


def _env_allows() -> bool:
    return (envs.get(RUNTIME_LORA_ENV) or "0").strip().lower() in ("1", "true")


def add_lora_serving_args(group: argparse._ArgumentGroup) -> None:
    """``--lora-modules`` (vLLM's) and ``--allow-runtime-lora-updating`` (ours)."""
    group.add_argument("--lora-modules", type=parse_lora_module, nargs="+", action="extend", default=None,
                       metavar="NAME=PATH|JSON",
                       help="LoRA adapters to serve from the start (needs --enable-lora), each 'name=path' or "
                            "vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request "
                            "picks one by naming it in `model`. PATH: a PEFT directory or a GGUF LoRA file.")
    group.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                       default=_env_allows(),
                       help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM serves them when "
                            f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; default: that or ${RUNTIME_LORA_ENV}).")


def adapters(raw_request: Request) -> LoRAAdapters:
    """The adapter table of the server's (main) engine. Raises SamplingParamsError (400)
    when the engine runs without ``--enable-lora``."""
    table = getattr(raw_request.app.state, "lora_adapters", None)
    if table is None:
        raise SamplingParamsError("LoRA adapters are not enabled on this server: start it with --enable-lora.",
                                  "lora_name")
    return table


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Load an adapter and serve it by name (vLLM's route and answers)."""
    return Response(await adapters(raw_request).load(request), status_code=200)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Stop serving an adapter; its running requests finish on it (vLLM's route)."""
    return Response(await adapters(raw_request).unload(request), status_code=200)


DISABLED_MESSAGE = ("Run-time LoRA updating is off on this server: {path} is served when it is started with "
                    "--allow-runtime-lora-updating or with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                    f"(or {RUNTIME_LORA_ENV}=1) in its environment.")


def _disabled(path: str) -> Any:
    """The route at ``path`` while run-time updating is off: vLLM's 404, with the OpenAI
    error body naming the switches (it was Starlette's bare "Not Found", which told a user
    nothing of why a documented route is missing). Reads no body."""
    async def route() -> None:
        raise NotFoundError(DISABLED_MESSAGE.format(path=path))
    return route


def register_lora_api_routers(app: FastAPI, args: Any) -> None:
    """Mount the two routes when run-time LoRA updating is allowed (vLLM's gate), else
    their 404 stand-ins (:func:`_disabled`, left out of the OpenAPI schema as vLLM does)."""
    if getattr(args, "allow_runtime_lora_updating", False):
        logger.warning("Run-time LoRA loading and unloading is enabled (/v1/load_lora_adapter, "
                       "/v1/unload_lora_adapter): anyone with API access can load files from this host.")
        app.include_router(router)
        return
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        app.add_api_route(path, _disabled(path), methods=["POST"], include_in_schema=False)
