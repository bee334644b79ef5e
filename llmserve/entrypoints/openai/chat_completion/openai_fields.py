"""OpenAI chat fields that ask for something this server either cannot do or does
through the chat template (issue 10: a field the server accepts must take effect or be a
400; found by the fresh trial with the official client, which sends them as given).

- ``audio`` / ``modalities`` other than ``["text"]``: audio output (the model writes text).
- ``web_search_options``: a web search before answering (no network tools here).
- ``functions`` / ``function_call``: OpenAI's legacy function calling, the old form of
  ``tools``; refused like ``tools`` (tool calling is not available yet).
- ``reasoning_effort``: passed to the chat template as a variable, as vLLM does
  (templates of reasoning models read it); an explicit ``chat_template_kwargs`` entry wins.

Fields that cannot change a text answer (``store``, ``metadata``, ``service_tier``,
``prediction``, ``prompt_cache_key``, ``safety_identifier``, ``parallel_tool_calls``,
``verbosity``) stay accepted and ignored, as in vLLM; those shared with the Responses API
take only OpenAI's types and values (common/service_fields.py).
"""
from __future__ import annotations

from typing import Any, Optional

from llmserve.sampling_params import SamplingParamsError


def check_openai_only_fields(request: Any) -> None:
    """Raise SamplingParamsError (``param`` = the field) for a ChatCompletionRequest field
    whose request this server cannot honour."""
    if request.audio is not None:
        raise SamplingParamsError("Audio output is not supported: this model produces text only "
                                  "(leave out `audio`).", "audio")
    if request.modalities is not None and any(m != "text" for m in request.modalities):
        at = next(i for i, m in enumerate(request.modalities) if m != "text")
        what = "audio output is" if request.modalities[at] == "audio" else "only \"text\" is"
        raise SamplingParamsError(  # the client's values are not quoted back
            f"modalities[{at}]: {what} not supported: this model produces text only "
            "(send [\"text\"] or leave the field out).", "modalities")
    if request.web_search_options is not None:
        raise SamplingParamsError("Web search is not supported by this server (leave out `web_search_options`).",
                                  "web_search_options")
    if request.functions:
        raise SamplingParamsError("Function calling (`functions`, the legacy form of `tools`) is not supported "
                                  "by this server yet.", "functions")
    if request.function_call not in (None, "none", "auto"):
        raise SamplingParamsError("`function_call` requires `functions`, which this server does not support yet.",
                                  "function_call")


def template_kwargs(request: Any) -> Optional[dict[str, Any]]:
    """The chat template's extra variables: ``chat_template_kwargs`` plus
    ``reasoning_effort`` when given (vLLM passes it to the template)."""
    kwargs = request.chat_template_kwargs
    if request.reasoning_effort is None:
        return kwargs
    return {"reasoning_effort": request.reasoning_effort, **(kwargs or {})}
