"""Protocol models shared by the OpenAI endpoints (vLLM's ``entrypoints/openai/engine/protocol.py``):
the base models, the error body, usage, stream options, chat input messages and the
sampling fields common to chat and completions. Each endpoint's own request/response
models live in its folder (``chat_completion/protocol.py``, ``completion/protocol.py``, ...).

Requests keep OpenAI's field names plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, ...). Each generation request converts itself
to a :class:`~llmserve.sampling_params.SamplingParams` with ``to_sampling_params``, which
raises :class:`~llmserve.sampling_params.SamplingParamsError` (a ValueError with ``param``)
on out-of-range values, so the server answers 400 naming the field.

Request bodies take each field's JSON type only, as OpenAI's API does (pydantic's strict
mode on every request model and the objects inside it: :class:`OpenAIRequestModel`,
:class:`OpenAIRequestPart`): ``"max_tokens": "5"``, ``"temperature": "1"``,
``"stream": "yes"`` and ``"logprobs": 1`` are a 400 naming the field, where pydantic's lax
mode read them as 5, 1.0 and true. A JSON integer is still a number (``"temperature": 1``),
and an integral number is still an integer (``"max_tokens": 5.0``, see :data:`JSONInt`).
List fields have the documented limits of :mod:`~llmserve.entrypoints.openai.common.limits`.

Unknown request fields are accepted and ignored, as vLLM and OpenAI do (logged once per
field name, as vLLM warns); fields whose meaning llmserve cannot honour (``suffix``,
``tools`` with a tool choice) are rejected with a 400 instead of being silently ignored.
``response_format`` and vLLM's ``structured_outputs`` become
``SamplingParams.structured_outputs`` (``structured.py``).
"""
from __future__ import annotations

import functools
import logging
import types
import typing
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic_core import PydanticCustomError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmserve.entrypoints.openai.common.structured import ResponseFormat, structured_outputs_params
from llmserve.entrypoints.openai.common.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID_LIST_ITEMS,
)
from llmserve.sampling_params import RequestOutputKind, SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.openai")

# vLLM's default ``max_logprobs``: the most top logprobs one position may ask for.
MAX_LOGPROBS = 20
# OpenAI's documented range for ``temperature``.
MAX_TEMPERATURE = 2.0
# The most completions one request may ask for (``n``; per prompt for completions): MAX_N,
# imported from common/limits.py with the other limits.


# The context of the errors below: validation_errors.resolve_unions reads it to report the
# integer member of a union (``prompt: [true]`` -> ``prompt.0``) rather than "must be a list
# of integers or ...": a boolean is refused by name only by the member that reads numbers.
BOOLEAN_REFUSED = {"refused": "boolean"}


