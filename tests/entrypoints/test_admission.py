"""Admission control units: the controller's limits, Retry-After from the drain rate, the
stall clock, the X-Request-Timeout parser and the deadline wrapper (fake clocks; no
sleeps), and the middleware/routes over a scripted engine (429 body, Retry-After, /ready,
/health stall, rejection metrics)."""
import argparse
import asyncio
import io
import json
import random
import time
import wave
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from llmserve.config import AdmissionConfig
from llmserve.engine_args import AsyncEngineArgs
from llmserve.entrypoints.openai.admission import (MAX_RETRY_AFTER_S, AdmissionController, DrainRate,
                                                   admission_config_from_args)
from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.entrypoints.openai.deadline import Deadline, parse_request_timeout, with_deadline
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from llmserve.sampling_params import SamplingParamsError


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _controller(limit=2, stall=10.0, clock=None, stat_logger=None):
    return AdmissionController(AdmissionConfig(limit, stall), block_size=16, stat_logger=stat_logger,
                               clock=clock or Clock())


def _stats(running=0, waiting=0, used=0, total=100):
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, num_used_blocks=used,
                          num_total_blocks=total, kv_cache_usage=used / total)


def test_config_validates_and_defaults_to_twice_max_num_seqs():
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AdmissionConfig(-2, 1.0)
    with pytest.raises(ValueError, match="engine_stall_timeout"):
        AdmissionConfig(1, -1.0)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AsyncEngineArgs(max_waiting_requests=-5)
    with pytest.raises(ValueError, match="engine_stall_timeout"):
        AsyncEngineArgs(engine_stall_timeout=float("nan"))
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    assert args.max_waiting_requests is None and args.engine_stall_timeout == 60.0
    assert admission_config_from_args(args, 128) == AdmissionConfig(256, 60.0, 1.0)
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["--max-waiting-requests", "64", "--engine-stall-timeout", "5"])
    assert admission_config_from_args(args, 128) == AdmissionConfig(64, 5.0, 1.0)
    with pytest.raises(ValueError, match="max_queue_delay"):
        AsyncEngineArgs(max_queue_delay=-1.0)
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--max-queue-delay", "0"])
    assert admission_config_from_args(args, 128).max_queue_delay == 0.0


def _controller_seqs(limit, max_num_seqs, clock=None):
    return AdmissionController(AdmissionConfig(limit, 10.0), block_size=16, max_num_seqs=max_num_seqs,
                               clock=clock or Clock())


def test_waiting_requests_are_bounded_and_running_ones_do_not_count():
    c = _controller_seqs(limit=2, max_num_seqs=2)
    assert c.admit() is None and c.admit() is None  # the batch's two slots
    assert c.num_waiting == 0
    assert c.admit() is None and c.admit() is None  # two wait behind the full batch
    rej = c.admit()
    assert (rej.reason, rej.status) == ("queue_full", 429)
    assert "2 requests are waiting (--max-waiting-requests 2)" in rej.message
    assert c.in_flight == 4 and c.num_waiting == 2
    c.release()
    assert c.in_flight == 3 and c.admit() is None


def test_a_stale_engine_snapshot_never_counts_running_requests_as_waiting():
    # The fresh-user trial: 8 streams on --max-num-seqs 4 --max-waiting-requests 8, and the
    # last engine stats (a step that takes seconds on a starved CPU, or the idle step before
    # the burst) still say 0 running: a new request got 429 "8 requests are waiting".
    c = _controller_seqs(limit=8, max_num_seqs=4)
    c.record(_stats(running=0), None)
    c.in_flight = 8
    assert c.num_waiting == 4  # at most in_flight - max_num_seqs: 4 of the 8 hold the batch
    assert c.admit() is None
    for dip in (0, 3, 4):  # the snapshot between steps, after a finish, when full
        c.record(_stats(running=dip), None)
        assert c.num_waiting == 5
    c.in_flight = 12  # 4 running and 8 waiting: now the bound is reached
    rej = c.admit()
    assert rej.reason == "queue_full" and "8 requests are waiting (--max-waiting-requests 8)" in rej.message
    c.record(_stats(running=2, waiting=9), None)  # the engine's own queue is longer (n > 1, small KV)
    assert c.num_waiting == 9 and "9 requests are waiting" in c.admit().message


def test_unbounded_and_zero_limits():
    c = _controller(limit=-1)
    assert all(c.admit() is None for _ in range(1000))
    c = _controller_seqs(limit=0, max_num_seqs=2)  # none may wait: admitted only into a free slot
    assert c.admit() is None and c.admit() is None
    assert c.admit().reason == "queue_full"  # the two admitted fill the batch: this one would wait
    c.record(_stats(running=2), None)
    rej = c.admit()
    assert rej.reason == "queue_full" and "the batch is full (2 requests run at once)" in rej.message
    c.record(_stats(running=1), None)  # one finished (the engine says so before its response ends)
    c.release()
    assert c.admit() is None
    full = AdmissionController(AdmissionConfig(0, 0.0), max_num_seqs=1, clock=Clock())
    full.record(_stats(running=1), None)  # the batch is full (requests of another client)
    assert full.admit().reason == "queue_full"


