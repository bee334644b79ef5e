"""Gemma 2, Gemma 3 (text) and Phi-3 over the paged KV cache vs transformers, float32.

Tiny random checkpoints built from the HF config classes with every quirk switched on:
sliding windows of 8 tokens (prompts run to 30-100), Gemma 2's attention and final soft
caps set low enough to bite, Gemma 3's q/k norms with a local RoPE base and linear scaling
on the global layers, Phi-3's partial rotary (0.75) and LongRoPE factors with an original
context of 32 (so the engine's 64-token answers cross onto the long factors).
"""
from __future__ import annotations

import copy
import math
import random
from typing import Optional

import numpy as np
import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model
from tests.models.tiny_arch import (assert_chunked_steps_match_hf, checkpoints_fixture, finish_gguf, gguf_writer,
                                    hf_logits, load_ours, save_random, tiny_engine)

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
    """Write a random ``arch`` checkpoint (norm weights perturbed, q/k scaled up); return
    the HF model."""
    def perturb(name: str, p: torch.Tensor) -> None:
        if "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
        if any(f".{x}_proj." in name for x in ("q", "k", "qkv")):
            p.mul_(8.0)  # attention scores of a few units: the soft cap of 2 bites
    return save_random(tiny_config(arch), path, seed, perturb)


checkpoints = checkpoints_fixture(save_tiny)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, checkpoints, model_config_fn):
    path, hf = checkpoints(request.param)
    return request.param, load_ours(path, model_config_fn), hf, path


@pytest.mark.parametrize("use_kernel", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["kernel", "torch"])
def test_chunked_prefill_and_decodes_beyond_window_match_hf(tiny, tokens_fn, step_runner_cls, use_kernel,
                                                            monkeypatch):
    """A's prompt whole, B's in two chunks (the second past the window), then batched
    decodes to 30 tokens: every position's logits within 1e-4 of HF's full forward."""
    arch, ours, hf, path = tiny
    if not use_kernel:
        from llmserve.ops import cpu_ops
        monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    assert_chunked_steps_match_hf(arch, ours, hf, tokens_fn, step_runner_cls, 30, 17, (5, 20), ATOL)


def test_quirks_are_exercised(tiny, tokens_fn, step_runner_cls):
    """The checkpoint's windows, soft caps and long factors change the logits (so the
    comparisons above would catch them being wrong)."""
    arch, ours, hf, path = tiny
    attn = ours.model.layers[0].self_attn.attn
    assert attn.sliding_window == 8
    if arch == "gemma2":
        assert attn.logits_soft_cap == 2.0 and ours.final_logit_softcapping == 3.0
        for layer in ours.model.layers:
            layer.self_attn.attn.logits_soft_cap = None
        try:
            uncapped = step_runner_cls(ours).step([("a", tokens_fn(20, 5))])["a"]
        finally:
            for layer in ours.model.layers:
                layer.self_attn.attn.logits_soft_cap = 2.0
        assert (uncapped - step_runner_cls(ours).step([("a", tokens_fn(20, 5))])["a"]).abs().max() > 1e-3
    if arch == "gemma3":
        assert ours.model.layers[1].self_attn.attn.sliding_window is None
        assert not torch.equal(ours.rotary_emb["sliding_attention"].inv_freq,
                               ours.rotary_emb["full_attention"].inv_freq)
    if arch == "phi3":
        assert ours.rotary_emb.rotary_dim == 12
    prompt = tokens_fn(20, 5)
    base = step_runner_cls(ours).step([("a", prompt)])["a"]
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    for layer in ours.model.layers:
        layer.self_attn.attn.sliding_window = None
    try:
        assert (step_runner_cls(ours).step([("a", prompt)])["a"] - base).abs().max() > 1e-3
    finally:
        for layer, window in zip(ours.model.layers, windows):
            layer.self_attn.attn.sliding_window = window


def test_whole_long_prompt_matches_hf(tiny, tokens_fn, step_runner_cls):
    """A 48-token prompt in one step (6 windows long) equals HF's forward; on Phi-3 it is
    longer than original_max_position_embeddings (32), so it runs on the long factors and
    the attention factor."""
    arch, ours, hf, path = tiny
    prompt = tokens_fn(48, 6)
    got = step_runner_cls(ours).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)
    if arch == "phi3":
        assert (got[:32] - hf_logits(hf, prompt[:32])).abs().max() > 1e-3  # the factors differ


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


