"""The Messages API fields this server accepts and ignores, checked as Anthropic checks
them: a value Anthropic refuses with 400 ``invalid_request_error`` is refused here too,
naming its path in Anthropic's (pydantic's) words, so a client that works here works
there. The fields change nothing a local model does:

- ``metadata``: an object whose only key is ``user_id`` (a string or null; at most
  :data:`MAX_USER_ID_CHARS` characters); another key is ``metadata.<key>: Extra inputs
  are not permitted``, as Anthropic answers it.
- ``service_tier``: ``"auto"`` or ``"standard_only"``; ``speed``: ``"standard"`` or
  ``"fast"``; ``inference_geo``: a string (``anthropic.types.MessageCreateParams``).
- ``cache_control``, at the top level (automatic caching), on a ``system`` block, on any
  content block (inside a ``tool_result``'s, a ``search_result``'s or a document's
  content too) and on a tool: null, or an object with ``type`` ``"ephemeral"`` and an
  optional ``ttl`` ``"5m"`` or ``"1h"``; at most :data:`MAX_CACHE_BREAKPOINTS` of them
  in one request (Anthropic: "A maximum of 4 blocks with cache_control may be provided.
  Found 5."). Other keys inside it are accepted and logged once per key: Anthropic's
  betas add some (``scope``, sent by Claude Code), and the prefix cache here reuses
  any shared prefix by itself whatever they say.

Null means "not given" for each field (the SDK types them Optional or leaves them out).
Raises SamplingParamsError (400) with ``param`` the path at fault.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Iterator, Optional

from llmserve.entrypoints.chat_utils import json_type_name
from llmserve.sampling_params import SamplingParamsError

METADATA_KEYS = ("user_id",)
MAX_USER_ID_CHARS = 256  # Anthropic's bound on metadata.user_id
SERVICE_TIERS = ("auto", "standard_only")
SPEEDS = ("standard", "fast")
CACHE_CONTROL_TYPES = ("ephemeral",)
CACHE_TTLS = ("5m", "1h")
CACHE_CONTROL_KEYS = ("type", "ttl")
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's bound on cache_control markers per request
logger = logging.getLogger("llmserve.entrypoints.anthropic")


def _got(value: Any) -> str:
    """What was sent, by its JSON type only ("a number"): error messages never echo a
    request's values (validation_errors.py's rule)."""
    return json_type_name(value)


def _one_of(value: Any, allowed: tuple[str, ...], where: str) -> None:
    """``value`` is null or one of ``allowed`` (pydantic's Literal wording, Anthropic's)."""
    if value is None or (isinstance(value, str) and value in allowed):
        return
    options = " or ".join(", ".join(f"'{a}'" for a in allowed).rsplit(", ", 1))
    raise SamplingParamsError(f"{where}: Input should be {options}; got {_got(value)}.", where)


def check_metadata(metadata: Any) -> None:
    """``metadata``: null or ``{"user_id": <string or null>}`` (module docstring)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise SamplingParamsError(f"metadata: Input should be an object; got {_got(metadata)}.", "metadata")
    for key in metadata:
        if key not in METADATA_KEYS:
            raise SamplingParamsError(f"metadata.{key}: Extra inputs are not permitted (metadata takes only "
                                      f"{', '.join(METADATA_KEYS)}).", f"metadata.{key}")
    user_id = metadata.get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise SamplingParamsError(f"metadata.user_id: Input should be a valid string; got {_got(user_id)}.",
                                  "metadata.user_id")
    if user_id is not None and len(user_id) > MAX_USER_ID_CHARS:
        raise SamplingParamsError(f"metadata.user_id: String should have at most {MAX_USER_ID_CHARS} characters; "
                                  f"got {len(user_id)}.", "metadata.user_id")


@functools.lru_cache(maxsize=64)
def _warn_unknown_cache_key(key: str) -> None:
    """Log a ``cache_control`` key not known here once per key (the cache bounds it)."""
    logger.warning("cache_control.%s is not a key known to this server (%s); it is accepted and has no effect.",
                   key, ", ".join(CACHE_CONTROL_KEYS))


