"""Greedy outputs and logprobs of llmserve vs Hugging Face transformers on the same
weights (float32), alone, batched, with/without prefix caching, chunked prefill and
forced preemption."""
import math

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=32)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_hf_one_by_one_and_batched(llm_fp32, hf_greedy):
    alone = [llm_fp32.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    assert alone == [hf_greedy[p] for p in PROMPTS[:4]]
    batched = _tokens(llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert batched == [hf_greedy[p] for p in PROMPTS]


@pytest.mark.slow  # ~5 s; batched = alone: test_200_concurrent_requests_match_alone, prefix cache: tests/core; `make test-all`
def test_greedy_batch_of_64_with_and_without_prefix_cache(llm_fp32, hf_greedy):
    prompts = PROMPTS * 4  # repeated prompts exercise prefix-cache hits
    llm_fp32.reset_prefix_cache()
    outs = llm_fp32.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy[p] for p in prompts]
    text = [o.outputs[0].text for o in outs]
    tok = llm_fp32.get_tokenizer()
    assert text == [tok.decode(t, skip_special_tokens=True) for t in _tokens(outs)]


def test_prefix_cache_hits_give_the_same_greedy_output(llm_fp32, hf_model):
    tok = llm_fp32.get_tokenizer()
    prefix = ("You are a helpful assistant who answers questions about geography in great detail, "
              "with names of cities, rivers and mountains, and you always stay polite.\n")
    prompts = [prefix + "What is the capital of Italy?", prefix + "Name a river in Egypt."]
    sp = SamplingParams(temperature=0, max_tokens=12)
    llm_fp32.reset_prefix_cache()
    first = llm_fp32.generate(prompts[0], sp, use_tqdm=False)[0]
    second = llm_fp32.generate(prompts, sp, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in second)
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    ids = tok.encode(prompts[1])
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, len(ids):]
    assert second[1].outputs[0].token_ids == ref.tolist()


@pytest.fixture(scope="module")
def llm_tight():
    """Chunked prefill at a 32-token budget, no prefix caching, and a KV cache too small
    for the batch (forces preemption)."""
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False, max_num_batched_tokens=32,
              enable_prefix_caching=False, num_gpu_blocks_override=24, max_model_len=128)
    yield llm
    llm.shutdown()


def test_greedy_under_chunked_prefill_and_preemption(llm_tight, hf_greedy):
    long_prompt = " ".join(PROMPTS[:6])  # > 32 tokens: split over several steps
    outs = llm_tight.generate(PROMPTS + [long_prompt], GREEDY, use_tqdm=False)
    assert _tokens(outs)[:-1] == [hf_greedy[p] for p in PROMPTS]
    stats = llm_tight.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_used_blocks"] == 0


def test_logprobs_match_hf_log_softmax(llm_fp32, hf_model):
    tok = llm_fp32.get_tokenizer()
    p = PROMPTS[1]
    out = llm_fp32.generate(p, SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
                            use_tqdm=False)[0]
    ids = tok.encode(p) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for i in range(1, n_prompt):
        t = ids[i]
        lp = out.prompt_logprobs[i][t]
        assert abs(lp.logprob - ref[i - 1, t].item()) < 1e-3
        assert lp.rank == int((ref[i - 1] > ref[i - 1, t]).sum()) + 1
        assert len(out.prompt_logprobs[i]) in (2, 3)
    for j, d in enumerate(out.outputs[0].logprobs):
        t = out.outputs[0].token_ids[j]
        row = ref[n_prompt + j - 1]
        assert abs(d[t].logprob - row[t].item()) < 1e-3 and d[t].rank == 1
        top = torch.topk(row, 3)
        assert set(d) == set(top.indices.tolist())
        for tid, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[tid].logprob - v) < 1e-3
    cum = sum(d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    assert math.isclose(out.outputs[0].cumulative_logprob, cum, abs_tol=1e-4)


def test_seeded_sampling_same_alone_and_in_batch(llm_fp32):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm_fp32.generate(PROMPTS[2], sp, use_tqdm=False)[0].outputs[0].text
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batch = llm_fp32.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:6], [others, others, sp, others, others, others],
                              use_tqdm=False)
    assert batch[2].outputs[0].text == alone


def test_n_fans_out_with_distinct_reproducible_seeds(llm_fp32):
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16)
    a = llm_fp32.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    b = llm_fp32.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    texts = [o.text for o in a.outputs]
    assert texts == [o.text for o in b.outputs]
    assert len(set(texts)) > 1


def test_outputs_in_input_order_and_token_id_prompts(llm_fp32, hf_greedy):
    tok = llm_fp32.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS[:3]]
    outs = llm_fp32.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy[p] for p in PROMPTS[:3]]
    assert outs[0].prompt is None and outs[0].prompt_token_ids == tok.encode(PROMPTS[0])
    per_prompt = llm_fp32.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=2),
                                                 SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [2, 5]
    assert [o.outputs[0].finish_reason for o in per_prompt] == ["length", "length"]


@pytest.fixture(scope="module")
def llm_mp():
    """LLM with the EngineCore in a child process (SyncMPClient, the default); the two tests
    below share it (one start), the second shuts it down."""
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="128MiB", max_model_len=512)
    yield llm
    llm.shutdown()


def test_llm_over_sync_mp_client_matches_in_process(llm_mp, hf_greedy):
    """LLM over SyncMPClient gives the same greedy tokens; utility calls work (its shutdown
    ending the child: the next test)."""
    outs = llm_mp.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy[p] for p in PROMPTS[:4]]
    stats = llm_mp.llm_engine.get_stats()
    assert stats["num_used_blocks"] == 0 and stats["num_running_reqs"] == 0
    assert llm_mp.llm_engine.engine_core.resources.proc.is_alive()


def test_llm_shutdown_is_prompt_and_engine_exits_by_itself(llm_mp, engine_exit_watch):
    """LLM (SyncMPClient) shutdown delivers SHUTDOWN: the engine exits 0 on its own, well
    within the 5 s it would get before SIGTERM."""
    import time

    proc = llm_mp.llm_engine.engine_core.resources.proc
    with engine_exit_watch(proc) as watch:  # SIGTERM/SIGKILL would fail it
        assert llm_mp.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
        t0 = time.monotonic()
        llm_mp.shutdown()
        elapsed = time.monotonic() - t0
    watch.assert_exited_by_itself()
    assert elapsed < 2.0, elapsed
    assert not proc.is_alive()


def test_idle_kv_prefault_keeps_cached_blocks(hf_greedy):
    """The idle engine's prefault (MADV_POPULATE_WRITE over the KV cache) leaves blocks in
    use untouched: a prompt whose KV is in the prefix cache before the prefault gives the
    same greedy tokens after it, and the whole cache ends up resident."""
    from llmserve import LLM

    # Within the 32 MiB prefault headroom, so the whole cache gets prefaulted while idle.
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False, kv_cache_memory="30MiB",
              max_model_len=512)
    try:
        prompt = " ".join(PROMPTS[:6])  # several full 16-token blocks
        first = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.engine_core.engine_core.model_runner
        assert runner._kv_prefault_next == 0
        calls = 0
        while runner.prefault_kv(budget_bytes=8 << 20):
            calls += 1
        assert calls >= 2 and runner._kv_prefault_next == runner._kv_num_blocks  # done, in chunks
        again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens > 0  # served from the cached blocks...
        assert again.outputs[0].token_ids == first  # ...which the prefault did not change
        assert llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy[PROMPTS[2]]
    finally:
        llm.shutdown()