@pytest.fixture(scope="module", params=[pytest.param("gemma2", marks=pytest.mark.slow), "gemma3", "phi3"])
def tiny_llm(request, checkpoints):
    """(arch, engine on the checkpoint, HF model); Gemma 2's engine run is in test-all (its
    layers are Gemma 3's minus q/k norms; its soft caps are checked by the logits tests)."""
    llm, hf = tiny_engine(checkpoints, request.param)
    yield request.param, llm, hf
    llm.shutdown()


@pytest.mark.parametrize("lens", [(5, 45), pytest.param((5, 45, 17, 30, 9, 38), marks=pytest.mark.slow)],
                         ids=["2", "6"])
def test_engine_greedy_64_tokens_alone_and_batched(tiny_llm, lens):
    """64 greedy tokens through the engine (chunked prefill: 32-token steps; prompts of 5
    to 45 tokens), alone and batched, equal transformers' greedy decoding. For Gemma the
    check is one HF forward over prompt + answer: every answer token must be HF's argmax
    after the tokens before it, which by induction makes the answer HF's greedy one
    (a cached HF loop costs ~0.1 s a token for Gemma here). Phi-3 runs HF's cached loop: its
    forward over a whole sequence past 32 tokens uses the long factors everywhere."""
    from llmserve import SamplingParams

    arch, llm, hf = tiny_llm
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, out in enumerate(batched):
        assert_hf_greedy(arch, hf, prompts[i], list(out.outputs[0].token_ids), f"{arch} prompt {i} (batched)")
    alone = llm.generate({"prompt_token_ids": prompts[1]}, sp, use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == list(batched[1].outputs[0].token_ids), f"{arch} (alone)"


def assert_hf_greedy(arch: str, hf, prompt: list[int], answer: list[int], what: str) -> None:
    """``answer`` is transformers' greedy continuation of ``prompt``."""
    if arch == "phi3":
        assert answer == hf_greedy(hf, prompt, len(answer)), what
        return
    logits = hf_logits(hf, prompt + answer[:-1])[len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == answer, what


# ---- the same checkpoints as GGUF files (llama.cpp's names and metadata) ----

_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GGUF_NORMS = {"gemma": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                         "post_feedforward_layernorm": "post_ffw_norm"},
               "phi3": {"post_attention_layernorm": "ffn_norm"}}


def gguf_name(arch: str, hf_name: str) -> str:
    """HF parameter name -> llama.cpp tensor name (convert_hf_to_gguf.py's mapping)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, suffix = rest.rsplit(".", 1)
    names = {**_GGUF_BLOCK, **_GGUF_NORMS["phi3" if arch == "phi3" else "gemma"]}
    return f"blk.{layer}.{names[part]}.{suffix}"


def _encode(arr, qtype):
    """(array to write, raw ggml type or None) of ``arr`` in ``qtype`` (norms stay F32)."""
    import gguf
    if arr.ndim == 1 or qtype == "F32":
        return arr.astype("float32"), None
    if qtype == "F16":
        return arr.astype("float16"), None
    return gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype]), gguf.GGMLQuantizationType[qtype]


def round_trip(arr, qtype):
    """``arr`` as the GGUF file holds it, dequantized (float32)."""
    import gguf
    data, raw = _encode(arr, qtype)
    return data.astype("float32") if raw is None else gguf.quants.dequantize(data, raw)


def write_gguf(hf, arch: str, path: str, qtype: str, eot_token_id: Optional[int] = None) -> None:
    """Write ``hf``'s weights as llama.cpp's converter would (``gemma2``/``gemma3``/``phi3``
    architecture keys, Gemma norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, no
    window for an all-global Gemma 3); 2-d weights in ``qtype`` ("F32", "F16" or a ggml quant
    type such as "Q8_0"). Unlike the converter it also writes ``attention.scale`` and Gemma 3's
    ``sliding_window_pattern`` (2): the tiny checkpoints' 24 and 2 are not llama.cpp's defaults
    (its rule's head_dim and 6), which the converter's files leave to the reader."""
    import gguf
    cfg = hf.config
    garch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    w = gguf_writer(path, garch, cfg)
    w.add_name(f"tiny-{garch}")
    w.add_vocab_size(cfg.vocab_size)
    # convert_hf_to_gguf.py writes no window for a Gemma 3 whose layers are all global
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ["sliding_attention"])
    if sliding:
        w.add_sliding_window(cfg.sliding_window)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    if garch.startswith("gemma"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_attention_scale(cfg.query_pre_attn_scalar ** -0.5)
        if garch == "gemma2":
            w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
            w.add_rope_freq_base(full["rope_theta"])
            w.add_float32(f"{garch}.rope.freq_base_swa", local["rope_theta"])
            if sliding:
                w.add_sliding_window_pattern(2)
            if full.get("rope_type") == "linear":
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(full["factor"])
    else:
        rp = cfg.rope_parameters
        w.add_rope_freq_base(rp["rope_theta"])
        w.add_rope_dimension_count(int(16 * rp["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(512 / 32) / math.log(32)))
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = p.float().numpy()
        if garch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1.0
        data, raw = _encode(arr, qtype)
        w.add_tensor(gguf_name(garch, name), data, raw_dtype=raw)
    finish_gguf(w)


def _same(got, want) -> bool:
    """``got`` equals ``want`` (floats to 1e-6, float32 in the file; dicts on want's keys)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(_same(got.get(k), v) for k, v in want.items())
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want)


def test_gguf_copy_matches_its_dequantized_weights(tiny, tmp_path, tokens_fn, step_runner_cls, model_config_fn):
    """The checkpoint written as GGUF (Q8_0; and F16 for Gemma 3) loads with the right
    architecture and quirks (from the metadata), and its logits, beyond the window, equal
    transformers' on the file's dequantized weights within 1e-4."""
    arch = tiny[0]
    for qtype in ("Q8_0", "F16") if arch == "gemma3" else ("Q8_0",):
        _check_gguf_copy(tiny, qtype, tmp_path, tokens_fn, step_runner_cls, model_config_fn)


def _check_gguf_copy(tiny, qtype, tmp_path, tokens_fn, step_runner_cls, model_config_fn):
    arch, ours, hf, path = tiny
    gpath = str(tmp_path / f"{arch}-{qtype}.gguf")
    write_gguf(hf, arch, gpath, qtype)
    resolved = resolve_model(gpath)
    config = load_hf_config(resolved)
    for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "layer_types", "rope_parameters", "original_max_position_embeddings"):
        if hasattr(hf.config, key):
            assert _same(getattr(config, key), getattr(hf.config, key)), key
    model = get_model(model_config_fn(resolved, config, "float32"))
    assert type(model) is type(ours)
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" not in name:
                p.copy_(torch.from_numpy(round_trip(p.numpy(), qtype)))
    prompt = tokens_fn(30, 8)
    runner = step_runner_cls(model)
    got = torch.cat([runner.step([("a", prompt[:20])])["a"]] + [runner.step([("a", [t])])["a"] for t in prompt[20:]])
    want = hf_logits(ref, prompt)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    if qtype == "Q8_0":  # bfloat16, the GGUF default: the blocks run packed (int8 activations)
        bf16 = get_model(model_config_fn(resolved, config, "bfloat16"))
        assert any(getattr(m, "qweight", None) is not None for m in bf16.modules())
        got = step_runner_cls(bf16).step([("a", prompt)])["a"]
        assert (got - want).abs().max() < 0.1  # 0.04-0.06 measured (bf16 and int8 activations)


def test_gemma3_file_without_a_window_has_no_sliding_layer(tmp_path, tokens_fn, step_runner_cls, model_config_fn):
    """An all-global Gemma 3 (``sliding_window_pattern`` 1): llama.cpp's converter writes no
    ``attention.sliding_window`` for it and llama.cpp then runs no sliding layer. From such a
    file every layer is global, on the global RoPE base, and the logits past the unused
    8-token window equal transformers' within 1e-4 (llmserve slid 5 of every 6 layers over
    the config default's 4096 with the local base: off by ~0.3 from the 2nd token)."""
    import transformers as tf
    cfg = tf.Gemma3TextConfig(**{**COMMON, "vocab_size": 1024}, num_hidden_layers=2, head_dim=16, sliding_window=8,
                              query_pre_attn_scalar=16, sliding_window_pattern=1, rope_local_base_freq=100.0,
                              rope_theta=10000.0)
    hf = save_random(cfg, str(tmp_path / "hf"), 0,
                     lambda name, p: p.add_(torch.randn_like(p) * 0.1) if "norm" in name else None)
    gpath = str(tmp_path / "all-global.gguf")
    write_gguf(hf, "gemma3", gpath, "F32")
    resolved = resolve_model(gpath)
    config = load_hf_config(resolved)
    assert config.layer_types == ["full_attention", "full_attention"]
    prompt = tokens_fn(20, 5, vocab=1024)
    got = step_runner_cls(get_model(model_config_fn(resolved, config, "float32"))).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)


