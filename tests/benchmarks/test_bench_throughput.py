"""``llmserve bench throughput`` / ``bench latency``: flags, validation and end-to-end runs."""
from __future__ import annotations

import argparse
import json

import pytest

from llmserve.benchmarks import latency, throughput

REAL_MODEL = "SmolLM2-135M-Instruct"


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_throughput_flags_and_defaults():
    args = _parse(throughput, [])
    assert (args.backend, args.num_prompts, args.input_len, args.output_len) == ("llmserve", 256, 128, 128)
    assert args.random_range_ratio == 0.0 and args.hf_batch_size == 64 and not args.compare_hf
    assert args.dtype == "auto" and args.enable_prefix_caching is True
    args = _parse(throughput, ["--backend", "hf", "--compare-hf", "--num-prompts", "3", "--input-len", "5",
                               "--output-len", "6", "--random-range-ratio", "0.5", "--seed", "9",
                               "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
                               "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
                               "--hf-batch-size", "8", "--ceiling-tokens-per-step", "256", "1",
                               "--output-json", "x.json"])
    assert args.backend == "hf" and args.compare_hf and args.num_prompts == 3
    assert (args.input_len, args.output_len, args.random_range_ratio, args.seed) == (5, 6, 0.5, 9)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory) == (32, 256, "2GiB")
    assert args.enable_prefix_caching is False and args.hf_batch_size == 8
    assert args.ceiling_tokens_per_step == [256, 1] and args.output_json == "x.json"
    with pytest.raises(SystemExit):
        _parse(throughput, ["--backend", "vllm"])


@pytest.mark.parametrize("argv, field", [(["--num-prompts", "0"], "num_prompts"),
                                         (["--output-len", "0"], "output_len"),
                                         (["--random-range-ratio", "1.0"], "random_range_ratio"),
                                         (["--hf-batch-size", "0"], "hf_batch_size"),
                                         (["--ceiling-tokens-per-step", "0"], "ceiling_tokens_per_step")])
def test_throughput_rejects_bad_flags(argv, field):
    with pytest.raises(ValueError, match=field):
        throughput.main(_parse(throughput, argv))


def test_latency_flags_and_helpers():
    args = _parse(latency, ["--batch-size", "4", "--input-len", "8", "--output-len", "16",
                            "--num-iters-warmup", "1", "--num-iters", "3"])
    assert (args.batch_size, args.input_len, args.output_len, args.num_iters_warmup, args.num_iters) == (4, 8, 16, 1, 3)
    s = latency.latency_stats([1.0, 2.0, 3.0, 10.0])
    assert s["mean_s"] == 4.0 and s["median_s"] == 2.5 and s["min_s"] == 1.0 and s["max_s"] == 10.0
    assert 9.7 < s["p99_s"] < 10.0
    assert latency.decode_time_per_token(1.1, 0.1, 11) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="output_len"):
        latency.decode_time_per_token(1.0, 0.5, 1)
    with pytest.raises(ValueError, match="output_len"):
        latency.main(_parse(latency, ["--output-len", "1"]))


def test_hf_backend_end_to_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "r.json"
    args = _parse(throughput, ["--backend", "hf", "--model", tiny_llama_dir, "--dtype", "float32",
                               "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
                               "--random-range-ratio", "0.5", "--hf-batch-size", "2",
                               "--ceiling-tokens-per-step", "4", "--ceiling-iters", "1",
                               "--output-json", str(out)])
    result = throughput.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    hf = result["hf"]
    assert hf["num_requests"] == 5
    assert 5 * 4 <= hf["prompt_tokens"] <= 5 * 12 and 5 * 2 <= hf["output_tokens"] <= 5 * 6
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert hf["total_tokens_per_s"] == pytest.approx((hf["prompt_tokens"] + hf["output_tokens"]) / hf["elapsed_s"])
    [ceiling] = result["ceiling"]
    assert ceiling["tokens_per_step"] == 4 and ceiling["tokens_per_s"] > 0
    assert ceiling["achieved_total_tokens_ratio"]["hf"] == pytest.approx(
        hf["total_tokens_per_s"] / ceiling["tokens_per_s"])


def test_llmserve_end_to_end_on_the_real_model(capsys, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ENABLE_MULTIPROCESSING", "0")  # in-process engine: faster start/stop
    args = _parse(throughput, ["--model", REAL_MODEL, "--num-prompts", "4", "--input-len", "16",
                               "--output-len", "8", "--ceiling-tokens-per-step", "8",
                               "--ceiling-iters", "1"])
    result = throughput.main(args)
    r = result["llmserve"]
    assert (r["num_requests"], r["prompt_tokens"], r["output_tokens"]) == (4, 64, 32)
    assert r["requests_per_s"] == pytest.approx(4 / r["elapsed_s"])
    assert r["output_tokens_per_s"] == pytest.approx(32 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(96 / r["elapsed_s"])
    assert result["dtype"] in ("bfloat16", "float32")
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed and "GEMM ceiling @ 8 tokens/step" in printed


def test_latency_end_to_end(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ENABLE_MULTIPROCESSING", "0")
    args = _parse(latency, ["--model", tiny_llama_dir, "--dtype", "float32", "--batch-size", "2",
                            "--input-len", "8", "--output-len", "6", "--num-iters-warmup", "1",
                            "--num-iters", "2", "--ceiling-iters", "1"])
    result = latency.main(args)
    assert len(result["latencies_s"]) == 2 and result["latency"]["median_s"] > 0
    assert result["ceiling"]["tokens_per_step"] == 2
    assert result["decode_time_per_token_s"] == pytest.approx(
        (result["latency"]["median_s"] - result["latency_1_token"]["median_s"]) / 5)
    assert result["decode_vs_ceiling_time_ratio"] == pytest.approx(
        result["decode_time_per_token_s"] / result["ceiling"]["seconds_per_step"])
