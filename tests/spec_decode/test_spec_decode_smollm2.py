"""Greedy output with n-gram speculation equals the output without it, token for token,
on the real SmolLM2-135M-Instruct (float32, row-invariant GEMMs) over 200 chat prompts
of the edit/rewrite and chat workloads, all in one batch (issue 31). Slow (make test-all);
its cheap twin is tests/spec_decode/test_spec_decode_engine.py on a tiny random Llama."""
from __future__ import annotations

import pytest

from llmserve.benchmarks.spec_datasets import chat_messages, edit_messages


def _conversations(n: int) -> list[list[dict]]:
    msgs = edit_messages(n // 2) + chat_messages(n - n // 2)
    return [[{"role": "user", "content": f"{m[0]['content']}\\n\\n(Request {i}.)"}] for i, m in enumerate(msgs)]


@pytest.mark.slow
def test_smollm2_greedy_200_prompts_same_with_speculation():
    from llmserve import LLM, SamplingParams

    convs = _conversations(200)
    sp = SamplingParams(temperature=0.0, max_tokens=64)
    kw = dict(dtype="float32", multiprocess_mode=False, kv_cache_memory="512MiB", max_model_len=1024,
              batch_invariant=True)
    base = LLM("SmolLM2-135M-Instruct", **kw)
    ref = [o.outputs[0].token_ids for o in base.chat(convs, sp, use_tqdm=False)]
    base.shutdown()
    spec = LLM("SmolLM2-135M-Instruct", speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}, **kw)
    got = [o.outputs[0].token_ids for o in spec.chat(convs, sp, use_tqdm=False)]
    totals = spec.llm_engine.engine_core.engine_core.scheduler.spec.totals
    assert totals.num_accepted_tokens > 200  # drafts were made and accepted
    assert [i for i, (a, b) in enumerate(zip(ref, got)) if a != b] == []
