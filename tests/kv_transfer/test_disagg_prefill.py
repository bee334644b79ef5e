"""Disaggregated prefill over the shared-storage connector (issue 32 item 3), in-process
twin of tests/e2e/test_disagg_proxy_server.py (which also compares with transformers): a
kv_producer engine prefills (max_tokens=1) and saves the prompts' blocks, a kv_consumer
engine over the same folder loads them and decodes. Its greedy tokens equal one engine's
that prefills by itself, in float32 and bfloat16, at c=1 and c=8; with the producer gone
the consumer prefills by itself and answers the same."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.entrypoints.disagg_proxy import prefill_body

PROMPTS = [[int(t) for t in torch.randint(5, 250, (40 + 9 * i,), generator=torch.Generator().manual_seed(i))]
           for i in range(8)]
FRESH = [[t + 1 for t in p] for p in PROMPTS[:2]]  # never prefilled by the producer
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(model: str, role, path, dtype: str) -> LLM:
    cfg = None if role is None else {"kv_connector": "SharedStorageConnector", "kv_role": role,
                                     "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    return LLM(model, tokenizer="SmolLM2-135M-Instruct", dtype=dtype, multiprocess_mode=False,
               kv_cache_memory="8MiB", max_model_len=256, kv_transfer_config=cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, save_tiny_model_fn) -> str:
    path = str(tmp_path_factory.mktemp("disagg_model"))
    save_tiny_model_fn("llama", path)
    return path


def _gen(llm: LLM, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _prefill(producer: LLM, prompts) -> None:
    producer.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                      use_tqdm=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_producer_then_consumer_equals_one_instance_at_c1_and_c8(model_dir, tmp_path, dtype):
    single = _llm(model_dir, None, tmp_path, dtype)
    ref = [_gen(single, PROMPTS[:1])[0], _gen(single, PROMPTS[1:])[0], _gen(single, FRESH)[0]]
    single.shutdown()
    producer, consumer = _llm(model_dir, "kv_producer", tmp_path, dtype), _llm(model_dir, "kv_consumer", tmp_path, dtype)
    _prefill(producer, PROMPTS[:1])
    assert _gen(consumer, PROMPTS[:1]) == (ref[0], [(len(PROMPTS[0]) - 1) // 16 * 16])  # c=1: loaded
    _prefill(producer, PROMPTS[1:])  # c=8: the rest prefilled in one batch
    assert _gen(consumer, PROMPTS[1:]) == (ref[1], [(len(p) - 1) // 16 * 16 for p in PROMPTS[1:]])
    producer.shutdown()  # gone: the consumer prefills by itself
    assert _gen(consumer, FRESH) == (ref[2], [0, 0])
    consumer.shutdown()


def test_prefill_request_is_one_token_without_stream():
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {}, "n": 2}
    assert prefill_body(body, "/v1/completions") == {"model": "m", "prompt": "x", "max_tokens": 1}
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, "/v1/chat/completions")
    assert chat == {"messages": [], "max_tokens": 1, "max_completion_tokens": 1}


class _Recorder:
    """A stand-in server (stdlib, port 0, a thread) that records each POST's path and JSON
    body and answers ``{}``."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                seen.append((self.path, json.loads(self.rfile.read(int(self.headers["content-length"])))))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_proxy_prefills_the_servers_aliases_and_llama_server_routes():
    """``/chat/completions`` (the main server's alias of chat) and llama-server's
    ``/completion``, ``/completions`` and ``/infill`` go to the prefill instance first, with
    a one-token budget, as ``/v1/chat/completions`` does; they were only forwarded to the
    decode instance, which then prefilled by itself. Other routes are only forwarded."""
    from fastapi.testclient import TestClient

    from llmserve.entrypoints.disagg_proxy import build_app

    prefill, decode = _Recorder(), _Recorder()
    try:
        with TestClient(build_app(prefill.url, decode.url, prefill_timeout=10)) as client:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
            llama = {"prompt": "x", "n_predict": 9, "stream": True}
            sent = [("/chat/completions", chat), ("/completion", llama), ("/completions", llama),
                    ("/infill", {**llama, "input_prefix": "a"}), ("/tokenize", {"prompt": "x"})]
            for path, body in sent:
                assert client.post(path, json=body).status_code == 200, path
        assert decode.seen == sent  # every request as it came
        assert [path for path, _ in prefill.seen] == ["/chat/completions", "/completion", "/completions", "/infill"]
        assert prefill.seen[0][1]["max_tokens"] == prefill.seen[0][1]["max_completion_tokens"] == 1
        assert all(body["n_predict"] == 1 and "stream" not in body for _, body in prefill.seen[1:])
    finally:
        prefill.close()
        decode.close()