def _not_a_boolean(value: Any) -> Any:
    """An integer field's value as given, unless it is a JSON boolean (``"max_tokens": true``
    asked for one token, ``"prompt": [true]`` ran token id 1, before the request models
    were strict; OpenAI answers 400), or the integer of an integral JSON number (``5.0``:
    JSON has one number type, JSON Schema's "integer" takes it, and vLLM reads it as 5).
    A string or a fractional number is left to the strict ``int`` that follows (a 400).
    Raises PydanticCustomError ``int_type`` (a 400 naming the field)."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be an integer, not a boolean", BOOLEAN_REFUSED)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _not_a_boolean_number(value: Any) -> Any:
    """A number field's value as given, unless it is a JSON boolean: pydantic's lax mode
    reads ``true`` as 1.0 (``"temperature": true``, a ``logit_bias`` value of ``true``);
    OpenAI answers 400. Raises PydanticCustomError ``float_type`` (a 400 naming the field)."""
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a number, not a boolean", BOOLEAN_REFUSED)
    return value


# An integer request field: ``true`` is refused by name and ``5.0`` read as 5 (_not_a_boolean),
# ``"5"`` refused by the request models' strict mode. Every integer field of the request
# models, and every integer in a list of them (token ids: a completions prompt, embeddings
# input, stop_token_ids), has this type or Int64, so all read them alike.
JSONInt = Annotated[int, BeforeValidator(_not_a_boolean)]
# A number (float) request field: ``true`` is refused alike (_not_a_boolean_number).
JSONFloat = Annotated[float, BeforeValidator(_not_a_boolean_number)]
# Integers that cross the process boundary must fit in 64 bits (vLLM bounds ``seed`` alike).
Int64 = Annotated[JSONInt, Field(ge=-(2**63), le=2**63 - 1)]

# OpenAI's reasoning effort values (chat's ``reasoning_effort``, the Responses API's
# ``reasoning.effort``); another value is a 400, as OpenAI answers (vLLM: a Literal too).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ReasoningEffort = Literal[REASONING_EFFORTS]


def timing_field() -> Any:
    """A response's ``metrics`` / ``timings`` object (common/request_metrics.py): left
    out of the JSON unless the request asked for it."""
    return Field(default=None, exclude_if=lambda v: v is None)


def random_uuid() -> str:
    """A random 32-hex-digit id (used in request ids such as ``chatcmpl-<uuid>``)."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of all API models: unknown fields are allowed (and ignored). Lax: the
    responses the server builds are of this class; request bodies are
    :class:`OpenAIRequestModel` and :class:`OpenAIRequestPart`."""

    model_config = ConfigDict(extra="allow")


class OpenAIRequestPart(OpenAIBaseModel):
    """Base of the objects inside a request body (a chat message, ``stream_options``, an
    Anthropic tool...): strict about JSON types as the request models are (a model's
    strict mode does not reach the models of its fields), NaN and Infinity refused."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _list_limits(field: Any) -> tuple[Optional[int], Optional[int]]:
    """(int-list limit, other-list limit) of a field's list types (see list_limits)."""
    ints: list[int] = []
    others: list[int] = []
    members = [(field.annotation, field.metadata)]
    while members:
        ann, meta = members.pop()
        origin = typing.get_origin(ann)
        if origin is Annotated:
            base, *extra = typing.get_args(ann)
            members.append((base, [*meta, *(m for x in extra for m in getattr(x, "metadata", [x]))]))
        elif origin in (Union, types.UnionType):
            members += [(a, meta) for a in typing.get_args(ann)]
        elif origin is list:
            limit = min((m.max_length for m in meta if isinstance(getattr(m, "max_length", None), int)), default=None)
            item = typing.get_args(ann)[0] if typing.get_args(ann) else Any
            item = typing.get_args(item)[0] if typing.get_origin(item) is Annotated else item
            (ints if item is int else others).append(limit if limit is not None else 1 << 62)
    return (max(ints) if ints else None, max(others) if others else None)


# Fields that would change the answer where a route does not take them: refused (400 naming
# them) instead of ignored, like every unknown field is (README "Request fields"). A request
# chat template runs only where the route takes one and the server trusts it.
# vLLM's pre-0.10 guided-decoding fields -> their structured_outputs keys (SamplingRequest).
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                  "guided_decoding_backend": None}

NEVER_IGNORED_FIELDS = {
    "chat_template": "This route takes no request `chat_template` (a request template is accepted only on "
                     "/v1/chat/completions, /tokenize and /v1/embeddings with messages, and only with "
                     "--trust-request-chat-template).",
}


@functools.lru_cache(maxsize=1024)
def _warn_ignored_field(model: str, name: str) -> None:
    """Log an ignored request field once per (model, field name); the cache bounds it."""
    logger.warning("The request field %r is not used by this server (%s); it is ignored.", name, model)


