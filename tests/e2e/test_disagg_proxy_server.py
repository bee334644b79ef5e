"""Disaggregated prefill end to end (issue 32 item 3): `llmserve serve` as kv_producer and as
kv_consumer over one SharedStorageConnector folder, `llmserve disagg-proxy` in front. Greedy
tokens through the proxy equal transformers' at c=1 and c=8 (and streamed), the consumer
reports the prompt as cached (loaded, not prefilled), and with the producer killed every
request is still answered, the same. Slow (three processes); the in-process twin is
tests/kv_transfer/test_disagg_prefill.py."""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.e2e.e2e_utils import API_KEY, SERVE_CLI, RemoteServer, _free_port

PROMPTS = [list(range(1000 + 50 * i, 1000 + 50 * i + 40 + 7 * i)) for i in range(9)]


def _serve(model_dir: str, role: str, tier: str) -> RemoteServer:
    cfg = {"kv_connector": "SharedStorageConnector", "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": tier}}
    return RemoteServer(["--model", model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--enable-prompt-tokens-details",
                         "--kv-transfer-config", json.dumps(cfg)], entrypoint=SERVE_CLI)


class _Proxy:
    def __init__(self, prefill: RemoteServer, decode: RemoteServer) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.cli", "disagg-proxy",
                                      "--port", str(self.port), "--prefiller-port", str(prefill.port),
                                      "--decoder-port", str(decode.port), "--prefill-timeout", "20"])
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("proxy not ready")

    def complete(self, prompt: list[int], stream: bool = False):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        if not stream:
            r = self.http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        tokens = []
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return tokens

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.mark.slow
def test_proxy_producer_consumer_equal_transformers_and_survive_the_producer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                           eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    producer, consumer = _serve(tiny_model_dir, "kv_producer", str(tmp_path)), \
        _serve(tiny_model_dir, "kv_consumer", str(tmp_path))
    proxy = _Proxy(producer, consumer)
    try:
        assert proxy.complete(PROMPTS[0]) == (ref[0], (len(PROMPTS[0]) - 1) // 16 * 16)  # c=1: loaded
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # c=8
            got = list(pool.map(proxy.complete, PROMPTS[1:]))
        assert [t for t, _ in got] == ref[1:] and all(c > 0 for _, c in got)
        assert proxy.complete(PROMPTS[1], stream=True) == ref[1]
        producer.proc.kill()  # mid-run: the decode instance prefills by itself
        producer.proc.wait(10)
        fresh = [t + 3 for t in PROMPTS[0]]
        with torch.no_grad():
            ref_fresh = hf.generate(torch.tensor([fresh]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                    eos_token_id=None)[0, len(fresh):].tolist()
        assert proxy.complete(fresh) == (ref_fresh, 0)
    finally:
        proxy.stop()
        producer.stop()
        consumer.stop()
