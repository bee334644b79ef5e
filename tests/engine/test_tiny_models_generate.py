"""Whole-engine greedy generation on tiny random Llama, Mistral, Qwen2 and Qwen3
checkpoints against transformers, float32: 8 prompts x 32 new tokens, alone and batched,
and the sampled-token logprobs against transformers' log_softmax. (8 prompts, not 16: the
reference's full forward per token was most of the ~8 s per architecture.)"""
from __future__ import annotations

import random

import pytest
import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NUM_PROMPTS, NEW_TOKENS = 8, 32


def hf_greedy_with_logprobs(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (full forward each step, no stopping) and the
    log_softmax of each chosen token."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt):], lps


@pytest.fixture(scope="module", params=ARCHS)
def tiny_llm(request, tmp_path_factory, save_tiny_model_fn):
    """(arch, llmserve LLM on the tiny checkpoint, transformers model, prompts)."""
    from llmserve import LLM

    path = str(tmp_path_factory.mktemp(f"gen_{request.param}"))
    hf = save_tiny_model_fn(request.param, path, seed=7)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(NUM_PROMPTS)]
    # The tiny checkpoints share SmolLM2's vocabulary size, so its tokenizer serves them.
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", max_num_batched_tokens=64, block_size=16)
    yield request.param, llm, hf, prompts
    llm.shutdown()


def test_greedy_and_logprobs_match_transformers(tiny_llm):
    from llmserve import SamplingParams

    arch, llm, hf, prompts = tiny_llm
    refs = [hf_greedy_with_logprobs(hf, p, NEW_TOKENS) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, (out, (ref_ids, ref_lps)) in enumerate(zip(batched, refs)):
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref_ids, f"{arch} prompt {i}: batched greedy differs from transformers"
        got_lps = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lps, ref_lps)) < 1e-3, f"{arch} prompt {i}"
    for i in (0, 7):  # and alone
        alone = llm.generate({"prompt_token_ids": prompts[i]}, sp, use_tqdm=False)[0]
        assert list(alone.outputs[0].token_ids) == refs[i][0]
