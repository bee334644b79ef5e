"""Tenants' fair share of the scheduler (core/fair_share.py), and --scheduling-policy
priority (vLLM's ordering: lower priority value first, then arrival; preemption of the
lowest-priority, latest running request)."""
from collections import Counter

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import run_step


def _sched(fair=True, policy="fcfs", max_seqs=4, num_blocks=256, budget=64):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                                     policy=policy, tenant_fair_share=fair),
                     CacheConfig(block_size=4, enable_prefix_caching=False), num_blocks)


def _req(rid, tenant=None, weight=1.0, n=4, max_tokens=8, priority=0, arrival=None):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                eos_token_id=0, arrival_time=arrival, priority=priority, log_stats=True)
    r.tenant, r.tenant_weight = tenant, weight
    return r


def _admission_order(s, steps=200):
    order = []
    for _ in range(steps):
        so, _ = run_step(s)
        order += [x.request.request_id for x in so.scheduled if x.num_computed_tokens == 0]
        if not s.has_unfinished_requests():
            break
    return order


def test_quiet_tenant_jumps_a_flooders_deep_queue_fifo_does_not():
    def quiet_start(fair):
        s = _sched(fair=fair)
        for i in range(40):
            s.add_request(_req(f"flood{i}", "flooder", arrival=float(i)))
        run_step(s)  # the flooder fills the batch (4 slots), 36 wait
        s.add_request(_req("quiet", "quiet", arrival=100.0))
        return _admission_order(s).index("quiet")
    assert quiet_start(fair=True) == 0  # the next free slot is the quiet tenant's
    assert quiet_start(fair=False) == 36  # FIFO: behind the whole flood


def test_weights_1_to_3_get_token_shares_within_10_percent():
    s = _sched(max_seqs=8)
    for i in range(300):
        s.add_request(_req(f"a{i}", "a", weight=1.0, arrival=float(i)))
        s.add_request(_req(f"b{i}", "b", weight=3.0, arrival=float(i)))
    tokens = Counter()
    for _ in range(400):  # both saturate the whole time
        so, _ = run_step(s)
        for x in so.scheduled:
            tokens[x.request.tenant] += x.num_scheduled_tokens
    share_b = tokens["b"] / (tokens["a"] + tokens["b"])
    assert abs(share_b - 0.75) <= 0.075, tokens
    assert s.fair_share.tokens == tokens  # the policy counted the same tokens


def test_admissions_within_one_step_follow_the_weights():
    s = _sched(max_seqs=4)
    for i in range(4):
        s.add_request(_req(f"light{i}", "light", weight=1.0, arrival=float(i)))
        s.add_request(_req(f"heavy{i}", "heavy", weight=3.0, arrival=float(i)))
    so, _ = run_step(s)  # each admission is charged at once: the next pick of the step sees it
    assert Counter(x.request.tenant for x in so.scheduled) == {"heavy": 3, "light": 1}


def test_single_tenant_order_is_fifo_as_without_fair_share():
    def order(fair):
        s = _sched(fair=fair, max_seqs=2)
        for i in range(8):
            s.add_request(_req(f"r{i}", "only", max_tokens=3 + i % 3, arrival=float(i)))
        return _admission_order(s)
    assert order(True) == order(False) == [f"r{i}" for i in range(8)]


def test_idle_tenant_earns_no_credit_for_a_later_burst():
    s = _sched(max_seqs=2)
    for i in range(4):
        s.add_request(_req(f"a{i}", "a", arrival=float(i)))
    _admission_order(s)  # a runs alone for a while: its virtual time grows
    assert not s.has_unfinished_requests()
    for i in range(6):
        s.add_request(_req(f"b{i}", "b", arrival=10.0 + i))
        s.add_request(_req(f"c{i}", "c", arrival=10.0 + i))
    # b and c start level: they alternate, neither gets the batch to itself
    first = _admission_order(s)[:6]
    assert Counter(r[0] for r in first) == {"b": 3, "c": 3}


