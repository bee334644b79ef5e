"""The engine-client surface vLLM users call: EngineClient, from_vllm_config, Executor.get_class,
make_client / make_async_mp_client, add_request with an EngineCoreRequest, trace headers,
IterationStats only with outputs, the queue-time metric, streaming input, shutdown(timeout).
Real model (float32) behind a real engine process."""
import asyncio
import dataclasses
import logging
import os
import signal
import time

import pytest

from llmserve import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams, StreamingInput
from llmserve.engine.core_client import EngineCoreClient
from llmserve.engine.protocol import EngineClient
from llmserve.executor import Executor, UniProcExecutor
from llmserve.metrics.prometheus import PrometheusStatLogger
from tests.conftest import PROMPTS

GREEDY = dict(temperature=0.0)


def _args(**kw):
    base = dict(model="SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="128MiB",
                max_model_len=512, max_num_seqs=4, disable_log_stats=False)
    base.update(kw)
    return AsyncEngineArgs(**base)


class _Recorder:
    """A stat logger that keeps what it is handed."""

    def __init__(self):
        self.records = []

    def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
        self.records.append((scheduler_stats, iteration_stats))


@pytest.fixture(scope="module")
def setup():
    config = _args().create_engine_config()
    prom, rec = PrometheusStatLogger(config), _Recorder()
    eng = AsyncLLM.from_vllm_config(config, stat_loggers=[prom, rec])
    yield eng, prom, rec
    eng.shutdown()


async def _final(engine, prompt, params, rid, **kw):
    out = None
    async for out in engine.generate(prompt, params, rid, **kw):
        pass
    return out


def test_executor_class_and_unsupported_backends():
    config = _args().create_engine_config()
    assert Executor.get_class(config) is UniProcExecutor

    class _PC:
        distributed_executor_backend = "tpu"
        tensor_parallel_size = 1

    class _Cfg:
        parallel_config = _PC()

    with pytest.raises(ValueError, match="distributed_executor_backend='tpu' is not supported"):
        Executor.get_class(_Cfg())
    _PC.distributed_executor_backend, _PC.tensor_parallel_size = "uni", 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        Executor.get_class(_Cfg())
    _PC.distributed_executor_backend = None  # several workers, no backend: one process each (vLLM's "mp")
    assert Executor.get_class(_Cfg()).__name__ == "MultiprocExecutor"


def test_make_client_refuses_what_it_cannot_do():
    config = _args().create_engine_config()
    with pytest.raises(ValueError, match="asyncio_mode needs multiprocess_mode"):
        EngineCoreClient.make_client(False, True, config, UniProcExecutor, False)
    # several API servers: engines started elsewhere, reached at client_addresses (multi_api_server.py)
    with pytest.raises(ValueError, match="client_addresses and client_count > 1 go together"):
        EngineCoreClient.make_async_mp_client(config, UniProcExecutor, False, client_count=2, client_index=1)
    with pytest.raises(ValueError, match="client_addresses and client_count > 1 go together"):
        EngineCoreClient.make_async_mp_client(config, UniProcExecutor, False,
                                              client_addresses={"input_address": "x", "output_address": "y"})
    with pytest.raises(ValueError, match="lacks"):
        EngineCoreClient.make_async_mp_client(config, UniProcExecutor, False, client_addresses={"input": "x"},
                                              client_count=2)
    with pytest.raises(ValueError, match="client_index=2 is out of range"):
        EngineCoreClient.make_async_mp_client(config, UniProcExecutor, False, client_count=2, client_index=2)
    with pytest.raises(ValueError, match="must be one address"):  # one engine: one address each
        EngineCoreClient.make_async_mp_client(config, UniProcExecutor, False, client_count=2,
                                              client_addresses={"input_address": ["x"], "output_address": "y"})
    dp_config = dataclasses.replace(config, parallel_config=dataclasses.replace(config.parallel_config,
                                                                                data_parallel_size=2))
    with pytest.raises(ValueError, match="one address per data parallel rank"):  # DP=2: a list of 2 each
        EngineCoreClient.make_async_mp_client(dp_config, UniProcExecutor, False, client_count=2,
                                              client_addresses={"input_address": ["x", "z"], "output_address": "y"})


def test_async_llm_is_an_engine_client(setup):
    eng, _, _ = setup
    assert isinstance(eng, EngineClient)
    assert eng.is_running and not eng.is_stopped and not eng.errored
    assert eng.vllm_config.model_config is eng.model_config


def test_add_request_takes_an_engine_core_request(setup, loop, caplog):
    eng, _, _ = setup
    sp = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
    req, _ = eng.input_processor.process_inputs("own-id", PROMPTS[0], sp)

    async def run():
        plain = await _final(eng, PROMPTS[0], sp, "plain")
        with caplog.at_level(logging.WARNING, logger="llmserve.engine.async_llm"):
            prepared = await _final(eng, req, None, "other-id")
        return plain, prepared

    plain, prepared = loop.run_until_complete(run())
    assert prepared.request_id == "own-id"
    assert prepared.outputs[0].token_ids == plain.outputs[0].token_ids
    assert "does not match" in caplog.text


