"""A request's own 400 before admission's 429: validation comes first.

AdmissionMiddleware decides before the body is parsed (admission.py), so with the queue
full a malformed request was answered 429 ``queue_full`` and its client retried it,
after ``Retry-After``, into the same 400 it could have read at once (fresh-user trial).
OpenAI's, Anthropic's and Ollama's servers tell a client its own error first. So when
the controller would refuse a request, :func:`malformed_response` checks it as its route
would, with the route's own code, and answers that route's error when there is one
(reshaped into Anthropic's or Ollama's body on their paths, as every error is);
otherwise the refusal stands. Only refused requests are checked: an admitted request is
checked once, by its route.

What is checked, without rendering a prompt or touching the engine:

- a FastAPI route with a JSON body model (the OpenAI routes, ``/v1/messages``): the body
  parsed and validated as FastAPI does it (the same 400 wording, by
  ``server_utils.exception_response``; a body whose content type is not JSON is refused
  as FastAPI refuses it), then the checks its handler runs first
  (:attr:`Prechecks.by_model`): the model it names (404 for one not served, 400 for one
  that cannot serve the route: :func:`check_model`), then ``check()`` of chat,
  completion and Responses requests, Anthropic's mapping and rules;
- a route that reads its own body: :attr:`Prechecks.by_path`, its parser and checks
  (Ollama's ``check_chat``...; SageMaker's ``/invocations`` returns the request it
  dispatches to, whose body-model checks then run; speech to text reads its multipart
  form, the model and the file, whose audio is probed, not decoded).

Then, for a request that passed those and would generate (chat, completions,
Responses, Anthropic Messages: :attr:`Prechecks.fits`), its prompt is rendered as the
route renders it and held against the context (``input_processor.check_prompt_fits``):
a prompt too long, or one that leaves no room for ``max_tokens``, is the route's 400 too
(it was the 429, which the client retried into the same 400). This costs a refused
request its prompt's tokenization, bounded by the prompt character limit, once.

Left to the route, so refused as before: audio that opens but fails to decode.
"""
from __future__ import annotations

import contextvars
import email.message
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from llmserve.entrypoints.openai.server_utils import body_model_of, exception_response, required_fields_of

# (app state, parsed request) -> None, raising the route's error
ModelCheck = Callable[[Any, Any], Optional[Awaitable[None]]]
# (app state, raw body, content type) -> None or the parsed request whose body-model
# checks (Prechecks.by_model) run next, raising the route's error
BodyCheck = Callable[[Any, bytes, Optional[str]], Awaitable[Optional[BaseModel]]]


@dataclass(frozen=True)
class Prechecks:
    """``by_model``: body model -> its handler's first checks (a subclass uses its
    nearest base's); ``by_path``: route path -> the check of a route that parses its
    own body."""

    by_model: Mapping[type, ModelCheck] = field(default_factory=dict)
    by_path: Mapping[str, BodyCheck] = field(default_factory=dict)
    fits: Mapping[type, ModelCheck] = field(default_factory=dict)

    def model_check(self, model: type) -> Optional[ModelCheck]:
        return self._nearest(self.by_model, model)

    def fit_check(self, model: type) -> Optional[ModelCheck]:
        """The context-length check of a generating request of body model ``model``."""
        return self._nearest(self.fits, model)

    @staticmethod
    def _nearest(checks: Mapping[type, ModelCheck], model: type) -> Optional[ModelCheck]:
        for base in model.__mro__:
            if base in checks:
                return checks[base]
        return None


def _is_json(content_type: Optional[str]) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (none given counts)."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_as_fastapi(model: type[BaseModel], body: bytes, content_type: Optional[str] = None) -> BaseModel:
    """``body`` (sent with ``content_type``) as FastAPI reads a JSON body into ``model``:
    RequestValidationError with FastAPI's errors (``json_invalid`` at the offset, or the
    model's located under ``body``; a content type that is not JSON: the raw bytes, which
    no model takes) when it does not parse, HTTPException 400 for a body that is not
    UTF-8. RecursionError passes (JsonDepthMiddleware's)."""
    if not body:  # FastAPI reads no body as a missing one
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}],
                                     body=None)
    from llmserve.entrypoints.openai.json_depth import long_integer_field, long_integer_message
    from llmserve.sampling_params import SamplingParamsError

    field_at = long_integer_field(body) if _is_json(content_type) else None
    if field_at is not None:  # the route's own 400 (JsonDepthMiddleware's, inside admission)
        raise SamplingParamsError(long_integer_message(field_at), field_at or None)
    try:
        value: Any = json.loads(body) if _is_json(content_type) else body
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
    except UnicodeDecodeError as e:  # FastAPI's words; the app's handler says which bytes
        raise HTTPException(400, "There was an error parsing the body") from e
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None


