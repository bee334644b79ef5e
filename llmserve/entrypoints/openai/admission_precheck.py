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
  ``server_utils.exception_response``), then the request-level checks its handler runs
  first (:attr:`Prechecks.by_model`: ``check()`` of chat, completion and Responses
  requests; Anthropic's mapping and rules);
- a route that reads its own body (Ollama's): :attr:`Prechecks.by_path`, its parser and
  checks (``ollama/serving.check_chat``...).

A body whose content type FastAPI would not read as JSON, and any check that needs the
prompt (its length against the context), are left to the route: such a request is
refused as before.
"""
from __future__ import annotations

import email.message
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from llmserve.entrypoints.openai.server_utils import body_model_of, exception_response, required_fields_of

# (app state, parsed request) -> None, raising the route's error
ModelCheck = Callable[[Any, Any], Optional[Awaitable[None]]]
# (app state, raw body) -> None, raising the route's error
BodyCheck = Callable[[Any, bytes], Awaitable[None]]


@dataclass(frozen=True)
class Prechecks:
    """``by_model``: body model -> its handler's first checks (a subclass uses its
    nearest base's); ``by_path``: route path -> the check of a route that parses its
    own body."""

    by_model: Mapping[type, ModelCheck] = field(default_factory=dict)
    by_path: Mapping[str, BodyCheck] = field(default_factory=dict)

    def model_check(self, model: type) -> Optional[ModelCheck]:
        for base in model.__mro__:
            if base in self.by_model:
                return self.by_model[base]
        return None


def _is_json(content_type: Optional[str]) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (none given counts)."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_as_fastapi(model: type[BaseModel], body: bytes) -> BaseModel:
    """``body`` as FastAPI reads a JSON body into ``model``: RequestValidationError with
    FastAPI's errors (``json_invalid`` at the offset, or the model's located under
    ``body``) when it does not parse. RecursionError passes (JsonDepthMiddleware's)."""
    if not body:  # FastAPI reads no body as a missing one
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}],
                                     body=None)
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
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
            await prechecks.by_path[path](state, body)
            return None
        model = body_model_of(_route_of(router, scope.get("method", "POST"), path))
        if model is None or not _is_json(content_type):
            return None
        required = required_fields_of(model)
        request = parse_as_fastapi(model, body)
        check = prechecks.model_check(model)
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


def _check_chat(_: Any, request: Any) -> None:
    request.check_openai_budget()  # OpenAIServingChat.create_chat_completion's first checks, in its order
    request.check()


def _check_request(_: Any, request: Any) -> None:
    request.check()


def openai_model_checks() -> dict[type, ModelCheck]:
    """The OpenAI routes' request-level checks by body model (their handlers run them
    before rendering: chat, completions, Responses)."""
    from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
    from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest

    return {ChatCompletionRequest: _check_chat, CompletionRequest: _check_request, ResponsesRequest: _check_request}