def test_kv_cache_bound_counts_blocks_in_use_and_those_waiting_requests_need():
    c = _controller(limit=100)
    fin = IterationStats(finished_requests=[FinishedRequestStats("stop", 1.0, 150, 10)])  # 160 tokens: 10 blocks
    for _ in range(60):
        c.record(None, fin)
    assert c.blocks_per_request == pytest.approx(10, abs=0.05)
    assert c.admit() is None and c.admit() is None
    c.record(_stats(running=2, used=60, total=100), None)  # those 2 run and hold 60 blocks
    assert c.admit() is None  # nobody waits: always admitted
    for _ in range(3):  # 1, 2, 3 waiting: 60 + (1 + 1) x 10 = 80 ... 60 + (3 + 1) x 10 = 100
        assert c.admit() is None
    rej = c.admit()  # 60 + (4 + 1) x 10 > 100
    assert (rej.reason, rej.status) == ("kv_cache_full", 429)
    c.record(_stats(running=6, used=60, total=100), None)  # the waiting ones started
    assert c.admit() is None


def test_an_encoder_model_is_never_refused_for_its_nominal_kv_cache():
    c = AdmissionController(AdmissionConfig(64, 10.0), max_num_seqs=4, clock=Clock(), uses_kv_cache=False)
    c.record(_stats(running=0, used=31, total=31), None)
    assert all(c.admit() is None for _ in range(32))  # 32 embedding clients at once


def test_nothing_waiting_is_always_admitted_even_when_the_cache_is_full():
    c = _controller(limit=10)
    c.record(_stats(running=0, used=100, total=100), None)
    assert c.admit() is None


def _finished(seconds: float, n: int = 1) -> IterationStats:
    return IterationStats(finished_requests=[FinishedRequestStats("length", seconds, 10, 16, inference_time=seconds)
                                             for _ in range(n)])


def test_predicted_queue_delay_bounds_the_wait_from_the_time_in_the_batch():
    clock = Clock()
    c = AdmissionController(AdmissionConfig(64, 10.0, 1.0), block_size=16, max_num_seqs=4, clock=clock)
    c.record(_stats(running=4), _finished(2.0, n=4))  # 2 s in the batch: 4 slots drain 2 per second
    assert c.drain_rate() == pytest.approx(2.0)
    c.in_flight = 4  # a full batch: the next waits about 0.5 s, the one after 1 s
    assert c.admit() is None and c.admit() is None
    rej = c.admit()  # the third waiting: 3 / 2 per s = 1.5 s > 1 s
    assert (rej.reason, rej.status) == ("queue_delay", 429) and "--max-queue-delay 1" in rej.message
    assert rej.retry_after >= 1
    c.in_flight = 3  # a free slot: admitted whatever the rate
    assert c.admit() is None
    c.in_flight = 2
    c.record(_stats(running=2, waiting=3), None)  # n > 1 requests: the engine's own queue counts
    assert c.admit().reason == "queue_delay"
    off = AdmissionController(AdmissionConfig(64, 10.0, 0.0), max_num_seqs=4, clock=clock)
    off.in_flight = 40
    assert off.admit() is None  # 0: only the count bound
    unbounded = AdmissionController(AdmissionConfig(-1, 10.0, 1.0), max_num_seqs=4, clock=clock)
    unbounded.in_flight = 400
    assert unbounded.admit() is None  # -1 stays vLLM's unbounded queue
    encoder = AdmissionController(AdmissionConfig(64, 10.0, 1.0), max_num_seqs=4, clock=clock, uses_kv_cache=False)
    encoder.in_flight = 32  # pooling finishes within the step that runs it: no delay refusal
    assert encoder.admit() is None


def test_a_cold_start_admits_what_the_waiting_bound_admits_then_the_delay_rule_applies():
    """Fresh-user trial: --max-num-seqs 1 --max-waiting-requests 1 on a just-started server
    answered a burst of 6 with 5 x 429 (no request had finished, so the unknown wait was
    refused as too long), and 2 x 200 once warm. With no finish rate the delay rule refuses
    nothing: the count bound holds from the first request; once measured, the delay rule
    refuses what the count bound admits."""
    c = AdmissionController(AdmissionConfig(1, 10.0, 1.0), max_num_seqs=1, clock=Clock())
    burst = [c.admit() for _ in range(6)]
    assert burst[:2] == [None, None]  # one runs, one waits (--max-waiting-requests 1)
    assert [r.reason for r in burst[2:]] == ["queue_full"] * 4
    big = AdmissionController(AdmissionConfig(256, 10.0, 1.0), max_num_seqs=128, clock=Clock())
    results = [big.admit() for _ in range(400)]  # the engine has not stepped yet
    assert results[:384] == [None] * 384  # the batch and its 256 waiting places
    assert all(r.reason == "queue_full" for r in results[384:])
    warm = AdmissionController(AdmissionConfig(1, 10.0, 1.0), max_num_seqs=1, clock=Clock())
    warm.record(_stats(running=1), _finished(3.0))  # measured: 3 s in the batch
    assert warm.admit() is None  # the free slot
    rej = warm.admit()  # the waiting place is free, but the wait (about 3 s) is past the bound
    assert (rej.reason, rej.status) == ("queue_delay", 429) and "about 3.0 s" in rej.message
    assert rej.retry_after == 2


