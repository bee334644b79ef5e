"""KV cache groups for hybrid models through the whole engine, float32: tiny random Gemma 2
(sliding and full layers alternate, 4 layers) and Gemma 3 (2 sliding per full one, 6
layers) checkpoints with an 8-token window and 8-token blocks. The full-attention group
keeps every block, the windowed groups only their window's (measured per group while a
request runs); greedy tokens equal transformers' and prompt and answer logprobs are within
1e-4 of its fp32 log_softmax at positions far past the window, alone and batched; a re-sent
conversation hits the prefix cache past the window and continues the same way; preemption,
beams, n-gram drafts and sleep mode keep the answers (Gemma 3)."""
from __future__ import annotations

import random

import pytest
import torch

from llmserve.core.kv_cache_manager import max_window_blocks
from llmserve.worker.kv_cache_groups import plan_kv_cache_layout
from tests.models.test_gemma_phi3 import COMMON
from tests.models.tiny_arch import hf_logits, save_random

BS, WINDOW, PROMPT, NEW, STEP = 8, 8, 40, 64, 32
VOCAB = COMMON["vocab_size"]


def tiny_config(arch: str):
    import transformers as tf
    if arch == "gemma2":
        return tf.Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    return tf.Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
                               query_pre_attn_scalar=24, sliding_window_pattern=3, rope_local_base_freq=100.0,
                               rope_theta=10000.0)


def _perturb(name: str, p: torch.Tensor) -> None:
    if "norm" in name:
        p.add_(torch.randn_like(p) * 0.1)
    if ".q_proj." in name or ".k_proj." in name:
        p.mul_(8.0)  # sharp attention: a wrong window or a wrong block shows in the logits


def _engine(path: str, **kw):
    from llmserve import LLM
    return LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               max_num_batched_tokens=STEP, block_size=BS, **{"kv_cache_memory": "16MiB", **kw})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``get(arch) -> (LLM, HF model)``: each checkpoint written and served once."""
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            path = str(tmp_path_factory.mktemp(f"hybrid_{arch}"))
            hf = save_random(tiny_config(arch), path, 0, _perturb)
            llm = _engine(path)
            llm.path, llm.arch = path, arch
            built[arch] = (llm, hf)
        return built[arch]
    yield get
    for llm, _ in built.values():
        llm.shutdown()


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, engines):
    return engines(request.param)


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_layout_groups_and_shared_kv_tensors(gemma):
    """Gemma 2's 4 layers: one full and one windowed group of 2 layers; Gemma 3's 6 (2
    full, 4 windowed): one full and two windowed groups of 2. Either way 2 KV tensors,
    each shared by one layer of every group, and a block is 2 layers' K/V."""
    llm, _ = gemma
    runner = _core(llm).model_runner
    groups = [None, WINDOW] if llm.arch == "gemma2" else [None, WINDOW, WINDOW]
    assert _core(llm).scheduler.kv_cache_manager.group_windows == groups
    assert runner.kv_cache_group_windows() == groups
    assert len({id(t) for t in runner.kv_caches}) == 2 and len(runner.kv_caches) == (4 if llm.arch == "gemma2" else 6)
    assert runner.kv_cache_bytes_per_block() == 2 * 2 * BS * 2 * 16 * 4
    layers = runner.model.model.layers
    for layer, kv in zip(layers, runner.kv_caches):
        attn = layer.self_attn.attn
        assert (attn.kv_cache_group == 0) == (attn.sliding_window is None)
        assert sum(1 for lay, other in zip(layers, runner.kv_caches)
                   if other is kv and lay.self_attn.attn.kv_cache_group == attn.kv_cache_group) == 1


