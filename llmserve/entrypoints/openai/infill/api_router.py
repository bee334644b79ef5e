"""llama-server's native routes, ``POST /infill`` and ``POST /completion`` (and its
``/completions`` alias): thin routes over infill/serving.py, on the completion handler of
the model the request names; ``POST /apply-template``, a chat request's messages rendered
through the chat template (``{"prompt": TEXT}``, to edit and send to ``/completion``); and
``GET /props``, the server properties llama.cpp's clients read first (the context size, the
default sampling, the chat template); ``GET /slots``, llama-server's per-slot state, made
from the requests the engine runs (it has no slots: see :func:`slots`); ``POST
/slots/{id}?action=...`` (save, restore, erase) is a 501."""
from __future__ import annotations

import zlib
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

import llmserve
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.chat_completion.tool_calling import ToolPlan
from llmserve.entrypoints.openai.infill.fim import gguf_path_of
from llmserve.entrypoints.openai.infill.protocol import LLAMA_CPP_DEFAULTS, InfillRequest, LlamaCompletionRequest, \
    LlamaSamplingRequest, llama_settings
from llmserve.entrypoints.openai.infill.serving import create_infill, create_llama_completion
from llmserve.entrypoints.openai.admission_precheck import route_handler
from llmserve.entrypoints.openai.common.errors import make_error
from llmserve.entrypoints.openai.server_utils import json_response, request_id_of, result_response, \
    with_cancellation
from llmserve.entrypoints.openai.tenants import tenant_name_of

router = APIRouter()


def completion_handler(raw_request: Request, request: LlamaSamplingRequest):
    """The completion handler of the model ``request`` names (:func:`route_handler`)."""
    return route_handler(raw_request.app.state, "openai_serving_completion", request)


@router.post("/infill")
async def infill(request: InfillRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, create_infill(completion_handler(raw_request, request), request, request_id_of(raw_request))))


@router.post("/completion")
@router.post("/completions")
async def llama_completion(request: LlamaCompletionRequest, raw_request: Request) -> Response:
    result = await with_cancellation(raw_request, create_llama_completion(
        completion_handler(raw_request, request), request, request_id_of(raw_request)))
    if isinstance(result, list):  # several prompts: llama-server's array of answers
        return JSONResponse([r.model_dump(mode="json") for r in result])
    return result_response(result)


@router.post("/apply-template")
async def apply_template(request: ChatCompletionRequest, raw_request: Request) -> JSONResponse:
    """llama-server's ``POST /apply-template``: the prompt text ``/v1/chat/completions``
    would run for this request (its template, tools, ``chat_template_kwargs``,
    ``add_generation_prompt``), without generating. Raises ModelNotFoundError (404) /
    SamplingParamsError (400), as the chat route does."""
    serving = route_handler(raw_request.app.state, "openai_serving_chat", request)
    serving._check_model(request)
    request.check()
    plan = ToolPlan.of(request, enable_auto_tools=serving.enable_auto_tools, tool_parser_cls=serving.tool_parser_cls,
                       exclude_tools_when_tool_choice_none=serving.exclude_tools_when_tool_choice_none)
    prompt = await serving.render(request, plan.template_tools)
    text = prompt.text if prompt.text is not None else \
        serving.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


def _params(defaults: dict[str, Any]) -> dict[str, Any]:
    """``/completion``'s default sampling under llama-server's names (the model's
    generation config, else llama-server's defaults, as the route applies them)."""
    pick = {k: defaults.get(k, v) for k, v in LLAMA_CPP_DEFAULTS.items()}
    return {"n_predict": -1, "seed": -1, "temperature": pick["temperature"], "top_k": pick["top_k"],
            "top_p": pick["top_p"], "min_p": pick["min_p"], "repeat_penalty": pick["repetition_penalty"],
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop": [], "max_tokens": -1, "ignore_eos": False,
            "stream": False, "n_probs": 0}


@router.get("/props")
async def props(raw_request: Request) -> JSONResponse:
    """llama-server's ``GET /props`` for the served model (the first with ``--extra-model``):
    ``default_generation_settings`` (``n_ctx``: the context length; ``params``: the
    defaults ``/completion`` uses), ``total_slots`` (``--max-num-seqs``), ``model_path``,
    ``model_alias``, ``chat_template``, ``modalities`` (text only), ``build_info``."""
    from llmserve.entrypoints.ollama.info import chat_template, model_states

    state = model_states(raw_request.app.state)[0]
    handler = state.openai_serving_completion
    config = getattr(state.engine_client, "vllm_config", None)
    config_of_model = state.engine_client.model_config
    slots = config.scheduler_config.max_num_seqs if config is not None else 1
    return JSONResponse({
        "default_generation_settings": _slot(0, handler.max_model_len, _params(handler.default_sampling_params or {})),
        "total_slots": slots, "model_path": gguf_path_of(config_of_model) or config_of_model.model_path,
        "model_alias": state.openai_serving_models.model_names[0], "chat_template": chat_template(state),
        "modalities": {"vision": False, "audio": False}, "build_info": f"llmserve {llmserve.__version__}"})