def test_a_full_batch_that_flickers_between_steps_still_bounds_the_delay():
    c = AdmissionController(AdmissionConfig(256, 10.0, 1.0), max_num_seqs=128, clock=Clock())
    c.record(_stats(running=128), _finished(4.0))  # 32 per second
    c.in_flight = 128 + 40
    c.record(_stats(running=127), _finished(4.0))  # one finished; the next step refills the batch
    assert c.admit().reason == "queue_delay"  # 41 ahead / 32 per s > 1 s, whatever the snapshot says


def test_simulated_overload_keeps_every_admitted_wait_near_the_bound():
    """A closed loop of 256 clients (a refused one retries after Retry-After) against a
    128-slot batch whose requests take 1-3 s, stepped every 0.1 s on a fake clock; the
    stats arrive after each step's finishes (the batch looks short of full until the next
    step refills it). Every request admitted once a request has finished starts within
    the bound (1 s); before that (a cold start: no rate to predict by) the batch and
    ``--max-waiting-requests`` are admitted, and they wait about their place in line."""
    rnd = random.Random(0)
    clock = Clock()
    c = AdmissionController(AdmissionConfig(256, 100.0, 1.0), max_num_seqs=128, clock=clock)
    queue, running, waits, idle_until, warm_at = [], [], [], [0.0] * 256, None
    for _ in range(400):
        clock.t += 0.1
        for i in range(256):
            if idle_until[i] <= clock.t:
                rej = c.admit()
                idle_until[i] = float("inf") if rej is None else clock.t + rej.retry_after
                if rej is None:
                    queue.append(clock.t)
        done = [(end, took) for end, took in running if end <= clock.t]
        running = [(end, took) for end, took in running if end > clock.t]
        warm_at = clock.t if warm_at is None and done else warm_at
        c.record(_stats(running=len(running), waiting=len(queue)),
                 IterationStats(finished_requests=[_finished(took).finished_requests[0] for _, took in done]))
        for _ in done:
            c.release()
            idle_until[idle_until.index(float("inf"))] = clock.t  # one waiting client goes again
        while queue and len(running) < 128:
            admitted = queue.pop(0)
            waits.append((admitted, clock.t - admitted))
            took = 1.0 + 2.0 * rnd.random()
            running.append((clock.t + took, took))
    warm = [w for admitted, w in waits if admitted > warm_at]
    assert len(warm) > 1000 and max(warm) <= 1.0 + 0.1  # the bound, plus one step
    assert len(waits) - len(warm) == 256  # cold: every client, 128 run and 128 wait (within the 256)


def test_retry_after_follows_the_measured_drain_rate():
    clock = Clock()
    rate = DrainRate(window_s=30.0, clock=clock)
    clock.t += 0.5
    assert rate.retry_after(10) == 1  # cold start: nothing finished in half a second
    clock.t += 9.5
    assert rate.retry_after(10) == 10  # nothing finished for 10 s
    for _ in range(20):  # 20 finished in 10 s: 2 per second
        rate.record()
    assert rate.retry_after(10) == 5
    assert rate.retry_after(1000) == MAX_RETRY_AFTER_S
    clock.t += 31  # they leave the window
    assert rate.retry_after(10) == 30


def test_retry_after_counts_busy_time_not_the_idle_window():
    """Fresh-user trial: 30 sequential requests in 10 s, 20 s of quiet, then a burst. The
    drain rate is 3 per busy second (it was 1 per second over the 30 s window, idle time
    included), and a full batch's predicted rate (Little's law) is higher still: 256
    waiting were told ``Retry-After: 60`` by an engine that drained them in seconds."""
    clock = Clock()
    rate = DrainRate(window_s=30.0, clock=clock)
    rate.start_work()
    for _ in range(30):
        clock.t += 1 / 3
        rate.record()
    rate.stop_work()
    clock.t += 20.0  # idle: not counted
    rate.start_work()
    assert rate.rate() == pytest.approx(3.0, rel=0.01)
    assert rate.retry_after(30) == 10  # was 30 (30 finished / the whole 30 s window)
    assert rate.retry_after(256, rate=32.0) == 8  # a full batch's rate, when higher
    assert rate.retry_after(10, rate=1e9) == 1  # at least 1 s, a whole number
    c = AdmissionController(AdmissionConfig(256, 10.0, 0.0), max_num_seqs=128, clock=clock)
    c.record(_stats(running=0, total=100000), _finished(4.0, n=8))  # 4 s in a full batch: 32 per second
    for _ in range(8):
        assert c.admit() is None
        c.release()  # finished; the engine is idle again
    clock.t += 20.0
    assert [c.admit() for _ in range(384)] == [None] * 384  # the batch and 256 waiting
    rej = c.admit()
    assert rej.reason == "queue_full" and rej.retry_after == 8  # 256 / 32 per s, not 60


