"""``GET /v1/models`` and ``GET /v1/models/{model_id}``."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.models.protocol import ModelList
from llmserve.entrypoints.openai.models.serving import ModelNotFoundError
from llmserve.sampling_params import SamplingParamsError
from llmserve.entrypoints.openai.server_utils import json_response
from llmserve.entrypoints.openai.tenant_quotas import callable_models
from llmserve.entrypoints.openai.tenants import tenant_of, tenant_sees_model

router = APIRouter()
MAX_PAGE = 1000  # Anthropic's bounds on ``limit``


def page_of(models: ModelList, after_id: Optional[str], before_id: Optional[str],
            limit: Optional[int]) -> ModelList:
    """One page of ``models`` in Anthropic's paging (the ``anthropic`` SDK's
    ``models.list(after_id=, before_id=, limit=)``): the models after ``after_id`` or
    before ``before_id`` (an id not listed: none), at most ``limit`` (1..1000), and
    ``has_more``. Without any of them, every model (OpenAI's list has no paging).
    Raises SamplingParamsError naming ``limit``, or both cursors given at once."""
    if after_id is None and before_id is None and limit is None:
        return models
    if limit is not None and not 1 <= limit <= MAX_PAGE:
        raise SamplingParamsError(f"limit: must be between 1 and {MAX_PAGE}.", "limit")
    if after_id is not None and before_id is not None:
        raise SamplingParamsError("before_id: give after_id or before_id, not both.", "before_id")
    ids = [card.id for card in models.data]
    data = models.data
    if after_id is not None:
        data = data[ids.index(after_id) + 1:] if after_id in ids else []
    elif before_id is not None:
        data = data[:ids.index(before_id)] if before_id in ids else []
    size = limit if limit is not None else 20  # Anthropic's default page
    kept = data[-size:] if before_id is not None else data[:size]
    return ModelList(data=kept, has_more=len(kept) < len(data))


@router.get("/v1/models")
@router.get("/models")  # llama-server's alias
async def show_available_models(raw_request: Request, after_id: Optional[str] = None,
                                before_id: Optional[str] = None, limit: Optional[int] = None) -> Response:
    """The served models and adapters the caller's key may call (a tenant's
    ``allowed_models`` hides the others, as their requests answer 404), paged as
    Anthropic pages them when asked (:func:`page_of`)."""
    models = raw_request.app.state.openai_serving_models.show_available_models()
    models.data = [card for card in models.data if tenant_sees_model(raw_request, card.id)]
    return json_response(page_of(models, after_id, before_id, limit))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """One model's card (OpenAI's "retrieve model"); 404 NotFoundError for an unknown id.
    ``:path`` keeps ids with a slash (``org/name``) in one parameter. A model outside the
    tenant's ``allowed_models`` answers the same 404 as an unknown one."""
    if not tenant_sees_model(raw_request, model_id):
        raise ModelNotFoundError(model_id, callable_models(tenant_of(raw_request), raw_request.app.state))
    return json_response(raw_request.app.state.openai_serving_models.show_model(model_id))


def register_models_api_routers(app: FastAPI) -> None:
    """Mount /v1/models and /v1/models/{model_id}."""
    app.include_router(router)
