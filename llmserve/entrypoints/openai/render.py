"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` (vLLM's
renderer API): a request rendered as the token-in ``GenerateRequest`` the engine would
run, without generating.

The completions route answers a list (one GenerateRequest per prompt, ``cmpl-`` ids),
the chat route one object (``chatcmpl-`` id). Each carries the prompt's ``token_ids``
exactly as ``/v1/completions`` / ``/v1/chat/completions`` would send them to the engine
(same renderer, chat template, truncation), the resolved ``sampling_params`` and the
request's ``stream`` / ``stream_options`` / ``cache_salt`` / ``priority`` /
``kv_transfer_params``. Errors are the OpenAI body: an unknown model 404, an invalid
request 400 (the generate handlers' own checks).

Why: KV-aware routers (vllm-router's ``kv_aware``, llm-d's precise prefix scorer) call
these to learn a request's exact token ids and match them, block by block, against the
token ids of the KV events' ``BlockStored``. vllm-router 0.1.17 treats ``/tokenize``'s
answer as a count only: without render every placement lookup missed.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from llmserve.entrypoints.openai.chat_completion.tool_calling import ToolPlan
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.entrypoints.openai.completion.serving import OpenAIServingCompletion
from llmserve.entrypoints.openai.server_utils import request_id_of
from llmserve.sampling_params import SamplingParams

# Derived by the engine's InputProcessor, not part of what a caller sets (vLLM leaves
# its private ``_all_stop_token_ids`` out of the rendered sampling_params too).
_DERIVED_PARAMS = frozenset({"all_stop_token_ids", "bad_words_token_ids"})


class GenerateRequest(BaseModel):
    """vLLM's token-in request (``vllm.entrypoints.serve.disagg.protocol.GenerateRequest``),
    the body of the render endpoints' answer."""

    request_id: str
    token_ids: list[int]
    features: Optional[str] = None  # multimodal inputs: none on this server
    sampling_params: dict[str, Any]
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None
    priority: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None
    token_offsets: Optional[list[tuple[int, int]]] = None  # only with return_token_offsets (not supported)


class GenerateRequestList(BaseModel):
    """The completions render answer: a JSON array (one item per prompt)."""

    items: list[GenerateRequest]

    def model_dump_json(self, **kwargs: Any) -> str:  # the array itself, not {"items": ...}
        return "[" + ",".join(item.model_dump_json(**kwargs) for item in self.items) + "]"


def _jsonable(value: Any) -> Any:
    """A sampling-param value as JSON (enums by value, nested dataclasses as dicts)."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.name.startswith("_")}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def sampling_params_json(params: SamplingParams) -> dict[str, Any]:
    """The caller-visible fields of ``params`` (no private or engine-derived ones)."""
    return {f.name: _jsonable(getattr(params, f.name)) for f in dataclasses.fields(params)
            if not f.name.startswith("_") and f.name not in _DERIVED_PARAMS}


def _generate_request(request: Any, request_id: str, model_name: str, token_ids: list[int],
                      params: SamplingParams) -> GenerateRequest:
    options = request.stream_options
    return GenerateRequest(
        request_id=request_id, token_ids=list(token_ids), sampling_params=sampling_params_json(params),
        model=model_name, stream=bool(request.stream),
        stream_options=options.model_dump() if options is not None else None,
        cache_salt=getattr(request, "cache_salt", None), priority=getattr(request, "priority", 0) or 0,
        kv_transfer_params=getattr(request, "kv_transfer_params", None))


async def render_completion(serving: OpenAIServingCompletion, request: CompletionRequest,
                            request_id: Optional[str] = None) -> GenerateRequestList:
    """One GenerateRequest per prompt of a completions request, as ``/v1/completions``
    would run it. Raises ModelNotFoundError (404) / SamplingParamsError (400)."""
    model_name, prompts = await serving._prepare(request)
    rid = serving.new_request_id(request_id)
    return GenerateRequestList(items=[_generate_request(request, rid if len(prompts) == 1 else f"{rid}-{i}",
                                                        model_name, p.ids, p.params)
                                      for i, p in enumerate(prompts)])


async def render_chat(serving: OpenAIServingChat, request: ChatCompletionRequest,
                      request_id: Optional[str] = None) -> GenerateRequest:
    """The GenerateRequest of a chat request, as ``/v1/chat/completions`` would run it
    (template, tools for the template, truncation; a forced tool schema on the params).
    Raises ModelNotFoundError (404) / SamplingParamsError (400)."""
    model_name = serving._check_model(request)
    request.check_openai_budget()  # first, as the route runs it
    request.check()
    plan = ToolPlan.of(request, enable_auto_tools=serving.enable_auto_tools, tool_parser_cls=serving.tool_parser_cls,
                       exclude_tools_when_tool_choice_none=serving.exclude_tools_when_tool_choice_none)
    prompt = serving.truncate(await serving.render(request, plan.template_tools), request)
    params = request.to_sampling_params(request.requested_max_tokens(), serving.default_sampling_params)
    serving.output_parsing(request, plan, params, prompt.token_ids)  # puts a forced tool schema on params
    return _generate_request(request, serving.new_request_id(request_id), model_name, prompt.token_ids, params)


router = APIRouter()


@router.post("/v1/completions/render")
async def completions_render(request: CompletionRequest, raw_request: Request) -> Response:
    result = await render_completion(raw_request.app.state.openai_serving_completion, request,
                                     request_id_of(raw_request))
    return Response(content=result.model_dump_json(), media_type="application/json")


@router.post("/v1/chat/completions/render")
async def chat_completions_render(request: ChatCompletionRequest, raw_request: Request) -> Response:
    result = await render_chat(raw_request.app.state.openai_serving_chat, request, request_id_of(raw_request))
    return Response(content=result.model_dump_json(), media_type="application/json")


def register_render_api_routers(app: FastAPI) -> None:
    """Mount /v1/completions/render and /v1/chat/completions/render."""
    app.include_router(router)
