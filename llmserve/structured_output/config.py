"""``StructuredOutputsConfig`` (vLLM's ``vllm/config/structured_outputs.py``): the engine's
grammar backend and its options, set with ``--structured-outputs-config JSON``."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional

BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How the engine enforces ``SamplingParams.structured_outputs``.

    backend: "auto" or "xgrammar" (the only backend here; "auto" picks it).
    disable_fallback: accepted for vLLM compatibility (there is no other backend to fall
      back to).
    disable_any_whitespace: JSON grammars allow no optional whitespace (vLLM's option).
      Default True here, unlike vLLM's False: with free whitespace, small models (SmolLM2)
      spend the token budget on newlines and indentation, or run away in them, and the
      JSON is cut with ``length`` (C26 J3: ``json_object`` at 64 tokens); compact JSON
      finishes (xgrammar then writes json.dumps' separators: ", " and ": "). The
      config option ``{"disable_any_whitespace": false}`` gives vLLM's behaviour.
    disable_additional_properties: schemas without ``additionalProperties`` are treated as
      ``additionalProperties: false`` (xgrammar's strict mode already does so; kept for
      vLLM compatibility).
    reasoning_parser: name of the reasoning parser (``--reasoning-parser``) whose
      ``is_reasoning_end`` decides when a request's grammar starts to apply; "" for none.
    enable_in_reasoning: apply the grammar during reasoning too (vLLM's option).
    max_compile_workers: threads that compile grammars (default 2, >= 1). With 2 or more,
      large grammars (specs of 16 KiB or more) may hold all but one of them, so one slow
      grammar (an enum of 20,000 strings compiles ~10 s) does not hold up the small ones.

    Raises ValueError naming the field for an unknown backend.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False
    max_compile_workers: int = 2

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config: backend must be one of {list(BACKENDS)}, "
                             f"got {self.backend!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(v, bool):
                raise ValueError(f"structured_outputs_config: {f.name} must be a boolean, got {v!r}")
        w = self.max_compile_workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"structured_outputs_config: max_compile_workers must be an integer >= 1, got {w!r}")
        if not isinstance(self.reasoning_parser, str):
            raise ValueError("structured_outputs_config: reasoning_parser must be a string")


def make_structured_outputs_config(value: Any) -> StructuredOutputsConfig:
    """None -> default; a dict or its JSON text (the CLI flag) -> StructuredOutputsConfig.
    Raises ValueError naming ``structured_outputs_config`` (unknown key, bad JSON, bad value)."""
    if isinstance(value, StructuredOutputsConfig):
        return value
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs_config: not valid JSON: {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}")
    try:
        return StructuredOutputsConfig(**value)
    except TypeError as e:
        raise ValueError(f"structured_outputs_config: {e}") from None


def with_reasoning_parser(cfg: StructuredOutputsConfig, name: Optional[str]) -> StructuredOutputsConfig:
    """``cfg`` with ``--reasoning-parser NAME`` folded in (vLLM sets
    ``structured_outputs_config.reasoning_parser`` from that flag)."""
    if not name or cfg.reasoning_parser == name:
        return cfg
    import dataclasses

    return dataclasses.replace(cfg, reasoning_parser=name)
