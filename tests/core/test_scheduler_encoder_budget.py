"""The scheduler's encoder budget (encoder-decoder models, issue 15): new audio requests
start only while their encoder positions fit ``max_num_encoder_input_tokens`` per step;
one larger than the whole budget still starts, alone; running requests cost nothing."""
from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request
from llmserve.core.scheduler import Scheduler
from llmserve.engine.messages import EncoderInputs
from llmserve.sampling_params import SamplingParams

from sched_utils import run_step


def _sched(encoder_budget: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                     max_num_encoder_input_tokens=encoder_budget),
                     CacheConfig(block_size=4, enable_prefix_caching=False), 64)


def _req(rid: str, enc_tokens: int) -> Request:
    enc = EncoderInputs(b"", (80, 2 * enc_tokens), "float32", enc_tokens) if enc_tokens else None
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), 0, encoder_inputs=enc)


def test_encoder_budget_spreads_new_audio_requests_over_steps():
    s = _sched(3000)
    for i in range(5):
        s.add_request(_req(f"a{i}", 1500))
    s.add_request(_req("text", 0))
    starts = []
    for _ in range(3):
        so, _ = run_step(s)
        starts.append(sorted(x.request.request_id for x in so.scheduled if x.num_computed_tokens == 0))
    assert starts == [["a0", "a1"], ["a2", "a3"], ["a4", "text"]]


def test_request_over_the_whole_budget_runs_alone():
    s = _sched(1000)
    s.add_request(_req("big", 1500))
    s.add_request(_req("next", 1500))
    so, _ = run_step(s)
    assert [x.request.request_id for x in so.scheduled] == ["big"]
    so, _ = run_step(s)
    assert sorted(x.request.request_id for x in so.scheduled) == ["big", "next"]