def test_layout_of_real_gemma_shapes():
    """Gemma 3 1B (26 layers, every 6th full): 4 layers a group, one full group and six
    windowed ones (the last of 2 layers); Gemma 2 2B (26 alternating): 13 a group."""
    g3 = plan_kv_cache_layout([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert g3.num_slots == 4 and g3.group_windows == [None] + [512] * 6
    assert g3.layer_group[5] == 0 and g3.layer_slot[23] == 3 and g3.layer_group[25] == 6
    g2 = plan_kv_cache_layout([4096 if i % 2 == 0 else None for i in range(26)])
    assert g2.num_slots == 13 and g2.group_windows == [None, 4096]
    assert plan_kv_cache_layout([None, 8], hybrid=False).group_windows == [None]


def _spy_held(monkeypatch, llm, held: dict) -> None:
    """Record, after each schedule, every group's blocks per request and whether it decodes."""
    sched = _core(llm).scheduler
    kv, schedule = sched.kv_cache_manager, sched.schedule

    def spy():
        out = schedule()
        for s in out.scheduled:
            held.setdefault(s.request.request_id, []).append(
                (s.num_scheduled_tokens == 1, kv.group_num_used_blocks(s.request.request_id)))
        return out

    monkeypatch.setattr(sched, "schedule", spy)


def _assert_matches_hf(hf, prompt, out, what: str) -> None:
    """Answer tokens are HF's greedy ones (each the argmax after the tokens before it);
    answer logprobs (and prompt logprobs when asked) within 1e-4 of HF's fp32
    log_softmax, past the window."""
    answer = list(out.outputs[0].token_ids)
    lps = torch.log_softmax(hf_logits(hf, prompt + answer[:-1]), -1)
    assert lps[len(prompt) - 1:].argmax(-1).tolist() == answer, what
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, answer)]
    want = [float(lps[len(prompt) - 1 + i, t]) for i, t in enumerate(answer)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, what
    if out.prompt_logprobs is None:
        return
    got_p = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    want_p = [float(lps[i, t]) for i, t in enumerate(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got_p, want_p)) < 1e-4, what


def test_groups_hold_their_blocks_and_answers_equal_transformers(gemma, monkeypatch):
    """A 40-token prompt (32 + 8) and 64 greedy tokens, alone then batched with 5- and
    45-token prompts: 104 tokens are 13 blocks, all held by the full group at the end; a
    windowed group holds at most 2 while decoding (the current block and the one the
    window of its first token reaches) and at most ceil((32 + 8) / 8) + 3 in a prefill
    step; every block returns. Then the conversation is re-sent with 50 answer tokens:
    an 88-token hit (the full group's 11 blocks, the windows' last block; 10 null blocks
    in each windowed table) and the same continuation."""
    from llmserve import SamplingParams

    llm, hf = gemma
    kv = _core(llm).scheduler.kv_cache_manager
    held: dict = {}
    _spy_held(monkeypatch, llm, held)
    prompt = _prompt(5, PROMPT)
    # Alone without prompt logprobs (a request that asks for them skips the prefix cache).
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    alone = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    _assert_matches_hf(hf, prompt, alone, f"{llm.arch} alone")
    steps = next(iter(held.values()))
    assert steps[-1][1][0] == 13
    assert max(h[g] for dec, h in steps if dec for g in range(1, len(h))) == 2
    assert max(h[g] for _, h in steps for g in range(1, len(h))) <= max_window_blocks(WINDOW, BS, STEP)
    assert kv.num_used_blocks == 0

    held.clear()
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompts = [_prompt(6, 5), prompt, _prompt(7, 45)]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, batch)):
        _assert_matches_hf(hf, p, out, f"{llm.arch} batched {i}")
    assert list(batch[1].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert all(max(h[g] for dec, h in steps if dec for g in range(1, len(h))) == 2 for steps in held.values())
    assert kv.num_used_blocks == 0

    monkeypatch.undo()
    sched = _core(llm).scheduler
    tables, schedule = [], sched.schedule

    def spy():
        out = schedule()
        tables.extend(s.group_block_ids for s in out.scheduled)
        return out

    monkeypatch.setattr(sched, "schedule", spy)
    answer = list(alone.outputs[0].token_ids)
    again = llm.generate({"prompt_token_ids": prompt + answer[:50]},
                         SamplingParams(temperature=0.0, max_tokens=NEW - 50, ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens == 88
    assert list(again.outputs[0].token_ids) == answer[50:]
    first = tables[0]
    assert 0 not in first[0] and all(t[:10] == [0] * 10 and 0 not in t[10:] for t in first[1:])


def test_preemption_beams_drafts_and_sleep_keep_the_answers(engines):
    """On Gemma 3's groups: two 104-token requests in a 33-block cache (each needs 13
    full + 2 x 2 windowed blocks while decoding) preempt and recompute and answer as in a
    large cache; width-3 beams past the window equal transformers'; n-gram drafts (4)
    keep the greedy tokens; after sleep and wake-up the same answer again (the reloaded
    model's layers read their groups' tables)."""
    from llmserve import SamplingParams
    from llmserve.beam_search import BeamSearchParams
    from tests.engine.test_beam_search import assert_same_beams, hf_beams

    base, hf = engines("gemma3")
    prompts = [_prompt(11, PROMPT), _prompt(12, PROMPT)]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in base.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                  use_tqdm=False)]
    out = base.beam_search([{"prompt_token_ids": prompts[0]}],
                           BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.5))[0]
    assert_same_beams(out, hf_beams(hf, prompts[0], 3, 12, 0.5, False, eos=-1), PROMPT, "gemma3 beams")
    assert _core(base).scheduler.kv_cache_manager.num_used_blocks == 0

    small = _engine(base.path, num_gpu_blocks_override=34, max_model_len=128)
    try:
        got = [list(o.outputs[0].token_ids) for o in small.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                     use_tqdm=False)]
        assert got == want and _core(small).scheduler.num_preemptions_total >= 1
    finally:
        small.shutdown()

    spec = _engine(base.path, enable_sleep_mode=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4})
    try:
        rep = prompts[0][:20] * 2  # repeats: the n-gram proposer drafts
        want_rep = list(base.generate({"prompt_token_ids": rep}, sp, use_tqdm=False)[0].outputs[0].token_ids)
        assert list(spec.generate({"prompt_token_ids": rep}, sp, use_tqdm=False)[0].outputs[0].token_ids) == want_rep
        assert _core(spec).scheduler.spec is not None
        spec.sleep(1)
        spec.wake_up()
        assert list(spec.generate({"prompt_token_ids": prompts[1]}, sp, use_tqdm=False)[0].outputs[0].token_ids) \
            == want[1]
    finally:
        spec.shutdown()
