"""vLLM's metric families added in issue 10 (iteration_tokens_total, request_params_n,
request_params_max_tokens) and the per-phase request times, following the requests."""
from __future__ import annotations

from e2e_utils import MODEL
from test_server import metric, scrape


def test_params_and_phase_histograms_follow_the_requests(server):
    lab = {"model_name": MODEL}
    before = scrape(server)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "n": 2,
                                        "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    r2 = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert r2.status_code == 200, r2.text
    after = scrape(server)

    def delta(name: str, **extra: str) -> float:
        return metric(after, name, **lab, **extra) - metric(before, name, **lab, **extra)

    # three finished samples: n=2 (two samples of max_tokens 3) and n=1 (max_tokens 5)
    assert delta("vllm:request_params_n_count") == 3
    assert delta("vllm:request_params_n_sum") == 2 + 2 + 1
    assert delta("vllm:request_params_max_tokens_count") == 3
    assert delta("vllm:request_params_max_tokens_sum") == 3 + 3 + 5
    assert delta("vllm:request_params_n_bucket", le="1.0") == 1
    # every step's tokens: the prompt and generated tokens, nothing else
    assert delta("vllm:generation_tokens_total") == 11
    assert delta("vllm:iteration_tokens_total_sum") == \
        delta("vllm:prompt_tokens_total") + delta("vllm:generation_tokens_total")
    assert delta("vllm:iteration_tokens_total_count") >= 5  # at least one step per decode token
    for hist in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        assert delta(f"vllm:{hist}_count") == 3, hist
    for hist in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert delta(f"vllm:{hist}_sum") > 0, hist


def test_a_zero_token_request_counts_no_generated_token(server):
    """An echo + logprobs request for 0 tokens (prompt scoring) has completion_tokens 0;
    /metrics counted the one token the engine samples after the prefill (+1 to
    generation_tokens_total and request_generation_tokens_sum)."""
    lab = {"model_name": MODEL}
    before = scrape(server)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Your answer: Yes", "echo": True, "logprobs": 1,
                                        "max_tokens": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["text"] == "Your answer: Yes"
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"]
    after = scrape(server)

    def delta(name: str) -> float:
        return metric(after, name, **lab) - metric(before, name, **lab)

    assert delta("vllm:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 0
    assert delta("vllm:request_generation_tokens_sum") == 0