def test_retry_after_after_idling_counts_from_the_new_work():
    """A burst after a quiet minute: the engine has been busy for a second, not stalled for
    the whole window, so a refused client is asked to wait about that second (it was told 30
    s, the window, as if the engine had stalled), and a stall then grows it again."""
    clock = Clock()
    c = _controller_seqs(2, 2, clock=clock)
    clock.t += 90  # idle: nothing admitted, nothing finished
    assert [c.admit() for _ in range(4)] == [None] * 4  # the burst: a full batch and 2 waiting
    clock.t += 1.0
    rej = c.admit()
    assert rej is not None and rej.reason == "queue_full" and rej.retry_after == 1
    clock.t += 12.0  # no request finishes: the work looks stalled
    assert c.admit().retry_after == 13


def test_stall_clock_runs_only_while_busy():
    clock = Clock()
    c = _controller(stall=10.0, clock=clock)
    clock.t += 100  # idle for long: not a stall
    assert c.stalled_for() == 0
    assert c.admit() is None  # work begins: the clock starts now
    clock.t += 9
    assert c.stalled_for() == 0
    clock.t += 2
    assert c.stalled_for() == pytest.approx(11)
    c.record(None, IterationStats())  # the frontend's own stats (an abort): not engine progress
    assert c.stalled_for() == pytest.approx(11)
    c.record(_stats(running=1), None)  # progress
    assert c.stalled_for() == 0
    c.release()
    c.record(_stats(running=0), None)
    clock.t += 100
    assert c.stalled_for() == 0
    assert _controller(stall=0.0, clock=clock).stalled_for() == 0


def test_request_timeout_header_parsing():
    assert parse_request_timeout(None) is None
    assert parse_request_timeout(" 2.5 ") == 2.5
    for bad in ("0", "-1", "abc", "nan", "inf", "1e9", ""):
        with pytest.raises(SamplingParamsError) as e:
            parse_request_timeout(bad)
        assert e.value.param == "X-Request-Timeout"


def test_with_deadline_aborts_once_at_the_deadline():
    async def run():
        aborted, expired = [], []
        done = asyncio.Event()

        async def gen():
            yield 1
            await done.wait()  # a request the engine would keep running
            yield 2

        async def abort():
            aborted.append(1)
            done.set()

        deadline = Deadline(time.monotonic() + 0.05, lambda: expired.append(1))
        items = [x async for x in with_deadline(gen(), abort, deadline)]
        return items, aborted, expired

    items, aborted, expired = asyncio.run(run())
    assert items == [1, 2] and aborted == [1] and expired == [1]


def test_with_deadline_does_not_fire_after_the_request_ends():
    async def run():
        aborted = []

        async def gen():
            yield 1

        async def abort():
            aborted.append(1)

        items = [x async for x in with_deadline(gen(), abort, Deadline(time.monotonic() + 0.01))]
        await asyncio.sleep(0.05)
        return items, aborted

    assert asyncio.run(run()) == ([1], [])


