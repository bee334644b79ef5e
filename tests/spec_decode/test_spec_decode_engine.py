"""n-gram speculative decoding end to end on a tiny random Llama (float32, in process):
greedy and seeded outputs, logprobs and stop strings are the same with and without
speculation, in mixed batches (rows that do not draft), with chunked prefill and with
preemption; drafts are really made and accepted, and the KV blocks balance afterwards."""
from __future__ import annotations

import random

import pytest

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
NEW = 48


def _prompts():
    """Repetitive token-id prompts (the random model falls into loops, so drafts are
    accepted) and two plain random ones."""
    rng = random.Random(0)
    out = []
    for i in range(6):
        base = [rng.randrange(100, 20000) for _ in range(6 + i)]
        out.append({"prompt_token_ids": base * 4 + base[:3]})
    for n in (20, 37):
        out.append({"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(n)]})
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, save_tiny_model_fn):
    path = str(tmp_path_factory.mktemp("spec_tiny_llama"))
    save_tiny_model_fn("llama", path, seed=3)
    return path


def _llm(path, spec, **kw):
    from llmserve import LLM

    return LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               kv_cache_memory="64MiB", max_model_len=256, batch_invariant=True, speculative_config=spec, **kw)


def _sched(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _params():
    """Per prompt: greedy, greedy with logprobs, seeded sampling, a penalty row (never
    drafts), min_tokens + a stop token."""
    from llmserve import SamplingParams

    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3), dict(temperature=0.8, top_p=0.95, seed=7),
             dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=1.0, seed=11, min_tokens=10)]
    tail = [dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=1.0, seed=7),
            dict(temperature=1.0, seed=7, logprobs=1)]  # the rejecting prompts
    kinds = [kinds[i % len(kinds)] for i in range(8)] + tail
    return [SamplingParams(max_tokens=NEW, ignore_eos=True, **kinds[i]) for i in range(len(PROMPTS))]


def _summary(outs):
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [sorted((t, round(lp.logprob, 4)) for t, lp in d.items())
                                               for d in c.logprobs]
        rows.append((tuple(c.token_ids), c.finish_reason, lps))
    return rows


def _rejecting_prompts(llm):
    """Prompts whose drafts the model rejects: the random model's greedy text is a loop of
    one token ``x``, and these prompts hold n-grams ending in ``x`` followed by other
    tokens; and prompts copying a seeded sample of the nearly flat model, whose next
    samples are close to but not always equal to the copy."""
    from llmserve import SamplingParams

    x = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    greedy = [{"prompt_token_ids": [x, x, x, 999, 1000, 5, x, 777, 888, 3, 5]},
              {"prompt_token_ids": [8, x, 4, 4, 4, 8, x, x, 6, 8]}]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    r = list(llm.generate(PROMPTS[2:3], sp, use_tqdm=False)[0].outputs[0].token_ids)
    return greedy + [{"prompt_token_ids": [9] + r}, {"prompt_token_ids": r[:20] + [5, 6] + r}]


@pytest.fixture(scope="module")
def reference(tiny_path):
    llm = _llm(tiny_path, None)
    PROMPTS.extend(_rejecting_prompts(llm))
    outs = _summary(llm.generate(PROMPTS, _params(), use_tqdm=False))
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], _params()[:2], use_tqdm=False)]
    return llm, outs, texts


@pytest.fixture(scope="module")
def spec_llm(tiny_path):
    return _llm(tiny_path, SPEC)


def test_same_outputs_with_speculation_in_a_mixed_batch(reference, spec_llm):
    _, ref, _ = reference
    spec = _sched(spec_llm).spec
    before = spec.totals.num_accepted_tokens
    assert _summary(spec_llm.generate(PROMPTS, _params(), use_tqdm=False)) == ref
    t = spec.totals
    assert t.num_accepted_tokens - before > NEW  # drafts were made and accepted
    assert t.num_accepted_tokens < t.num_draft_tokens  # and some rejected (rolled back)
    assert sum(t.num_accepted_tokens_per_pos) == t.num_accepted_tokens
    kv = _sched(spec_llm).kv_cache_manager
    assert not kv.req_to_blocks and kv.num_used_blocks == 0  # every block came back


def test_same_outputs_with_chunked_prefill_and_preemption(reference, tiny_path):
    _, ref, _ = reference
    llm = _llm(tiny_path, SPEC, max_num_batched_tokens=16, num_gpu_blocks_override=24, enable_prefix_caching=False)
    assert _summary(llm.generate(PROMPTS, _params(), use_tqdm=False)) == ref
    sched = _sched(llm)
    assert sched.num_preemptions_total > 0 and sched.spec.totals.num_accepted_tokens > 0


def test_stop_string_inside_a_multi_token_step(reference, spec_llm):
    """A stop string completed by an accepted draft ends the output at that token, as
    when tokens come one per step."""
    from llmserve import SamplingParams

    ref_llm, _, texts = reference
    for text in texts:
        stop = text[len(text) // 2:len(text) // 2 + 6]
        sp = SamplingParams(temperature=0.0, max_tokens=NEW, stop=[stop])
        i = texts.index(text)
        a = ref_llm.generate([PROMPTS[i]], sp, use_tqdm=False)[0].outputs[0]
        b = spec_llm.generate([PROMPTS[i]], sp, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.stop_reason) == (a.text, a.token_ids, a.stop_reason)
        assert a.stop_reason == stop


def test_max_tokens_and_max_model_len_are_exact(reference, spec_llm):
    from llmserve import SamplingParams

    ref_llm, _, _ = reference
    for max_tokens in (1, 2, 5, 9):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = spec_llm.generate(PROMPTS[:3], sp, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [max_tokens] * 3
        assert _summary(out) == _summary(ref_llm.generate(PROMPTS[:3], sp, use_tqdm=False))
    long = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] * 6}  # near max_model_len (256)
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    a = ref_llm.generate([long], sp, use_tqdm=False)[0]
    b = spec_llm.generate([long], sp, use_tqdm=False)[0]
    assert _summary([b]) == _summary([a]) and len(a.prompt_token_ids) + len(a.outputs[0].token_ids) == 256


def test_spec_decode_metrics_reach_prometheus(spec_llm):
    """The engine's per-step SpecDecodingStats cross the process boundary (msgspec) and
    become vLLM's vllm:spec_decode_* counters."""
    import msgspec

    from llmserve import SamplingParams
    from llmserve.engine.messages import EngineCoreOutputs
    from llmserve.metrics.prometheus import PrometheusStatLogger

    sched = _sched(spec_llm)
    seen, make = [], sched.make_stats
    sched.make_stats = lambda: seen.append(make()) or seen[-1]
    try:
        before = (sched.spec.totals.num_drafts, sched.spec.totals.num_accepted_tokens)
        spec_llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    finally:
        sched.make_stats = make
    wire = [msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreOutputs(outputs=[], scheduler_stats=s)),
                                   type=EngineCoreOutputs).scheduler_stats for s in seen]
    prom = PrometheusStatLogger(spec_llm.llm_engine.vllm_config)
    for s in wire:
        prom.record(s, None)
    value = lambda name, **kw: prom.registry.get_sample_value(name, {"model_name": prom.model_name, "engine": "0", **kw})
    drafts = sched.spec.totals.num_drafts - before[0]
    accepted = sched.spec.totals.num_accepted_tokens - before[1]
    assert drafts > 0 and value("vllm:spec_decode_num_drafts_total") == drafts
    assert value("vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert value("vllm:spec_decode_num_draft_tokens_total") >= accepted
    assert sum(value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) or 0
               for p in range(SPEC["num_speculative_tokens"])) == accepted
