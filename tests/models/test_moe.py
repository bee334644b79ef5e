"""Sparse MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache vs transformers, float32.

Tiny random checkpoints written by transformers' own model classes (``save_pretrained``: the
on-disk per-expert names, Mixtral's ``block_sparse_moe.experts.{e}.w1|w2|w3``): 2 layers, 8
experts, top-2; Qwen2-MoE with its sigmoid-gated shared expert and ``norm_topk_prob`` on;
Qwen3-MoE with ``norm_topk_prob`` off and its first layer dense (``mlp_only_layers``), so
both normalisations and both layer kinds run. As GGUF files (Mixtral; Qwen2-MoE / Qwen3-MoE as
llama.cpp's ``qwen2moe`` / ``qwen3moe``, every layer sparse, routing normalised as llama.cpp
does) they must give the same logits as transformers on the file's weights.
"""
from __future__ import annotations

import random

import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model
from llmserve.models import moe
from llmserve.models.llama import Linear
from tests.models.tiny_arch import (assert_chunked_steps_match_hf, checkpoints_fixture, finish_gguf, gguf_writer,
                                    hf_logits, load_ours, save_random, tiny_engine)

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
ATOL = 1e-4
VOCAB = 49152  # SmolLM2's tokenizer serves the engine test
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              num_hidden_layers=2, num_experts_per_tok=2, tie_word_embeddings=False)


# The Qwen-MoE checkpoints written as GGUF files: every layer sparse and the routing
# normalisation llama.cpp hard-codes (qwen2moe: off, qwen3moe: on), experts 64 wide (the rows
# of ffn_down_exps must be whole 32-value Q8_0 blocks); Qwen3-MoE's heads 32 wide, not
# hidden / heads (as Qwen3-30B-A3B's 128 against 2048 / 32): attention.key_length says so.
GGUF_QWEN = {"qwen2moe": ("qwen2_moe", dict(norm_topk_prob=False, moe_intermediate_size=64)),
             "qwen3moe": ("qwen3_moe", dict(norm_topk_prob=True, moe_intermediate_size=64, mlp_only_layers=[],
                                            head_dim=32))}


def tiny_config(arch: str):
    import transformers as tf
    if arch in GGUF_QWEN:
        base, changes = GGUF_QWEN[arch]
        cfg = tiny_config(base)
        for key, value in changes.items():
            setattr(cfg, key, value)
        return cfg
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
    def perturb(name: str, p: torch.Tensor) -> None:
        if name.endswith("mlp.gate.weight"):
            p.mul_(20.0)
    return save_random(tiny_config(arch), path, seed, perturb)


checkpoints = checkpoints_fixture(save_tiny)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, checkpoints, model_config_fn):
    path, hf = checkpoints(request.param)
    return request.param, load_ours(path, model_config_fn), hf


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
    assert_chunked_steps_match_hf(arch, ours, hf, tokens_fn, step_runner_cls, 24, 13, (5, 16), ATOL)


def test_grouped_equals_token_loop_and_routing_matters(tiny, tokens_fn, step_runner_cls, monkeypatch):
    """The grouped-by-expert path equals the one-pair-at-a-time loop; and the routing is
    exercised: several experts get tokens, and forcing expert 0 changes the logits."""
    arch, ours, hf = tiny
    prompt = tokens_fn(12, 5)
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
    llm, hf = tiny_engine(checkpoints, request.param)
    yield request.param, llm, hf
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


# ---- Mixtral as a GGUF file (llama.cpp's layout: llama architecture + expert_count) ----

_GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate": "ffn_gate_inp"}
_GGUF_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf q/k row permutation (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf):
    """(llama.cpp name, float32 array) of the Mixtral checkpoint: experts stacked [E, out, in]."""
    cfg, sd = hf.config, {k: v.float().numpy() for k, v in hf.state_dict().items()}
    out = [("token_embd.weight", sd["model.embed_tokens.weight"]), ("output_norm.weight", sd["model.norm.weight"]),
           ("output.weight", sd["lm_head.weight"])]
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        for part, g in _GGUF_PARTS.items():
            w = sd[p + part + ".weight"]
            if part == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
            out.append((f"blk.{L}.{g}.weight", w))
        gu, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]  # transformers 5's fused form
        i = cfg.intermediate_size
        out += [(f"blk.{L}.ffn_gate_exps.weight", gu[:, :i]), (f"blk.{L}.ffn_up_exps.weight", gu[:, i:]),
                (f"blk.{L}.ffn_down_exps.weight", down)]
    return out


