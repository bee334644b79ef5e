"""Ollama's non-streamed ``/api/generate`` and ``/api/chat`` without ``num_predict`` (so the
budget is the rest of the context, thousands of tokens) whose client goes away
mid-generation: the engine request is aborted, as on the OpenAI routes, instead of running
to the end of the context (checked on the shared ``server`` through /metrics: the running
gauge drops to 0, generation stops, one more request finished with reason "abort").

The output is held long on purpose: a JSON-schema ``format`` asking for an array of at
least 5000 integers, so the model cannot end it by itself before the client leaves.
"""
import json
import socket
import time

import pytest

from e2e_utils import MODEL, metric_sum

LONG_FORMAT = {"type": "array", "items": {"type": "integer"}, "minItems": 5000}
BODIES = {
    "/api/generate": {"model": MODEL, "prompt": "List numbers.", "stream": False, "format": LONG_FORMAT},
    "/api/chat": {"model": MODEL, "messages": [{"role": "user", "content": "List numbers."}], "stream": False,
                  "format": LONG_FORMAT},
}


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


# /api/generate in make test; /api/chat goes through the same cancellation wrapper (test-all:
# each case holds the shared server for ~11 s).
@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p == "/api/chat" else [])
                                  for p in sorted(BODIES)])
def test_a_client_that_leaves_aborts_the_ollama_request(server, path):
    lab = {"model_name": MODEL}
    aborts0 = metric_sum(server, "vllm:request_success_total", finished_reason="abort", **lab)
    payload = json.dumps(BODIES[path]).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    gen0 = metric_sum(server, "vllm:generation_tokens_total", **lab)
    _wait(lambda: metric_sum(server, "vllm:generation_tokens_total", **lab) >= gen0 + 8, "tokens generated")
    sock.close()  # the client gives up before the answer
    _wait(lambda: metric_sum(server, "vllm:num_requests_running", **lab) == 0, "the request to end")
    assert metric_sum(server, "vllm:request_success_total", finished_reason="abort", **lab) == aborts0 + 1
    stopped = metric_sum(server, "vllm:generation_tokens_total", **lab)
    time.sleep(1.0)
    assert metric_sum(server, "vllm:generation_tokens_total", **lab) == stopped  # nothing still generating
    assert stopped - gen0 < 5000  # ended at the disconnect, long before the format's 5000 items
