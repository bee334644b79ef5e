"""Protocol of Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/show``), as Ollama's ``api/types.go`` and its docs
(``docs/api.md``) define it.

Requests are pydantic models with Ollama's field names; unknown fields are accepted and
ignored (logged once, as the OpenAI requests do). ``options`` stays a plain dict: it is
mapped to sampling by ``options.py``, which names ``options.<key>`` in its errors.
Integer fields are Go ints (StrictInt: ``"5"``, ``1.5`` and ``true`` are refused, as Go's
decoder refuses them; go_errors.py words the 400 as Ollama does).
Responses are built as plain dicts in ``serving.py`` (Ollama's JSON leaves unset fields
out, and its clients read them as optional).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, Field, StrictInt

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES
from llmserve.entrypoints.openai.common.protocol import OpenAIRequestModel, OpenAIRequestPart

# ``keep_alive``: a duration ("5m", "1h"), seconds, or -1 / 0. Accepted and ignored: the
# model stays loaded for the server's life (there is no unloading to schedule). A string
# must still be a Go duration, as Ollama parses it (time.ParseDuration): "forever" is a
# 400 there, and was a silent 200 here (trial of stop 43). A number in a string ("-1", as
# OLLAMA_KEEP_ALIVE is written) is let through: it is unambiguous, and nothing is scheduled.
_GO_DURATION = re.compile(r"[-+]?(\d+(\.\d*)?|((\d+(\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h))+)")


def _check_duration(value: Optional[Union[str, float]]) -> Optional[Union[str, float]]:
    if isinstance(value, str) and not _GO_DURATION.fullmatch(value):
        raise ValueError('time: invalid duration (a Go duration such as "5m", "1h30m" or "-1s", or a number of '
                         'seconds)')
    return value


KeepAlive = Annotated[Optional[Union[str, float]], AfterValidator(_check_duration)]
# ``format``: "json", "" (none), or a JSON schema object.
Format = Optional[Union[str, dict[str, Any]]]


class OllamaToolCallFunction(OpenAIRequestPart):
    """The ``function`` of a tool call in the history (Go's api.ToolCallFunction):
    ``name``, ``index`` (a Go int) and ``arguments``, an object (Go's
    api.ToolCallFunctionArguments is a map): a JSON string or a list there is Go's
    decoder error, as Ollama answers it (``json: cannot unmarshal string into Go struct
    field ToolCallFunction.messages.tool_calls.function.arguments of type
    api.ToolCallFunctionArguments``); Ollama does not parse a string as JSON."""

    name: Optional[str] = None
    arguments: Optional[dict[str, Any]] = None
    index: Optional[StrictInt] = None


class OllamaToolCall(OpenAIRequestPart):
    """One of an assistant message's ``tool_calls`` (Go's api.ToolCall)."""

    id: Optional[str] = None
    function: Optional[OllamaToolCallFunction] = None


class OllamaMessage(OpenAIRequestModel):
    """One message of ``/api/chat``: role, content, and Ollama's extras: ``thinking``
    (the reasoning of an earlier assistant turn), ``images`` (base64, refused while no
    vision model runs), ``tool_calls`` (arguments as an object: :class:`OllamaToolCall`),
    ``tool_name`` (of a ``tool`` message: which tool answered)."""

    role: str
    content: Optional[str] = ""
    thinking: Optional[str] = None
    images: Optional[list[Any]] = None
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None


class OllamaBaseGenerate(OpenAIRequestModel):
    """Fields shared by ``/api/chat`` and ``/api/generate``. ``stream`` defaults to
    true (Ollama streams NDJSON unless told ``"stream": false``)."""

    model: str = Field(min_length=1)
    stream: Optional[bool] = True
    format: Format = None
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None
    think: Optional[Union[bool, str]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = None  # Go's int: "5", 1.5 and true are type errors
    # An over-long prompt is shortened (default) or refused (false): context_fit.py.
    truncate: Optional[bool] = None
    shift: Optional[bool] = None  # Ollama's context shift; accepted, no effect (context_fit.py)


class OllamaChatRequest(OllamaBaseGenerate):
    """``POST /api/chat``: ``messages`` and ``tools`` (OpenAI's function-tool shape)."""

    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: Optional[list[dict[str, Any]]] = None


class OllamaGenerateRequest(OllamaBaseGenerate):
    """``POST /api/generate``: ``prompt`` rendered with the chat template as one user
    turn (``system`` before it), or sent as it is with ``raw``; ``suffix`` asks for
    fill-in-the-middle. ``context`` (the token ids an earlier answer returned, Ollama's
    deprecated memory) puts their text before this turn's; ``template`` (a Go template, in
    place of the model's) makes the prompt as Ollama does (go_template.py); ``images`` needs a
    vision model."""

    prompt: Optional[str] = ""
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[StrictInt]] = None
    raw: Optional[bool] = False
    images: Optional[list[Any]] = None


class OllamaEmbedRequest(OpenAIRequestModel):
    """``POST /api/embed``: ``input`` a string or strings; ``truncate`` (default true)
    cuts inputs to the context instead of failing; ``dimensions`` (a Go int: 0 or less is
    unset, as Ollama reads it) keeps each vector's first values, renormalised, for any
    model (serving.ollama_vector)."""

    model: str = Field(min_length=1)
    input: Union[str, list[str]] = ""
    truncate: Optional[bool] = True
    dimensions: Optional[StrictInt] = None
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None


class OllamaEmbeddingsRequest(OpenAIRequestModel):
    """``POST /api/embeddings`` (Ollama's older route): one ``prompt``, one vector."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None


class OllamaShowRequest(OpenAIRequestModel):
    """``POST /api/show``: ``model`` (older clients send ``name``); ``verbose`` adds
    nothing here (the model info is small)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = None


class OllamaPullRequest(OpenAIRequestModel):
    """``POST /api/pull`` and ``/api/push``: ``model`` (older clients send ``name``),
    ``stream`` (default true: NDJSON progress lines). ``insecure``, ``username`` and
    ``password`` are registry settings: nothing is downloaded or uploaded here."""

    model: Optional[str] = None
    name: Optional[str] = None
    stream: Optional[bool] = True
    insecure: Optional[bool] = None
    username: Optional[str] = None
    password: Optional[str] = None


class OllamaDeleteRequest(OpenAIRequestModel):
    """``DELETE /api/delete``: ``model`` (older clients send ``name``)."""

    model: Optional[str] = None
    name: Optional[str] = None


class OllamaCopyRequest(OpenAIRequestModel):
    """``POST /api/copy``: ``source`` and ``destination`` model names."""

    source: Optional[str] = None
    destination: Optional[str] = None


class OllamaPushRequest(OllamaPullRequest):
    """``POST /api/push``: the fields of :class:`OllamaPullRequest` (Go's PushRequest)."""