def write_mixtral_gguf(hf, path: str, qtype: str) -> None:
    """Write ``hf`` as llama.cpp writes Mixtral (weights other than norms in ``qtype``)."""
    import gguf
    import numpy as np
    cfg = hf.config
    w = gguf_writer(path, "llama", cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    for name, arr in _gguf_tensors(hf):
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr), t), raw_dtype=t)
    finish_gguf(w)


@pytest.mark.parametrize("qtype", [pytest.param("F32", marks=pytest.mark.slow), "Q8_0"])
def test_mixtral_gguf_matches_hf_on_its_weights(checkpoints, tmp_path, tokens_fn, step_runner_cls, model_config_fn,
                                                qtype):
    """Mixtral written as llama.cpp does (``llama`` architecture with ``expert_count``, 3-D
    ``ffn_*_exps`` stacks, ``ffn_gate_inp`` router) loads as Mixtral, and its logits equal
    transformers' on the file's (round-tripped) weights within 1e-4 in float32 (weights
    dequantized); in bfloat16 every linear, each expert's too, runs the file's blocks
    (packed, dense copies freed), within 0.1."""
    import copy

    import gguf
    path, hf = checkpoints("mixtral")
    gpath = str(tmp_path / f"mixtral-{qtype}.gguf")
    write_mixtral_gguf(hf, gpath, qtype)
    resolved = resolve_model(gpath)
    config = load_hf_config(resolved)
    assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 8
    assert config.num_experts_per_tok == 2
    model = get_model(model_config_fn(resolved, config, "float32"))
    assert isinstance(model, moe.MixtralForCausalLM)
    ref = copy.deepcopy(hf)
    if qtype != "F32":
        t = gguf.GGMLQuantizationType[qtype]
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), t), t)))
    prompt = tokens_fn(24, 8)
    runner = step_runner_cls(model)
    got = torch.cat([runner.step([("a", prompt[:16])])["a"]] + [runner.step([("a", [t])])["a"] for t in prompt[16:]])
    want = hf_logits(ref, prompt)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    if qtype == "Q8_0":  # bfloat16, the GGUF default: every linear runs its blocks, the experts' too
        bf16 = get_model(model_config_fn(resolved, config, "bfloat16"))
        linears = {n: m for n, m in bf16.named_modules() if isinstance(m, Linear)}
        experts = [n for n in linears if ".mlp.experts." in n]
        assert len(experts) == 2 * 8 * config.num_hidden_layers  # gate_up and down of 8 experts a layer
        unpacked = [n for n, m in linears.items() if m.qweight is None or m.weight.numel()]
        assert unpacked == [], f"dense (not run from the file's blocks): {unpacked}"
        assert (step_runner_cls(bf16).step([("a", prompt)])["a"] - want).abs().max() < 0.1


# ---- Qwen2-MoE / Qwen3-MoE as GGUF files (llama.cpp's qwen2moe / qwen3moe architectures) ----

_QWEN_GGUF_PARTS = {**_GGUF_PARTS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def _qwen_gguf_tensors(hf):
    """(llama.cpp name, float32 array) of a Qwen-MoE checkpoint as convert_hf_to_gguf.py
    names them: q/k rows not permuted (only ``llama`` is), q/k/v biases and q/k norms kept,
    the shared expert's gate 1-D ``[hidden]`` (llama.cpp's ``{n_embd}``), experts stacked."""
    cfg, sd = hf.config, {k: v.float().numpy() for k, v in hf.state_dict().items()}
    out = [("token_embd.weight", sd["model.embed_tokens.weight"]), ("output_norm.weight", sd["model.norm.weight"]),
           ("output.weight", sd["lm_head.weight"])]
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        for part, g in _QWEN_GGUF_PARTS.items():
            for suffix in ("weight", "bias"):
                arr = sd.get(f"{p}{part}.{suffix}")
                if arr is not None:
                    out.append((f"blk.{L}.{g}.{suffix}", arr.reshape(-1) if g == "ffn_gate_inp_shexp" else arr))
        gu, down, i = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"], cfg.moe_intermediate_size
        out += [(f"blk.{L}.ffn_gate_exps.weight", gu[:, :i]), (f"blk.{L}.ffn_up_exps.weight", gu[:, i:]),
                (f"blk.{L}.ffn_down_exps.weight", down)]
    return out


def write_qwen_moe_gguf(hf, path: str, arch: str, qtype: str) -> None:
    """Write ``hf`` as llama.cpp's converter writes a ``qwen2moe`` / ``qwen3moe`` file (the
    weights it quantizes in ``qtype``)."""
    import gguf
    import numpy as np
    cfg = hf.config
    w = gguf_writer(path, arch, cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    for name, arr in _qwen_gguf_tensors(hf):
        # convert_hf_to_gguf.py writes 1-D tensors (norms, biases, the shared expert's gate) and
        # the routers (FFN_GATE_INP) in F32 whatever the file's type; llama-quantize leaves them so
        if arr.ndim == 1 or qtype == "F32" or ".ffn_gate_inp." in name:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr), t), raw_dtype=t)
    finish_gguf(w)


