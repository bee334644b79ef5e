"""``POST /invocations`` (Amazon SageMaker's inference route; vLLM's
``entrypoints/sagemaker/api_router.py`` with ``pooling/factories.get_pooling_invocation_types``)
and ``GET /ping`` (SageMaker's health check).

The body is recognised by its shape and the served model's tasks, validated by that
endpoint's request model and served by that endpoint's own route, so the answer (stream
or not, errors) is the same as on the endpoint itself:

- ``messages`` -> chat completions (embeddings with messages for a model that does not
  generate but embeds, classify for a classification model: vLLM has no chat handler for
  a pooling model, so its ``EmbeddingRequest`` or ``ClassificationChatRequest`` takes the
  body);
- ``prompt`` -> completions;
- ``query`` (with ``documents``) -> rerank;
- a score request's side names (``text_1``/``text_2``, ``queries``/``documents``,
  ``queries``/``items``, ``data_1``/``data_2``) -> score;
- ``input`` -> classify for a classification model (its supported tasks include
  "classify" and not "embed": vLLM registers no embeddings handler for it, so its
  ``ClassificationRequest`` takes the body), else embeddings.

Any other body is a 400 listing the shapes.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from llmserve.entrypoints.openai.basic.api_router import health
from llmserve.entrypoints.openai.chat_completion.api_router import create_chat_completion
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.classify.api_router import create_classify
from llmserve.entrypoints.openai.classify.protocol import ClassificationRequest
from llmserve.entrypoints.openai.completion.api_router import create_completion
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.entrypoints.openai.embeddings.api_router import create_embedding
from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from llmserve.entrypoints.openai.score.api_router import create_score, do_rerank
from llmserve.entrypoints.openai.score.protocol import SCORE_FIELD_NAMES, RerankRequest, ScoreRequest
from llmserve.sampling_params import SamplingParamsError

router = APIRouter()

Route = Callable[[Any, Request], Awaitable[Response]]

# kind -> (its request model, its route)
INVOCATION_TYPES: dict[str, tuple[type[BaseModel], Route]] = {
    "chat": (ChatCompletionRequest, create_chat_completion),
    "completion": (CompletionRequest, create_completion),
    "embed": (EmbeddingRequest, create_embedding),
    "classify": (ClassificationRequest, create_classify),
    "rerank": (RerankRequest, do_rerank),
    "score": (ScoreRequest, create_score),
}
_SCORE_KEYS = tuple(dict.fromkeys(n for pair in SCORE_FIELD_NAMES for n in pair))
_SHAPES = ("'messages' (ChatCompletionRequest), 'prompt' (CompletionRequest), 'input' (EmbeddingRequest, or "
           "ClassificationRequest for a classification model), 'query' and 'documents' (RerankRequest), "
           + " or ".join(f"'{a}' and '{b}'" for a, b in SCORE_FIELD_NAMES) + " (ScoreRequest)")


def served_tasks(state: Any, model: Any) -> tuple[str, ...]:
    """The supported tasks of the model a body names (``model``; with ``--extra-model``
    and no name: every served model's, together); ``state``: the app's."""
    registry = getattr(state, "model_registry", None)
    if registry is None:
        return tuple(getattr(getattr(state.engine_client, "model_config", None), "supported_tasks", ("generate",)))
    if isinstance(model, str) and model:
        return registry.resolve(model).supported_tasks  # 404 for an unknown name, as the endpoint
    return tuple(t for m in registry.models for t in m.supported_tasks)


def invocation_kind(body: dict, tasks: tuple[str, ...]) -> str | None:
    """The INVOCATION_TYPES key for ``body`` served by a model with ``tasks`` (see the
    module docstring), or None for a body of no known shape."""
    if "messages" in body:
        if "generate" in tasks or not ({"embed", "classify"} & set(tasks)):
            return "chat"
        return "embed" if "embed" in tasks else "classify"
    if "prompt" in body:
        return "completion"
    if "query" in body:
        return "rerank"
    if any(k in body for k in _SCORE_KEYS):
        return "score"
    if "input" in body:
        return "classify" if "classify" in tasks and "embed" not in tasks else "embed"
    return None


def parse_invocation(state: Any, raw: bytes) -> tuple[BaseModel, Route]:
    """The endpoint request a SageMaker invocation's body ``raw`` is (its shape and the
    served model's tasks: see the module docstring) and that endpoint's route; ``state``:
    the app's. Raises SamplingParamsError (400) for a body that is not a JSON object of
    one of the known shapes, RequestValidationError as the chosen model refuses it,
    ModelNotFoundError (404) for an unknown model when its tasks pick the endpoint.
    Also admission's check of an invocation it would refuse (admission_precheck.py)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SamplingParamsError(f"Invalid JSON in the request body: {e}", None) from e
    kind = None
    if isinstance(body, dict):
        needs_tasks = "input" in body or "messages" in body
        kind = invocation_kind(body, served_tasks(state, body.get("model")) if needs_tasks else ())
    if kind is None:
        raise SamplingParamsError(f"/invocations takes a JSON object with one of: {_SHAPES}.", None)
    model, route = INVOCATION_TYPES[kind]
    try:
        return model.model_validate(body), route
    except ValidationError as e:
        # with each input, as FastAPI's own errors carry it: validation_errors.py words a
        # value of the wrong JSON type by its kind ("must be an integer, not a string"),
        # never echoing it
        raise RequestValidationError(e.errors(include_url=False)) from e


@router.post("/invocations")
async def invocations(raw_request: Request) -> Response:
    """Serve a SageMaker invocation like the endpoint its body's shape names (errors:
    :func:`parse_invocation`; the endpoint's own answer as on the endpoint)."""
    request, route = parse_invocation(raw_request.app.state, await raw_request.body())
    return await route(request, raw_request)


async def _check_invocation(state: Any, body: bytes, _content_type: Optional[str] = None) -> BaseModel:
    return parse_invocation(state, body)[0]  # the endpoint's own first checks follow (by its body model)


# Path -> the check admission runs on a request it would refuse (admission_precheck.Prechecks.by_path)
SAGEMAKER_BODY_CHECKS = {"/invocations": _check_invocation}


@router.get("/ping")
async def ping(raw_request: Request) -> Response:
    """SageMaker's health check: the same answer as ``GET /health``."""
    return await health(raw_request)


def register_sagemaker_api_routers(app: FastAPI) -> None:
    """Mount /invocations and /ping."""
    app.include_router(router)