def _route_of(router: Any, method: str, path: str) -> Any:
    """The FastAPI route (APIRoute) of ``method`` and ``path`` (after the root path) in
    ``router``, looked up through included routers (FastAPI wraps each in an object that
    keeps the router as ``original_router`` and its ``include_context.prefix``); None
    when no route has a body model there."""
    for route in getattr(router, "routes", ()):
        inner = getattr(route, "original_router", None)
        if inner is not None:
            prefix = getattr(getattr(route, "include_context", None), "prefix", "") or ""
            if path.startswith(prefix):
                found = _route_of(inner, method, path[len(prefix):])
                if found is not None:
                    return found
        elif isinstance(route, APIRoute) and method in route.methods and route.path_regex.match(path):
            return route
    return None


async def malformed_response(prechecks: Prechecks, router: Any, state: Any, scope: dict, path: str, body: bytes,
                             content_type: Optional[str]) -> Optional[Response]:
    """The error response the route at ``path`` would give this request before any
    prompt is rendered, or None when it finds nothing wrong (or cannot tell: see the
    module docstring). ``router``: the app's (its routes find the body model)."""
    required: list[str] = []
    try:
        if path in prechecks.by_path:
            request = await prechecks.by_path[path](state, body, content_type)
            if request is None:
                return None
            model: Optional[type[BaseModel]] = type(request)
        else:
            model = body_model_of(_route_of(router, scope.get("method", "POST"), path))
            if model is None:
                return None
            required = required_fields_of(model)
            request = parse_as_fastapi(model, body, content_type)
        for check in (prechecks.model_check(model), prechecks.fit_check(model)):
            if check is not None:
                pending = check(state, request)
                if pending is not None:
                    await pending
    except RecursionError:
        return None
    except Exception as e:  # the route's own error, whatever its kind, mapped as the app maps it
        response = exception_response(e, content_type, required)
        # a 5xx is this check's failure, not the request's: the refusal stands
        return response if response.status_code < 500 else None
    return None


def route_handler(state: Any, attr: str, request: Any) -> Any:
    """The app's handler ``attr`` (``openai_serving_chat``...) that serves ``request``: with
    several models (``--extra-model``) the one its ``model`` names, picked as the route
    picks it (a 404 or 400 naming ``model`` when no served model can serve the route);
    None when the app has no such handler."""
    handler = getattr(state, attr, None)
    pick = getattr(handler, "handler_for", None)
    return pick(request) if callable(pick) else handler


def check_model(state: Any, attr: str, request: Any, task: Optional[str] = None) -> None:
    """The check of ``request``'s ``model`` that its handler ``attr`` runs first:
    ModelNotFoundError (404) for a name not served, a 400 naming ``model`` for a model
    that cannot serve the route (a pooling model asked to generate; with ``task``, a
    pooling handler's ``check_task``: a model that cannot embed, score or classify). Run
    in a copy of the context: the check also picks the request's LoRA adapter (a context
    variable) for its engine calls, which a refused request never makes."""
    handler = route_handler(state, attr, request)
    if handler is None:
        return
    if task is None:
        contextvars.copy_context().run(handler._check_model, request)
    else:
        contextvars.copy_context().run(handler.check_task, request, task)


def _check_chat(state: Any, request: Any) -> None:
    # OpenAIServingChat.create_chat_completion's first checks, in its order
    check_model(state, "openai_serving_chat", request)
    request.check_openai_budget()
    request.check()


def _check_completion(state: Any, request: Any) -> None:
    # OpenAIServingCompletion._prepare's first checks, in its order
    check_model(state, "openai_serving_completion", request)
    request.check_openai_budget()
    request.check()


def _checks_model(attr: str, then_request: bool = True) -> ModelCheck:
    """The first checks of a handler that runs ``_check_model``, then (``then_request``)
    ``request.check()``: completions, Responses; ``/infill`` and ``/completion`` only the first."""
    def check(state: Any, request: Any) -> None:
        check_model(state, attr, request)
        if then_request:
            request.check()
    return check


