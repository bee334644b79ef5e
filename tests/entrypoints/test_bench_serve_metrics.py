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


def _sse_response() -> bytes:
    body = (b'data: {"choices": [{"text": "hi"}]}\n\n'
            b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n')
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _one_request_per_connection_server():
    """A server that answers the first request of each connection and drops the
    connection, unanswered, when a second request arrives on it (what a client meets when
    the server closed a pooled keep-alive connection as it was reused)."""
    import asyncio

    async def handle(reader, writer):
        for answered in (True, False):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed it (an unpooled resend's connection)
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            if not answered:
                break
            writer.write(_sse_response())
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _bench_against_a_dropping_server(max_concurrency: int, num_requests: int) -> dict:
    """bench serve's result for ``num_requests`` 3-token completions at ``max_concurrency``
    against a server that closes each connection after one request."""
    import argparse
    import asyncio

    from llmserve.benchmarks.serve import benchmark

    async def run():
        server = await _one_request_per_connection_server()
        port = server.sockets[0].getsockname()[1]
        args = argparse.Namespace(ignore_eos=True, temperature=0.0, api_key=None, request_timeout=30,
                                  max_concurrency=max_concurrency, seed=0, num_warmups=0, lora_modules=None,
                                  request_rate=float("inf"), burstiness=1.0, metric_percentiles="99")
        try:
            return await benchmark(args, f"http://127.0.0.1:{port}/v1/completions", "m",
                                   [([1, 2, 3], 3, 1)] * num_requests, chat=False)
        finally:
            server.close()

    return asyncio.run(run())


def test_a_request_on_a_connection_the_server_closed_is_sent_again():
    """bench serve resends (once) a request that failed before any response because the
    pooled keep-alive connection was closed by the server: llama-server's HTTP library does
    this, and the compare script used to count those as llama-server's failed requests."""
    result = _bench_against_a_dropping_server(max_concurrency=1, num_requests=4)
    assert result["completed"] == 4 and result["failed"] == 0 and result["errors"] == []
    # requests 2 and 4 met a dropped connection; 2's resend went on a connection that is not
    # pooled, so request 3 opened a new pooled one
    assert result["retried_stale_connections"] == 2


def test_only_failures_before_any_response_are_resent():
    from llmserve.benchmarks.serve import never_reached_server

    assert never_reached_server(RequestFuncOutput(error="ServerDisconnectedError: Server disconnected"))
    assert never_reached_server(RequestFuncOutput(error="ClientOSError: [Errno None] Can not write request body"))
    assert not never_reached_server(RequestFuncOutput(error="HTTP 500: boom"))
    assert not never_reached_server(RequestFuncOutput(error="ClientConnectorError: refused"))
    cut_mid_stream = RequestFuncOutput(error="ServerDisconnectedError: Server disconnected", ttft=0.2)
    assert not never_reached_server(cut_mid_stream)


def test_a_resend_takes_a_connection_of_its_own_not_another_pooled_one():
    """At 8 streams the pool holds 8 connections the server will drop when reused: the 9th
    request meets one, and its resend must not take another from the pool (it did, and
    1-6 of 64 llama-server requests at 32 streams still failed after their resend)."""
    result = _bench_against_a_dropping_server(max_concurrency=8, num_requests=9)
    assert result["completed"] == 9 and result["failed"] == 0 and result["errors"] == []
    assert result["retried_stale_connections"] == 1


def test_server_comparison_rounds_draw_their_own_prompts_same_for_both_servers():
    """bench serve --compare-url-rounds: every round (and warm-up round) sends prompts no
    other round sent, so the servers' prefix caches cannot answer a measured round (with one
    prompt set for all rounds, SmolLM2 at 32 streams measured 742-785 tok/s on repeats
    against 515-532 fresh); both servers of a round get the same prompts."""
    import argparse

    from llmserve.benchmarks.server_compare import compare_servers, round_seeds

    sent: list[tuple[str, int]] = []

    async def fake_benchmark(args, url, model, requests, chat):
        sent.append((url, requests[0][0]))
        return {"output_throughput": 100.0, "median_tpot_ms": 10.0, "median_ttft_ms": 50.0, "failed": 0}

    args = argparse.Namespace(seed=5, compare_url_rounds=3, compare_url_warm_rounds=1, compare_server_pids=None)
    out = compare_servers(args, ["A", "B"], ["m", "m"], lambda seed: [(seed, 128, 128)], False, fake_benchmark)
    assert sent == [("A", 8), ("B", 8), ("A", 5), ("B", 5), ("B", 6), ("A", 6), ("A", 7), ("B", 7)]
    assert out["ratios"]["output_throughput"] == 1.0 and len(out["rounds"]) == 6
    measured, warm = round_seeds(5, 3, 2)
    assert measured == [5, 6, 7] and warm == [8, 9]
