"""RoPE scaling in GGUF files as llama.cpp's convert_hf_to_gguf.py writes it, which
transformers' GGUF config reader drops: Llama 3.1's ``llama3`` scaling as the per-frequency
``rope_freqs.weight`` divisors, and ``rope.scaling.type`` / ``factor`` /
``original_context_length`` (linear, YaRN). Checked against files the converter made from
tiny checkpoints (logits within 2e-5 of transformers' for llama3 once read)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model
from tests.models.tiny_arch import finish_gguf, gguf_writer, hf_logits, save_random

VOCAB = 1024
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # a short original context: the scaling bites at once
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
        "beta_slow": 2.0}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _rows_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's q/k row order for ``llama`` files: per head, halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(cfg) -> np.ndarray:
    """What the converter stores as ``rope_freqs.weight``: per frequency, the plain inverse
    frequency over the llama3-scaled one (transformers' own two computations)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return (plain / scaled).numpy().astype(np.float32)


@pytest.mark.parametrize("scaling", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scaled_rope_of_a_gguf_file_matches_transformers(tmp_path, tokens_fn, step_runner_cls, model_config_fn,
                                                         scaling):
    """A Llama 3.1-style file (``rope_freqs.weight``, no ``rope.scaling.*`` keys) and a YaRN
    one (``rope.scaling.*`` with the betas the converter copies): logits equal transformers'
    on the checkpoint within 1e-4 (llmserve ran plain RoPE on the first: ~0.1-4 off, and
    refused the second)."""
    import gguf
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(scaling))
    hf = save_random(cfg, str(tmp_path / "hf"), 0, lambda name, p: p.mul_(3.0) if "_proj" in name else None)
    path = str(tmp_path / "scaled.gguf")
    w = gguf_writer(path, "llama", cfg)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(16)
    if scaling is LLAMA3:
        w.add_tensor("rope_freqs.weight", _rope_freqs(hf.config))
    else:  # as convert_hf_to_gguf.py writes YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    for name, p in hf.state_dict().items():
        arr = p.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight"}.get(name, "output_norm.weight"), arr)
            continue
        if name == "lm_head.weight":
            continue
        _, _, layer, rest = name.split(".", 3)
        part = rest.rsplit(".", 1)[0]
        if part == "self_attn.q_proj":
            arr = _rows_interleaved(arr, 4)
        elif part == "self_attn.k_proj":
            arr = _rows_interleaved(arr, 2)
        w.add_tensor(f"blk.{layer}.{_BLOCK[part]}.weight", np.ascontiguousarray(arr))
    finish_gguf(w)
    resolved = resolve_model(path)
    model = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    prompt = tokens_fn(24, 4, vocab=VOCAB)
    got = step_runner_cls(model).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3moe"])
@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_keys_reach_the_config(tmp_path, arch, kind, model_config_fn):
    """``rope.scaling.*`` become ``rope_parameters`` as in the checkpoint's config.json (they
    were dropped: the file ran plain RoPE), and the model builds with them."""
    import gguf
    path = str(tmp_path / f"{arch}-{kind}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType(kind))
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(128)
    if arch == "qwen3moe":
        w.add_expert_count(2)
        w.add_expert_used_count(1)
    finish_gguf(w)
    resolved = resolve_model(path)
    config = load_hf_config(resolved)
    assert config.rope_parameters == {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 128}
    from llmserve.models.llama import RotaryEmbedding, _rope_parameters
    rotary = RotaryEmbedding(16, 512, _rope_parameters(config))  # builds (YaRN was refused here)
    assert rotary.attention_factor == (1.0 if kind == "linear" else pytest.approx(0.1 * np.log(4.0) + 1))


def test_gemma3_yarn_file_scales_its_global_layers(tmp_path, model_config_fn):
    """Gemma 3's global layers (every 6th): a YaRN-scaled file runs YaRN there (it ran on
    unscaled RoPE, its ``rope.scaling.type`` read only when linear), the sliding layers
    plain RoPE on their own base."""
    import gguf
    path = str(tmp_path / "gemma3-yarn.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    for add, value in ((w.add_context_length, 512), (w.add_embedding_length, 64), (w.add_block_count, 6),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_key_length, 16), (w.add_value_length, 16),
                       (w.add_sliding_window, 8), (w.add_rope_freq_base, 1e6), (w.add_rope_scaling_factor, 8.0),
                       (w.add_rope_scaling_orig_ctx_len, 128)):
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    finish_gguf(w)
    resolved = resolve_model(path)
    config = load_hf_config(resolved)
    assert config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    from llmserve.models.gemma import _rope_params_for
    from llmserve.models.llama import RotaryEmbedding
    rotary = {t: RotaryEmbedding(16, 512, _rope_params_for(config, t)) for t in ("full_attention", "sliding_attention")}
    assert rotary["full_attention"].attention_factor == pytest.approx(0.1 * np.log(8.0) + 1)
    assert rotary["sliding_attention"].attention_factor == 1.0
