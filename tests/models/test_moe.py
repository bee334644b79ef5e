"""Sparse MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache vs transformers, float32.

Tiny random checkpoints written by transformers' own model classes (``save_pretrained``: the
on-disk per-expert names, Mixtral's ``block_sparse_moe.experts.{e}.w1|w2|w3``): 2 layers, 8
experts, top-2; Qwen2-MoE with its sigmoid-gated shared expert and ``norm_topk_prob`` on;
Qwen3-MoE with ``norm_topk_prob`` off and its first layer dense (``mlp_only_layers``), so
both normalisations and both layer kinds run.
"""
from __future__ import annotations

import random

import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model
from llmserve.models import moe

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
ATOL = 1e-4
VOCAB = 49152  # SmolLM2's tokenizer serves the engine test
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              num_hidden_layers=2, num_experts_per_tok=2, tie_word_embeddings=False)


def tiny_config(arch: str):
    import transformers as tf
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=8)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=48, norm_topk_prob=True,
                                 shared_expert_intermediate_size=32)
    return tf.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=48, head_dim=16,
                             norm_topk_prob=False, mlp_only_layers=[0])


def save_tiny(arch: str, path: str, seed: int = 0):
    """Write a random ``arch`` checkpoint (router scaled up so the top-2 choice is sharp and
    varies by token); return the HF model."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
            built[arch] = (path, save_tiny(arch, path))
        return built[arch]
    return get


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, checkpoints, model_config_fn):
    path, hf = checkpoints(request.param)
    resolved = resolve_model(path)
    ours = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    return request.param, ours, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_checkpoint_names_and_layers(tiny):
    """Mixtral's on-disk expert names load (8 experts per sparse layer); Qwen2-MoE has its
    shared expert; Qwen3-MoE's layer 0 is dense and routes without renormalising."""
    arch, ours, hf = tiny
    last = ours.model.layers[-1].mlp
    assert isinstance(last, moe.SparseMoeBlock) and len(last.experts) == 8 and last.top_k == 2
    assert last.renormalize == (arch != "qwen3_moe")
    assert (last.shared_expert is not None) == (arch == "qwen2_moe")
    assert isinstance(ours.model.layers[0].mlp, moe.SparseMoeBlock) == (arch != "qwen3_moe")


def test_chunked_prefill_and_batched_decodes_match_hf(tiny, tokens_fn, step_runner_cls):
    """A's prompt whole, B's in two chunks, then batched decodes to 24 tokens: every
    position's logits within 1e-4 of HF's full forward."""
    arch, ours, hf = tiny
    seqs = {"a": tokens_fn(24, 2), "b": tokens_fn(24, 3)}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    runner = step_runner_cls(ours)
    done = {"a": 0, "b": 0}

    def check(out):
        for rid, logits in out.items():
            n = logits.shape[0]
            torch.testing.assert_close(logits, refs[rid][done[rid]:done[rid] + n], atol=ATOL, rtol=1e-4,
                                       msg=lambda m: f"{arch}/{rid} at {done[rid]}: {m}")
            done[rid] += n

    check(runner.step([("a", seqs["a"][:13]), ("b", seqs["b"][:5])]))
    check(runner.step([("a", seqs["a"][13:14]), ("b", seqs["b"][5:16])]))
    while any(done[r] < 24 for r in seqs):
        check(runner.step([(r, seqs[r][done[r]:done[r] + 1]) for r in seqs if done[r] < 24]))


def test_grouped_equals_token_loop_and_routing_matters(tiny, tokens_fn, step_runner_cls, monkeypatch):
    """The grouped-by-expert path equals the one-pair-at-a-time loop; and the routing is
    exercised: several experts get tokens, and forcing expert 0 changes the logits."""
    arch, ours, hf = tiny
    prompt = tokens_fn(20, 5)
    grouped = step_runner_cls(ours).step([("a", prompt)])["a"]
    monkeypatch.setattr(moe, "MOE_IMPL", "token_loop")
    looped = step_runner_cls(ours).step([("a", prompt)])["a"]
    torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)
    block = ours.model.layers[-1].mlp
    x = torch.randn(20, 64)
    _, ids = moe.route(block.gate.forward(x), 2, block.renormalize)
    assert len(set(ids.flatten().tolist())) >= 4
    monkeypatch.setattr(moe, "route", lambda logits, k, r: (torch.full((logits.shape[0], k), 1.0 / k),
                                                            torch.arange(k).expand(logits.shape[0], k)))
    monkeypatch.setattr(moe, "MOE_IMPL", "grouped")
    assert (step_runner_cls(ours).step([("a", prompt)])["a"] - grouped).abs().max() > 1e-3


def test_bad_top_k_is_a_clear_error():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe.SparseMoeBlock(8, 8, 4, 5, True, "silu", torch.float32)


@pytest.fixture(scope="module", params=["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                                pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def tiny_llm(request, checkpoints):
    """(arch, engine, HF model); the Qwen-MoE engine runs are in test-all (its layers' logits are
    checked above in make test)."""
    from llmserve import LLM

    arch = request.param
    path, hf = checkpoints(arch)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", max_num_batched_tokens=32, block_size=16)
    yield arch, llm, hf
    llm.shutdown()


def test_engine_greedy_48_tokens_alone_and_batched(tiny_llm):
    """48 greedy tokens through the engine (chunked prefill, prompts of 5 to 40 tokens),
    batched and alone, are transformers' greedy ones: one HF forward over prompt + answer
    must give every answer token as the argmax after the tokens before it."""
    from llmserve import SamplingParams

    arch, llm, hf = tiny_llm
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, out in enumerate(batched):
        answer = list(out.outputs[0].token_ids)
        logits = hf_logits(hf, prompts[i] + answer[:-1])[len(prompts[i]) - 1:]
        assert logits.argmax(-1).tolist() == answer, f"{arch} prompt {i} (batched)"
    alone = llm.generate({"prompt_token_ids": prompts[1]}, sp, use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == list(batched[1].outputs[0].token_ids), f"{arch} (alone)"
