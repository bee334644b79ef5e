"""Ollama's ``options`` and ``format`` -> the fields of the common request (the OpenAI
chat / completion request's sampling and structured-output fields).

Ollama's runner options (``docs/modelfile.md``, ``api/types.go`` ``Options``):
- mapped: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``num_predict``
  (-> ``max_tokens``; 0 and every negative value, -1 "no limit" and -2 "fill the
  context" included, leave the budget to the engine: the room left in the context, as
  Ollama's runner stops on num_predict only when it is above 0), ``stop``, ``repeat_penalty`` (->
  ``repetition_penalty``), ``presence_penalty``, ``frequency_penalty``;
- ``num_ctx``: the context of this request in tokens (:func:`context_size`): the prompt
  is shortened to fit it (``truncate``) and the answer stops at it, as in Ollama, whose
  runner is sized by it;
- accepted and ignored, since they describe Ollama's own runner, not the answer (each
  still of the JSON type Ollama requires, as its Options.FromMap checks: a boolean or a
  number, else a 400 naming it):
  ``num_batch``,
  ``num_gpu``, ``main_gpu``, ``num_thread``, ``numa``, ``low_vram``, ``f16_kv``,
  ``use_mmap``, ``use_mlock``, ``vocab_only``, ``logits_all``, ``embedding_only``,
  ``num_keep``, ``repeat_last_n`` (the penalties see the whole sequence, as vLLM's),
  ``penalize_newline``, ``mirostat_tau`` / ``mirostat_eta`` (without ``mirostat``);
- refused with a 400 naming ``options.<key>`` when set to anything but their neutral
  value, since they change sampling in a way this server does not do: ``mirostat``
  (0), ``tfs_z`` (1), ``typical_p`` (1);
- any other key is ignored with a warning in the log, as Ollama does.
Options left out take the model's generation-config defaults (vLLM's rule), not
Ollama's built-in ones (temperature 0.8, top_k 40, ...).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional

from llmserve.entrypoints.openai.common.structured import structured_outputs_params
from llmserve.sampling_params import SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.ollama")

# Ollama option -> the common request's field; the value must be a number.
NUMERIC_OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
INTEGER_OPTIONS = frozenset({"top_k", "seed", "num_predict", "num_ctx"})
# Ignored options by the JSON type Ollama's Options.FromMap requires of them: a value of
# another type is its error there ("option %q must be of type boolean"), a 400 here.
IGNORED_NUMBER_OPTIONS = frozenset({"num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "repeat_last_n",
                                    "mirostat_tau", "mirostat_eta"})
IGNORED_BOOL_OPTIONS = frozenset({"numa", "low_vram", "f16_kv", "use_mmap", "use_mlock", "vocab_only", "logits_all",
                                  "embedding_only", "penalize_newline"})
IGNORED_OPTIONS = IGNORED_NUMBER_OPTIONS | IGNORED_BOOL_OPTIONS
# Ollama's scheduler raises a smaller num_ctx to 4 tokens (server/sched.go getRunner), with
# no error: 0 and negative values included.
MIN_NUM_CTX = 4
# Options whose only value honoured here is the neutral one (Ollama's "off").
NEUTRAL_OPTIONS = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}


def _number(key: str, value: Any) -> Any:
    """``options.<key>`` checked as a finite number (an integer for INTEGER_OPTIONS).
    The message names the option and the JSON type sent, never the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(f"options.{key} must be a number, got {type(value).__name__}.", f"options.{key}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SamplingParamsError(f"options.{key} must be a finite number.", f"options.{key}")
    if key in INTEGER_OPTIONS:
        if value != int(value):
            raise SamplingParamsError(f"options.{key} must be an integer, got a fraction.", f"options.{key}")
        return int(value)
    return value


def _check_ignored(key: str, value: Any) -> None:
    """An ignored option still needs the JSON type Ollama's Options.FromMap requires
    (IGNORED_BOOL_OPTIONS a boolean, IGNORED_NUMBER_OPTIONS a number); a client sending
    ``use_mmap: "yes"`` gets Ollama's refusal as a 400, not a silent 200. Raises
    SamplingParamsError naming ``options.<key>``."""
    if key in IGNORED_BOOL_OPTIONS and not isinstance(value, bool):
        raise SamplingParamsError(f"options.{key} must be a boolean, got {type(value).__name__}.", f"options.{key}")
    if key in IGNORED_NUMBER_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SamplingParamsError(f"options.{key} must be a number, got {type(value).__name__}.", f"options.{key}")


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise SamplingParamsError("options.stop must be a list of strings.", "options.stop")
    return value


def _max_tokens(value: Any) -> Optional[int]:
    """``options.num_predict`` as ``max_tokens``: None (no limit: the room left in the
    context) for 0 and below, which Ollama's runner reads as no limit (its check is
    ``numPredict > 0``; its server caps a negative one at 10 x num_ctx, past the context
    anyway); else the integer."""
    n = _number("num_predict", value)
    return n if n > 0 else None


def sampling_fields(options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The common request's sampling fields of Ollama's ``options`` (see the module
    docstring). Raises SamplingParamsError naming ``options.<key>``."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if value is None:
            continue
        if key in NUMERIC_OPTIONS:
            out[NUMERIC_OPTIONS[key]] = _number(key, value)
        elif key == "num_predict":
            out["max_tokens"] = _max_tokens(value)
        elif key == "stop":
            out["stop"] = _stop(value) or None
        elif key == "num_ctx":
            _number(key, value)  # checked here; the context itself is context_size's
        elif key in NEUTRAL_OPTIONS:
            if _number(key, value) != NEUTRAL_OPTIONS[key]:
                raise SamplingParamsError(
                    f"options.{key}: only {NEUTRAL_OPTIONS[key]} (off) is supported by this server.",
                    f"options.{key}")
        elif key in IGNORED_OPTIONS:
            _check_ignored(key, value)
        else:
            logger.warning("Ollama option %r is not known here; it is ignored.", key)
    return out


def check_options(options: Optional[dict[str, Any]]) -> None:
    """The JSON types of ``options`` where no sampling reads them (``/api/embed``,
    ``/api/embeddings``): each numeric option a number (an integer where Ollama's is one),
    ``stop`` a string or a list of strings, with :func:`sampling_fields`'s words (Ollama
    checks the types of every request's options, embeddings too). Raises
    SamplingParamsError naming ``options.<key>``."""
    for key, value in (options or {}).items():
        if value is None:
            continue
        if key in NUMERIC_OPTIONS or key in INTEGER_OPTIONS or key in NEUTRAL_OPTIONS:
            _number(key, value)
        elif key == "stop":
            _stop(value)
        elif key in IGNORED_OPTIONS:
            _check_ignored(key, value)


def context_size(options: Optional[dict[str, Any]], max_model_len: int) -> int:
    """The context of one request in tokens: ``options.num_ctx`` when given (an integer;
    below :data:`MIN_NUM_CTX` raised to it, as Ollama does), never more than the server's
    ``max_model_len`` (tokens; Ollama likewise caps it at the model's trained context,
    with a warning, not an error), else ``max_model_len``. Raises SamplingParamsError
    naming ``options.num_ctx`` for a value that is not an integer."""
    value = (options or {}).get("num_ctx")
    if value is None:
        return max_model_len
    return min(max(_number("num_ctx", value), MIN_NUM_CTX), max_model_len)


def structured_fields(fmt: Any) -> dict[str, Any]:
    """The common request's ``structured_outputs`` of Ollama's ``format``: ``"json"`` ->
    any JSON object, a JSON schema object -> that schema, ``""`` / null -> none. A schema
    the grammar compiler refuses is a 400 naming ``format``."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        spec: dict[str, Any] = {"json_object": True}
    elif isinstance(fmt, dict):
        spec = {"json": fmt}
    else:
        raise SamplingParamsError('format must be "json" or a JSON schema object (a string that holds JSON is '
                                  'not read as a schema).', "format")
    try:
        structured_outputs_params(None, spec)
    except ValueError as e:
        raise SamplingParamsError(f"format: {e}", "format") from e
    return {"structured_outputs": spec}


# The common request's field -> the Ollama field or option a client sent it as.
_SENT_AS = {**{field: f"options.{key}" for key, field in NUMERIC_OPTIONS.items()},
            "max_tokens": "options.num_predict", "stop": "options.stop"}


def in_ollama_terms(error: SamplingParamsError) -> SamplingParamsError:
    """``error`` (raised past the request's mapping: the chat or completion handler, the
    sampling parameters' checks) naming the Ollama option the client sent instead of the
    common request's field: ``stop cannot contain an empty string`` -> ``options.stop
    cannot contain an empty string``, param ``options.stop``; ``max_tokens`` ->
    ``options.num_predict``. Other errors are returned as they are."""
    param = error.param or ""
    field, dot, rest = param.partition(".")
    name = _SENT_AS.get(field)
    if name is None:
        return error
    message = str(error)
    message = name + message[len(field):] if message.startswith(field) else f"{name}: {message}"
    return SamplingParamsError(message, name + dot + rest)


def _deepest_first_field_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of pydantic's errors for the first failing field, the one that says why: a union
    field (``stop``: a string or a list of strings) fails once per branch, the string
    branch first, so the first error alone told a client who sent a list of strings that
    it should send a string. Preferred: an error other than a branch's type mismatch
    (``string_type``, ``list_type``...: the value has the other branch's shape), then the
    deepest location (``stop.list[...].0``: the branch that matched went further)."""
    first = errors[0]
    head = tuple(first.get("loc") or ())[:1]
    same = [err for err in errors if tuple(err.get("loc") or ())[:1] == head]
    return max(same, key=lambda err: (not str(err.get("type", "")).endswith("_type"), len(err.get("loc") or ())))


def build_request(cls: Any, **fields: Any) -> Any:
    """``cls(**fields)`` (a chat or completion request), its validation errors given in
    Ollama's terms: the first error's message, naming the option the client sent
    (``options.seed``), not the common request's field or pydantic's whole report.
    Raises SamplingParamsError."""
    from pydantic import ValidationError

    try:
        return cls(**fields)
    except ValidationError as e:
        err = _deepest_first_field_error(e.errors())
        field = str(err["loc"][0]) if err.get("loc") else ""
        name = _SENT_AS.get(field, field or None)
        raise SamplingParamsError(f"{name}: {err['msg']}" if name else err["msg"], name) from None
