"""``llmserve bench serve`` against the real server: every request completes with its
exact output length, the table is printed and --save-result writes the JSON."""
from __future__ import annotations

import pytest
import json
import subprocess
import sys

from e2e_utils import MODEL


@pytest.mark.slow  # ~6 s; bench serve's options and results: tests/benchmarks; `make test-all`
def test_bench_serve_small_run(server, tmp_path):
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--base-url", server.url_root,
           "--api-key", server.api_key, "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
           "--max-concurrency", "2", "--request-rate", "50", "--seed", "1", "--save-result", "--result-dir",
           str(tmp_path), "--result-filename", "out.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("Serving Benchmark Result", "Request throughput", "Output token throughput", "Median TTFT",
                  "P99 TPOT", "Mean ITL", "Median E2EL"):
        assert label in proc.stdout, label
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["model_id"] == MODEL and result["lora_modules"] == []
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_input_tokens"] == 64 and result["total_output_tokens"] == 16
    assert result["output_throughput"] > 0 and result["median_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] > 0


@pytest.mark.slow  # a bench option, not a serving path: `make test-all`
def test_bench_serve_structured_output_compare_rounds(server, tmp_path):
    """--structured-output-compare with --structured-output-rounds: ABBA rounds of the same
    requests, unconstrained and with the builtin schema; per-round ratios and their median."""
    import statistics

    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--base-url", server.url_root,
           "--api-key", server.api_key, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
           "--random-input-len", "8", "--random-output-len", "4", "--max-concurrency", "2", "--temperature", "0",
           "--structured-output-schema", "builtin", "--structured-output-compare", "--structured-output-rounds", "2",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "so.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("round ") == 2 and "median of 2 alternating rounds" in proc.stdout
    result = json.loads((tmp_path / "so.json").read_text())
    ratios = result["structured_output_throughput_ratios"]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
    assert result["structured_output_throughput_ratio"] == statistics.median(ratios)
    assert result["completed"] == 2 and result["total_output_tokens"] == 8  # every JSON answer ran its length


@pytest.mark.slow  # a bench option, not a serving path: `make test-all`
def test_bench_serve_compare_url_runs_both_and_reports_ratios(server, tmp_path):
    """--compare-url sends the same requests to a second server (here the same one) and
    saves its metrics with this/other ratios."""
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--base-url", server.url_root,
           "--compare-url", server.url_root, "--api-key", server.api_key, "--num-prompts", "2",
           "--random-input-len", "16", "--random-output-len", "3", "--max-concurrency", "1", "--seed", "2",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "cmp.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Comparing with" in proc.stdout and "median TPOT ms" in proc.stdout
    result = json.loads((tmp_path / "cmp.json").read_text())
    other = result["compare"]
    assert other["completed"] == 2 and other["failed"] == 0 and other["total_output_tokens"] == 6
    expected = result["output_throughput"] / other["output_throughput"]
    assert abs(other["ratio_output_throughput"] - expected) < 1e-9
    assert other["ratio_median_tpot_ms"] > 0
