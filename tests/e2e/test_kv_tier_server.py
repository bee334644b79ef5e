"""`llmserve serve --kv-transfer-config` with the disk tier (issue 32): a server stopped
and started again over the same tier path answers a repeated prompt with its blocks loaded
from disk (usage.prompt_tokens_details.cached_tokens, vllm:external_prefix_cache_hits)
and the same greedy tokens."""
from __future__ import annotations

import json
import re

import pytest

from tests.e2e.e2e_utils import SERVE_CLI, RemoteServer

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16 a restart can load


def _serve(model_dir: str, tier: str) -> RemoteServer:
    cfg = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": tier}}
    return RemoteServer(["--model", model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--enable-prompt-tokens-details",
                         "--kv-transfer-config", json.dumps(cfg)], entrypoint=SERVE_CLI)


def _complete(srv: RemoteServer):
    r = srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens


def _metric(srv: RemoteServer, name: str) -> float:
    text = srv.http.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


@pytest.mark.slow  # two server starts (~45 s); twin: tests/kv_transfer/test_disk_tier.py (in-process restart + metrics)
def test_restarted_server_serves_the_prompt_from_the_disk_tier(tiny_model_dir, tmp_path):
    srv = _serve(tiny_model_dir, str(tmp_path))
    try:
        first, cached = _complete(srv)
        assert cached == 0 and len(first) == 6
    finally:
        assert srv.stop() == 0  # a clean stop flushes the tier's writer
    srv = _serve(tiny_model_dir, str(tmp_path))
    try:
        assert _complete(srv) == (first, 96)
        assert _metric(srv, "vllm:external_prefix_cache_hits_total") == 96
        assert _metric(srv, "vllm:external_prefix_cache_queries_total") == len(PROMPT)
    finally:
        srv.stop()
