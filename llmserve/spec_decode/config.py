"""SpeculativeConfig: vLLM's ``--speculative-config`` / ``LLM(speculative_config=...)``.

Only draft-free n-gram speculation (prompt lookup) is implemented: ``{"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``, vLLM's field
names and defaults (vllm/config/speculative.py: an ngram config without prompt_lookup_*
gets 5 for both; one of them set gives the other the same value).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional

SUPPORTED_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculative decoding (vLLM's ``SpeculativeConfig``).

    method: "ngram" (also chosen when ``model`` is "ngram" or "[ngram]", vLLM's older form).
    num_speculative_tokens: most draft tokens per request per step (k >= 1); the engine
      drafts fewer where the measured acceptance says more do not pay (spec_decode/adaptive.py).
    prompt_lookup_min / prompt_lookup_max: the n-gram lengths (tokens) matched against the
      request's prompt and output, longest first.
    disable_by_batch_size: no drafting in a step whose running batch holds at least this
      many requests (None: never; vLLM's field).

    Raises ValueError naming the field for an unknown method, a draft model, k < 1, or
    lookup lengths out of order.
    """

    num_speculative_tokens: Optional[int] = None
    method: Optional[str] = None
    model: Optional[str] = None
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None and self.model in ("ngram", "[ngram]"):
            method = "ngram"
        if method is None:
            raise ValueError("speculative_config: method is required (supported: 'ngram'); "
                             "a draft model ('model': PATH) is not implemented")
        if method not in SUPPORTED_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported here "
                             f"(supported: {list(SUPPORTED_METHODS)})")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "model", None)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or b < 2):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 2, got {b!r}")


def make_speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    """None, a SpeculativeConfig, a dict or a JSON string (the CLI) -> SpeculativeConfig.
    Raises ValueError naming ``speculative_config`` (bad JSON, unknown key, bad value)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON: {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**value)
