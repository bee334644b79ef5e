"""The scheduler's timeline events (core/timeline.py): one SCHEDULED per prefill chunk with
its token count and prefix-cache hits, none per decode step, PREEMPTED with its reason and
the recompute after it, all in time order."""
from llmserve.core.outputs import EngineCoreEventType as T
from llmserve.core.request import Request
from llmserve.core.timeline import PREEMPTED_KV_CACHE_FULL
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import make_scheduler, run_step


def _events(s, steps):
    seen: dict[str, list] = {}
    for _ in range(steps):
        _, outs = run_step(s)
        for o in outs:
            seen.setdefault(o.request_id, []).extend(o.events or ())
    return seen


def test_chunked_prefill_records_each_chunk_then_no_decode_events():
    s = make_scheduler(budget=8, max_len=64)  # a 20-token prompt takes chunks of 8, 8, 4
    s.add_request(Request("a", list(range(1, 21)), SamplingParams(max_tokens=3), 0, log_stats=True))
    ev = _events(s, 6)["a"]
    assert [e.type for e in ev] == [T.QUEUED, T.SCHEDULED, T.SCHEDULED, T.SCHEDULED]
    assert [e.num_tokens for e in ev[1:]] == [8, 8, 4]
    assert [e.timestamp for e in ev] == sorted(e.timestamp for e in ev)


def test_prefix_cache_hits_are_the_first_schedulings_cached_tokens():
    s = make_scheduler(budget=64, max_len=64)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 can be shared
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1), 0, log_stats=True))
    _events(s, 2)
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=1), 0, log_stats=True))
    ev = _events(s, 2)["b"]
    sched = [e for e in ev if e.type == T.SCHEDULED]
    assert [(e.num_tokens, e.cached_tokens) for e in sched] == [(1, 12)]


def test_forced_preemption_then_recompute_in_order():
    s = make_scheduler(num_blocks=4, budget=64, max_len=12)  # 3 usable blocks of 4 tokens
    s.add_request(Request("a", [1] * 4, SamplingParams(max_tokens=8), 0, log_stats=True))
    s.add_request(Request("b", [2] * 4, SamplingParams(max_tokens=8), 0, log_stats=True))
    seen = _events(s, 30)
    victim = next(rid for rid, ev in seen.items() if any(e.type == T.PREEMPTED for e in ev))
    ev = seen[victim]
    kinds = [e.type for e in ev]
    i = kinds.index(T.PREEMPTED)
    assert kinds[:2] == [T.QUEUED, T.SCHEDULED] and kinds[i + 1] == T.SCHEDULED
    assert ev[i].reason == PREEMPTED_KV_CACHE_FULL
    assert ev[i + 1].num_tokens > 1  # the recompute of its prompt and the tokens it had made
    assert [e.timestamp for e in ev] == sorted(e.timestamp for e in ev)


def test_no_events_without_stats():
    s = make_scheduler(budget=8, max_len=64)
    s.add_request(Request("a", list(range(1, 21)), SamplingParams(max_tokens=2), 0))
    assert _events(s, 5) == {"a": []}
