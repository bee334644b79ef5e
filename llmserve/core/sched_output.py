"""What the scheduler hands the model runner each step (vLLM's
``vllm/v1/core/sched/output.py``). Plain Python, no torch; imports nothing above ``core``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from llmserve.core.request import Request


@dataclass
class ScheduledRequest:
    """One request in a step: its tokens [num_computed_tokens, + num_scheduled_tokens)
    are run; block_ids cover them. spec_token_ids: draft tokens (speculative decoding,
    llmserve/spec_decode) run after the request's one real token: num_scheduled_tokens is
    then 1 + len(spec_token_ids)."""

    request: "Request"
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    # A model with several KV cache groups (core/kv_cache_coordinator.py): the block table
    # of each group, the first equal to block_ids; empty with one group.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the model runner runs this step. finished_req_ids: requests whose per-request
    runner state must be dropped (finished, aborted, or given a new prompt by streaming
    input); preempted_req_ids: requests preempted this step. grammar_bitmask: the
    structured-output bitmask (int32 [R, ceil(V / 32)], built by the StructuredOutputManager)
    for the requests in structured_output_request_ids ({request_id: bitmask row}), which
    sample this step; None when no constrained request samples."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: Optional[Any] = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # KV blocks to copy (src, dst) before the forward: copy-on-write of a partial block
    # that beams forked from one parent share (core/beam_search.py).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The KV connector's loads and saves for this step (llmserve/kv_transfer:
    # KVConnectorBase_V1.build_connector_meta); None without kv_transfer_config.
    kv_connector_metadata: Optional[Any] = None
