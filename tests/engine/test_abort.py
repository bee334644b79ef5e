"""Aborts (issue 10 point 3, cases C46 / C52): ``AsyncLLM.abort`` from another coroutine
ends that request's ``generate()`` with a final "abort" output holding the tokens so far;
no output of an aborted request reaches a new request that reuses its id; n > 1, aborts
while queued, and the offline ``LLMEngine.abort_request`` follow the same rules.
Real model (default dtype, greedy, so the tokens so far are a prefix of the full answer)."""
import asyncio
import time

import pytest

from llmserve import AsyncEngineArgs, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from llmserve.engine.llm_engine import LLMEngine
from tests.conftest import PROMPTS

PROMPT = "The history of the bicycle"


def _kw():
    return dict(model="SmolLM2-135M-Instruct", kv_cache_memory="256MiB", max_model_len=512)


class _Reasons:
    """A stat logger keeping the finish reason of every finished request."""

    def __init__(self):
        self.reasons = []

    def record(self, scheduler_stats, iteration_stats):
        if iteration_stats is not None:
            self.reasons += [f.finish_reason for f in iteration_stats.finished_requests]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**_kw()))  # stats on: abort metrics
    eng.reasons = _Reasons()
    eng.stat_loggers.append(eng.reasons)
    yield eng
    eng.shutdown()


def _sp(kind, max_tokens=60, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, output_kind=kind, **kw)


async def _run(engine, prompt, sp, rid, outs):
    async for out in engine.generate(prompt, sp, rid):
        outs.append(out)


async def _reference(engine, prompt, n_tokens, rid):
    outs = []
    await _run(engine, prompt, _sp(RequestOutputKind.FINAL_ONLY, n_tokens), rid, outs)
    return outs[-1].outputs[0].token_ids


async def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_abort_ends_generate_with_tokens_so_far(engine, loop, kind):
    """C46: A1-A4, after a few tokens (decode) and right after the request was added
    (queued / prefill: no tokens)."""
    async def run():
        ref = await _reference(engine, PROMPT, 60, f"ref-{kind.name}")
        results = {}
        for when in ("decode", "queued"):
            rid, outs = f"ab-{kind.name}-{when}", []
            task = asyncio.create_task(_run(engine, PROMPT, _sp(kind), rid, outs))
            if when == "decode":
                await _wait_for(lambda: len(outs) >= 3)  # each output holds >= 1 new token
            else:
                await asyncio.sleep(0)  # generate() has sent the request; no step has run
            await engine.abort(rid)
            await asyncio.wait_for(task, 30)
            results[when] = outs
        after = await _reference(engine, PROMPT, 60, f"after-{kind.name}")
        return ref, results, after

    ref, results, after = loop.run_until_complete(run())
    assert after == ref  # A4: the engine serves normally afterwards
    for when, outs in results.items():
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason == "abort", when
        assert all(not o.finished for o in outs[:-1])
        if kind == RequestOutputKind.CUMULATIVE:
            toks = last.outputs[0].token_ids
            if len(outs) > 1:  # nothing taken back
                assert toks[:len(outs[-2].outputs[0].token_ids)] == outs[-2].outputs[0].token_ids
        else:
            toks = [t for o in outs for t in o.outputs[0].token_ids]
        assert toks == ref[:len(toks)], when  # the tokens so far, nothing stray
        if when == "decode":
            assert 3 <= len(toks) < 60
        else:
            assert toks == []


def test_reused_id_gets_no_output_of_the_aborted_request(engine, loop):
    """The new request with the id of one aborted a moment ago ends at exactly max_tokens
    with its own tokens (before: one stray token from the old one, max_tokens + 1)."""
    other = PROMPTS[1]

    async def run():
        ref = await _reference(engine, other, 8, "reuse-ref")
        got = []
        for i in range(6):
            outs = []
            task = asyncio.create_task(_run(engine, PROMPT, _sp(RequestOutputKind.DELTA, 200), "reuse", outs))
            await _wait_for(lambda: len(outs) >= 1 + i % 3)
            await engine.abort("reuse")
            await asyncio.wait_for(task, 30)
            new = []
            await _run(engine, other, _sp(RequestOutputKind.DELTA, 8), "reuse", new)
            got.append(([t for o in new for t in o.outputs[0].token_ids], new[-1].outputs[0].finish_reason))
        return ref, got

    ref, got = loop.run_until_complete(run())
    assert got == [(ref, "length")] * 6


