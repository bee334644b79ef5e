"""GGUF loading pieces: the fast tensor index vs gguf.GGUFReader, name mapping and the
q/k un-permutation (end-to-end equality with transformers is in tests/models)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.models.tiny_arch import finish_gguf

from llmserve.model_loader.gguf_loader import (_read_with_gguf_reader, gguf_to_hf_name,
                                               read_gguf_tensors, reverse_permute)


@pytest.mark.parametrize("alignment", [32, 64])
def test_fast_index_matches_gguf_reader(tmp_path, alignment):
    import gguf
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_block_count(1)
    w.add_token_list(["a", "bb", "<|im_end|>"] * 50)          # string array
    w.add_token_scores([0.5] * 150)                            # float array
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch, fast = read_gguf_tensors(path)
    arch_ref, ref = _read_with_gguf_reader(path)
    assert arch == arch_ref == "llama"
    assert [t.name for t in fast] == [t.name for t in ref]
    for a, b in zip(fast, ref):
        assert a.tensor_type == b.tensor_type
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    with pytest.raises(ValueError, match="not a GGUF"):
        (tmp_path / "x.gguf").write_bytes(b"nope" * 10)
        read_gguf_tensors(str(tmp_path / "x.gguf"))


def test_a_file_cut_short_is_named_truncated(tmp_path):
    """A partial download: cut in the header (struct would run off the end) or in the
    tensor data (numpy would fail to reshape) is GGUFDamagedError saying so, also from
    the architecture check that runs first at start-up."""
    import gguf

    from llmserve.model_loader.gguf_config import check_gguf_architecture
    from llmserve.model_loader.gguf_loader import GGUFDamagedError

    path = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    for cut, words in ((8, "header ends early"), (len(data) - 100, "'token_embd.weight' needs bytes")):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        for read in (read_gguf_tensors, check_gguf_architecture):
            with pytest.raises(GGUFDamagedError, match=words):
                read(str(short))
    assert check_gguf_architecture(str(path)) == "llama"


def test_name_mapping():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_reverse_permute_undoes_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf permute: rows of each head (2, dim/2) -> (dim/2, 2)."""
    n_head, head_dim, hidden = 3, 8, 5
    w = np.arange(n_head * head_dim * hidden, dtype=np.float32).reshape(n_head * head_dim, hidden)
    permuted = (w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2)
                .reshape(w.shape))
    assert not np.array_equal(permuted, w)
    assert np.array_equal(reverse_permute(permuted, n_head), w)


@pytest.mark.parametrize("arch,tokens,want", [
    # a Qwen conversion whose EOS is <|endoftext|>: llama.cpp stops at <|im_end|> by its text
    ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"], (0, 2)),
    ("llama", ["<|begin_of_text|>", "<|end_of_text|>", "x", "<|eot_id|>", "<|eom_id|>"], (1, 3, 4)),
    ("qwen3moe", ["a", "b"], ()),
])
def test_end_of_turn_tokens_by_text_for_every_architecture(tmp_path, arch, tokens, want):
    """llama.cpp's vocabulary loader adds its end-of-generation texts to the stop set for
    every architecture, not only Gemma and Phi-3 (as here before)."""
    import gguf

    from llmserve.model_loader.gguf_config import gguf_eos_token_ids
    path = str(tmp_path / "meta.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_token_list(tokens)
    finish_gguf(w)
    assert gguf_eos_token_ids(path) == want


def test_a_file_without_its_hyperparameters_is_refused_naming_the_keys(tmp_path):
    # a Q4_K file written without llama.* keys loaded with transformers' LlamaConfig defaults and
    # failed on "weight 'model.embed_tokens.weight' has shape (512, 256), expected (32000, 4096)"
    import gguf

    from llmserve.model_loader import load_hf_config, resolve_model

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(32)  # one of the three: the other two are named
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match=r"lacks the metadata key\(s\) \['llama.context_length', 'llama.block_count'\]"):
        load_hf_config(resolve_model(str(path)))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "llama"])
def test_head_size_comes_from_attention_key_length(tmp_path, arch):
    """A head size other than hidden / heads (Qwen3's, Mistral Nemo's) is the file's
    ``attention.key_length``, not the config class's default (Qwen3Config's 128 made a
    64-wide qwen3 file fail to load on q_proj's shape); without the key, head_dim is left."""
    import gguf
    import transformers as tf

    from llmserve.model_loader.gguf_config import complete_gguf_config
    path = str(tmp_path / f"{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_key_length(32)
    w.add_value_length(32)
    finish_gguf(w)
    cls = tf.LlamaConfig if arch == "llama" else tf.Qwen3MoeConfig if arch == "qwen3moe" else tf.Qwen3Config
    config = complete_gguf_config(cls(hidden_size=64, num_attention_heads=4), path)
    assert config.head_dim == 32
    path = str(tmp_path / "plain.gguf")
    finish_gguf(gguf.GGUFWriter(path, "qwen3"))
    assert complete_gguf_config(tf.Qwen3Config(hidden_size=64, num_attention_heads=4), path).head_dim == 128


@pytest.mark.parametrize("shape", [(1, 8), (8,)], ids=["converter", "llama-quantize"])
def test_shared_expert_gate_loads_in_either_stored_shape(tmp_path, shape):
    """Qwen2-MoE's shared-expert gate: convert_hf_to_gguf.py stores it 2-d ``{n_embd, 1}``
    (numpy ``[1, hidden]``), llama-quantize's output 1-d ``{n_embd}`` (it drops the trailing 1,
    checked on files both made); either loads as HF's ``[1, hidden]``."""
    import gguf
    import torch
    from types import SimpleNamespace

    from llmserve.model_loader.gguf_loader import iterate_gguf_weights
    path = str(tmp_path / "shexp.gguf")
    w = gguf.GGUFWriter(path, "qwen2moe")
    gate = np.arange(8, dtype=np.float32).reshape(shape)
    w.add_tensor("blk.0.ffn_gate_inp_shexp.weight", gate)
    finish_gguf(w)
    got = dict(iterate_gguf_weights(path, SimpleNamespace(num_attention_heads=2, num_key_value_heads=1),
                                    torch.float32))
    assert got["model.layers.0.mlp.shared_expert_gate.weight"].tolist() == [list(range(8))]
