"""Issue 33 over HTTP, against one server (a tiny random Llama, two named API keys, an
in-process OTLP/HTTP receiver, ``--enable-per-request-metrics``, 32-token steps so that
prompts are prefilled in chunks):

- ``GET /v1/requests`` and ``GET /v1/requests/{id}/timeline``: found by the response id
  and by the X-Request-Id, events in order, per tenant (another key gets 404), 401
  without a key, the finished ring bounded;
- vLLM's ``metrics`` and llama.cpp's ``timings`` agree with the client's clock within
  10 ms;
- three requests' spans reach the OTLP receiver with vLLM's ``gen_ai.*`` attributes, each
  the child of the ``traceparent`` it was sent with.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.e2e.e2e_utils import RemoteServer

KEYS = {"alice": "key-alice", "bob": "key-bob"}
RING = 6  # --max-finished-request-timelines
GROW = 400  # tokens of the request watched while it runs
BUDGET = 32  # --max-num-batched-tokens: a 70-token prompt is prefilled in 3 chunks


class OtlpReceiver:
    """A tiny OTLP/HTTP collector: decodes each POST /v1/traces body as an
    ExportTraceServiceRequest (opentelemetry-proto) and queues its spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        spans: "queue.Queue" = queue.Queue()
        self.spans = spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            spans.put(span)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def take(self, trace_ids: set, timeout: float = 60.0) -> list:
        """The spans of these traces (others, from earlier requests, are skipped)."""
        deadline, out = time.time() + timeout, []
        while len(out) < len(trace_ids):
            span = self.spans.get(timeout=max(0.1, deadline - time.time()))
            if span.trace_id.hex() in trace_ids:
                out.append(span)
        return out


@pytest.fixture(scope="module")
def otlp():
    rec = OtlpReceiver()
    yield rec
    rec.httpd.shutdown()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, save_tiny_model_fn, otlp):
    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-timelines"))
    save_tiny_model_fn("llama", path)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(path)
    keys = os.path.join(path, "keys.json")
    with open(keys, "w") as f:
        json.dump([{"key": k, "tenant": t} for t, k in KEYS.items()], f)
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # export spans within 50 ms (SDK default: 5 s)
    try:
        server = RemoteServer(["--model", path, "--served-model-name", "tiny", "--dtype", "float32",
                               "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", str(BUDGET),
                               "--api-keys-file", keys, "--otlp-traces-endpoint", otlp.url,
                               "--collect-detailed-traces", "model", "--enable-per-request-metrics",
                               "--max-finished-request-timelines", str(RING)], api_key=None)
    finally:
        if old is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old
    yield server
    server.stop()


def _h(tenant: str, **extra) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}", **extra}