# ---- over HTTP, with a scripted engine --------------------------------------------------
class _HeldEngine:
    """Engine stub whose requests wait until ``release`` is set (so they stay in flight)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=49152, served_model_name=("m",), model="m")
        self.generation_config_defaults = {}
        self.errored = False
        self.stat_loggers = []

    async def check_health(self):
        return None


def _app(tokenizer, *flags):
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
    engine = _HeldEngine(tokenizer)
    prom = PrometheusStatLogger(SimpleNamespace(model_config=engine.model_config))
    app = build_app(args)
    asyncio.run(init_app_state(engine, app.state, args, stat_logger=prom))
    return app, engine, prom


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_429_with_retry_after_ready_and_rejection_metrics(smol_tokenizer):
    app, engine, prom = _app(smol_tokenizer, "--max-waiting-requests", "1")
    controller = app.state.admission
    assert engine.stat_loggers == [controller]
    client = TestClient(app)
    assert client.get("/ready").status_code == 200 and client.get("/ready").json() == {"ready": True}
    controller.in_flight = controller.max_num_seqs + 1  # a full batch and one request waiting
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "rq-1"})
    assert r.status_code == 429 and r.headers["content-type"] == "application/json"
    assert r.headers["X-Request-Id"] == "rq-1"
    assert 1 <= int(r.headers["Retry-After"]) <= MAX_RETRY_AFTER_S
    err = r.json()["error"]
    assert err["code"] == 429 and err["type"] == "RateLimitError" and "overloaded" in err["message"]
    engine.model_config.supported_tasks = ("generate", "embed")  # /v1/embeddings serves it (not its own 400)
    for path in ("/v1/completions", "/v1/embeddings", "/invocations"):  # every generation/pooling route
        assert client.post(path, json={"model": "m", "prompt": "x", "input": "x"}).status_code == 429
    ready = client.get("/ready")
    assert ready.status_code == 503 and "queue_full" in ready.json()["error"]["message"]
    assert "Retry-After" in ready.headers
    assert client.post("/tokenize", json={"model": "m", "prompt": "hi"}).status_code == 200  # not admitted work
    text = client.get("/metrics").text
    assert 'vllm:request_rejected_total{engine="0",model_name="m",reason="queue_full"} 4.0' in text
    assert 'vllm:request_rejected_total{engine="0",model_name="m",reason="kv_cache_full"} 0.0' in text
    controller.in_flight = 0
    controller.is_draining = lambda: True
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and "Retry-After" in r.headers and "shutting down" in r.json()["error"]["message"]
    assert client.get("/ready").status_code == 503
    assert 'reason="draining"} 1.0' in client.get("/metrics").text


def test_bad_request_timeout_header_is_a_400_naming_it(smol_tokenizer):
    app, _, _ = _app(smol_tokenizer)
    r = TestClient(app).post("/v1/chat/completions", json=CHAT, headers={"X-Request-Timeout": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
    assert app.state.admission.in_flight == 0


def test_health_reports_a_stalled_engine(smol_tokenizer):
    app, _, _ = _app(smol_tokenizer, "--engine-stall-timeout", "5")
    controller = app.state.admission
    clock = Clock()
    controller.clock = clock
    client = TestClient(app)
    assert controller.admit() is None  # a request in flight; the engine says nothing
    clock.t += 4
    assert client.get("/health").status_code == 200
    clock.t += 2
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineStalledError"
    assert "no progress for 6.0 s" in r.json()["error"]["message"]
    assert client.get("/ready").status_code == 503
    controller.record(_stats(running=1), None)  # it moved again
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200


def test_data_parallel_ranks_add_their_batches_and_their_stats():
    from llmserve.entrypoints.openai.admission import make_admission_controller, ranks_fed

    def parallel(size, external=False, hybrid=False, local=None):
        return SimpleNamespace(data_parallel_size=size, data_parallel_external_lb=external,
                               data_parallel_hybrid_lb=hybrid, data_parallel_size_local=local)
    assert ranks_fed(None) == 1 and ranks_fed(parallel(1)) == 1 and ranks_fed(parallel(4)) == 4
    assert ranks_fed(parallel(4, external=True)) == 1  # each API server owns one rank
    assert ranks_fed(parallel(4, hybrid=True, local=2)) == 2  # this node's ranks
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4, tenant_fair_share=False),
                             cache_config=SimpleNamespace(block_size=16), parallel_config=parallel(2),
                             model_config=SimpleNamespace(is_encoder_only=False))
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["--max-waiting-requests", "4", "--max-queue-delay", "0"])
    c = make_admission_controller(SimpleNamespace(vllm_config=config), args)
    assert c.max_num_seqs == 8  # 2 ranks x 4
    c.in_flight = 8  # both ranks full: nobody waits
    c.record(_stats(running=4, used=10, total=100), None)
    c.record(_stats(running=4, waiting=1, used=30, total=100), None, engine_idx=1)
    assert (c.stats.num_running_reqs, c.stats.num_waiting_reqs, c.stats.num_used_blocks,
            c.stats.num_total_blocks) == (8, 1, 40, 200)  # summed, not the last rank's
    assert c.num_waiting == 1 and c.admit() is None
    c.record(_stats(running=4), None, engine_idx=1)  # rank 1's newer stats replace its older ones
    assert c.stats.num_waiting_reqs == 0 and c.stats.num_running_reqs == 8


# ---- fan-out: one call, several engine requests (tester's fanout.py) ---------------------
def test_fan_out_is_read_from_lists_and_n_per_route():
    from llmserve.entrypoints.openai.fan_out import fan_out_of

    def fan(path, **body):
        return fan_out_of(json.dumps(body).encode(), path)
    big = fan("/v1/completions", prompt=["hello"] * 1024, n=16)
    assert (big.sequences, big.field(384)) == (16384, "prompt")
    assert fan("/v1/completions", prompt=[1, 2, 3], n=2).sequences == 2  # one prompt of token ids
    assert fan("/v1/completions", prompt=[[1, 2], [3]], best_of=3, n=3).sequences == 6
    assert fan("/v1/chat/completions", messages=[{"role": "user", "content": "x"}] * 5, n=3).sequences == 3
    assert fan("/v1/embeddings", input=["a"] * 40).sequences == 40
    assert fan("/rerank", query="q", documents=["d"] * 7).sequences == 7
    assert fan("/score", text_1="a", text_2=["b"] * 5).sequences == 5
    assert fan("/v1/responses", input=[{"role": "user", "content": "x"}] * 9).sequences == 1  # items, not prompts
    assert fan("/v1/completions", prompt=["a"] * 1025).sequences == 1  # the route's own 400 names the limit
    assert fan("/v1/completions", n=True).sequences == 1 and fan_out_of(b"not json").sequences == 1
    assert fan_out_of(b"[" * 5000 + b"]" * 5000, "/v1/completions").sequences == 1  # RecursionError: one


def test_a_fan_out_takes_all_its_sequences_of_the_limits_or_is_refused():
    from llmserve.entrypoints.openai.fan_out import FanOut
    c = AdmissionController(AdmissionConfig(8, 10.0, 0.0), max_num_seqs=4, clock=Clock())
    assert c.capacity == 12
    fan = FanOut(3, "prompt", 4, "n")  # 12 sequences: 4 run, 8 wait
    assert c.admit(fan=fan, tenant="a") is None
    assert (c.in_flight, c.num_waiting, c.tenant_in_flight) == (12, 8, {"a": 12})
    r = c.admit()  # before the fix the call counted 1 and this one was admitted behind 8 queued sequences
    assert r.reason == "queue_full" and r.status == 429 and r.retry_after >= 1
    c.release(fan, "a")
    assert (c.in_flight, c.tenant_in_flight) == (0, {})
    c.in_flight = 2  # 2 free slots and a queue bound of 8: a fan-out of 11 would leave 9 waiting
    r = c.admit(fan=FanOut(11, "prompt"))
    assert r.reason == "queue_full" and "11 sequences" in r.message
    assert c.admit(fan=FanOut(10, "prompt")) is None and c.num_waiting == 8
    c.in_flight = 1  # busy: a call larger than all the limits hold waits for an idle engine
    for fan in (FanOut(13, "prompt"), FanOut(1, None, 13, "n")):
        r = c.admit(fan=fan)
        assert (r.status, r.reason) == (429, "queue_full") and "13 sequences" in r.message and r.retry_after >= 1
    c.in_flight = 0  # idle: it runs alone (a list within the documented 1024 prompts, as vLLM serves)
    assert c.admit(fan=FanOut(13, "prompt")) is None and c.in_flight == 13
    assert c.admit().reason == "queue_full"  # a request arriving meanwhile is refused at once
    c.release(FanOut(13, "prompt"))
    unbounded = AdmissionController(AdmissionConfig(-1, 10.0, 0.0), max_num_seqs=4, clock=Clock())
    assert unbounded.capacity is None and unbounded.admit(fan=FanOut(1000, "prompt")) is None


def test_a_small_request_after_a_fan_out_is_answered_at_once_not_queued_behind_it():
    """The tester's case: a 4-token chat behind a call of many sequences waited 117 s. Now
    the call's sequences fill the queue, and the chat is either admitted into a free slot
    or refused at once (429 queue_delay with Retry-After) while they drain."""
    from llmserve.entrypoints.openai.fan_out import FanOut
    c = AdmissionController(AdmissionConfig(512, 10.0, 1.0), max_num_seqs=256, clock=Clock())
    c.record(_stats(running=10), _finished(2.0))  # warm: 128 sequences a second drain
    assert c.admit(fan=FanOut(300, "prompt", 2, "n")) is None  # 600: 256 run, 344 wait
    r = c.admit()
    assert r.reason == "queue_delay" and 1 <= r.retry_after <= MAX_RETRY_AFTER_S  # ~345/128 s ahead
    c.release(FanOut(300, "prompt", 2, "n"))
    assert c.admit() is None


def test_fair_share_counts_the_tenants_sequences_not_its_calls():
    from llmserve.entrypoints.openai.admission import _tenant_in_flight
    from llmserve.entrypoints.openai.fan_out import FanOut
    from llmserve.entrypoints.openai.tenants import TENANT_IN_FLIGHT_KEY
    c = AdmissionController(AdmissionConfig(8, 10.0, 0.0), max_num_seqs=4, clock=Clock())
    c.fair_share = True
    scope = {"state": {TENANT_IN_FLIGHT_KEY: lambda: 2}}  # the flooder's 1 call in flight + this one
    assert c.admit(fan=FanOut(12, "prompt"), tenant="flood") is None
    assert _tenant_in_flight(scope, c, "flood") == 12 and _tenant_in_flight(scope, c, "quiet") == 0
    assert c.admit(_tenant_in_flight(scope, c, "flood")).reason == "queue_full"  # its own 8 waiting
    assert c.admit(_tenant_in_flight(scope, c, "quiet")) is None  # nobody of its own ahead


def test_a_quiet_tenant_is_admitted_beside_a_flooders_full_batch():
    """A flooder's 30 streams filled the batch, and the quiet tenant's one request got 429
    queue_delay (the flooder's long predicted wait); under fair share it takes a flooder's
    seat at once."""
    c = AdmissionController(AdmissionConfig(8, 10.0, 1.0), max_num_seqs=4, clock=Clock())
    c.record(_stats(), _finished(20.0))  # 20 s in the batch: a waiting request waits seconds
    c.fair_share = True
    for _ in range(4):
        assert c.admit(c.tenant_in_flight.get("flood", 0), tenant="flood") is None
    assert c.admit(c.tenant_in_flight.get("flood", 0), tenant="flood").reason == "queue_delay"  # its own wait
    assert c.admit(0, tenant="quiet") is None
    assert c.admit(1, tenant="quiet") is None  # 2 of the 4 seats are its equal share
    assert c.admit(2, tenant="quiet").reason == "queue_delay"
    c.fair_share = False  # one first-come queue: the quiet request waits behind the batch as before
    assert c.admit(c.tenant_in_flight.get("x", 0) if c.fair_share else None, tenant="x").reason == "queue_delay"


def test_fan_out_over_http_larger_than_the_queue_waits_for_an_idle_engine(smol_tokenizer):
    """A call past all the limits (1024 prompts x n=16) on a busy engine is a 429 at once
    naming its sequences, with Retry-After; small calls and the routes' own 400s pass."""
    app, engine, prom = _app(smol_tokenizer)
    engine.model_config.supported_tasks = ("generate", "embed")  # /v1/embeddings serves it (not its own 400)
    controller = app.state.admission
    client = TestClient(app)
    assert controller.capacity == 3 * controller.max_num_seqs  # defaults: batch + 2 batches waiting
    controller.in_flight = 1  # another request runs
    t = time.monotonic()
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["hello"] * 1024, "n": 16, "max_tokens": 8})
    assert r.status_code == 429 and time.monotonic() - t < 5 and "Retry-After" in r.headers
    assert "16384 sequences" in r.json()["error"]["message"] and r.json()["error"]["type"] == "RateLimitError"
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 4, "n": 100})  # 400 > 384
    assert r.status_code == 429 and "400 sequences" in r.text
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 129})  # past MAX_N: the route's own 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "128" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"model": "m", "input": ["x"] * (controller.capacity + 1)})
    assert r.status_code == 429
    assert controller.in_flight == 1
    text = client.get("/metrics").text
    assert 'vllm:request_rejected_total{engine="0",model_name="m",reason="queue_full"} 3.0' in text
    controller.in_flight = controller.max_num_seqs + 2 * controller.max_num_seqs - 3  # 3 places left in the queue
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2})  # 4 sequences: no room
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert r.json()["error"]["type"] == "RateLimitError" and "4 sequences" in r.json()["error"]["message"]


