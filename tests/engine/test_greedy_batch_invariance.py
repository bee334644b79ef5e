"""Issue 10.6: greedy decoding in bfloat16 gives the same tokens alone, in a batch, with a
warm prefix cache and at a 64-token step budget with ``batch_invariant=True`` (``--batch-invariant``).
Without it, oneDNN's bf16 GEMMs round a row differently at 1 row than at >= 2 rows, and
SmolLM2's greedy text alone vs in a batch of four diverged after ~20 tokens."""
from __future__ import annotations

import pytest

from llmserve.benchmarks.seed_repro import seeded_prompts

PROMPTS = seeded_prompts(4)
NEW_TOKENS = 40


LONG = PROMPTS[0] + " Keep it under five hundred words and mention dates." * 6  # > 64 tokens


def _llm(**kw):
    from llmserve import LLM

    return LLM(dtype="bfloat16", multiprocess_mode=False, kv_cache_memory="64MiB", max_model_len=256,
               batch_invariant=True, **kw)


def _greedy_ids(llm, prompts) -> list[tuple[int, ...]]:
    from llmserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm_bf16():
    llm = _llm()
    yield llm
    del llm


@pytest.fixture(scope="module")
def alone(llm_bf16):
    """Each of PROMPTS + [LONG] run by itself on a cold cache."""
    out = []
    for p in PROMPTS + [LONG]:
        llm_bf16.reset_prefix_cache()
        out.append(_greedy_ids(llm_bf16, [p])[0])
    return out


def test_bf16_greedy_tokens_do_not_depend_on_the_batch(llm_bf16, alone):
    llm_bf16.reset_prefix_cache()
    assert _greedy_ids(llm_bf16, PROMPTS) == alone[:4]  # one batch, cold cache
    assert _greedy_ids(llm_bf16, PROMPTS) == alone[:4]  # every prompt a prefix-cache hit
    assert _greedy_ids(llm_bf16, PROMPTS[::-1]) == alone[3::-1]  # other batch slots


def test_bf16_greedy_tokens_at_a_64_token_budget(alone):
    chunked = _llm(max_num_batched_tokens=64, enable_prefix_caching=False)
    # LONG runs in chunks of <= 64 tokens beside the others' prefills and decodes
    assert _greedy_ids(chunked, PROMPTS + [LONG]) == alone


def test_logprobs_with_and_without_a_prefix_cache_hit_are_equal(llm_bf16):
    """C37/C40 with the invariant path: exact equality (the default path allows ~1e-4)."""
    from llmserve import SamplingParams

    llm_bf16.reset_prefix_cache()
    p = PROMPTS[1] + " Answer in three paragraphs, each one about a different century."
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    cold, warm = (llm_bf16.generate([p], sp, use_tqdm=False)[0] for _ in range(2))
    assert warm.num_cached_tokens > 0 and cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert cold.outputs[0].logprobs == warm.outputs[0].logprobs
    plp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    short, longer = (llm_bf16.generate([q], plp, use_tqdm=False)[0] for q in (p, p + " zulu zulu"))
    n = len(short.prompt_token_ids)
    assert short.prompt_logprobs[1:] == longer.prompt_logprobs[1:n]