def test_gemma3_image_text_checkpoint_serves_its_text_model(tmp_path, tokens_fn, step_runner_cls, model_config_fn):
    """A Gemma3ForConditionalGeneration checkpoint loads as its text model (vision tower and
    projector skipped) and gives the full model's logits on a text-only prompt."""
    import transformers as tf
    text = dict(COMMON, vocab_size=1024, num_hidden_layers=2, head_dim=16, sliding_window=8, sliding_window_pattern=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=1000,
        boi_token_index=1001, eoi_token_index=1002)).eval()
    hf.save_pretrained(str(tmp_path))
    resolved = resolve_model(str(tmp_path))
    config = load_hf_config(resolved)
    assert config.architectures == ["Gemma3ForCausalLM"] and config.num_hidden_layers == 2
    ours = get_model(model_config_fn(resolved, config, "float32"))
    prompt = tokens_fn(20, 9, vocab=999)
    got = step_runner_cls(ours).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)


def test_unsupported_architectures_are_refused_by_name(tmp_path):
    """An HF architecture or a GGUF architecture llmserve cannot run is refused at load,
    naming it and listing the supported ones (issue 30 item 6)."""
    import gguf
    import transformers as tf
    from llmserve.models import get_model_class

    cfg = tf.Gemma3Config()  # no architectures: try a made-up one
    cfg.architectures = ["Gemma3nForConditionalGeneration"]
    with pytest.raises(ValueError, match=r"Gemma3nForConditionalGeneration.*supported.*Gemma2ForCausalLM.*Phi3ForCausalLM"):
        get_model_class(cfg)
    path = str(tmp_path / "olmoe.gguf")
    w = gguf.GGUFWriter(path, "olmoe")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'olmoe'.*supported GGUF architectures.*gemma2.*phi3"):
        load_hf_config(resolve_model(path))


