"""Ollama's model management routes on a server whose models are fixed at start.

llmserve serves the models it was started with (``llmserve serve MODEL``,
``--extra-model``, LoRA adapters), so nothing is downloaded, uploaded, copied or deleted.
What each route answers, in Ollama's words where Ollama has them (``server/routes.go``):

- ``POST /api/pull`` of a served model: success at once (``{"status": "success"}``, or the
  NDJSON lines ``pulling manifest`` and ``success`` when streamed, Ollama's default), as
  Ollama answers a pull of a model it already has; scripts and apps that pull before they
  chat (``ollama.pull(model)``) go on. An unknown model is a 404 that says nothing is
  downloaded here (Ollama would fetch it from its registry).
- ``POST /api/push``, ``DELETE /api/delete``, ``POST /api/copy``: Ollama's 404 for an unknown
  model (``model 'NAME' not found``; copy's source ``model "NAME" not found``), 501 for a
  served one (it cannot be pushed, deleted or copied here).
- A name missing is a 400 as in Ollama (``model is required``; copy: ``source "" is
  invalid`` / ``destination "" is invalid``).

Names match as on the other Ollama routes (``names.py``); a model the API key may not
call is unknown (the tenant check, ``tenant_quotas.MODEL_NAMING_PATHS``).
"""
from __future__ import annotations

import json
from typing import Any, AsyncGenerator, Optional, Union

from fastapi import HTTPException

from llmserve.entrypoints.ollama.names import resolve
from llmserve.entrypoints.ollama.protocol import (OllamaCopyRequest, OllamaDeleteRequest, OllamaPullRequest,
                                                  OllamaPushRequest)
from llmserve.sampling_params import SamplingParamsError


def not_available(path: str) -> str:
    """The 501 message of a management route that cannot act here."""
    return (f"{path} is not available: llmserve serves the models it was started with (`llmserve serve MODEL`, "
            "`--extra-model`); see GET /api/tags.")


def _served(state: Any, name: Optional[str], route: str, field: str = "model") -> str:
    """The served model (or adapter) ``name`` calls. Raises SamplingParamsError (400) for
    no name, OllamaModelNotFound (404, ``route``'s words) for an unknown one."""
    if not name:
        raise SamplingParamsError(f"{field} is required", field)
    models = state.openai_serving_models
    return resolve(name, models.model_names + models.lora_names, route=route)


async def _pull_lines() -> AsyncGenerator[str, None]:
    for status in ("pulling manifest", "success"):
        yield json.dumps({"status": status}) + "\n"


def pull_model(state: Any, request: OllamaPullRequest) -> Union[dict[str, str], AsyncGenerator[str, None]]:
    """``POST /api/pull``: success for a served model (streamed unless ``stream`` is false).
    Raises the 400/404 of :func:`_served`."""
    _served(state, request.model or request.name, "/api/pull")
    return _pull_lines() if request.stream is not False else {"status": "success"}


def push_model(state: Any, request: OllamaPushRequest) -> None:
    """``POST /api/push``: 404 for an unknown model, else 501 (always raises)."""
    _served(state, request.model or request.name, "/api/push")
    raise HTTPException(501, not_available("/api/push"))


def delete_model(state: Any, request: OllamaDeleteRequest) -> None:
    """``DELETE /api/delete``: 404 for an unknown model, else 501 (always raises)."""
    _served(state, request.model or request.name, "/api/delete")
    raise HTTPException(501, not_available("/api/delete"))


def copy_model(state: Any, request: OllamaCopyRequest) -> None:
    """``POST /api/copy``: 400 for a missing name, 404 for an unknown source, else 501
    (always raises). Ollama checks both names before it looks the source up."""
    for field in ("source", "destination"):
        if not getattr(request, field):
            raise SamplingParamsError(f'{field} "" is invalid', field)
    _served(state, request.source, "/api/copy", "source")
    raise HTTPException(501, not_available("/api/copy"))