def test_preemption_takes_the_tenant_over_its_share_first():
    def first_preempted(fair):
        s = _sched(fair=fair, max_seqs=3, num_blocks=9)  # 8 usable blocks of 4 tokens
        s.add_request(_req("big0", "big", n=8, max_tokens=20, arrival=0.0))
        s.add_request(_req("big1", "big", n=8, max_tokens=20, arrival=1.0))
        s.add_request(_req("small", "small", n=4, max_tokens=20, arrival=2.0))
        for _ in range(40):
            so, _ = run_step(s)
            if so.preempted_req_ids:
                return sorted(so.preempted_req_ids)
    assert first_preempted(fair=True) == ["big1"]  # big is over its share (2 streams)
    assert first_preempted(fair=False) == ["small"]  # FIFO: the latest to join the batch


def test_priority_first_then_fairness_within_a_class():
    s = _sched(policy="priority", max_seqs=1)
    for i in range(4):
        s.add_request(_req(f"f{i}", "flooder", priority=1, arrival=float(i)))
    s.add_request(_req("q", "quiet", priority=1, arrival=10.0))
    s.add_request(_req("urgent", "flooder", priority=0, arrival=20.0))
    order = _admission_order(s)
    assert order[0] == "urgent"  # a better priority class wins over fairness
    assert order.index("q") <= 2  # within class 1 the quiet tenant does not wait for the flood


def test_priority_policy_vllm_order_and_preempts_lowest_priority_latest():
    s = _sched(policy="priority", max_seqs=2, num_blocks=7, fair=False)  # 6 blocks of 4 tokens
    s.add_request(_req("p5_late", priority=5, n=8, max_tokens=16, arrival=3.0))
    s.add_request(_req("p5_early", priority=5, n=8, max_tokens=16, arrival=1.0))
    so, _ = run_step(s)
    assert [x.request.request_id for x in so.scheduled] == ["p5_early", "p5_late"]  # tie: arrival
    s.add_request(_req("p0", priority=0, n=4, max_tokens=16, arrival=5.0))
    preempted = []
    for _ in range(30):
        so, _ = run_step(s)
        preempted += list(so.preempted_req_ids)
        if "p0" in s.requests and s.requests["p0"].status == RequestStatus.RUNNING:
            break
    assert preempted and preempted[0] == "p5_late"  # lowest priority, latest arrival
    assert s.requests["p0"].status == RequestStatus.RUNNING


def test_quiet_request_takes_a_seat_from_a_full_flooder_batch_at_once():
    s = _sched(max_seqs=4)
    for i in range(12):
        s.add_request(_req(f"flood{i}", "flooder", max_tokens=20, arrival=float(i)))
    for _ in range(3):
        run_step(s)  # the flooder holds all 4 seats and decodes
    s.add_request(_req("quiet", "quiet", max_tokens=3, arrival=100.0))
    so, _ = run_step(s)
    assert "quiet" in [x.request.request_id for x in so.scheduled]  # the very next step, no wait for a seat
    assert so.preempted_req_ids == {"flood3"}  # the flooder's newest (least work to redo)
    victim = s.requests["flood3"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_preemptions == 1
    assert [e.reason for e in victim.events if e.reason] == ["fair_share"]  # its timeline says why
    done = Counter()
    for _ in range(300):
        so, outs = run_step(s)
        preempted = so.preempted_req_ids
        assert not preempted, preempted  # one tenant over its share gives up one seat, once
        for o in outs:
            done[o.request_id] += o.finished
        if not s.has_unfinished_requests():
            break
    assert sum(done.values()) == 13 and s.fair_share.tokens["quiet"] == 4 + 3 - 1  # all finish


def test_late_heavy_tenant_is_raised_to_its_weighted_seats_without_thrashing():
    s = _sched(max_seqs=8, budget=128)
    for i in range(40):
        s.add_request(_req(f"a{i}", "a", weight=1.0, max_tokens=200, arrival=float(i)))
    run_step(s)  # a (weight 1) alone takes all 8 seats
    for i in range(40):
        s.add_request(_req(f"b{i}", "b", weight=3.0, max_tokens=200, arrival=100.0 + i))
    preemptions = 0
    for _ in range(12):
        so, _ = run_step(s)
        preemptions += len(so.preempted_req_ids)
    held = Counter(r.tenant for r in s.running)
    assert held == {"a": 2, "b": 6} and preemptions == 6  # toward 1:3 of 8 seats, then no more
