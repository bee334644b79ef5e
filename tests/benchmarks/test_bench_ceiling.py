"""The GEMM ceiling: shapes from the config, timing returns consistent positive figures."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from llmserve.benchmarks.ceiling import linear_shapes, measure_gemm_ceiling


def _tiny_config(**kw):
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, vocab_size=300, head_dim=16)
    base.update(kw)
    return LlamaConfig(**base)


def test_linear_shapes_follow_the_config():
    shapes = {s.name: s for s in linear_shapes(_tiny_config())}
    # q: 4 heads x 16, k and v: 2 heads x 16 each.
    assert (shapes["qkv_proj"].in_features, shapes["qkv_proj"].out_features) == (64, 64 + 2 * 32)
    assert (shapes["o_proj"].in_features, shapes["o_proj"].out_features) == (64, 64)
    assert (shapes["gate_up_proj"].in_features, shapes["gate_up_proj"].out_features) == (64, 192)
    assert (shapes["down_proj"].in_features, shapes["down_proj"].out_features) == (96, 64)
    assert (shapes["lm_head"].in_features, shapes["lm_head"].out_features, shapes["lm_head"].count) == (64, 300, 1)
    assert all(shapes[n].count == 3 for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))


def test_smollm2_shapes_give_its_flops_per_token():
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30, vocab_size=49152, head_dim=64)
    per_token = sum(s.flops_per_token for s in linear_shapes(cfg))
    # 30 x (576*960 + 576*576 + 576*3072 + 1536*576) + 576*49152 multiply-adds, x2.
    assert per_token == 2 * (30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) + 576 * 49152)


def test_missing_size_raises_value_error():
    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=300)
    with pytest.raises(ValueError, match="intermediate_size"):
        linear_shapes(cfg)


@pytest.mark.parametrize("tokens", [1, 8])
def test_measure_returns_consistent_positive_numbers(tokens):
    cfg = _tiny_config()
    before = torch.get_num_threads()
    r = measure_gemm_ceiling(cfg, tokens, "float32", num_threads=1, warmup=1, iters=3)
    assert torch.get_num_threads() == before  # the thread count is restored
    assert r.num_threads == 1 and r.dtype == "float32" and r.tokens_per_step == tokens
    assert 0 < r.seconds_per_step <= r.median_seconds_per_step  # fastest pass, then the median
    assert r.tokens_per_s == pytest.approx(tokens / r.seconds_per_step)
    flops = tokens * sum(s.flops_per_token for s in linear_shapes(cfg))
    assert r.gflops_per_step == pytest.approx(flops / 1e9)
    assert r.gflop_per_s == pytest.approx(r.gflops_per_step / r.seconds_per_step)
    per_layer = 64 * 128 + 64 * 64 + 64 * 192 + 96 * 64
    assert r.weight_bytes == 4 * (3 * per_layer + 300 * 64)


def test_measure_bfloat16_weights():
    r = measure_gemm_ceiling(_tiny_config(), 4, "bfloat16", warmup=0, iters=1)
    assert r.dtype == "bfloat16" and r.seconds_per_step > 0
    assert r.weight_bytes == 2 * (3 * (64 * 128 + 64 * 64 + 64 * 192 + 96 * 64) + 300 * 64)


@pytest.mark.parametrize("kw, field", [({"tokens_per_step": 0}, "tokens_per_step"),
                                       ({"iters": 0}, "iters"),
                                       ({"num_threads": 0}, "num_threads"),
                                       ({"dtype": "int3"}, "dtype")])
def test_invalid_arguments_raise(kw, field):
    args = {"tokens_per_step": 2, **kw}
    with pytest.raises(ValueError, match=field):
        measure_gemm_ceiling(_tiny_config(), **args)
