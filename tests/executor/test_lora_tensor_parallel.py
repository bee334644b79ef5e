"""LoRA under tensor parallel (slow: two worker processes): each rank keeps the adapter's
B columns of its column-parallel rows and the A rows of its row-parallel inputs, and adds
its partial delta before the all-reduce; TP=2 gives TP=1's (and peft's) greedy tokens
for base and adapter requests mixed in one batch."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.lora.request import LoRARequest

pytestmark = pytest.mark.slow
PROMPT = list(range(700, 730))


def _run(base, reqs, **kw):
    llm = LLM(base, tokenizer="SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="32MiB",
              max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=16, **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(reqs), sp, lora_request=reqs, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_tp2_lora_equals_tp1_and_peft(tmp_path, save_tiny_model_fn, make_lora_adapter_fn):
    base = str(tmp_path / "base")
    hf = save_tiny_model_fn("llama", base, seed=3)
    loras, pms = [], []
    for i, r in ((1, 8), (2, 16)):
        path = str(tmp_path / f"a{i}")
        pms.append(make_lora_adapter_fn(hf, path, r, seed=20 + i))
        loras.append(LoRARequest(f"a{i}", i, path))
    reqs = [None, loras[0], loras[1]]
    tp1 = _run(base, reqs, multiprocess_mode=False)
    ref = pms[1].generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert tp1[2] == ref[0, len(PROMPT):].tolist()
    assert _run(base, reqs, multiprocess_mode=False, tensor_parallel_size=2) == tp1
