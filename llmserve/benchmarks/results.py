"""Rates shared by the benchmark result types (requests/s and tokens/s over a run)."""
from __future__ import annotations

__all__ = ["TokenRates"]


class TokenRates:
    """Mixin for a result with ``elapsed_s`` (s), ``num_requests``, ``prompt_tokens`` and
    ``output_tokens``: requests/s, output tokens/s and total (prompt + output) tokens/s,
    as vLLM's throughput benchmark reports them."""

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def rates(self) -> dict[str, float]:
        """The three rates by name (for JSON output)."""
        return {"requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s}
