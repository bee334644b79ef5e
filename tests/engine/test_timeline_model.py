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


def test_each_choice_of_an_n_request_is_a_row_of_its_own():
    # n=128 showed 128 rows of the one response id (the web page keys rows and timelines
    # by id); each choice is now vLLM's sub-request name "<i>_<response id>", and the
    # response id (and the client's X-Request-Id) still find the request (its first choice)
    from llmserve.engine.parallel_sampling import ParentRequest
    from llmserve.engine.request_timeline import RequestLabels, current_request_labels

    op = OutputProcessor(get_tokenizer("SmolLM2-135M-Instruct"), log_stats=False)
    op.timelines = RequestTimelines(default_model="base")
    parent = ParentRequest("cmpl-internal", SamplingParams(n=3, max_tokens=2))
    token = current_request_labels.set(RequestLabels(aliases=["client-id"],
                                                     response_ids={"cmpl-internal": "cmpl-abc"}))
    try:
        reqs = [(EngineCoreRequest(cid, [1, 2], parent.child_params(i), 2, 0.0), None)
                for i, cid in enumerate(parent.child_ids)]
        register_incarnations(op, reqs, parent, None, None)
    finally:
        current_request_labels.reset(token)
    rows = [r.summary()["id"] for r in op.timelines.list()]
    assert rows == ["0_cmpl-abc", "1_cmpl-abc", "2_cmpl-abc"]
    assert op.timelines.get("2_cmpl-abc").request_id == "2_cmpl-internal"
    assert op.timelines.get("cmpl-abc").id == op.timelines.get("client-id").id == "0_cmpl-abc"
