"""Stats produced by the engine each step (vLLM's SchedulerStats / IterationStats).

Times are in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SpecDecodingStats:
    """Speculative decoding counts since the last stats (vLLM's ``SpecDecodingStats``):
    num_drafts: verifications (one per request per step with drafts); num_draft_tokens:
    draft tokens verified; num_accepted_tokens: of them accepted; num_accepted_tokens_per_pos:
    accepted at each draft position (0-based, length num_spec_tokens)."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < self.num_spec_tokens:
            per_pos.extend([0] * (self.num_spec_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


@dataclass
class SchedulerStats:
    """Snapshot of the scheduler after one step: request counts and KV usage (0..1)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found in the cache this step
    num_preemptions: int = 0
    num_scheduled_reqs: int = 0  # requests in the last step's batch (the live view's batch size)
    # LoRA (vLLM's vllm:lora_requests_info labels): adapter name -> running / waiting
    # requests, and max_loras; empty and 0 without enable_lora.
    running_lora_adapters: dict = field(default_factory=dict)
    waiting_lora_adapters: dict = field(default_factory=dict)
    max_lora: int = 0
    # KV connector (llmserve/kv_transfer) counters since the last stats: prompt tokens looked
    # up ("queries"), found in the external tier ("hits"), bytes loaded, blocks and bytes
    # restored into the prefix cache at start-up ("blocks_restored", "bytes_restored");
    # None: no connector.
    kv_connector_stats: Optional[dict] = None
    # Speculative decoding (llmserve/spec_decode): counts since the last stats, or None.
    spec_decoding_stats: Optional[SpecDecodingStats] = None


@dataclass
class FinishedRequestStats:
    """One finished request: finish reason ("stop", "length", "abort"), token counts,
    e2e latency, time to first token, mean time per output token; from the engine's
    events (vLLM's names): queued_time (queued -> first scheduled), prefill_time (first
    scheduled -> first token), decode_time (first -> last token), inference_time (first
    scheduled -> last token). Seconds; 0 when unknown (stats off, or never scheduled)."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft: float = 0.0
    mean_tpot: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    # The request's parameters (vLLM's request_params_* histograms): its output budget
    # (max_tokens as resolved) and its n (the parent's, for each of n > 1 samples).
    max_tokens_param: Optional[int] = None
    n_param: int = 1


@dataclass
class IterationStats:
    """What happened in one batch of outputs processed by the front-end."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