class OpenAIRequestModel(OpenAIBaseModel):
    """Base of request bodies: each field takes its JSON type only (pydantic's strict
    mode: a string is not read as a number or a boolean, nor a number as a boolean; an
    integer is a number; OpenAI answers these 400 too), NaN and Infinity are rejected
    (Python's json accepts them); unknown fields are ignored with a warning logged once
    per field name (vLLM's behaviour). A type error is pydantic's (``bool_type``,
    ``int_type``...), which Ollama's routes word as Go's decoder does (ollama/go_errors.py)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @classmethod
    def list_limits(cls) -> dict[str, tuple[Optional[int], Optional[int]]]:
        """Field name -> (most items of a list of ints, most items of any other list), from
        the fields' ``max_length`` (a union such as ``prompt`` has one of each: token ids,
        and a list of prompts). Computed once per class."""
        limits = cls.__dict__.get("_list_limits_cache")
        if limits is None:
            limits = {n: lim for n, f in cls.model_fields.items() if (lim := _list_limits(f)) != (None, None)}
            setattr(cls, "_list_limits_cache", limits)
        return limits

    @field_validator("*", mode="before")
    @classmethod
    def _early_list_length(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic checks max_length only after validating every item (each union member
        # in turn): 100k prompts held the event loop ~2.5 s and left ~35 MiB behind before
        # the 400; the raw list's length is checked here first
        if isinstance(value, list) and (limits := cls.list_limits().get(info.field_name)) is not None:
            limit = limits[0] if value and type(value[0]) is int else limits[1]
            if limit is not None and len(value) > limit:
                raise PydanticCustomError("too_long", "List should have at most {max_length} items, not {actual_length}",
                                          {"max_length": limit, "actual_length": len(value)})
        return value

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> "OpenAIRequestModel":
        for name in (self.model_extra or {}):
            if name in NEVER_IGNORED_FIELDS:
                raise PydanticCustomError("field_not_accepted", NEVER_IGNORED_FIELDS[name], {"param": name})
            _warn_ignored_field(type(self).__name__, name)
        return self


# ----------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    """The inner object of an OpenAI error body. ``code`` is the HTTP status code (vLLM's),
    or OpenAI's string code where a client tests it (``"context_length_exceeded"``)."""

    message: str
    type: str
    param: Optional[str] = None
    code: Union[int, str]


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- usage
class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    """Token counts of one request: prompt, completion (all choices) and their sum."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class StreamOptions(OpenAIRequestPart):
    """``include_usage``: one last chunk with ``choices: []`` and the usage; left out,
    no usage is sent (OpenAI: usage only when asked for).
    ``continuous_usage_stats`` (vLLM): running usage on every chunk (with include_usage)."""

    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


# ----------------------------------------------------------------------------- sampling
class SamplingRequest(OpenAIRequestModel):
    """Sampling fields shared by chat and completions (OpenAI + vLLM extras).

    None means "not given": the server then uses the model's generation-config default
    (when it has one) or OpenAI's default. ``max_tokens`` None is left for the engine's
    InputProcessor to resolve (the room left in the context, capped by the model's
    default budget).
    """

    model: Optional[str] = None
    n: Optional[Int64] = 1
    max_tokens: Optional[Int64] = None
    temperature: Optional[JSONFloat] = None
    top_p: Optional[JSONFloat] = None
    presence_penalty: Optional[JSONFloat] = None
    frequency_penalty: Optional[JSONFloat] = None
    logit_bias: Optional[Annotated[dict[str, JSONFloat], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)],
                         Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                                   Field(max_length=MAX_STOP_STRINGS)]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM extras
    structured_outputs: Optional[dict[str, Any]] = None
    top_k: Optional[Int64] = None
    min_p: Optional[JSONFloat] = None
    repetition_penalty: Optional[JSONFloat] = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[Annotated[list[Int64], Field(max_length=MAX_TOKEN_ID_LIST_ITEMS)]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[Annotated[list[Int64], Field(max_length=MAX_ALLOWED_TOKEN_IDS)]] = None
    bad_words: Optional[Annotated[list[str], Field(max_length=MAX_TOKEN_ID_LIST_ITEMS)]] = None
    priority: Int64 = 0
    # vLLM extras that change the response
    prompt_logprobs: Optional[Int64] = None
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # timing fields on the response (common/request_metrics.py): vLLM's and llama.cpp's opt-ins
    include_metrics: Optional[bool] = None
    timings_per_token: Optional[bool] = None
    truncate_prompt_tokens: Optional[Int64] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    # vLLM's beam search (common/beam.py): n beams, transformers' length_penalty / early_stopping
    use_beam_search: bool = False
    length_penalty: JSONFloat = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        """vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar`` / ``guided_whitespace_pattern`` fields (deprecated in vLLM 0.10
        for ``structured_outputs``) become that dict, so a client written for them is
        constrained, not silently answered free text (the trial of stop 43 found them
        ignored); ``guided_decoding_backend`` names a backend and is dropped. Both forms
        at once is a 400 naming ``structured_outputs``."""
        if not isinstance(data, dict) or not any(k in data for k in _GUIDED_FIELDS):
            return data
        data = dict(data)
        data.pop("guided_decoding_backend", None)
        guided = {_GUIDED_FIELDS[k]: data.pop(k) for k in list(data) if k in _GUIDED_FIELDS and k != "guided_decoding_backend"}
        guided = {k: v for k, v in guided.items() if v is not None}
        if not guided:
            return data
        if data.get("structured_outputs") is not None:
            raise PydanticCustomError("field_not_accepted", "Set either structured_outputs or the older guided_* "
                                      "fields, not both.", {"param": "structured_outputs"})
        data["structured_outputs"] = guided
        return data

    @model_validator(mode="before")
    @classmethod
    def _llama_cpp_n_predict(cls, data: Any) -> Any:
        """llama-server's ``n_predict``, which it reads on its OpenAI routes too (a llama.cpp
        client's budget was ignored here, leaving the route's default), as ``max_tokens``:
        -1 (llama-server's "no limit") leaves the route's default budget; beside a
        ``max_tokens`` or ``max_completion_tokens`` of another value, or not an integer
        >= -1, it is a 400 naming ``n_predict``."""
        if not isinstance(data, dict) or "n_predict" not in data:
            return data
        data = dict(data)
        n = data.pop("n_predict")
        if n is None or (n == -1 and type(n) is int):
            return data
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise PydanticCustomError("field_not_accepted", "n_predict (llama.cpp's max_tokens) must be an integer, "
                                      "-1 (no limit) or at least 0.", {"param": "n_predict"})
        for name in ("max_tokens", "max_completion_tokens"):
            if data.get(name) is not None and data[name] != n:
                raise PydanticCustomError("field_not_accepted", f"n_predict (llama.cpp's max_tokens) and {name} "
                                          "differ: set one of them.", {"param": "n_predict"})
        if data.get("max_tokens") is None and data.get("max_completion_tokens") is None:
            data["max_tokens"] = n
        return data

    def check_common(self) -> None:
        """Checks that do not need the prompt. Raises SamplingParamsError (param set)."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options can only be set if stream is true.", "stream_options")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise SamplingParamsError(f"max_tokens must be at least 0, got {self.max_tokens}.", "max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}.", "temperature")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be between 1 and {MAX_N} (this server's limit), got {self.n}.", "n")
        check_max_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise SamplingParamsError("`prompt_logprobs` are not available when `stream=True` (vLLM).",
                                      "prompt_logprobs")
        t = self.truncate_prompt_tokens
        if t is not None and not (t == -1 or t >= 1):
            raise SamplingParamsError(
                f"truncate_prompt_tokens must be at least 1, or -1 for the model's context length, got {t}.",
                "truncate_prompt_tokens")

    def sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments of the fields shared by chat and completions.

        defaults: the model's generation-config defaults under SamplingParams names
        (vLLM's ``get_diff_sampling_param``); a field the request leaves out takes the
        model's default, else OpenAI's.
        """
        def pick(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name, builtin)

        return dict(
            n=self.n if self.n is not None else 1,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # Keys that are not token ids are named by the InputProcessor, with the vocabulary.
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs_params(self.response_format, self.structured_outputs),
        )


def check_max_logprobs(value: Optional[int], param: str) -> None:
    """Raise SamplingParamsError unless ``value`` is None or in [0, MAX_LOGPROBS]."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise SamplingParamsError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}.", param)


# OpenAI's message roles. Another role passes the schema only as a plain name
# (CUSTOM_ROLE_PATTERN: "" and text that would write template markup, "user<|im_end|>...",
# are refused here) and is then checked against the chat template that renders the
# request (chat_utils.check_custom_roles): a role the template names (vLLM's custom roles:
# Llama 3.1's "ipython", Granite's "document") renders, as in vLLM; any other is a 400
# naming messages.N.role, as OpenAI answers (a fresh-user trial got a 200 for "bogus",
# which templates that print any role rendered).
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
CUSTOM_ROLE_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,31}$"
ChatRole = Union[Literal[OPENAI_ROLES], Annotated[str, Field(pattern=CUSTOM_ROLE_PATTERN)]]
# Roles whose message may have no content: an assistant turn of tool calls only, and
# tool/function results (vLLM renders a missing content as empty).
_CONTENT_OPTIONAL_ROLES = frozenset({"assistant", "tool", "function"})


