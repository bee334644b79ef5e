"""``llmserve bench serve`` pieces: the shared random dataset and the metric arithmetic."""
from __future__ import annotations

import pytest

from llmserve.benchmarks.datasets import sample_random_requests, special_token_ids
from llmserve.benchmarks.serve import RequestFuncOutput, calculate_metrics, request_models


def test_random_dataset_is_seeded_and_clean(smol_tokenizer):
    a = sample_random_requests(smol_tokenizer, 6, 32, 8, 0.25, seed=1)
    assert a == sample_random_requests(smol_tokenizer, 6, 32, 8, 0.25, seed=1)
    assert a != sample_random_requests(smol_tokenizer, 6, 32, 8, 0.25, seed=2)
    assert all(24 <= len(ids) <= 40 and 6 <= out <= 10 for ids, out in a)
    special = special_token_ids(smol_tokenizer)
    assert special and not special.intersection(t for ids, _ in a for t in ids)
    fixed = sample_random_requests(smol_tokenizer, 3, 128, 128, 0.0, seed=0)
    assert [(len(i), o) for i, o in fixed] == [(128, 128)] * 3
    for bad in ({"num_prompts": 0}, {"input_len": 0}, {"range_ratio": 1.0}):
        kw = {"num_prompts": 2, "input_len": 4, "output_len": 4, "range_ratio": 0.0, **bad}
        with pytest.raises(ValueError):
            sample_random_requests(smol_tokenizer, seed=0, **kw)


def test_calculate_metrics():
    outs = [RequestFuncOutput(success=True, latency=1.0, ttft=0.1, itl=[0.3, 0.3, 0.3], prompt_len=10, output_tokens=4),
            RequestFuncOutput(success=True, latency=2.0, ttft=0.5, itl=[0.5, 0.5, 0.5], prompt_len=10, output_tokens=4),
            RequestFuncOutput(success=False, error="HTTP 500")]
    m = calculate_metrics(outs, duration_s=2.0, percentiles=[99.0])
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 500"]
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 14.0
    assert m["mean_ttft_ms"] == pytest.approx(300.0) and m["median_ttft_ms"] == pytest.approx(300.0)
    assert m["mean_tpot_ms"] == pytest.approx(400.0)  # (0.9/3 + 1.5/3) / 2
    assert m["mean_itl_ms"] == pytest.approx(400.0) and m["p99_e2el_ms"] == pytest.approx(1990.0)


def test_lora_modules_pick_each_request_model_uniformly_and_seeded():
    """--lora-modules (vLLM's bench serve flag): every request names one of the adapters,
    the same ones for the same seed (both servers/rounds of a comparison)."""
    names = [f"a{i}" for i in range(1, 9)]
    picks = request_models("base", names, 800, seed=3)
    assert picks == request_models("base", names, 800, seed=3)
    assert picks != request_models("base", names, 800, seed=4)
    assert set(picks) == set(names) and all(60 <= picks.count(n) <= 140 for n in names)
    assert request_models("base", None, 3, seed=3) == ["base"] * 3