def test_trace_headers_reach_the_request_log_line(setup, loop, caplog):
    eng, _, _ = setup
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "k=v"}
    eng.log_requests = True
    try:
        with caplog.at_level(logging.INFO, logger="llmserve.engine.async_llm"):
            loop.run_until_complete(_final(eng, PROMPTS[1], SamplingParams(max_tokens=2), "traced",
                                           trace_headers=headers))
    finally:
        eng.log_requests = False
    line = next(r.getMessage() for r in caplog.records if "Added request traced" in r.getMessage())
    assert headers["traceparent"] in line and "k=v" in line


def test_queue_time_and_phase_timings_are_recorded(setup, loop):
    eng, prom, rec = setup
    sp = SamplingParams(max_tokens=6, **GREEDY)
    before = len(rec.records)

    async def run():  # more requests than max_num_seqs=4: some wait in the queue
        await asyncio.gather(*[_final(eng, PROMPTS[i], sp, f"q-{i}") for i in range(10)])

    loop.run_until_complete(run())
    fins = [f for _, it in rec.records[before:] if it is not None for f in it.finished_requests]
    assert len(fins) == 10
    assert all(f.queued_time > 0 and f.prefill_time > 0 and f.inference_time >= f.prefill_time for f in fins)
    assert all(f.decode_time > 0 for f in fins)  # 6 tokens: the last comes after the first
    assert max(f.queued_time for f in fins) > min(f.queued_time for f in fins)
    text = prom.render().decode()
    qsum = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("vllm:request_queue_time_seconds_sum"))
    assert qsum > 0
    assert "vllm:request_prefill_time_seconds_count" in text


def test_iteration_stats_only_with_outputs(setup, loop):
    eng, _, rec = setup
    before = len(rec.records)

    async def run():  # an abort leaves the engine idle: its last message has no outputs
        # ignore_eos: still running when closed (a sampled EOS at once would leave nothing to abort)
        gen = eng.generate(PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True), "to-abort")
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if any(s is not None and s.num_running_reqs == 0 and it is None for s, it in rec.records[before:]):
                return
            await asyncio.sleep(0.05)

    loop.run_until_complete(run())
    recs = rec.records[before:]
    assert any(s is not None and it is None for s, it in recs)  # stats-only message: no IterationStats


def test_streaming_input_extends_the_prompt_while_the_request_lives(setup, loop):
    eng, _, _ = setup
    tok = eng.tokenizer
    first = tok.encode(PROMPTS[3])
    second = tok.encode(" And then,", add_special_tokens=False)
    third = [int(t) for t in tok.encode(" in the end", add_special_tokens=False)]
    sp = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA, **GREEDY)

    async def chunks():
        yield first
        await asyncio.sleep(0.05)
        yield " And then,"
        yield StreamingInput(third, SamplingParams(max_tokens=2, **GREEDY))

    async def alone(ids, n, rid):
        out = await _final(eng, {"prompt_token_ids": ids}, SamplingParams(max_tokens=n, **GREEDY), rid)
        return out.outputs[0].token_ids

    async def run():
        got, finished = [], []
        async for out in eng.generate(chunks(), sp, "stream-in"):
            got += out.outputs[0].token_ids
            finished.append(out.finished)
        a = await alone(first, 3, "ref-1")
        b = await alone(first + a[:-1] + second, 3, "ref-2")
        c = await alone(first + a[:-1] + second + b[:-1] + third, 2, "ref-3")
        return got, finished, a + b + c

    got, finished, expected = loop.run_until_complete(run())
    assert got == expected  # each chunk continues the cached context, as vLLM's streaming input
    assert finished[-1] and not any(finished[:-1])


def test_streaming_input_rejects_reasoning_kwargs_and_bad_chunks(setup, loop):
    eng, _, _ = setup

    async def chunks(*items):
        for it in items:
            yield it

    async def run(gen, **kw):
        async for _ in eng.generate(gen, SamplingParams(max_tokens=2), f"bad-{time.monotonic_ns()}", **kw):
            pass

    with pytest.raises(NotImplementedError):
        loop.run_until_complete(run(chunks("Hi"), reasoning_ended=True))
    with pytest.raises(NotImplementedError):
        loop.run_until_complete(run(chunks("Hi"), reasoning_parser_kwargs={}))
    with pytest.raises(ValueError, match="out of vocabulary"):
        loop.run_until_complete(run(chunks("Hi", [10 ** 9])))
    with pytest.raises(ValueError, match="no chunk"):
        loop.run_until_complete(run(chunks()))
    # Without streaming input the reasoning kwargs are accepted and passed through.
    out = loop.run_until_complete(_final(eng, "Hi", SamplingParams(max_tokens=2), "reasoning-ok",
                                         reasoning_ended=False))
    assert out.finished
    assert not eng.output_processor.states  # nothing left behind


@pytest.mark.slow  # ~5 s (waits the timeout out); prompt shutdown: tests/engine/test_async_llm.py; `make test-all`
def test_shutdown_honours_its_timeout():
    eng = AsyncLLM.from_engine_args(_args(disable_log_stats=True))
    pid = eng.engine_core.engine_pid
    os.kill(pid, signal.SIGSTOP)  # a stuck engine: it cannot act on SHUTDOWN or SIGTERM
    t0 = time.monotonic()
    eng.shutdown(timeout=1.0)
    elapsed = time.monotonic() - t0
    assert not eng.engine_core.resources.proc.is_alive()
    assert elapsed < 4.0  # without the timeout: 5 s for SHUTDOWN + 5 s after SIGTERM
    assert eng.is_stopped
