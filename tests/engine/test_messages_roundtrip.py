"""Every message type that crosses the process boundary survives encode -> decode through
``engine/serial.py`` with all of its fields equal (nothing re-validated, nothing lost),
and the layers import one way."""
import subprocess
import sys

import pytest
import torch

from llmserve.core.outputs import EngineCoreEvent, EngineCoreEventType, FinishReason
from llmserve.engine import messages as m
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder
from llmserve.metrics.stats import SchedulerStats
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams


def _params():
    """SamplingParams with fields derived after construction (by the InputProcessor)."""
    p = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=None, stop=["\n\n"], stop_token_ids=[5],
                       logprobs=2, seed=3, bad_words=["xyz"],
                       structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True))
    p.max_tokens = 77
    p.all_stop_token_ids |= {11, 12}  # extra EOS ids of the generation config
    p.bad_words_token_ids = [[4, 5]]
    return p


def _lp():
    return m.LogprobsLists([[1, 2, 3]], [[-0.1, -2.0, -3.5]], [1])


def _event():
    return EngineCoreEvent(EngineCoreEventType.PREEMPTED, 123.25, 16, 4, "kv_cache_full")


def _output():
    # pooling_output: one element, so the dict comparison below can truth-test it
    # (tests/pooling/test_pooling_engine.py round-trips a whole vector).
    return m.EngineCoreOutput("r1", [7, 8], _lp(), _lp(), FinishReason.STOP, 5, 3, [_event()],
                              torch.tensor([0.25]), beam_sequences=[_beam_seq()], model_execute_time=0.5,
                              beam_first_token_ts=12.5)


def _beam_seq():
    return m.BeamSequenceOutput([5, 6, 2], [-0.5, -1.25, -0.125], -1.875, -0.625, FinishReason.STOP, 2)


def _beam_params():
    return m.BeamSearchParams(4, 32, True, 0.5, 0.8, True, "never")


def _lora():
    return m.LoRARequest("sql", 3, "/adapters/sql", "/local/sql", 4096, "base-model", {"a": 1}, True)


def _enc():
    return m.EncoderInputs(b"\x00\x00\x80?" * 6, (2, 3), "float32", 1)


SAMPLES = {
    m.EncoderInputs: _enc,
    m.EngineCoreRequest: lambda: m.EngineCoreRequest("r1", [1, 2, 3], _params(), 2, 1700000000.5, 3, True,
                                                     {"traceparent": "00-abc-def-01"},
                                                     PoolingParams(normalize=False, dimensions=8, task="embed"),
                                                     True, [4, 5], _enc(), data_parallel_rank=1,
                                                     client_index=2, beam_search_params=_beam_params(),
                                                     tenant="alice", tenant_weight=3.0, lora_request=_lora()),
    m.StreamingInputChunk: lambda: m.StreamingInputChunk("r1", [9, 10], _params(), True),
    m.EngineCoreOutput: _output,
    m.EngineCoreOutputs: lambda: m.EngineCoreOutputs(
        [_output()], SchedulerStats(3, 1, 0.5, 10, 20, 64, 32, 1), 99.5,
        m.UtilityOutput(4, {"a": 1}, None), ["r0"], [m.EngineCoreRejection("r2", "too long")],
        m.EngineCoreDead("boom", 9, True), m.EngineCoreReady(100, 1234), engine_index=1),
    m.EngineCoreReady: lambda: m.EngineCoreReady(100, 1234),
    m.EngineCoreRejection: lambda: m.EngineCoreRejection("r2", "The request needs up to 900 tokens", True),
    m.EngineCoreDead: lambda: m.EngineCoreDead("EngineCore process died (exit code -9)", -9, True),
    m.UtilityOutput: lambda: m.UtilityOutput(4, None, "ValueError: no"),
    m.UtilityRequest: lambda: m.UtilityRequest(5, "get_stats", [1, "x"], 1),
    m.LogprobsLists: _lp,
    EngineCoreEvent: _event,
    m.BeamSearchParams: lambda: _beam_params(),
    m.BeamSequenceOutput: _beam_seq,
    m.LoRARequest: _lora,
}


def _fields(obj):
    return {f: getattr(obj, f) for f in obj.__struct_fields__}


def test_every_wire_type_has_a_sample():
    assert set(SAMPLES) == set(m.WIRE_TYPES)


@pytest.mark.parametrize("cls", m.WIRE_TYPES, ids=lambda c: c.__name__)
def test_round_trip_keeps_every_field(cls):
    obj = SAMPLES[cls]()
    back = MsgpackDecoder(cls).decode(MsgpackEncoder().encode(obj))
    assert type(back) is cls
    assert _fields(back) == _fields(obj)
    names, defaults = cls.__struct_fields__, cls.__struct_defaults__
    for f, default in zip(names[len(names) - len(defaults):], defaults):  # no field left at its default
        if cls is not m.UtilityOutput:
            assert getattr(obj, f) != default, f"sample leaves {cls.__name__}.{f} at its default"


def test_request_sampling_params_keep_derived_fields():
    req = SAMPLES[m.EngineCoreRequest]()
    back = MsgpackDecoder(m.EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    sp, bsp = req.sampling_params, back.sampling_params
    assert bsp.max_tokens == 77
    assert bsp.bad_words_token_ids == [[4, 5]]
    assert bsp.all_stop_token_ids == sp.all_stop_token_ids  # extra EOS ids survive the decode
    assert back.sampling_params == req.sampling_params


def test_finish_reason_and_events_decode_typed():
    back = MsgpackDecoder(m.EngineCoreOutputs).decode(MsgpackEncoder().encode(SAMPLES[m.EngineCoreOutputs]()))
    out = back.outputs[0]
    assert out.finish_reason is FinishReason.STOP and str(out.finish_reason) == "stop"
    assert out.events[0].type is EngineCoreEventType.PREEMPTED and out.events[0].reason == "kv_cache_full"
    assert back.engine_dead and back.dead.during_startup


def _imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(n for n in sys.modules if n.startswith('llmserve'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_layers_import_one_way():
    ground = _imported_by("llmserve.core.outputs")
    assert ground <= {"llmserve", "llmserve.core", "llmserve.core.outputs"}
    wire = _imported_by("llmserve.engine.messages")
    assert not {n for n in wire if n.startswith(("llmserve.worker", "llmserve.core.scheduler", "llmserve.ops",
                                                 "llmserve.engine.core"))}
    ops = _imported_by("llmserve.ops.cpu_ops")
    assert ops <= {"llmserve", "llmserve.envs", "llmserve.ops", "llmserve.ops.cpu_ops"}  # envs: ground floor too
    runner = _imported_by("llmserve.worker.model_runner")
    assert not {n for n in runner if n.startswith("llmserve.engine")}, "the runner must know no process or client"
    assert "llmserve.benchmarks" not in " ".join(_imported_by("llmserve.attention"))
