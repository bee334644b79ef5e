"""`llmserve serve --kv-transfer-config` with the disk tier (issue 32): a server stopped
and started again over the same tier path restores the tier into its prefix cache while
idle and answers a repeated prompt from RAM (usage.prompt_tokens_details.cached_tokens,
vllm:kv_connector_blocks_restored, no vllm:external_prefix_cache_hits); with
restore_on_start false the blocks load from disk on demand. Same greedy tokens each time."""
from __future__ import annotations

import json
import re

import pytest

from tests.e2e.e2e_utils import SERVE_CLI, RemoteServer

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16 a restart can load


def _serve(model_dir: str, tier: str, restore: bool = True) -> RemoteServer:
    cfg = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": tier, "restore_on_start": restore}}
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


@pytest.mark.slow  # three server starts (~70 s); twins: tests/kv_transfer/test_disk_tier.py, test_tier_restore.py
def test_restarted_server_serves_the_prompt_from_the_disk_tier(tiny_model_dir, tmp_path):
    srv = _serve(tiny_model_dir, str(tmp_path))
    try:
        first, cached = _complete(srv)
        assert cached == 0 and len(first) == 6
    finally:
        assert srv.stop() == 0  # a clean stop flushes the tier's writer
    srv = _serve(tiny_model_dir, str(tmp_path))  # restores the 6 blocks while idle, before the request
    try:
        assert _complete(srv) == (first, 96)
        assert _metric(srv, "vllm:kv_connector_blocks_restored_total") == 6
        assert _metric(srv, "vllm:external_prefix_cache_hits_total") == 0
    finally:
        srv.stop()
    srv = _serve(tiny_model_dir, str(tmp_path), restore=False)
    try:
        assert _complete(srv) == (first, 96)
        assert _metric(srv, "vllm:kv_connector_blocks_restored_total") == 0
        assert _metric(srv, "vllm:external_prefix_cache_hits_total") == 96
        assert _metric(srv, "vllm:external_prefix_cache_queries_total") == len(PROMPT)
    finally:
        srv.stop()
