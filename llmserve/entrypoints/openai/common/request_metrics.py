"""Per-request timing fields on chat and completion responses (issue 33), in the shapes
people already parse, both computed from the final ``RequestOutput.metrics``
(llmserve.outputs.RequestMetrics, unix seconds):

- vLLM's ``metrics`` (vLLM PR 46768): ``time_to_first_token_ms``, ``generation_time_ms``,
  ``queue_time_ms``, ``mean_itl_ms``, ``tokens_per_second``; double opt-in as in vLLM:
  the server flag ``--enable-per-request-metrics`` and the request field
  ``include_metrics: true``; left out when one response holds several generations
  (n > 1, several prompts), as vLLM does.
- llama.cpp's ``timings``: ``prompt_n`` (prompt tokens computed), ``cache_n`` (from the
  prefix cache), ``prompt_ms`` (first scheduling to first token), ``predicted_n``,
  ``predicted_ms`` (first to last token), their per-token ms and per-second rates;
  with the request field ``timings_per_token: true`` (llama.cpp's name).

Streams carry them on the chunk that finishes the choice and on the usage chunk.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["vllm_metrics", "llama_timings", "ResponseTimings"]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def vllm_metrics(m: Any, num_generated: int) -> Optional[dict]:
    """vLLM's ``metrics`` object of RequestMetrics ``m`` (None before the first token)."""
    if m is None or m.first_token_time is None:
        return None
    end = m.last_token_time or m.first_token_time
    gen = end - m.first_token_time
    itl = gen / (num_generated - 1) if num_generated > 1 else 0.0
    return {"time_to_first_token_ms": _ms(m.first_token_time - m.arrival_time),
            "generation_time_ms": _ms(gen),
            "queue_time_ms": _ms(m.time_in_queue) if m.time_in_queue is not None else None,
            "mean_itl_ms": _ms(itl),
            "tokens_per_second": round((num_generated - 1) / gen, 3) if gen > 0 and num_generated > 1 else None}


def llama_timings(m: Any, num_prompt: int, num_cached: int, num_generated: int) -> Optional[dict]:
    """llama.cpp's ``timings`` object (None before the first token)."""
    if m is None or m.first_token_time is None:
        return None
    start = m.first_scheduled_time or m.arrival_time
    prompt_s = max(m.first_token_time - start, 0.0)
    predicted_s = max((m.last_token_time or m.first_token_time) - m.first_token_time, 0.0)
    prompt_n = max(num_prompt - num_cached, 0)
    return {"cache_n": num_cached, "prompt_n": prompt_n, "prompt_ms": _ms(prompt_s),
            "prompt_per_token_ms": _ms(prompt_s / prompt_n) if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": num_generated, "predicted_ms": _ms(predicted_s),
            "predicted_per_token_ms": _ms(predicted_s / num_generated) if num_generated else 0.0,
            "predicted_per_second": num_generated / predicted_s if predicted_s > 0 else 0.0}


class ResponseTimings:
    """Which timing fields one response carries. ``enable_metrics``: the server's
    ``--enable-per-request-metrics``; request: its ``include_metrics`` and
    ``timings_per_token`` fields; single: the response holds one generation."""

    def __init__(self, request: Any, enable_metrics: bool, single: bool = True) -> None:
        self.metrics = bool(enable_metrics and getattr(request, "include_metrics", False) and single)
        self.timings = bool(getattr(request, "timings_per_token", False))

    @property
    def active(self) -> bool:
        return self.metrics or self.timings

    def fields(self, output: Any, num_prompt: int, num_generated: int) -> dict:
        """``{"metrics": ..., "timings": ...}`` (only those asked for) of the final
        RequestOutput ``output``."""
        out: dict = {}
        if output is None:
            return out
        m = getattr(output, "metrics", None)
        if self.metrics:
            out["metrics"] = vllm_metrics(m, num_generated)
        if self.timings:
            out["timings"] = llama_timings(m, num_prompt, int(output.num_cached_tokens or 0), num_generated)
        return out
