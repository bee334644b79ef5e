"""Sliding-window KV freeing through the whole engine, on the tiny Mistral checkpoint
(window 8 on both layers, float32): the blocks the window has left are freed while a long
request runs, greedy tokens still equal transformers', a re-sent conversation hits the
prefix cache with null blocks before its last window and continues the same way; which
models free (every layer windowed) and that a KV connector turns it off."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from llmserve.attention.backend import PagedAttention
from llmserve.engine.core import _kv_sliding_window
from llmserve.worker.kv_cache_groups import layout_for_model
from llmserve.worker.model_runner import ModelRunner

BS, WINDOW, PROMPT, NEW = 16, 8, 40, 64


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation, one full forward per token, and each chosen
    token's log_softmax."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(logits.argmax()))
            lps.append(float(torch.log_softmax(logits, -1)[ids[-1]]))
    return ids[len(prompt):], lps


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, save_tiny_model_fn):
    from llmserve import LLM

    path = str(tmp_path_factory.mktemp("swa_mistral"))
    hf = save_tiny_model_fn("mistral", path, seed=3)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="16MiB", max_num_batched_tokens=32, block_size=BS)
    llm.path = path
    yield llm, hf
    llm.shutdown()


def test_long_request_holds_only_its_window_and_matches_transformers(mistral, monkeypatch):
    """A 40-token prompt (chunked 32 + 8) and 64 greedy tokens: 104 tokens span 7 blocks,
    but at most 2 are held at once (the current 16-token block and the one before it,
    which the 8-token window of the current block's first token reaches), and usage
    with them; the tokens equal transformers' greedy ones, their logprobs within 1e-4."""
    from llmserve import SamplingParams

    llm, hf = mistral
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    kv = sched.kv_cache_manager
    assert kv.sliding_window == WINDOW
    held, usage = [], []
    schedule = sched.schedule

    def spy():
        out = schedule()
        held.append(kv.num_used_blocks)
        usage.append(sched.make_stats().kv_cache_usage)
        return out

    monkeypatch.setattr(sched, "schedule", spy)
    prompt = [random.Random(5).randrange(3, 49152) for _ in range(PROMPT)]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    answer = list(out.token_ids)
    ref, ref_lps = hf_greedy(hf, prompt, NEW)
    assert answer == ref
    lps = [lp[t].logprob for lp, t in zip(out.logprobs, answer)]
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    assert len(held) >= NEW and max(held) == 2, held
    assert max(usage) == pytest.approx(2 / (kv.pool.num_blocks - 1))
    assert kv.num_used_blocks == 0

    # Re-sent with the first 50 answer tokens: 89 tokens may hit 5 blocks (80 tokens);
    # token 80's window needs only block 4, which is cached: blocks 0-3 are null.
    monkeypatch.setattr(sched, "schedule", schedule)
    again = llm.generate({"prompt_token_ids": prompt + answer[:50]},
                         SamplingParams(temperature=0.0, max_tokens=NEW - 50, ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens == 80
    assert list(again.outputs[0].token_ids) == answer[50:]
    assert kv.pool.blocks[0].ref_cnt == 0 and kv.pool.blocks[0].block_hash is None


class _Layer(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.attn = PagedAttention(4, 16, 2, 0.25, sliding_window=window)


def _config(num_layers: int, kv_transfer_config=None, pp: int = 1) -> SimpleNamespace:
    mc = SimpleNamespace(is_encoder_only=False, is_encoder_decoder=False, num_layers=num_layers)
    return SimpleNamespace(model_config=mc, kv_transfer_config=kv_transfer_config,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pp))


@pytest.mark.parametrize("windows,expected,groups", [((8, 8), 8, [8]), ((4, 8), 8, [8]), ((8, None), None, [None, 8]),
                                                     ((None, None), None, [None])],
                         ids=["mistral", "mixed-windows", "gemma-hybrid", "full"])
def test_only_models_windowed_on_every_layer_free_blocks(windows, expected, groups):
    """The one window the KV cache frees by is the largest of the layers', only when every
    layer has one; Gemma 2/3's global layers read every block, so such a model gets a
    full-attention KV cache group beside its windowed one (worker/kv_cache_groups.py)."""
    model = nn.ModuleList(_Layer(w) for w in windows)
    runner = SimpleNamespace(model=model, config=_config(len(windows)))
    assert ModelRunner.kv_cache_sliding_window(SimpleNamespace(kv_cache_layout=lambda: layout_for_model(
        runner.model, runner.config))) == expected
    assert layout_for_model(model, runner.config).group_windows == groups
    # A KV connector or pipeline stages: one group, nothing freed for the hybrid model.
    ktc = SimpleNamespace(is_kv_transfer_instance=True)
    assert layout_for_model(model, _config(len(windows), ktc)).group_windows == [expected]
    assert layout_for_model(model, _config(len(windows), pp=2)).group_windows == [expected]


def test_kv_connector_keeps_every_block():
    """Connectors save and load whole prefixes block by block: with one, nothing is freed."""
    executor = SimpleNamespace(kv_cache_sliding_window=lambda: 8)
    assert _kv_sliding_window(executor, SimpleNamespace(kv_transfer_config=None)) == 8
    ktc = SimpleNamespace(is_kv_transfer_instance=True)
    assert _kv_sliding_window(executor, SimpleNamespace(kv_transfer_config=ktc)) is None


def test_beams_forked_past_the_window_equal_transformers(mistral, monkeypatch):
    """Width-3 beams on a 40-token prompt for 12 tokens: the forks share the null blocks
    and the window's blocks (the scheduler frees block 0-1 as the beams pass 48 tokens)
    and copy the partial one; beams and cumulative logprobs equal transformers', and
    every block returns."""
    from llmserve.beam_search import BeamSearchParams
    from tests.engine.test_beam_search import assert_same_beams, hf_beams

    llm, hf = mistral
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, beams_on_null = sched.schedule, []

    def spy():
        out = schedule()
        beams_on_null.append(sum(1 for x in out.scheduled if x.block_ids[:2] == [0, 0]))
        return out

    monkeypatch.setattr(sched, "schedule", spy)
    prompt = [random.Random(9).randrange(3, 49152) for _ in range(PROMPT)]
    out = llm.beam_search([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.5))[0]
    assert_same_beams(out, hf_beams(hf, prompt, 3, 12, 0.5, False, eos=-1), PROMPT, "mistral beams")
    assert max(beams_on_null) == 3  # all three beams ran with blocks 0-1 freed
    kv = sched.kv_cache_manager
    assert kv.num_used_blocks == 0 and kv.pool.blocks[0].ref_cnt == 0


def test_ngram_drafts_past_the_window_keep_greedy_tokens(mistral, monkeypatch):
    """n-gram speculative decoding (4 drafts) on the same checkpoint: drafted steps run
    with the window's early blocks freed (rejected drafts' blocks trimmed), and the 64
    tokens equal the engine's greedy answer without drafts."""
    from llmserve import LLM, SamplingParams

    base, _ = mistral
    prompt = [random.Random(5).randrange(3, 49152) for _ in range(PROMPT)]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    want = list(base.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids)
    llm = LLM(base.path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="16MiB", max_num_batched_tokens=32, block_size=BS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4})
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        schedule, drafted_on_null = sched.schedule, []

        def spy():
            out = schedule()
            drafted_on_null.extend(x.spec_token_ids for x in out.scheduled if x.spec_token_ids and x.block_ids[0] == 0)
            return out

        monkeypatch.setattr(sched, "schedule", spy)
        got = list(llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids)
        assert got == want and drafted_on_null
        assert sched.kv_cache_manager.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_cache_smaller_than_max_model_len_serves_a_windowed_model(mistral):
    """7 usable 16-token blocks (112 tokens) with max_model_len 512: the engine refuses
    that for a model with a full-attention layer (33 blocks needed, test_async_llm), but
    the window needs ceil((32 + 8) / 16) + 3 = 6 (32-token steps); a 60 + 64-token
    request (124 tokens, 8 blocks' worth) runs and answers as in a large cache."""
    from llmserve import LLM, SamplingParams

    base, _ = mistral
    prompt = [random.Random(8).randrange(3, 49152) for _ in range(60)]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    want = list(base.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids)
    llm = LLM(base.path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              num_gpu_blocks_override=8, max_model_len=512, max_num_batched_tokens=32, block_size=BS)
    try:
        got = list(llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids)
        assert got == want
    finally:
        llm.shutdown()
