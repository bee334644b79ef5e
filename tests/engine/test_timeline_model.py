"""The model a request timeline (GET /v1/requests) lists: its LoRA adapter's name when it
runs with one (the ``model`` its response names), else the base model's served name."""
from __future__ import annotations

from llmserve.engine.messages import EngineCoreRequest
from llmserve.engine.output_processor import OutputProcessor, register_incarnations
from llmserve.engine.request_timeline import RequestTimelines
from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import get_tokenizer


def _record(op, rid, lora=None, own_lora=None):
    req = EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=2), 2, 0.0, lora_request=own_lora)
    (sent,) = register_incarnations(op, [(req, None)], None, None, lora)
    return op.states[sent.request_id].timeline


def test_timeline_model_is_the_adapter_name():
    op = OutputProcessor(get_tokenizer("SmolLM2-135M-Instruct"), log_stats=False)
    op.timelines = RequestTimelines(default_model="base")
    chat = LoRARequest("chat", 1, "/adapters/chat")
    assert _record(op, "plain").model == "base"
    assert _record(op, "by-arg", lora=chat).model == "chat"  # AsyncLLM / LLMEngine pass the adapter
    assert _record(op, "prepared", own_lora=chat).model == "chat"  # an EngineCoreRequest carrying one
    assert op.timelines.get("by-arg").summary()["model"] == "chat"
