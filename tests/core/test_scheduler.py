"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, abort, limits."""
import pytest

from llmserve.core.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import make_scheduler as _sched
from tests.core.sched_utils import run_step as _step


def _req(rid, n, max_tokens=4, priority=0, arrival=None, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_id=0, arrival_time=arrival, priority=priority)


def test_chunked_prefill_splits_long_prompt_and_runs_decodes_alongside():
    s = _sched(budget=16, caching=False)
    s.add_request(_req("a", 4, max_tokens=10))
    so, _ = _step(s)
    assert [(x.request.request_id, x.num_scheduled_tokens) for x in so.scheduled] == [("a", 4)]
    s.add_request(_req("b", 40))
    so, _ = _step(s)
    # a decodes (1 token) while b gets the rest of the budget (15).
    assert {x.request.request_id: x.num_scheduled_tokens for x in so.scheduled} == {"a": 1, "b": 15}
    so, outs = _step(s)
    assert {x.request.request_id: x.num_scheduled_tokens for x in so.scheduled} == {"a": 1, "b": 15}
    assert [o.request_id for o in outs if o.new_token_ids] == ["a"]  # b still mid-prompt
    so, outs = _step(s)
    assert {x.request.request_id: x.num_scheduled_tokens for x in so.scheduled} == {"a": 1, "b": 10}
    assert sorted(o.request_id for o in outs if o.new_token_ids) == ["a", "b"]


def test_no_chunking_waits_for_budget():
    s = _sched(budget=300, max_len=256, chunked=False)
    s.add_request(_req("a", 200))
    s.add_request(_req("b", 200))
    so, _ = _step(s)
    assert [x.request.request_id for x in so.scheduled] == ["a"]


def test_max_num_seqs_caps_running():
    s = _sched(max_seqs=2)
    for i in range(4):
        s.add_request(_req(str(i), 4))
    so, _ = _step(s)
    assert len(so.scheduled) == 2 and len(s.waiting) == 2


def test_length_finish_and_blocks_freed():
    s = _sched()
    s.add_request(_req("a", 4, max_tokens=3))
    finished = []
    for _ in range(5):
        _, outs = _step(s)
        finished += [o for o in outs if o.finish_reason is not None]
    assert len(finished) == 1 and str(finished[0].finish_reason) == "length"
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()


def test_eos_and_stop_token_and_min_tokens():
    s = _sched()
    s.add_request(_req("a", 4, max_tokens=10))
    _, outs = _step(s, token=0)  # EOS
    assert str(outs[0].finish_reason) == "stop" and outs[0].stop_reason is None
    s.add_request(_req("b", 4, max_tokens=10, stop_token_ids=[5]))
    _, outs = _step(s, token=5)
    assert str(outs[0].finish_reason) == "stop" and outs[0].stop_reason == 5
    s.add_request(_req("c", 4, max_tokens=10, min_tokens=2))
    _, outs = _step(s, token=0)
    assert outs[0].finish_reason is None  # EOS ignored before min_tokens
    s.add_request(_req("d", 4, max_tokens=3, ignore_eos=True))
    _, outs = _step(s, token=0)
    assert all(o.finish_reason is None for o in outs if o.request_id == "d")


def test_max_model_len_caps_generation():
    s = _sched(max_len=8)
    s.add_request(_req("a", 6, max_tokens=100))
    outs = []
    for _ in range(4):
        outs += _step(s)[1]
    a = [o for o in outs if o.request_id == "a"]
    assert str(a[-1].finish_reason) == "length" and len(a) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens each need 2 blocks,
    # then grow: one must be preempted, and both still finish.
    s = _sched(num_blocks=7, budget=64)
    s.add_request(_req("a", 8, max_tokens=8, arrival=1.0))
    s.add_request(_req("b", 8, max_tokens=8, arrival=2.0))
    preempted = set()
    done = {}
    for _ in range(60):
        so, outs = _step(s)
        preempted |= so.preempted_req_ids
        for o in outs:
            if o.finish_reason is not None:
                done[o.request_id] = o
        if not s.has_unfinished_requests():
            break
    assert preempted == {"b"}  # the latest arrival goes first
    assert set(done) == {"a", "b"}
    assert s.kv_cache_manager.num_used_blocks == 0


def test_priority_policy_orders_and_preempts_by_priority():
    s = _sched(num_blocks=7, policy="priority", max_seqs=1)
    s.add_request(_req("low", 4, priority=5, arrival=1.0))
    s.add_request(_req("high", 4, priority=0, arrival=2.0))
    so, _ = _step(s)
    assert [x.request.request_id for x in so.scheduled] == ["high"]


def test_abort_frees_blocks_at_once():
    s = _sched()
    s.add_request(_req("a", 10, max_tokens=50))
    s.add_request(_req("b", 10, max_tokens=50))
    _step(s)
    assert s.kv_cache_manager.num_used_blocks > 0
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()


def test_rejects_prompt_longer_than_max_model_len_and_unfittable():
    s = _sched(max_len=16)
    with pytest.raises(ValueError, match="16"):
        s.add_request(_req("a", 20))
    s2 = _sched(num_blocks=3, max_len=256)
    with pytest.raises(ValueError, match="KV cache"):
        s2.add_request(_req("a", 10, max_tokens=100))


def test_prefix_cache_hit_skips_computed_tokens():
    s = _sched(budget=64)
    s.add_request(_req("a", 12, max_tokens=1))
    _step(s)
    s.add_request(_req("b", 14, max_tokens=1))
    so, _ = _step(s)
    (x,) = so.scheduled
    assert x.num_computed_tokens == 12 and x.num_scheduled_tokens == 2