def test_gguf_end_of_turn_tokens_stop_generation(tiny, tmp_path):
    """GGUF files stop at the end-of-turn tokens llama.cpp recognises by text (Phi's <|end|>,
    <|endoftext|>; Gemma's <end_of_turn>) and at tokenizer.ggml.eot_token_id, besides their
    EOS (issue 30 item 4). End to end on Phi-3: the token the tiny model picks first is
    the file's eot_token_id, and the answer stops there."""
    import gguf
    from llmserve import LLM, SamplingParams
    from llmserve.model_loader.gguf_config import gguf_eos_token_ids

    arch, ours, hf, path = tiny
    garch = "gemma3" if arch == "gemma3" else arch
    meta_only = str(tmp_path / "meta.gguf")
    w = gguf.GGUFWriter(meta_only, garch)
    w.add_token_list(["a", "<end_of_turn>", "<|end|>", "b", "<|endoftext|>", "c"])
    w.add_eot_token_id(5)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    assert gguf_eos_token_ids(meta_only) == (1, 2, 4, 5)
    if arch != "phi3":
        return
    prompt = list(range(100, 120))
    first = int(hf_logits(hf, prompt)[-1].argmax())
    gpath = str(tmp_path / f"{arch}-eot.gguf")
    write_gguf(hf, arch, gpath, "F32", eot_token_id=first)
    assert gguf_eos_token_ids(gpath) == (first,)
    llm = LLM(gpath, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="16MiB")
    try:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == [first] and out.finish_reason == "stop"
