"""Sampling parameters for text generation (vLLM's ``SamplingParams``).

Validation follows vLLM's ranges and raises ``ValueError`` naming the field, so the
HTTP layer can turn it into a 400 with ``param`` set.
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Union

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How outputs are delivered (vLLM's ``RequestOutputKind``).

    CUMULATIVE: every output carries the whole text so far; DELTA: only what is new since
    the last output; FINAL_ONLY: one output when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParamsError(ValueError):
    """A ValueError that names the offending field (``param``)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(SamplingParamsError):
    """A prompt (with its output budget) that does not fit the model's context: a 400
    whose ``code`` is OpenAI's ``"context_length_exceeded"`` (common/errors.py), the one
    value the official clients test to tell it from other refusals (Codex CLI: only in a
    ``response.failed`` event, then "ran out of room" and compaction; openai-python:
    ``BadRequestError.code``). ``param``: the field to shorten."""


def _err(param: str, message: str) -> SamplingParamsError:
    return SamplingParamsError(message, param)


# SamplingParams fields that must be integers when set (None allowed where the default is).
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_REQUIRED_INT_FIELDS = ("n", "min_tokens")  # None is not allowed for these


def _str_list(param: str, value) -> list:
    """``stop`` / ``bad_words``: None -> [], a string -> [it], a list (or tuple) of
    strings -> a list. Raises SamplingParamsError naming ``param`` for anything else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _err(param, f"{param} must be a string or a list of strings.")
    return list(value)


@dataclass
class StructuredOutputsParams:
    """Constraints on the text a request may generate (vLLM's ``StructuredOutputsParams``).

    Exactly one of the constraint fields is set:
      json: a JSON schema (dict or its JSON text) the output must validate against.
      json_object: True for "any JSON object" (OpenAI ``response_format: json_object``).
      regex: a regular expression the whole output must match.
      choice: a list of strings; the output is exactly one of them.
      grammar: an EBNF/GBNF grammar (xgrammar's dialect, ``root ::= ...``).
      structural_tag: xgrammar's structural-tag JSON text (tool calls between tags).
    Options:
      disable_any_whitespace: JSON without optional whitespace.
      disable_additional_properties: treat schemas as ``additionalProperties: false``.
      whitespace_pattern: regex for JSON whitespace (backends that support it).

    The engine compiles the constraint with its backend (xgrammar) off the step loop and
    masks each step's logits with it. Raises SamplingParamsError (param
    ``structured_outputs``, the message naming ``structured_outputs.<field>``) for a field
    of the wrong type (:data:`_STRUCTURED_FIELD_TYPES`) and when no constraint or more
    than one is given. :meth:`from_dict` builds one from a request's JSON object.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        for name, (types, what) in _STRUCTURED_FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and not _is_structured_value(value, types):
                raise _err("structured_outputs", f"structured_outputs.{name} must be {what}, got "
                                                 f"{_json_type_name(value)}.")
        given = [k for k in STRUCTURED_CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _err("structured_outputs",
                       "structured_outputs needs exactly one of json, regex, choice, grammar, "
                       f"json_object or structural_tag; got {given or 'none'}.")

    @classmethod
    def from_dict(cls, value: object, param: str = "structured_outputs") -> "StructuredOutputsParams":
        """The constraint of a JSON object of this class's fields (vLLM's request field
        ``structured_outputs``, the offline ``SamplingParams(structured_outputs={...})``).
        Raises SamplingParamsError naming ``param`` for anything but an object, for unknown
        keys (all of them, with the known ones) and for a field of the wrong type: never
        Python's own ``__init__() got an unexpected keyword argument`` text."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _err(param, f"{param} must be an object with one of {', '.join(STRUCTURED_CONSTRAINT_KINDS)}, "
                              f"got {_json_type_name(value)}.")
        unknown = [k for k in value if k not in _STRUCTURED_FIELD_TYPES]
        if unknown:
            names = ", ".join(f"{param}.{k}" if isinstance(k, str) and k.isidentifier() else f"{param}[{k!r}]"
                              for k in unknown)
            raise _err(param, f"unknown field(s) {names}; {param} takes {', '.join(_STRUCTURED_FIELD_TYPES)}.")
        return cls(**value)


# Each StructuredOutputsParams field -> (the types it takes, how a message says so); None
# is always allowed (unset). bool is checked apart from int (True is an int in Python).
# A string regex/grammar is required: str(5) would have compiled as the regex "5".
_STRUCTURED_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "json": ((dict, str, bool), "a JSON schema (an object, or its JSON text)"),
    "regex": ((str,), "a string"),
    "choice": ((list, tuple), "a non-empty list of strings"),
    "grammar": ((str,), "a string"),
    "json_object": ((bool,), "a boolean"),
    "structural_tag": ((dict, str), "a structural tag (an object, or its JSON text)"),
    "disable_any_whitespace": ((bool,), "a boolean"),
    "disable_additional_properties": ((bool,), "a boolean"),
    "whitespace_pattern": ((str,), "a string"),
}
STRUCTURED_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _is_structured_value(value: object, types: tuple[type, ...]) -> bool:
    """Whether ``value`` is one of ``types`` (bool only where bool is listed); a
    list/tuple (``choice``) must be non-empty and hold strings only."""
    if isinstance(value, bool) and bool not in types:
        return False
    if not isinstance(value, types):
        return False
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(c, str) for c in value)
    return True


def _json_type_name(value: object) -> str:
    """The JSON name of a decoded value's type (``5`` -> "a number"), for messages
    that should not echo the value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _clamp_logit_bias(bias: dict) -> dict:
    """``logit_bias`` with integer keys (ints or integer strings, as JSON sends them) and
    values clamped to [-100, 100] (vLLM's ``to_sampling_params`` clamp, in every path:
    chat, completions, offline). A key that is not a token id is kept as given, so the
    InputProcessor, which knows the vocabulary, names it with the out-of-range ids.
    Raises SamplingParamsError naming every key whose value is not a number (or NaN)."""
    out, bad_values = {}, []
    for k, v in bias.items():
        try:
            key = int(k) if not isinstance(k, float) else k
        except (TypeError, ValueError):
            key = k
        try:
            value = float(v)
        except (TypeError, ValueError):
            value = math.nan
        if math.isnan(value):
            bad_values.append(repr(k))
        out[key] = min(100.0, max(-100.0, value))
    if bad_values:
        raise _err("logit_bias", f"logit_bias values must be numbers; bad values at keys: {', '.join(bad_values)}.")
    return out


@dataclass
class SamplingParams:
    """Parameters of one generation request, with vLLM's names and defaults.

    Fields (all optional):
      n: number of completions to return (>= 1).
      presence_penalty, frequency_penalty: in [-2, 2]; OpenAI's additive penalties on
        tokens already generated (presence: once, frequency: per occurrence).
      repetition_penalty: > 0; CTRL-style multiplicative penalty on prompt and output tokens
        (1.0 = off).
      temperature: >= 0; 0 means greedy. top_p in (0, 1]; top_k: 0 or -1 = off, else >= 1;
        min_p in [0, 1].
      seed: per-request RNG seed; the same seed gives the same tokens whatever else is
        in the batch.
      stop: strings that end generation; cut from the text unless
        ``include_stop_str_in_output``. stop_token_ids: token ids that end generation.
      ignore_eos: keep generating past EOS. max_tokens: output budget in tokens (None =
        rest of the context); min_tokens: EOS and stop_token_ids are blocked until this many.
      logprobs: number of top logprobs per output token (plus the sampled one); -1 = all
        the vocabulary. prompt_logprobs: same for each prompt token.
      detokenize, skip_special_tokens, spaces_between_special_tokens: detokenizer options.
      logit_bias: {token_id: bias} added to logits (OpenAI, clamped to [-100, 100]).
      allowed_token_ids: only these tokens may be sampled. bad_words: strings whose token
        sequences may not be generated.
      output_kind: see RequestOutputKind.
      truncate_prompt_tokens: keep only the last this many prompt tokens (-1: the
        model's context length; vLLM), applied by the engine's InputProcessor.
      structured_outputs: a StructuredOutputsParams constraint (JSON schema, regex,
        choice, grammar), enforced by the engine's grammar backend.

    Raises:
      SamplingParamsError (a ValueError) with ``param`` set, on any out-of-range value.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Derived by the InputProcessor, not by users: the stop ids (``stop_token_ids`` plus the
    # generation config's extra EOS ids) and the tokenized bad words.
    all_stop_token_ids: set[int] = field(default_factory=set)
    bad_words_token_ids: Optional[list[list[int]]] = None
    # True once __post_init__ has normalised and checked the fields. It travels with the
    # params (msgspec encodes it), so the engine process, whose decoder calls __post_init__
    # again, neither re-validates nor rebuilds the derived fields above (vLLM keeps its
    # ``_all_stop_token_ids`` the same way). ``dataclasses.replace`` resets it (init=False).
    _validated: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._validated:  # decoded from another process: already checked and derived
            return
        self.stop = _str_list("stop", self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise _err("stop_token_ids", "stop_token_ids must be a list of token ids.")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self.bad_words = _str_list("bad_words", self.bad_words)
        self._verify_types()
        if self.logit_bias:
            self.logit_bias = _clamp_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:  # a dict of its fields offline, as the server takes
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if 0 < self.temperature < _SAMPLING_EPS:
            # Tiny temperatures are numerically unstable; treat them as greedy.
            self.temperature = 0.0
        self._verify_args()
        if self.temperature == 0.0:
            # Greedy: the truncation parameters do not matter.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        # Keep ids derived before (a clone, a round trip) and add the user's own.
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)
        self._validated = True

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """SamplingParams from keyword arguments where None means "the default" (vLLM's
        ``SamplingParams.from_optional``), e.g. the model's generation-config defaults.
        ``max_tokens=None`` is kept (the rest of the context). Raises SamplingParamsError."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def _verify_types(self) -> None:
        """Integer fields hold integers (not bools, floats or strings: a float ``logprobs``
        reached the sampler's topk and failed the engine step); ``temperature`` and
        ``repetition_penalty`` are finite; ``output_kind`` is a RequestOutputKind;
        ``allowed_token_ids`` is a list. Raises SamplingParamsError naming the field."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name not in _REQUIRED_INT_FIELDS:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise _err(name, f"{name} must be an integer.")
            setattr(self, name, int(v))  # numpy integers too
        for name in ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isinf(v):
                raise _err(name, f"{name} must be a finite number.")
            setattr(self, name, float(v))
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise _err("output_kind", "output_kind must be a RequestOutputKind (0, 1 or 2).") from None
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (list, tuple, set)):
            raise _err("allowed_token_ids", "allowed_token_ids must be a list of token ids.")

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise _err("n", f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _err("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _err("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise _err("repetition_penalty", f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            raise _err("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k is None:
            self.top_k = 0
        if self.top_k < -1:
            raise _err("top_k", f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise _err("max_tokens", f"max_tokens must be at least 0, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise _err("min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < -1:
            raise _err("logprobs", f"logprobs must be non-negative or -1, got {self.logprobs}.")
        t = self.truncate_prompt_tokens
        if t is not None and not (t == -1 or t >= 1):
            raise _err("truncate_prompt_tokens",
                       f"truncate_prompt_tokens must be at least 1, or -1 for the model's context length, got {t}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise _err("prompt_logprobs", f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise _err("seed", f"seed must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) for s in self.stop):
            raise _err("stop", "stop must be a string or a list of strings.")
        if any(s == "" for s in self.stop):
            raise _err("stop", "stop cannot contain an empty string.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise _err("allowed_token_ids", "allowed_token_ids must not be empty.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