def _chat(srv, tenant="alice", max_tokens=4, headers=None, **body) -> httpx.Response:
    r = srv.http.post("/v1/chat/completions", headers=_h(tenant, **(headers or {})),
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": max_tokens, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r


def test_timeline_by_response_id_and_request_id_per_tenant(srv):
    r = _chat(srv, headers={"X-Request-Id": "tl-1"})
    body = r.json()
    tl = srv.http.get(f"/v1/requests/{body['id']}/timeline", headers=_h("alice")).json()
    assert tl["id"] == body["id"] and tl["tenant"] == "alice" and tl["model"] == "tiny"
    assert tl["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert tl["generated_tokens"] == body["usage"]["completion_tokens"] == 4
    names = [e["event"] for e in tl["events"]]
    assert names == ["arrived", "queued", "scheduled", "first_token", "finished"]
    times = [e["time"] for e in tl["events"]]
    assert times == sorted(times) and abs(times[0] - time.time()) < 60
    sched, fin = tl["events"][2], tl["events"][-1]
    assert sched["num_tokens"] + sched["cached_tokens"] == tl["prompt_tokens"] and fin["reason"] == "length"
    assert srv.http.get("/v1/requests/tl-1/timeline", headers=_h("alice")).json() == tl
    # another tenant: 404 (OpenAI error body), not in its list; no key: 401
    other = srv.http.get(f"/v1/requests/{body['id']}/timeline", headers=_h("bob"))
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError"
    assert body["id"] not in [row["id"] for row in srv.http.get("/v1/requests", headers=_h("bob")).json()["data"]]
    assert srv.http.get("/v1/requests").status_code == 401
    unknown = srv.http.get("/v1/requests/nope/timeline", headers=_h("alice"))
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "request_id"


def _watch_running(srv) -> list:
    """Stream one GROW-token completion for bob and poll ``/v1/requests`` while it runs;
    return the (generated_tokens, engine) pairs of the polls that saw it running."""
    def stream():
        with srv.http.stream("POST", "/v1/completions", headers=_h("bob"),
                             json={"model": "tiny", "prompt": "count", "max_tokens": GROW, "ignore_eos": True,
                                   "stream": True}) as resp:
            for _ in resp.iter_lines():
                pass

    t = threading.Thread(target=stream)
    t.start()
    seen = []
    deadline = time.time() + 60
    while time.time() < deadline and t.is_alive():
        rows = srv.http.get("/v1/requests", headers=_h("bob")).json()
        running = [row for row in rows["data"] if row["state"] == "running"]
        if running:
            seen.append((running[0]["generated_tokens"], rows["engine"]))
        if len({n for n, _ in seen}) >= 2:
            break
        time.sleep(0.01)
    t.join()
    return seen


def test_list_shows_running_then_finished_and_the_ring_is_bounded(srv):
    # the tiny model can make all GROW tokens between two polls on a loaded CI machine (stop
    # 38's CI saw one running row at 30 tokens, stop 39's at 400): a run that shows fewer than
    # two polls is tried again, up to 5 runs; what is asserted is unchanged
    for _ in range(5):
        seen = _watch_running(srv)
        if len({n for n, _ in seen}) >= 2:
            break
    assert len({n for n, _ in seen}) >= 2, seen  # a running row whose token count grows
    assert seen[-1][0] > seen[0][0]
    engine = seen[-1][1]
    assert engine["num_running"] >= 1 and engine["batch_size"] >= 1 and 0 < engine["kv_cache_usage"] <= 1
    row = srv.http.get("/v1/requests", headers=_h("bob")).json()["data"][0]
    assert row["state"] == "finished" and row["id"].startswith("cmpl-") and row["generated_tokens"] == GROW
    assert row["tokens_per_second"] > 0 and row["finish_reason"] == "length" and row["tenant"] == "bob"
    for _ in range(RING + 2):
        _chat(srv, tenant="bob", max_tokens=1)
    idle = srv.http.get("/v1/requests", headers=_h("bob")).json()
    assert len(idle["data"]) == RING
    assert idle["engine"]["batch_size"] == idle["engine"]["num_running"] == 0  # idle, not the last step's
    newest = srv.http.get("/v1/requests?limit=2", headers=_h("bob")).json()["data"]
    assert [r["id"] for r in newest] == [r["id"] for r in idle["data"][:2]]
    for bad in ("0", "x"):
        r = srv.http.get(f"/v1/requests?limit={bad}", headers=_h("bob"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_chunked_prefill_events_over_http(srv):
    prompt = list(range(100, 170))  # 70 tokens, steps of 32
    r = srv.http.post("/v1/completions", headers=_h("alice"),
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    tl = srv.http.get(f"/v1/requests/{r.json()['id']}/timeline", headers=_h("alice")).json()
    sched = [e for e in tl["events"] if e["event"] == "scheduled"]
    assert [e["num_tokens"] for e in sched] == [32, 32, 6]
    names = [e["event"] for e in tl["events"]]
    assert names.index("first_token") > names.index("scheduled") + 2


def test_beam_search_timeline_has_first_token_and_every_token(srv):
    """A beam search's timeline: the first beam's queue and prefill events under the
    request's id, first_token at the search's first step, the returned beams' tokens."""
    r = srv.http.post("/v1/completions", headers=_h("alice"),
                      json={"model": "tiny", "prompt": "count", "max_tokens": 5, "ignore_eos": True,
                            "use_beam_search": True, "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    tl = srv.http.get(f"/v1/requests/{body['id']}/timeline", headers=_h("alice")).json()
    assert [e["event"] for e in tl["events"]] == ["arrived", "queued", "scheduled", "first_token", "finished"]
    times = [e["time"] for e in tl["events"]]
    assert times == sorted(times) and times[3] < times[4]
    assert tl["generated_tokens"] == body["usage"]["completion_tokens"] == 15


def _timed_stream(srv) -> tuple[dict, dict, float, float]:
    """One streamed chat asking for both timing objects: (metrics, timings, the client's
    time to the first token's chunk, its time from that chunk to the last token's)."""
    t0 = time.time()
    first = last = None
    final = {}
    with srv.http.stream("POST", "/v1/chat/completions", headers=_h("alice"),
                         json={"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
                               "max_tokens": 16, "ignore_eos": True, "stream": True, "include_metrics": True,
                               "timings_per_token": True, "return_token_ids": True}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                now = time.time()
                first = first or now
                last = now
            if chunk.get("metrics"):
                final = chunk
    return final["metrics"], final["timings"], first - t0, last - first


def test_metrics_and_timings_agree_with_the_client_clock(srv):
    runs = [_timed_stream(srv) for _ in range(3)]
    for m, tm, _, _ in runs:
        assert tm["predicted_n"] == 16 and tm["prompt_n"] + tm["cache_n"] > 0
        assert m["generation_time_ms"] == tm["predicted_ms"]
        # generation_time_ms is rounded to 0.001 ms: on a fast run (0.36 ms in stop 40's CI
        # rehearsal) that rounding alone is 0.14%, so the bound is the one the rounding allows
        g = m["generation_time_ms"]
        assert 15e3 / (g + 5e-4) - 1e-3 <= m["tokens_per_second"] <= 15e3 / max(g - 5e-4, 1e-9) + 1e-3
    # The server's clock against the client's. The generation time (first to last token)
    # is compared by the median of 3; the time to first token also holds the client's
    # own send and the server's response start, which a loaded shared machine stretches
    # by ~5-15 ms, so the best of 3 is compared.
    gen_gap = sorted(abs(tm["predicted_ms"] - gen * 1e3) for _, tm, _, gen in runs)[1]
    ttft_gap = min(abs(m["time_to_first_token_ms"] - ttft * 1e3) for m, _, ttft, _ in runs)
    assert gen_gap < 10 and ttft_gap < 10, (gen_gap, ttft_gap, runs)


def test_traces_carry_the_traceparent_and_gen_ai_attributes(srv, otlp):
    sent = {}
    for i in range(3):
        trace_id, parent = f"{i + 1:032x}", f"{i + 0xabc:016x}"
        r = _chat(srv, max_tokens=3, headers={"traceparent": f"00-{trace_id}-{parent}-01"}, temperature=0.5)
        sent[trace_id] = (parent, r.json()["id"])
    spans = otlp.take(set(sent))
    assert {s.trace_id.hex() for s in spans} == set(sent)
    for span in spans:
        parent, rid = sent[span.trace_id.hex()]
        attrs = {a.key: a.value for a in span.attributes}
        assert span.parent_span_id.hex() == parent and span.name == "llm_request"
        assert attrs["gen_ai.request.id"].string_value == rid
        assert attrs["gen_ai.usage.completion_tokens"].int_value == 3
        assert attrs["gen_ai.usage.prompt_tokens"].int_value > 0
        assert attrs["gen_ai.request.temperature"].double_value == 0.5
        assert attrs["gen_ai.response.model"].string_value == "tiny"
        e2e = attrs["gen_ai.latency.e2e"].double_value
        ttft = attrs["gen_ai.latency.time_to_first_token"].double_value
        assert 0 < attrs["gen_ai.latency.time_in_queue"].double_value < ttft < e2e
        assert attrs["gen_ai.latency.time_in_model_forward"].double_value > 0
        assert [e.name for e in span.events][-1] == "finished"
