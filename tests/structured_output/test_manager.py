"""StructuredOutputManager with the scheduler (no model): grammars compile off the step
loop (WAITING_FOR_FSM while others run), one bitmask row per constrained request that
samples, matchers advance with accepted tokens and finish the request with ``stop``,
aborts while compiling, preemption, and reasoning (a fake parser: only the stop tokens
masked until the reasoning ends)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.outputs import FinishReason
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import ModelRunnerOutput, Scheduler
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams as SO
from llmserve.structured_output.bitmask import apply_grammar_bitmask
from llmserve.structured_output.config import StructuredOutputsConfig
from llmserve.structured_output.manager import StructuredOutputManager

END_THINK = 100  # the fake reasoning parser's end token


@pytest.fixture(scope="module")
def tok():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")


def _setup(tok, reasoning=False, budget=64):
    cfg = SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(reasoning_parser="fake" if reasoning else ""),
        model_config=SimpleNamespace(vocab_size=len(tok), extra_eos_token_ids=()))
    mgr = StructuredOutputManager(cfg, tokenizer=tok)
    if reasoning:
        mgr.reasoner = SimpleNamespace(is_reasoning_end=lambda ids: END_THINK in ids)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64, structured_output_manager=mgr)
    return mgr, s


def _add(mgr, s, rid, n_prompt, so=None, max_tokens=32, reasoning_ended=None):
    req = Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, structured_outputs=so),
                  eos_token_id=2)
    if so is not None:
        mgr.grammar_init(req, reasoning_ended)
    s.add_request(req)
    return req


def _step(s, tokens):
    """One step; each sampling request gets the next of its tokens (rid -> list)."""
    so = s.schedule()
    ro = ModelRunnerOutput()
    for x in so.scheduled:
        if x.num_computed_tokens + x.num_scheduled_tokens >= x.request.num_tokens:
            ro.sampled_token_ids[x.request.request_id] = tokens[x.request.request_id].pop(0)
    return so, s.update_from_output(so, ro)


def _allowed(so, rid, vocab):
    row = torch.zeros(1, vocab)
    apply_grammar_bitmask(row, so.grammar_bitmask, [0], [so.structured_output_request_ids[rid]])
    return set(torch.nonzero(row[0] == 0).flatten().tolist())


def test_compiles_off_the_loop_masks_and_finishes_with_stop(tok):
    mgr, s = _setup(tok)
    plain = _add(mgr, s, "plain", 4)
    req = _add(mgr, s, "json", 10, SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}))
    assert req.status == RequestStatus.WAITING_FOR_FSM or req.structured_output_request.is_ready()
    text_ids = tok.encode('{"a": 12}', add_special_tokens=False)  # json.dumps separators
    so, _ = _step(s, {"plain": [7]})  # the unconstrained request runs whatever the compile does
    assert "plain" in {x.request.request_id for x in so.scheduled}
    req.structured_output_request.future and req.structured_output_request.future.result()
    toks = {"plain": [7] * 40, "json": list(text_ids) + [2]}
    finished = None
    while finished is None:
        nxt = toks["json"][0]
        so, outs = _step(s, toks)
        if so.structured_output_request_ids:
            assert set(so.structured_output_request_ids) == {"json"}  # never the plain row
            assert nxt in _allowed(so, "json", len(tok))
        finished = next((o for o in outs if o.request_id == "json" and o.finish_reason is not None), None)
    assert finished.finish_reason == FinishReason.STOP
    assert req.output_token_ids == list(text_ids) + [2]
    assert s._num_structured == 0 and plain.status == RequestStatus.RUNNING


def test_chunked_prefill_gets_no_row_until_it_samples(tok):
    mgr, s = _setup(tok, budget=8)
    req = _add(mgr, s, "r", 20, SO(choice=["yes", "no"]))
    req.structured_output_request.future.result()
    so, _ = _step(s, {})
    assert so.scheduled[0].num_scheduled_tokens == 8 and so.grammar_bitmask is None
    _step(s, {})
    so, _ = _step(s, {"r": [tok.encode("yes", add_special_tokens=False)[0]]})
    assert so.structured_output_request_ids == {"r": 0}


def test_abort_while_compiling_and_bad_grammar_in_engine(tok):
    mgr, s = _setup(tok)
    req = _add(mgr, s, "r", 4, SO(regex="[a-z]{3}"))
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not s.waiting_for_fsm and not s.has_unfinished_requests() and s._num_structured == 0
    # A grammar that fails in the engine (validation skipped) aborts only its request.
    bad = _add(mgr, s, "bad", 4, SO(grammar="root ::= missing"))
    ok = _add(mgr, s, "ok", 4)
    bad.structured_output_request.future.exception()
    so, outs = _step(s, {"ok": [5]})
    assert [o.finish_reason for o in outs if o.request_id == "bad"] == [FinishReason.ABORT]
    assert ok.status == RequestStatus.RUNNING and s._num_structured == 0


def test_preemption_keeps_the_matcher_in_step(tok):
    mgr, s = _setup(tok)
    req = _add(mgr, s, "r", 4, SO(regex="abcabc"))
    req.structured_output_request.future.result()
    ids = tok.encode("abcabc", add_special_tokens=False)
    toks = {"r": list(ids) + [2]}
    _step(s, toks)
    s._preempt(req)  # recompute: same tokens, the matcher keeps its place
    while not req.is_finished():
        nxt = toks["r"][0]
        so, _ = _step(s, toks)
        if so.grammar_bitmask is not None:
            assert nxt in _allowed(so, "r", len(tok))
    assert req.get_finished_reason() == FinishReason.STOP


def test_grammar_waits_for_the_end_of_reasoning(tok):
    mgr, s = _setup(tok, reasoning=True)
    req = _add(mgr, s, "r", 4, SO(choice=["yes"]))
    req.structured_output_request.future.result()
    yes = tok.encode("yes", add_special_tokens=False)
    toks = {"r": [55, 66, END_THINK] + yes + [2]}
    seen = []
    while not req.is_finished():
        so, _ = _step(s, toks)
        seen.append(_allowed(so, "r", len(tok)))
    # Three reasoning tokens sampled free of the grammar but not of their end: every token
    # except EOS (2), so the request cannot stop before its answer (C59). Then the grammar.
    assert seen[:3] == [set(range(len(tok))) - {2}] * 3
    assert all(len(a) < 10 for a in seen[3:])
    assert req.get_finished_reason() == FinishReason.STOP
    # reasoning_ended from the front end: masked from the first token.
    req2 = _add(mgr, s, "r2", 4, SO(choice=["yes"]), reasoning_ended=True)
    req2.structured_output_request.future.result()
    so, _ = _step(s, {"r2": list(yes) + [2]})
    assert so.structured_output_request_ids == {"r2": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows,bm_rows", [([0, 1, 2, 3], [0, 1, 2, 3]), ([5, 2], [3, 0]), ([6], [1])])
def test_bitmask_masks_only_its_rows_in_place_in_every_dtype(dtype, rows, bm_rows):
    """The in-place kernel path (and the float copy for other dtypes) sets exactly the
    forbidden tokens of the constrained rows to -inf; other rows keep their bits."""
    g = torch.Generator().manual_seed(0)
    V = 49152 + 7  # a logits width past the bitmask's 32-token words: the tail stays as is
    bm = torch.randint(-2**31, 2**31 - 1, (4, 49152 // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(7, V, generator=g).to(dtype)
    expected = logits.clone()
    for r, b in zip(rows, bm_rows):
        allowed = ((bm[b].view(-1, 1) >> torch.arange(32)) & 1).flatten().bool()
        expected[r, :49152][~allowed] = float("-inf")
    apply_grammar_bitmask(logits, bm, rows, bm_rows)
    assert torch.equal(logits, expected)


A_SCHEMA = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                    "additionalProperties": False})


def _answer(s, tok, rid, text, others=None):
    """Drive ``rid`` through ``text`` + EOS, checking each token is allowed by its mask
    (when it has one). Returns (the finishing output or None, bitmask rows seen)."""
    ids = list(tok.encode(text, add_special_tokens=False)) + [2]
    toks = {rid: list(ids), **(others or {})}
    masked = 0
    for _ in range(len(ids)):
        nxt = toks[rid][0]
        so, outs = _step(s, toks)
        if rid in so.structured_output_request_ids:
            masked += 1
            assert nxt in _allowed(so, rid, len(tok)), (text, nxt)
        done = next((o for o in outs if o.request_id == rid and o.finish_reason is not None), None)
    return done, masked


def _wait_compiled(s, req):
    sor = req.structured_output_request
    sor.future and sor.future.result()
    s.has_requests_to_schedule()  # promotes it from waiting_for_fsm


def test_streaming_input_chunk_restarts_the_grammar(tok):
    """Each answer of a streaming-input session starts its grammar over: after a
    complete JSON answer, the next chunk's answer must again start with '{' (a matcher
    left terminated would allow only EOS); a chunk with another constraint compiles its
    grammar first (WAITING_FOR_FSM); a chunk without one runs unconstrained."""
    mgr, s = _setup(tok)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=32, structured_outputs=A_SCHEMA), eos_token_id=2,
                  resumable=True)
    mgr.grammar_init(req)
    s.add_request(req)
    _wait_compiled(s, req)
    first, masked = _answer(s, tok, "r", '{"a": 12}')
    assert masked == len(tok.encode('{"a": 12}', add_special_tokens=False)) + 1
    assert first is None and req.status == RequestStatus.WAITING_FOR_STREAMING_INPUT
    # chunk 2, same params: parked -> resumed with a fresh matcher
    s.update_streaming_request("r", [5, 6], None, final=False)
    assert req.status == RequestStatus.WAITING and req.structured_output_request.grammar.num_processed_tokens == 0
    # chunk 3 (another constraint) is queued before chunk 2 is answered: _continue_session path
    yes_no = SamplingParams(max_tokens=8, structured_outputs=SO(choice=["yes", "no"]))
    s.update_streaming_request("r", [7], yes_no, final=False)
    _, masked = _answer(s, tok, "r", '{"a": 7}')
    assert masked == len(tok.encode('{"a": 7}', add_special_tokens=False)) + 1 and s._num_structured == 1
    assert req.status in (RequestStatus.WAITING_FOR_FSM, RequestStatus.WAITING) and req not in s.running
    _wait_compiled(s, req)
    assert req.structured_output_request.key[0] == "choice"
    so = s.schedule()
    assert so.structured_output_request_ids == {"r": 0}
    allowed = _allowed(so, "r", len(tok))
    assert tok.encode("yes", add_special_tokens=False)[0] in allowed
    assert tok.encode("{", add_special_tokens=False)[0] not in allowed
    s.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"r": tok.encode("no", add_special_tokens=False)[0]}))
    _step(s, {"r": [2]})
    # chunk 4 without a constraint: unconstrained, and no longer counted as structured
    s.update_streaming_request("r", [8], SamplingParams(max_tokens=2), final=True)
    assert req.structured_output_request is None and s._num_structured == 0
    so, _ = _step(s, {"r": [9, 9]})
    assert so.grammar_bitmask is None
    _, outs = _step(s, {"r": [9]})
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH] and s.get_num_unfinished_requests() == 0


def _enum(n, tag):
    """A JSON-schema enum of ``n`` strings: its compile time grows faster than n (SmolLM2,
    one thread, this 2-core machine: 5,000 strings 0.04 s, 20,000 1.3 s, 40,000 3.9 s)."""
    return SO(json={"enum": [f"{tag}-{i}" for i in range(n)]})


BIG = 15000  # ~0.7 s to compile


def _queue_of(mgr):
    return mgr._compile_queue()


def test_small_grammars_compile_while_a_large_one_compiles(tok):
    """Tester log 12: with one compile thread, json_object/choice requests waited behind a
    slow enum. Now the small ones are ready while the large one still compiles, and the
    large one, aborted while it compiles, leaves nothing behind (result dropped, not
    cached), while the engine keeps scheduling."""
    mgr, s = _setup(tok)
    big = _add(mgr, s, "big", 4, _enum(BIG, "a"))
    t0 = time.perf_counter()
    small = [_add(mgr, s, "obj", 4, SO(json_object=True)), _add(mgr, s, "ch", 4, SO(choice=["yes", "no"]))]
    for r in small:
        r.structured_output_request.future.result(timeout=30)
    small_s = time.perf_counter() - t0
    assert not big.structured_output_request.future.done(), small_s  # still compiling
    s.has_requests_to_schedule()
    assert {r.request_id for r in s.waiting} == {"obj", "ch"} and s.waiting_for_fsm == [big]
    q = _queue_of(mgr)
    fut = big.structured_output_request.future
    s.finish_requests(["big"], RequestStatus.FINISHED_ABORTED)
    assert fut.cancelled() and not s.waiting_for_fsm
    big_s = _wait_idle(q) + small_s
    assert q.dropped == 1 and q.compiled == 3
    assert mgr.backend.cached(big.structured_output_request.key) is None
    assert mgr.backend.cached(small[0].structured_output_request.key) is not None
    # The small ones took a fraction of the large compile (measured: ~0.01 s vs ~0.7 s).
    assert small_s < big_s / 3, (small_s, big_s)


def _wait_idle(q, timeout=30.0):
    """Seconds until the queue has no job queued or compiling (fails after timeout)."""
    t0 = time.perf_counter()
    while True:
        with q._cv:
            if not q._jobs:
                return time.perf_counter() - t0
        assert time.perf_counter() - t0 < timeout, "compile queue never went idle"
        time.sleep(0.01)


def test_an_aborted_request_whose_grammar_is_queued_is_never_compiled(tok):
    """One worker: request A's large grammar compiles; B's (another key) waits in the
    queue; B is aborted -> its grammar is never compiled (skipped), and nothing of it is
    cached. A request sharing A's key waits for A's compile (one compile, two matchers)."""
    cfg = SimpleNamespace(structured_outputs_config=StructuredOutputsConfig(max_compile_workers=1),
                          model_config=SimpleNamespace(vocab_size=len(tok), extra_eos_token_ids=()))
    mgr = StructuredOutputManager(cfg, tokenizer=tok)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64, structured_output_manager=mgr)
    a = _add(mgr, s, "a", 4, _enum(BIG, "a"))
    a2 = _add(mgr, s, "a2", 4, _enum(BIG, "a"))
    b = _add(mgr, s, "b", 4, _enum(BIG, "b"))
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    q = _queue_of(mgr)
    assert q.skipped == 1
    a.structured_output_request.future.result(timeout=30)
    a2.structured_output_request.future.result(timeout=30)
    _wait_idle(q)
    assert q.compiled == 1 and q.dropped == 0
    assert mgr.backend.cached(b.structured_output_request.key) is None
    assert mgr.backend.cached(a.structured_output_request.key) is not None
    s.has_requests_to_schedule()
    assert {r.request_id for r in s.waiting} == {"a", "a2"} and not s.waiting_for_fsm
    assert a.structured_output_request.grammar is not a2.structured_output_request.grammar


def test_compile_queue_keeps_a_worker_for_small_grammars():
    """Two workers: a second large grammar waits while one compiles (it may not take the
    last worker), a small one submitted after it runs at once; the large one starts when
    the first ends (first come, first served among the large)."""
    import threading

    from llmserve.structured_output.compile_queue import CompileQueue

    started, release = [], {k: threading.Event() for k in ("L1", "L2", "s")}

    def compile_fn(key):
        started.append(key)
        assert release[key].wait(10)
        return key.lower()

    q = CompileQueue(compile_fn, lambda k, c: None, workers=2, large_bytes=100)
    l1, l2 = q.submit("L1", 500, str.upper), q.submit("L2", 500, str.upper)
    small = q.submit("s", 5, str.upper)
    release["s"].set()
    assert small.result(timeout=5) == "S"
    t0 = time.perf_counter()
    while len(started) < 2 and time.perf_counter() - t0 < 5:
        time.sleep(0.01)
    time.sleep(0.05)  # L2 would start now if it could
    assert sorted(started) == ["L1", "s"] and not l2.done()
    release["L1"].set(), release["L2"].set()
    assert (l1.result(timeout=5), l2.result(timeout=5)) == ("L1", "L2") and started[2:] == ["L2"]
    q.shutdown()