def check_cache_control(value: Any, where: str) -> bool:
    """One ``cache_control`` value at ``where`` (its path, ``....cache_control``): null,
    or ``{"type": "ephemeral", "ttl"?: "5m" | "1h"}``. Returns whether it marks a
    breakpoint (it is not null)."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise SamplingParamsError(f'{where}: Input should be an object such as {{"type": "ephemeral"}}; got '
                                  f"{_got(value)}.", where)
    if "type" not in value:
        raise SamplingParamsError(f"{where}.type: Field required (\"ephemeral\").", f"{where}.type")
    kind = value["type"]
    if not (isinstance(kind, str) and kind in CACHE_CONTROL_TYPES):
        raise SamplingParamsError(f"{where}.type: Input should be 'ephemeral'; got {_got(kind)}.", f"{where}.type")
    _one_of(value.get("ttl"), CACHE_TTLS, f"{where}.ttl")
    for key in value:
        if key not in CACHE_CONTROL_KEYS:
            _warn_unknown_cache_key(str(key)[:40])
    return True


def _block_cache_controls(block: Any, where: str) -> Iterator[tuple[Any, str]]:
    """``(cache_control, path)`` of a content block and of the blocks inside it (a
    ``tool_result``'s or ``search_result``'s ``content``, a document's ``source.content``)."""
    if not isinstance(block, dict):
        return  # refused by conversion.py, naming the block
    if "cache_control" in block:
        yield block["cache_control"], f"{where}.cache_control"
    inner = [(block.get("content"), f"{where}.content")]
    source = block.get("source")
    if isinstance(source, dict):
        inner.append((source.get("content"), f"{where}.source.content"))
    for content, at in inner:
        if isinstance(content, list):
            for k, b in enumerate(content):
                yield from _block_cache_controls(b, f"{at}.{k}")


def _cache_controls(request: Any) -> Iterator[tuple[Any, str]]:
    """Every ``cache_control`` of the request (an AnthropicCountTokensRequest), with its
    path, in the order Anthropic counts them (tools, system, messages)."""
    if "cache_control" in request.model_fields_set:
        yield request.cache_control, "cache_control"
    for i, tool in enumerate(request.tools or ()):
        if "cache_control" in tool.model_fields_set:
            yield tool.cache_control, f"tools.{i}.cache_control"
    if isinstance(request.system, list):
        for j, block in enumerate(request.system):
            yield from _block_cache_controls(block, f"system.{j}")
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for j, block in enumerate(message.content):
                yield from _block_cache_controls(block, f"messages.{i}.content.{j}")


def check_cache_controls(request: Any) -> None:
    """Each ``cache_control`` of the request (:func:`check_cache_control`), and at most
    MAX_CACHE_BREAKPOINTS of them."""
    found = sum(check_cache_control(value, where) for value, where in _cache_controls(request))
    if found > MAX_CACHE_BREAKPOINTS:
        raise SamplingParamsError(f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
                                  f"Found {found}.", None)


def cache_breakpoint_ttls(request: Any) -> list[str]:
    """The ``ttl`` of each cache breakpoint of the request (a ``cache_control`` that is not
    null; ``"5m"`` when it names none), in Anthropic's order (tools, system, messages);
    call after :func:`check_cache_controls`."""
    return [value.get("ttl") or "5m" for value, _ in _cache_controls(request) if isinstance(value, dict)]


def check_accepted_fields(request: Any) -> None:
    """The accepted-and-ignored fields of a messages or count_tokens request (module
    docstring); SamplingParamsError naming the first one at fault."""
    check_metadata(getattr(request, "metadata", None))
    _one_of(getattr(request, "service_tier", None), SERVICE_TIERS, "service_tier")
    _one_of(getattr(request, "speed", None), SPEEDS, "speed")
    geo = getattr(request, "inference_geo", None)
    if geo is not None and not isinstance(geo, str):
        raise SamplingParamsError(f"inference_geo: Input should be a valid string; got {_got(geo)}.", "inference_geo")
    check_cache_controls(request)