def _round_tripped(hf, qtype: str):
    """A copy of ``hf`` whose weights the file quantizes are quantized and dequantized."""
    import copy

    import gguf
    ref = copy.deepcopy(hf)
    if qtype != "F32":
        t = gguf.GGMLQuantizationType[qtype]
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if p.ndim >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), t), t)))
    return ref


@pytest.mark.parametrize("qtype", [pytest.param("F32", marks=pytest.mark.slow), "Q8_0"])
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_qwen_moe_gguf_matches_hf_on_its_weights(checkpoints, tmp_path, tokens_fn, step_runner_cls, model_config_fn,
                                                 arch, qtype):
    """A Qwen2-MoE / Qwen3-MoE checkpoint written as llama.cpp's converter does (its router and
    the shared expert's 1-D gate in F32) loads with the experts' widths and llama.cpp's routing
    normalisation, and its float32 logits equal transformers' on the file's round-tripped
    weights within 1e-4 (prefill, then decodes); in bfloat16 every linear but those F32 ones
    runs the file's blocks, each expert's too, within 0.1."""
    hf = checkpoints(arch)[1]
    gpath = str(tmp_path / f"{arch}-{qtype}.gguf")
    write_qwen_moe_gguf(hf, gpath, arch, qtype)
    resolved = resolve_model(gpath)
    config = load_hf_config(resolved)
    assert config.architectures == [type(hf).__name__] and config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.moe_intermediate_size == 64 and config.norm_topk_prob == (arch == "qwen3moe")
    if arch == "qwen2moe":
        assert config.shared_expert_intermediate_size == 32
    else:
        assert config.head_dim == 32
    model = get_model(model_config_fn(resolved, config, "float32"))
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(b, moe.SparseMoeBlock) and b.renormalize == (arch == "qwen3moe") for b in blocks)
    assert all((b.shared_expert is not None) == (arch == "qwen2moe") for b in blocks)
    prompt = tokens_fn(24, 8)
    want = hf_logits(_round_tripped(hf, qtype), prompt)
    runner = step_runner_cls(model)
    got = torch.cat([runner.step([("a", prompt[:16])])["a"]] + [runner.step([("a", [t])])["a"] for t in prompt[16:]])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    if qtype == "Q8_0":  # bfloat16, the GGUF default
        bf16 = get_model(model_config_fn(resolved, config, "bfloat16"))
        linears = {n: m for n, m in bf16.named_modules() if isinstance(m, Linear)}
        assert len([n for n in linears if ".mlp.experts." in n]) == 2 * 8 * config.num_hidden_layers
        unpacked = sorted(n for n, m in linears.items() if m.qweight is None or m.weight.numel())
        f32_linears = ("gate", "shared_expert_gate") if arch == "qwen2moe" else ("gate",)
        floats = sorted(f"model.layers.{L}.mlp.{g}" for L in range(config.num_hidden_layers) for g in f32_linears)
        assert unpacked == floats, "only the F32 routers and shared-expert gates may run dense"
        assert (step_runner_cls(bf16).step([("a", prompt)])["a"] - want).abs().max() < 0.1


def test_qwen_moe_gguf_widths_fallback_and_unsupported_moe_refused(tmp_path):
    """Without ``expert_feed_forward_length`` (files converted before llama.cpp took it) the
    widths are llama.cpp's fallbacks; a MoE architecture llmserve does not run (DeepSeek-V2's
    ``deepseek2``) is refused naming it and listing the supported ones, the Qwen-MoE ones too."""
    import gguf
    import transformers as tf

    from llmserve.model_loader.gguf_config import complete_gguf_config
    path = str(tmp_path / "old-qwen2moe.gguf")
    w = gguf.GGUFWriter(path, "qwen2moe")
    w.add_feed_forward_length(960)
    w.add_expert_used_count(4)
    finish_gguf(w)
    config = complete_gguf_config(tf.Qwen2MoeConfig(), path)  # its defaults: 1408 and 5632
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (240, 960)
    assert config.norm_topk_prob is False
    path = str(tmp_path / "deepseek2.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_expert_count(64)
    finish_gguf(w)
    with pytest.raises(ValueError, match=r"GGUF architecture 'deepseek2'.*supported GGUF architectures.*"
                                         r"'qwen2moe'.*'qwen3moe'"):
        load_hf_config(resolve_model(path))
