"""LoRA over the process split (AsyncLLM -> EngineCoreProc): adapters load off the step
loop (add_lora while another request streams; a request whose adapter is not loaded yet
waits for it, other streams do not), typed errors cross the boundary, and removing an
adapter in use waits for its requests."""
from __future__ import annotations

import asyncio

import pytest
import torch

from llmserve import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams
from llmserve.lora.errors import LoRAAdapterError
from llmserve.lora.request import LoRARequest

PROMPT = list(range(500, 520))
# An engine process of its own (~10-25 s to start on a loaded 2-core machine): make test-all.
# make test reaches the same path through the server's /v1/load_lora_adapter (e2e).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny_model_fn, make_lora_adapter_fn):
    root = tmp_path_factory.mktemp("lora_async")
    base = str(root / "base")
    hf = save_tiny_model_fn("llama", base)
    loras = []
    for i in (1, 2):
        path = str(root / f"a{i}")
        pm = make_lora_adapter_fn(hf, path, 8, seed=10 + i)
        ref = pm.generate(torch.tensor([PROMPT]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        loras.append((LoRARequest(f"a{i}", i, path), ref[0, len(PROMPT):].tolist()))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=base, tokenizer="SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="64MiB",
        disable_log_stats=True, enable_lora=True, max_loras=2, max_lora_rank=8))
    yield engine, loras
    engine.shutdown()


async def _tokens(engine, rid, lora=None, max_tokens=5, out_kind=RequestOutputKind.FINAL_ONLY):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=out_kind)
    final = None
    async for out in engine.generate({"prompt_token_ids": PROMPT}, sp, rid, lora_request=lora):
        final = out
    return final.outputs[0].token_ids


def test_adapters_load_off_the_loop_and_errors_are_typed(setup, loop):
    engine, loras = setup
    (lr1, ref1), (lr2, ref2) = loras

    async def run():
        # A long base stream; the adapter loads while it runs, and its request (whose
        # adapter is not loaded: the engine loads it first) joins the same batches.
        stream = asyncio.ensure_future(_tokens(engine, "base", max_tokens=40,
                                               out_kind=RequestOutputKind.CUMULATIVE))
        assert await engine.add_lora(lr1) is True
        assert await engine.list_loras() == {1}
        got1, got2 = await asyncio.gather(_tokens(engine, "r1", lr1), _tokens(engine, "r2", lr2))
        assert (got1, got2) == (ref1, ref2)
        assert await engine.list_loras() == {1, 2}
        with pytest.raises(LoRAAdapterError) as e:
            await engine.add_lora(LoRARequest("bad", 7, "/no/such/adapter"))
        assert e.value.param == "lora_path"
        with pytest.raises(ValueError, match="does not exist"):
            await _tokens(engine, "r3", LoRARequest("bad2", 8, "/no/such/adapter"))
        # Removing an adapter in use: its request still finishes with it.
        busy = asyncio.ensure_future(_tokens(engine, "r4", lr2, max_tokens=5))
        await asyncio.sleep(0)
        assert await engine.remove_lora(2) is True
        assert await busy == ref2
        assert await engine.list_loras() == {1}
        assert len(await stream) == 40
    loop.run_until_complete(run())