class ChatMessageParam(OpenAIRequestPart):
    """One input message: ``content`` is a string, a list of at most MAX_CONTENT_PARTS
    content parts (``{"type": "text", "text": ...}``), or null (assistant messages with
    tool calls). ``tool_calls`` (an assistant's calls) is a list of call objects: a string
    there was kept as an unknown field and never reached the template (a fresh-user trial
    got a 200); each call's ``function`` is checked where the messages are rendered
    (chat_utils)."""

    role: ChatRole
    content: Optional[Union[str, Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    # Checked even when absent (validate_default): OpenAI requires it on a tool message
    # (400 "Missing required parameter: 'messages[N].tool_call_id'"); vLLM lets it pass to
    # the template, where it is lost or breaks templates that pair results with calls.
    tool_call_id: Optional[str] = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_for_tool(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        """A ``tool`` message needs the ``tool_call_id`` of the call it answers (missing
        or null: a 400 naming ``messages.N.tool_call_id``)."""
        if value is None and info.data.get("role") == "tool":
            raise PydanticCustomError("missing", "field required: a message with role 'tool' needs the "
                                                 "`tool_call_id` of the tool call it answers")
        return value

    @model_validator(mode="after")
    def _content_for_role(self) -> "ChatMessageParam":
        """A message of any role but assistant/tool/function needs ``content`` (OpenAI
        requires it for system, developer and user); raises ValueError (a 400 whose
        message names ``messages.N``)."""
        if self.content is None and self.role not in _CONTENT_OPTIONAL_ROLES:
            raise ValueError(f"a message with role {self.role!r} needs `content`")
        return self


# ----------------------------------------------------------------------------- logprobs
class PromptLogprob(OpenAIBaseModel):
    """One candidate of one prompt position in vLLM's ``prompt_logprobs`` (natural log,
    finite; 1-based rank; the token's text, or ``token_id:N`` with
    ``return_tokens_as_token_ids``)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's shape: None for the first prompt token, then {token id: PromptLogprob} (the
# actual prompt token plus the ``prompt_logprobs`` best); JSON writes the ids as strings.
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class ChatCompletionLogProb(OpenAIBaseModel):
    """One candidate token: text, natural-log probability (finite) and UTF-8 bytes."""

    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: four parallel lists, one entry per token. The first
    prompt token (with echo) has ``None`` logprob and top_logprobs."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