def _slot(slot_id: int, n_ctx: int, params: dict[str, Any], id_task: int = -1, n_decoded: int = 0) -> dict[str, Any]:
    """One entry of llama-server's ``/slots`` (also ``/props``' ``default_generation_settings``),
    with every documented field: ``id``, ``id_task`` (-1 when idle), ``n_ctx``,
    ``speculative``, ``is_processing``, ``params``, ``prompt`` (kept empty: the server keeps
    no prompt text) and ``next_token`` (``has_next_token``, ``has_new_line``, ``n_remain``
    (-1: no budget), ``n_decoded``, ``stopping_word``)."""
    budget = params.get("n_predict", -1)
    busy = id_task >= 0
    return {"id": slot_id, "id_task": id_task, "n_ctx": n_ctx, "speculative": False, "is_processing": busy,
            "params": params, "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False,
                           "n_remain": -1 if not busy or budget < 0 else max(budget - n_decoded, 0),
                           "n_decoded": n_decoded, "stopping_word": ""}}


def _task_id(request_id: str) -> int:
    """A running request's ``id_task``: a non-negative int fixed for the request's life."""
    return zlib.crc32(request_id.encode("utf-8")) & 0x7FFFFFFF


def _running_params(params: Any) -> dict[str, Any]:
    """A running request's sampling settings under llama-server's slot ``params`` names
    (a pooling request, which samples nothing, has only ``n_predict`` 0)."""
    return llama_settings(params) if hasattr(params, "temperature") else {"n_predict": 0}


@router.get("/slots")
async def slots(raw_request: Request, fail_on_no_slot: int = Query(0)) -> Response:
    """llama-server's ``GET /slots`` for the served model (the first with
    ``--extra-model``). The engine has no slots: it runs up to ``--max-num-seqs``
    sequences at once (``total_slots`` in ``/props``), so the answer is that many
    entries, the running sequences first (``is_processing: true``, their ``params`` and
    ``next_token`` with ``n_decoded`` and ``n_remain``; ``id_request`` is the id
    ``/v1/requests`` shows), then idle ones with the default ``params``; every entry has
    llama-server's fields (:func:`_slot`). ``id`` is a position in this list (0 to
    total - 1); ``id_task`` a number fixed for the running request's life (-1 when idle).
    Another tenant's running request fills a slot without its details (default
    ``params``, ``n_decoded`` 0). Queued requests hold no slot.
    ``fail_on_no_slot=1``: a 503 when no slot is idle. Request timelines off
    (``--no-request-timelines``, ``--disable-log-stats``): a 501, as llama-server answers
    with ``--no-slots``."""
    from llmserve.entrypoints.ollama.info import model_states

    state = model_states(raw_request.app.state)[0]
    store = getattr(state.engine_client, "request_timelines", None)
    if store is None:
        return json_response(make_error("The slots endpoint needs request timelines, which are off on this "
                                        "server (--no-request-timelines or --disable-log-stats).", 501,
                                        err_type="not_supported_error"), 501)
    handler = state.openai_serving_completion
    config = getattr(state.engine_client, "vllm_config", None)
    total = config.scheduler_config.max_num_seqs if config is not None else 1
    tenant = tenant_name_of(raw_request)
    running = [r for r in list(store.live.values()) if r.state == "running"][:total]
    if fail_on_no_slot and len(running) >= total:
        return json_response(make_error("No slot is available: every sequence the engine runs at once is busy.",
                                        503, "fail_on_no_slot"), 503)
    idle_params = _params(handler.default_sampling_params or {})
    entries = []
    for i in range(total):
        if i >= len(running):
            entries.append(_slot(i, handler.max_model_len, idle_params))
        elif running[i].tenant != tenant:  # busy, without another tenant's details
            entries.append(_slot(i, handler.max_model_len, idle_params, _task_id(running[i].request_id)))
        else:
            rec = running[i]
            entry = _slot(i, handler.max_model_len, {**idle_params, **_running_params(rec.params)},
                          _task_id(rec.request_id), rec.generated_tokens)
            entry["id_request"] = rec.id
            entries.append(entry)
    return JSONResponse(entries)


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, action: str = Query("")) -> Response:
    """llama-server's ``POST /slots/{id}?action=save|restore|erase`` (a slot's prompt cache
    to or from a file): a 501 naming ``action``, as the engine has no slots to save; its
    prefix cache is shared by every request and managed by itself."""
    return json_response(make_error(
        "Slot save, restore and erase (POST /slots/{id}?action=...) are not supported: "
        "this server has no per-slot prompt cache to save or restore; its prefix cache is shared and "
        "kept automatically.", 501, "action", err_type="not_supported_error"), 501)


def register_infill_api_routers(app: FastAPI) -> None:
    """Mount /infill, /completion, /completions, /apply-template, /props, /slots and
    /slots/{id_slot} (llama-server's slot actions, a 501)."""
    app.include_router(router)
