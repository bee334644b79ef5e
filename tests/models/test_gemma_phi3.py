"""Gemma 2, Gemma 3 (text) and Phi-3 over the paged KV cache vs transformers, float32.

Tiny random checkpoints built from the HF config classes with every quirk switched on:
sliding windows of 8 tokens (prompts run to 30-100), Gemma 2's attention and final soft
caps set low enough to bite, Gemma 3's q/k norms with a local RoPE base and linear scaling
on the global layers, Phi-3's partial rotary (0.75) and LongRoPE factors with an original
context of 32 (so the engine's 64-token answers cross onto the long factors).
"""
from __future__ import annotations

import random

import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model

ARCHS = ["gemma2", "gemma3", "phi3"]
ATOL = 1e-4
VOCAB = 49152  # SmolLM2's tokenizer serves the engine tests
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_config(arch: str):
    """A small config of ``arch`` with its quirks on (see the module docstring)."""
    import transformers as tf
    if arch == "gemma2":
        return tf.Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8,
                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8,
                                   query_pre_attn_scalar=24, sliding_window_pattern=2,
                                   rope_local_base_freq=100.0, rope_theta=10000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0})
    if arch == "phi3":
        return tf.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False,
                             original_max_position_embeddings=32, partial_rotary_factor=0.75,
                             rope_scaling={"rope_type": "longrope",
                                           "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [1.0 + 0.5 * i for i in range(6)]},
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(arch)


def save_tiny(arch: str, path: str, seed: int = 0):
    """Write a random ``arch`` checkpoint (norm weights perturbed); return the HF model."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory, model_config_fn):
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    hf = save_tiny(request.param, path)
    resolved = resolve_model(path)
    ours = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    return request.param, ours, hf, path


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_chunked_prefill_and_decodes_beyond_window_match_hf(tiny, tokens_fn, step_runner_cls, use_kernel,
                                                            monkeypatch):
    """A's prompt whole, B's in two chunks (the second past the window), then batched
    decodes to 30 tokens: every position's logits within 1e-4 of HF's full forward."""
    arch, ours, hf, path = tiny
    if not use_kernel:
        from llmserve.ops import cpu_ops
        monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    seqs = {"a": tokens_fn(30, 2), "b": tokens_fn(30, 3)}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    runner = step_runner_cls(ours)
    done = {"a": 0, "b": 0}

    def check(out):
        for rid, logits in out.items():
            n = logits.shape[0]
            torch.testing.assert_close(logits, refs[rid][done[rid]:done[rid] + n], atol=ATOL, rtol=1e-4,
                                       msg=lambda m: f"{arch}/{rid} at {done[rid]}: {m}")
            done[rid] += n

    check(runner.step([("a", seqs["a"][:17]), ("b", seqs["b"][:5])]))
    check(runner.step([("a", seqs["a"][17:18]), ("b", seqs["b"][5:20])]))
    while any(done[r] < 30 for r in seqs):
        check(runner.step([(r, seqs[r][done[r]:done[r] + 1]) for r in seqs if done[r] < 30]))


def test_quirks_are_exercised(tiny, tokens_fn, step_runner_cls):
    """The checkpoint's windows, soft caps and long factors change the logits (so the
    comparisons above would catch them being wrong)."""
    arch, ours, hf, path = tiny
    attn = ours.model.layers[0].self_attn.attn
    assert attn.sliding_window == 8
    if arch == "gemma2":
        assert attn.logits_soft_cap == 2.0 and ours.final_logit_softcapping == 3.0
    if arch == "gemma3":
        assert ours.model.layers[1].self_attn.attn.sliding_window is None
        assert not torch.equal(ours.rotary_emb["sliding_attention"].inv_freq,
                               ours.rotary_emb["full_attention"].inv_freq)
    if arch == "phi3":
        assert ours.rotary_emb.rotary_dim == 12
    prompt = tokens_fn(20, 5)
    base = step_runner_cls(ours).step([("a", prompt)])["a"]
    for layer in ours.model.layers:
        layer.self_attn.attn.sliding_window = None
    try:
        assert (step_runner_cls(ours).step([("a", prompt)])["a"] - base).abs().max() > 1e-3
    finally:
        for i, layer in enumerate(ours.model.layers):
            layer.self_attn.attn.sliding_window = 8 if arch != "gemma3" or i % 2 == 0 else None


def test_phi3_long_prompt_uses_long_factors(tiny, tokens_fn, step_runner_cls):
    """A 48-token prompt (> original_max_position_embeddings 32) runs on the long factors
    and the attention factor, as HF's forward over it."""
    arch, ours, hf, path = tiny
    if arch != "phi3":
        pytest.skip("LongRoPE is Phi-3's")
    prompt = tokens_fn(48, 6)
    got = step_runner_cls(ours).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)
    short = hf_logits(hf, prompt[:32])
    assert (got[:32] - short).abs().max() > 1e-3  # the factors differ


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, one cached forward per token. (Not ``generate``: on
    Phi-3 past original_max_position_embeddings it does not reproduce the model's own
    cached forward, a 7e-3 logit gap measured at the switch to the long factors.)"""
    ids = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for j in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[len(prompt) + j]]))
    return ids


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    from llmserve import LLM

    arch, ours, hf, path = tiny
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", max_num_batched_tokens=32, block_size=16)
    yield llm
    llm.shutdown()


def test_engine_greedy_64_tokens_alone_and_batched(tiny, tiny_llm):
    """64 greedy tokens through the engine (chunked prefill: 32-token steps; prompts of 5
    to 45 tokens), alone and four at once, equal transformers' generate."""
    from llmserve import SamplingParams

    arch, ours, hf, path = tiny
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 45, 17, 30)]
    refs = [hf_greedy(hf, p, 64) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batched = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, out in enumerate(batched):
        assert list(out.outputs[0].token_ids) == refs[i], f"{arch} prompt {i} (batched)"
    alone = tiny_llm.generate({"prompt_token_ids": prompts[1]}, sp, use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == refs[1], f"{arch} (alone)"
