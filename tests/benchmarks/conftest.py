"""Shared fixtures of the benchmark tests: a tiny random Llama directory that carries the
real SmolLM2 tokenizer (so the benchmarks' tokenizer paths work), built once per session."""
from __future__ import annotations

import pytest
import torch

from llmserve.tokenizer import get_tokenizer

REAL_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def real_tokenizer():
    """The SmolLM2 tokenizer, from the GGUF metadata (the engine's tokenizer loader)."""
    return get_tokenizer(REAL_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, real_tokenizer):
    """A randomly initialised 2-layer Llama (hidden 32, GQA 4/2 heads, vocab of the real
    tokenizer) saved with config.json, safetensors and the SmolLM2 tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=len(real_tokenizer),
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    real_tokenizer.save_pretrained(path)
    return str(path)
