"""Fixtures for the model tests: the packaged SmolLM2 GGUF (ours and transformers'
reference, loaded once per session) and a small paged-KV step runner that plays the model
runner's part. The tiny random checkpoints come from tests/conftest.py."""
from __future__ import annotations

import random
import pytest
import torch

from llmserve.attention import build_attn_metadata, get_kv_cache_shape


class StepRunner:
    """Feeds requests' token chunks through ``model`` step by step over a paged KV cache,
    allocating shuffled (non-contiguous) blocks, and returns each chunk's logits. kv_dtype:
    the cache's dtype (the model's by default; float16/bfloat16 as ``--kv-cache-dtype``)."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0, kv_dtype=None):
        cfg = model.config
        nkv = cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = kv_dtype or next(model.parameters()).dtype
        self.model = model
        self.block_size = block_size
        self.kv_caches = [torch.zeros(get_kv_cache_shape(num_blocks, block_size, nkv, hd), dtype=dtype)
                          for _ in range(cfg.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """chunks: ``(request_id, new_tokens)`` in batch order (decodes first).
        Returns request_id -> logits ``[len(new_tokens), vocab]`` float32."""
        qlens, slens, blocks, ids, pos = [], [], [], [], []
        for rid, toks in chunks:
            start = self.lens.get(rid, 0)
            end = start + len(toks)
            owned = self.blocks.setdefault(rid, [])
            while len(owned) * self.block_size < end:
                owned.append(self.free.pop())
            qlens.append(len(toks))
            slens.append(end)
            blocks.append(list(owned))
            ids += toks
            pos += range(start, end)
            self.lens[rid] = end
        md = build_attn_metadata(qlens, slens, blocks, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, md)
            logits = self.model.compute_logits(hidden)
        out, off = {}, 0
        for (rid, toks) in chunks:
            out[rid] = logits[off:off + len(toks)]
            off += len(toks)
        return out


@pytest.fixture(scope="session")
def step_runner_cls():
    return StepRunner


@pytest.fixture(scope="session")
def smollm2_resolved():
    from llmserve.model_loader import resolve_model
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_config(smollm2_resolved):
    from llmserve.model_loader import load_hf_config
    return load_hf_config(smollm2_resolved)


def make_model_config(resolved, hf_config, dtype: str, max_model_len: int = 2048):
    from llmserve.config import ModelConfig
    return ModelConfig(model="SmolLM2-135M-Instruct", tokenizer="SmolLM2-135M-Instruct",
                       served_model_name=("SmolLM2-135M-Instruct",), dtype=dtype,
                       max_model_len=max_model_len, seed=0, hf_config=hf_config,
                       model_path=resolved.path, gguf_file=resolved.gguf_file)


@pytest.fixture(scope="session")
def smollm2_model_fp32(smollm2_resolved, smollm2_config):
    from llmserve.model_loader import get_model
    return get_model(make_model_config(smollm2_resolved, smollm2_config, "float32"))


@pytest.fixture(scope="session")
def smollm2_hf(hf_model):
    """transformers' own model from the GGUF (float32): ``from_pretrained(gguf_file=...)``,
    i.e. its ``load_gguf_checkpoint`` (GGUF name mapping, dequantization, q/k
    un-permutation). The session's ``hf_model`` (tests/conftest.py), loaded once."""
    return hf_model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_resolved):
    from llmserve.tokenizer import get_tokenizer
    return get_tokenizer(smollm2_resolved.path, smollm2_resolved.gguf_file)


def seeded_tokens(n: int, seed: int, vocab: int = 49152, low: int = 100) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def tokens_fn():
    return seeded_tokens


@pytest.fixture(scope="session")
def model_config_fn():
    return make_model_config