def test_abort_n3_parent_ends_all_children_with_one_final_output(engine, loop):
    sp = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=200, min_tokens=200,
                        output_kind=RequestOutputKind.CUMULATIVE)

    async def run():
        outs = []
        task = asyncio.create_task(_run(engine, PROMPT, sp, "ab-n3", outs))
        await _wait_for(lambda: any(len(c.token_ids) >= 2 for o in outs for c in o.outputs))
        await engine.abort("ab-n3")
        await asyncio.wait_for(task, 30)
        return outs

    outs = loop.run_until_complete(run())
    finals = [o for o in outs if o.finished]
    assert len(finals) == 1 and outs[-1] is finals[0]
    assert [c.index for c in finals[0].outputs] == [0, 1, 2]
    assert [c.finish_reason for c in finals[0].outputs] == ["abort"] * 3
    assert engine.output_processor.get_num_unfinished_requests() == 0


def test_abort_counts_finished_abort_once_per_engine_request(engine, loop):
    """C52 A1: one finished-with-"abort" record per engine request (n=3: three)."""
    async def run():
        before = list(engine.reasons.reasons)
        for rid, n in (("m-1", 1), ("m-3", 3)):
            outs = []
            sp = SamplingParams(n=n, temperature=0.5, seed=1, max_tokens=200, min_tokens=200,
                                output_kind=RequestOutputKind.DELTA)
            task = asyncio.create_task(_run(engine, PROMPT, sp, rid, outs))
            await _wait_for(lambda: len(outs) >= 2)
            await engine.abort(rid)
            await asyncio.wait_for(task, 30)
        await asyncio.sleep(0.2)
        return before, list(engine.reasons.reasons)

    before, after = loop.run_until_complete(run())
    assert after[len(before):] == ["abort"] * 4


@pytest.mark.slow  # ~6 s; aborts with the tokens so far: the parametrized tests here; `make test-all`
def test_llm_engine_abort_request_offline():
    """LLMEngine.abort_request: the next step() returns the final "abort" output with the
    tokens so far; a new request with the same id gets only its own tokens."""
    eng = LLMEngine.from_engine_args(EngineArgs(**_kw()))
    try:
        def run(rid, prompt, n_tok, kind, abort_after=None):
            eng.add_request(rid, prompt, _sp(kind, n_tok))
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
                if abort_after is not None and len(outs) >= abort_after and not outs[-1].finished:
                    eng.abort_request(rid)
                    abort_after = None
            return outs

        ref = run("r", PROMPT, 20, RequestOutputKind.FINAL_ONLY)[-1].outputs[0].token_ids
        outs = run("x", PROMPT, 200, RequestOutputKind.CUMULATIVE, abort_after=4)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert outs[-1].outputs[0].token_ids == outs[-2].outputs[0].token_ids == ref[:4]
        again = run("x", PROMPT, 20, RequestOutputKind.FINAL_ONLY)
        assert len(again) == 1 and again[0].outputs[0].token_ids == ref
    finally:
        eng.shutdown()


def test_aborted_beam_search_keeps_its_best_beams_so_far(engine, loop):
    """A beam search aborted mid-way (an X-Request-Timeout deadline) ends with beam_width
    choices, each "abort" with the tokens of one of the best beams so far, ranked as the
    search ranks them (cum_logprob / generated_len ** length_penalty, best first); before,
    one empty choice. The engine is left with nothing of it."""
    from llmserve.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=4, max_tokens=400, ignore_eos=True)

    async def run():
        outs = []

        async def go():
            async for out in engine.beam_search(PROMPT, "ab-beam", params):
                outs.append(out)

        task = asyncio.create_task(go())
        await asyncio.sleep(1.0)
        await engine.abort("ab-beam")
        await asyncio.wait_for(task, 30)
        return outs

    outs = loop.run_until_complete(run())
    assert len(outs) == 1 and outs[0].finished
    choices = outs[0].outputs
    assert [c.finish_reason for c in choices] == ["abort"] * 4
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert all(0 < len(c.token_ids) < 400 and c.text for c in choices)
    scores = [c.cumulative_logprob / len(c.token_ids) for c in choices]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in choices}) == 4
    assert engine.output_processor.get_num_unfinished_requests() == 0