def test_an_encoder_admits_a_fan_out_larger_than_its_queue_only_alone():
    """Pooling sequences finish within a step and embedding clients send lists of ~1000:
    an encoder's call past the capacity is no 400, it runs when the engine is idle."""
    from llmserve.entrypoints.openai.fan_out import FanOut
    c = AdmissionController(AdmissionConfig(8, 10.0, 1.0), max_num_seqs=4, clock=Clock(), uses_kv_cache=False)
    c.in_flight = 1
    r = c.admit(fan=FanOut(1000, "documents"))
    assert r.reason == "queue_full" and r.status == 429  # busy: retry later, not a 400
    c.in_flight = 0
    assert c.admit(fan=FanOut(1000, "documents")) is None and c.in_flight == 1000
    assert c.admit().reason == "queue_full"  # the next one waits for it


def test_a_malformed_request_gets_its_own_400_not_the_429_on_every_front_door(smol_tokenizer):
    """With the queue full, each API family's malformed request is answered its route's own
    400 in its own error body (validation first: admission_precheck.py), is not counted as
    refused, and a well-formed one still gets the 429 (fresh-user trial: a bad body got 429,
    and its client retried it into the same 400). So is what the route refuses before it
    renders a prompt: an unknown model (404) or one that cannot serve the route, a body
    that is not JSON, a speech-to-text form without its file or with a file no decoder
    opens, a SageMaker invocation (a later trial found these still answered 429)."""
    app, engine, _ = _app(smol_tokenizer, "--max-waiting-requests", "1")
    controller = app.state.admission
    client = TestClient(app)
    controller.in_flight = controller.max_num_seqs + 1  # a full batch and one request waiting
    anthropic = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ollama = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    bad = [  # (path, body, what the 400 says)
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "logprobs"),  # the handler's check()
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens is 0 without echo"),
        ("/v1/messages", {**anthropic, "service_tier": "priority"}, "service_tier"),
        ("/v1/messages", {**anthropic, "messages": [{"role": "user", "content": ""}]}, "messages.0"),
        ("/api/chat", {**ollama, "messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{}"}}]}]}, "ToolCallFunction.messages.tool_calls.function"),
        ("/api/generate", {"model": "m", "prompt": "x", "raw": True, "template": "{{ .Prompt }}"},
         "raw mode does not support template"),  # a request template alone is served since a3235a3
    ]
    for path, body, words in bad:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        message = {"/v1/messages": lambda b: b["error"]["message"], "/api/": lambda b: b["error"]}.get(
            path if path == "/v1/messages" else path[:5], lambda b: b["error"]["message"])(r.json())
        assert words in message, (path, message)
    assert client.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"}).json()[
        "error"]["type"] == "invalid_request_error"
    # a prompt that cannot fit the context (64 tokens here), or leaves no room for the
    # budget asked: the route's own 400 (the engine's context rule), not the 429
    long_text = "word " * 100
    too_long = [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long_text}]}, "messages"),
                ("/v1/chat/completions", {**CHAT, "max_tokens": 60}, "max_tokens"),
                ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 60}, "max_completion_tokens"),
                ("/v1/completions", {"model": "m", "prompt": long_text, "max_tokens": 1}, "prompt"),
                ("/v1/completions", {"model": "m", "prompt": ["hi", long_text], "max_tokens": 1}, "prompt"),
                ("/v1/responses", {"model": "m", "input": long_text}, "input"),
                ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 60}, "max_output_tokens"),
                ("/invocations", {"model": "m", "prompt": long_text, "max_tokens": 1}, "prompt")]
    for path, body, param in too_long:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert "maximum context length is 64 tokens" in r.json()["error"]["message"], r.text
    r = client.post("/v1/messages", json={**anthropic, "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"], r.text
    assert client.post("/v1/messages", json={**anthropic, "max_tokens": 60}).status_code == 429  # clamped, as it runs
    long_int = client.post("/v1/completions", content=b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 4400
                           + b"}", headers={"content-type": "application/json"})
    assert long_int.status_code == 400 and long_int.json()["error"]["param"] == "max_tokens", long_int.text
    # what the route refuses before rendering, besides the body's fields: the model it
    # names, a body that is not JSON, a speech-to-text form, a SageMaker invocation
    openai = lambda b: b["error"]["message"]  # noqa: E731
    refused = [  # (path, request, status, how its error body reads, what it says)
        ("/v1/chat/completions", dict(json={**CHAT, "model": "nope"}), 404, openai, "`nope` does not exist"),
        ("/v1/completions", dict(json={"model": "nope", "prompt": "x"}), 404, openai, "`nope` does not exist"),
        ("/v1/embeddings", dict(json={"model": "m", "input": "x"}), 400, openai, "does not support the Embeddings"),
        ("/rerank", dict(json={"model": "nope", "query": "q", "documents": ["d"]}), 404, openai, "`nope`"),
        ("/v1/messages", dict(json={**anthropic, "model": "nope"}), 404, openai, "`nope` does not exist"),
        ("/api/generate", dict(json={"model": "nope", "prompt": "x"}), 404, lambda b: b["error"], "'nope' not found"),
        ("/api/embed", dict(json={"model": "nope", "input": "x"}), 404, lambda b: b["error"], '"nope" not found'),
        ("/v1/chat/completions", dict(content=json.dumps(CHAT).encode(), headers={"content-type": "text/plain"}),
         400, openai, "must be JSON sent with `Content-Type: application/json`"),
        ("/v1/messages", dict(content=b"hi", headers={"content-type": "application/x-www-form-urlencoded"}),
         400, openai, "must be JSON"),
        ("/v1/audio/transcriptions", dict(data={"model": "m"}, files={"x": ("a", b"1")}), 400, openai,
         "`file` is required"),
        ("/v1/audio/translations", dict(json={"model": "m"}), 400, openai, "multipart/form-data"),
        ("/v1/audio/transcriptions", dict(data={"model": "m"}, files={"file": ("a.wav", b"x")}), 400, openai,
         "not a speech-to-text model"),
        ("/invocations", dict(content=b"{", headers={"content-type": "application/json"}), 400, openai,
         "Invalid JSON"),
        ("/invocations", dict(json={"foo": 1}), 400, openai, "/invocations takes a JSON object"),
        ("/invocations", dict(json={**CHAT, "model": "nope"}), 404, openai, "`nope` does not exist"),
        ("/invocations", dict(json={**CHAT, "top_logprobs": 2}), 400, openai, "logprobs"),  # chat's check()
    ]
    for path, request, status, read, words in refused:
        r = client.post(path, **request)
        assert r.status_code == status and words in read(r.json()), (path, r.text)
    assert client.post("/v1/messages", json={**anthropic, "model": "nope"}).json()["error"]["type"] == "not_found_error"
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", anthropic), ("/api/chat", ollama)):
        assert client.post(path, json=body).status_code == 429, path
    engine.model_config.supported_tasks = ("generate", "embed")
    assert client.post("/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 429  # a model that embeds
    app.state.openai_serving_transcription.is_speech_model = True  # the file is probed, not decoded
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 160)  # 10 ms of silence
    for data, status in ((b"", 400), (b"not audio" * 8, 400), (wav.getvalue(), 429)):
        r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("a.wav", data)})
        assert r.status_code == status, r.text
        assert status == 429 or r.json()["error"]["message"].startswith("Invalid or unsupported audio file")
    assert 'reason="queue_full"} 6.0' in client.get("/metrics").text  # the malformed ones are not counted
    assert controller.in_flight == controller.max_num_seqs + 1
