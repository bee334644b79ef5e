"""Pooling through the engine's parts: the wire structs, the scheduler (whole prompts, no
KV for encoders), the pooler, and the async path (``AsyncLLM.encode``)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.outputs import ModelRunnerOutput
from llmserve.core.request import Request
from llmserve.core.scheduler import Scheduler
from llmserve.engine import messages as m
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder
from llmserve.pooler_config import PoolerConfig
from llmserve.pooling_params import PoolingParams
from llmserve.worker.pooler import Pooler


def test_pooling_request_and_output_round_trip():
    req = m.EngineCoreRequest("r1", [1, 2, 3], None, None, 1.5, pooling_params=PoolingParams(normalize=False,
                                                                                              dimensions=4))
    back = MsgpackDecoder(m.EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert back.sampling_params is None and back.pooling_params == req.pooling_params
    vec = torch.randn(384)
    outs = m.EngineCoreOutputs([m.EngineCoreOutput("r1", [], finish_reason=m.FinishReason.STOP, pooling_output=vec)])
    back = MsgpackDecoder(m.EngineCoreOutputs).decode(MsgpackEncoder().encode(outs))
    got = back.outputs[0].pooling_output
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and torch.equal(got, vec)


def _sched(needs_kv: bool, budget: int = 64, num_blocks: int = 8):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64),
                     CacheConfig(block_size=4), num_blocks, needs_kv=needs_kv)


def _preq(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), None, None, pooling_params=PoolingParams())


def _run(s: Scheduler):
    so = s.schedule()
    ro = ModelRunnerOutput()
    for x in so.scheduled:
        ro.pooler_output[x.request.request_id] = torch.full((2,), float(x.num_scheduled_tokens))
    return so, s.update_from_output(so, ro)


def test_scheduler_runs_pooling_prompts_whole_and_finishes_them():
    s = _sched(needs_kv=True, budget=64, num_blocks=64)
    for rid, n in (("a", 30), ("b", 30), ("c", 30)):
        s.add_request(_preq(rid, n))
    so, outs = _run(s)
    # c does not fit the 64-token budget whole: it waits instead of being chunked.
    assert [(x.request.request_id, x.num_scheduled_tokens) for x in so.scheduled] == [("a", 30), ("b", 30)]
    assert [(o.request_id, o.finished, o.new_token_ids, o.pooling_output.tolist()) for o in outs] == [
        ("a", True, [], [30.0, 30.0]), ("b", True, [], [30.0, 30.0])]
    assert not s.running and s.kv_cache_manager.num_used_blocks == 0  # blocks freed (cached) at once
    so, outs = _run(s)
    assert [o.request_id for o in outs] == ["c"] and not s.has_unfinished_requests()


def test_encoder_scheduler_allocates_no_kv_blocks():
    # 8 blocks of 4 tokens could not hold three 30-token prompts; an encoder needs none.
    s = _sched(needs_kv=False, budget=128, num_blocks=9)
    for rid in "abc":
        s.add_request(_preq(rid, 30))
    so, outs = _run(s)
    assert len(so.scheduled) == 3 and all(x.block_ids == [] for x in so.scheduled)
    assert len(outs) == 3 and s.kv_cache_manager.num_used_blocks == 0


def test_pooler_types_dimensions_and_normalize():
    hidden = torch.arange(12, dtype=torch.float32).view(4, 3)  # two requests: rows 0-2 and row 3
    lens = [3, 1]
    p = [PoolingParams(normalize=False), PoolingParams(normalize=False)]
    assert Pooler(PoolerConfig("MEAN")).pool(hidden, lens).tolist() == [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]
    assert Pooler(PoolerConfig("CLS"))(hidden, lens, p)[0].tolist() == [0.0, 1.0, 2.0]
    assert Pooler(PoolerConfig("LAST"))(hidden, lens, p)[0].tolist() == [6.0, 7.0, 8.0]
    v = Pooler(PoolerConfig("LAST", normalize=True))(hidden, lens, [PoolingParams(dimensions=2), PoolingParams()])
    assert torch.allclose(v[0], torch.tensor([6.0, 7.0]) / 85 ** 0.5) and v[1].shape == (3,)


def test_async_encode_and_supported_tasks():
    from llmserve import AsyncLLM
    from llmserve.engine_args import AsyncEngineArgs

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="all-MiniLM-L6-v2", dtype="float32"))
        try:
            assert await engine.get_supported_tasks() == ("encode", "embed")

            async def one(i, text):
                outs = [o async for o in engine.encode(text, PoolingParams(task="embed"), f"r{i}")]
                return outs

            results = await asyncio.gather(*(one(i, t) for i, t in enumerate(["a b c", "Hello there", "x"])))
            for outs in results:
                assert len(outs) == 1 and outs[0].finished and outs[0].outputs.data.shape == (384,)
            with pytest.raises(ValueError, match="--runner generate"):
                from llmserve import SamplingParams
                async for _ in engine.generate("hi", SamplingParams(max_tokens=2), "g"):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(main())


def _kind(c: PoolerConfig) -> tuple:
    return c.pooling_type, c.normalize


def test_bare_encoder_embeds_normalised_unless_sentence_transformers_says_otherwise(tmp_path):
    """vLLM's embed default is normalize=True; a sentence-transformers directory decides by
    its Normalize module (a fresh-user trial found a bare BertModel's [CLS] vector of norm
    24 returned raw)."""
    import json

    from transformers import BertConfig

    from llmserve.pooler_config import load_pooler_config
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     architectures=["BertModel"])
    assert _kind(load_pooler_config(str(tmp_path), cfg)) == ("CLS", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert _kind(load_pooler_config(str(tmp_path), cfg)) == ("MEAN", False)
    modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert _kind(load_pooler_config(str(tmp_path), cfg)) == ("MEAN", True)
