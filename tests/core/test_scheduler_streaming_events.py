"""Scheduler: outputs are the wire structs, request events (queue time), and streaming-input
sessions (resumable requests that take later prompt chunks)."""
import pytest

import functools

from llmserve.core.outputs import EngineCoreEventType, EngineCoreOutput, FinishReason
from llmserve.core.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import make_scheduler, run_step as _step

_sched = functools.partial(make_scheduler, max_len=64)


def test_outputs_are_wire_structs_with_events_only_when_logging_stats():
    s = _sched()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2), 0, log_stats=True))
    s.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=2), 0))
    _, outs = _step(s)
    by_id = {o.request_id: o for o in outs}
    assert all(type(o) is EngineCoreOutput for o in outs)
    ev = by_id["a"].events
    assert [e.type for e in ev] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert ev[1].timestamp >= ev[0].timestamp
    assert by_id["b"].events is None
    _, outs = _step(s)
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].events is None  # events are sent once
    assert by_id["a"].finish_reason == FinishReason.LENGTH


def test_preemption_records_an_event():
    s = _sched(num_blocks=4, budget=64, max_len=12)  # 3 usable blocks of 4 tokens
    s.add_request(Request("a", [1] * 4, SamplingParams(max_tokens=8), 0, log_stats=True))
    s.add_request(Request("b", [2] * 4, SamplingParams(max_tokens=8), 0, log_stats=True))
    seen = []
    for _ in range(12):
        _, outs = _step(s)
        for o in outs:
            seen += [(o.request_id, e.type) for e in o.events or ()]
    assert ("b", EngineCoreEventType.PREEMPTED) in seen or ("a", EngineCoreEventType.PREEMPTED) in seen


def _session(s, prompt=(1, 2, 3), max_tokens=2):
    s.add_request(Request("r", list(prompt), SamplingParams(max_tokens=max_tokens), 0, resumable=True))


def test_streaming_session_parks_then_continues_after_the_computed_tokens():
    s = _sched()
    _session(s)
    _step(s, token=10)
    _, outs = _step(s, token=11)
    # Answered the first chunk: not finished, parked with its blocks.
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([11], None)]
    req = s.requests["r"]
    assert req.status == RequestStatus.WAITING_FOR_STREAMING_INPUT
    assert not s.has_unfinished_requests() and s.kv_cache_manager.get_block_ids("r")
    s.update_streaming_request("r", [20, 21], None, final=False)
    # The last sampled token (11) had no KV: dropped; 10 stays in the context.
    assert req.all_token_ids == [1, 2, 3, 10, 20, 21] and req.num_computed_tokens == 4
    so, outs = _step(s, token=12)
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in so.scheduled] == [(4, 2)]
    assert "r" in so.finished_req_ids  # the runner rebuilds its per-request state
    assert outs[0].new_token_ids == [12] and outs[0].finish_reason is None


def test_streaming_chunk_queued_while_busy_and_final_closes():
    s = _sched()
    _session(s)
    s.update_streaming_request("r", [30], None, final=False)  # arrives while answering chunk 1
    s.update_streaming_request("r", [], None, final=True)
    tokens, finish = [], None
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        _, outs = _step(s, token=40 + len(tokens))
        for o in outs:
            tokens += o.new_token_ids
            finish = o.finish_reason or finish
    assert tokens == [40, 41, 42, 43]  # 2 per chunk
    assert finish == FinishReason.LENGTH and "r" not in s.requests
    assert s.kv_cache_manager.num_used_blocks == 0


def test_closing_a_parked_session_finishes_it_in_the_next_step():
    s = _sched()
    _session(s)
    _step(s)
    _step(s)
    s.update_streaming_request("r", [], None, final=True)
    assert s.has_unfinished_requests()
    assert s.take_pending_outputs()[0].finish_reason == FinishReason.LENGTH
    assert s.kv_cache_manager.num_used_blocks == 0


def test_streaming_chunk_past_max_model_len_and_non_resumable_raise():
    s = _sched(max_len=16)
    _session(s)
    with pytest.raises(ValueError, match="maximum model length"):
        s.update_streaming_request("r", list(range(20)), None, final=False)
    s.add_request(Request("plain", [1, 2], SamplingParams(max_tokens=2), 0))
    with pytest.raises(ValueError, match="does not take streaming input"):
        s.update_streaming_request("plain", [1], None, final=False)
    s.update_streaming_request("gone", [1], None, final=False)  # aborted/finished: ignored