def _checks_task(attr: str, task: Optional[str]) -> ModelCheck:
    """A pooling handler's first check, ``check_task`` for ``task`` (None: the request's
    own ``task``, else the handler's default, as ``/pooling`` picks it)."""
    def check(state: Any, request: Any) -> None:
        wanted = task or getattr(request, "task", None)
        if wanted is None:
            handler = route_handler(state, attr, request)
            if handler is None:
                return
            wanted = handler.default_pooling_task()
        check_model(state, attr, request, wanted)
    return check


def check_fits(serving: Any, n_prompt: int, max_tokens: Optional[int], names: Mapping[str, str]) -> None:
    """The engine's context rules (:func:`~llmserve.engine.input_processor.check_prompt_fits`)
    for a prompt of ``n_prompt`` tokens and ``max_tokens`` output tokens on ``serving``'s
    model, the error's field renamed to the route's (``names``: ``prompt`` -> ``messages``...)."""
    from llmserve.engine.input_processor import check_prompt_fits
    from llmserve.entrypoints.openai.common.serving import renamed_param
    from llmserve.sampling_params import SamplingParamsError

    try:
        check_prompt_fits(n_prompt, max_tokens, serving.model_config.max_model_len)
    except SamplingParamsError as e:
        raise renamed_param(e, names) from None


async def fits_chat(state: Any, request: Any, names: Optional[Mapping[str, str]] = None) -> None:
    """A chat request's prompt, rendered as ``/v1/chat/completions`` renders it, against
    the context (:func:`check_fits`)."""
    from llmserve.entrypoints.openai.render import render_chat

    serving = route_handler(state, "openai_serving_chat", request)
    if serving is None:
        return
    rendered = await render_chat(serving, request)
    if names is None:
        names = {"prompt": "messages",
                 "max_tokens": "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"}
    check_fits(serving, len(rendered.token_ids), rendered.sampling_params.get("max_tokens"), names)


async def _fits_completion(state: Any, request: Any) -> None:
    from llmserve.entrypoints.openai.render import render_completion

    serving = route_handler(state, "openai_serving_completion", request)
    if serving is None:
        return
    for item in (await render_completion(serving, request)).items:
        check_fits(serving, len(item.token_ids), item.sampling_params.get("max_tokens"), {})


async def _fits_responses(state: Any, request: Any) -> None:
    from llmserve.entrypoints.openai.responses.serving import PARAM_NAMES

    serving = route_handler(state, "openai_serving_responses", request)
    if serving is None:
        return
    model_name = serving._check_model(request)
    job = await serving._prepare(serving._with_referenced_items(request), model_name, None)
    check_fits(serving, len(job.prompt.token_ids), job.params.max_tokens, PARAM_NAMES)


def openai_fit_checks() -> dict[type, ModelCheck]:
    """The context-length checks of the OpenAI routes that generate, by body model."""
    from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
    from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest

    return {ChatCompletionRequest: fits_chat, CompletionRequest: _fits_completion, ResponsesRequest: _fits_responses}


def openai_model_checks() -> dict[type, ModelCheck]:
    """The OpenAI routes' first checks by body model (their handlers run them before
    rendering): the model the request names, then chat's, completions' and Responses'
    request-level ``check()``."""
    from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from llmserve.entrypoints.openai.classify.protocol import ClassificationRequest
    from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
    from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest, PoolingRequest
    from llmserve.entrypoints.openai.infill.protocol import InfillRequest, LlamaCompletionRequest
    from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest
    from llmserve.entrypoints.openai.score.protocol import RerankRequest, ScoreRequest

    return {ChatCompletionRequest: _check_chat,
            CompletionRequest: _check_completion,
            ResponsesRequest: _checks_model("openai_serving_responses"),
            InfillRequest: _checks_model("openai_serving_completion", then_request=False),
            LlamaCompletionRequest: _checks_model("openai_serving_completion", then_request=False),
            EmbeddingRequest: _checks_task("openai_serving_embedding", "embed"),
            PoolingRequest: _checks_task("openai_serving_embedding", None),
            ScoreRequest: _checks_task("openai_serving_scores", "score"),
            RerankRequest: _checks_task("openai_serving_scores", "score"),
            ClassificationRequest: _checks_task("openai_serving_classification", "classify")}
