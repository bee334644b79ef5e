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
