"""response_format / structured_outputs -> SamplingParams.structured_outputs on chat and
completions (no server): every accepted form, and the 400s naming the field. Also the
bench's --structured-output-schema body and StructuredOutputsConfig parsing."""
from __future__ import annotations

import json

import pydantic
import pytest

from llmserve.benchmarks.serve import BUILTIN_SCHEMA, structured_body
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.sampling_params import SamplingParamsError
from llmserve.structured_output import make_structured_outputs_config

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def _params(**kw):
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)
    comp = CompletionRequest(model="m", prompt="hi", **kw)
    return [r.to_sampling_params(8, {}).structured_outputs for r in (chat, comp)]


def test_response_format_forms():
    assert _params(response_format={"type": "text"}) == [None, None]
    assert all(p.json_object for p in _params(response_format={"type": "json_object"}))
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert all(p.json == SCHEMA for p in _params(response_format=rf))
    assert all(p.choice == ["a", "b"] for p in _params(structured_outputs={"choice": ["a", "b"]}))
    assert all(p.regex == "x+" and p.disable_any_whitespace
               for p in _params(structured_outputs={"regex": "x+", "disable_any_whitespace": True}))


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_constraints_name_the_field(kw, param):
    for cls, extra in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                       (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(SamplingParamsError) as e:
            cls(model="m", **extra, **kw).to_sampling_params(8, {})
        assert e.value.param == param


def test_bogus_response_format_type_fails_validation():
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest(model="m", messages=[], response_format={"type": "bogus"})
    assert e.value.errors()[0]["loc"][0] == "response_format"


def test_bench_body_and_config(tmp_path):
    assert structured_body(None) == {}
    assert structured_body("builtin")["response_format"]["json_schema"]["schema"] == BUILTIN_SCHEMA
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    assert structured_body(str(f))["response_format"]["json_schema"]["schema"] == SCHEMA
    cfg = make_structured_outputs_config('{"backend": "xgrammar", "disable_any_whitespace": false}')
    assert cfg.backend == "xgrammar" and not cfg.disable_any_whitespace
    assert make_structured_outputs_config(None).max_compile_workers == 2
    assert make_structured_outputs_config('{"max_compile_workers": 3}').max_compile_workers == 3
    for bad in ('{"backend": "outlines"}', '{"nope": 1}', "{", '{"disable_any_whitespace": "yes"}',
                '{"max_compile_workers": 0}', '{"max_compile_workers": true}', '{"max_compile_workers": "2"}'):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            make_structured_outputs_config(bad)


def test_vllm_guided_fields_become_structured_outputs():
    """Trial of stop 43: vLLM's older guided_* fields were ignored with a warning, so a
    client written for them got free text. They now constrain as structured_outputs does;
    a bad one is the same 400, and both forms at once are refused."""
    assert all(p.regex == "x+" for p in _params(guided_regex="x+", guided_decoding_backend="xgrammar"))
    assert all(p.choice == ["a", "b"] for p in _params(guided_choice=["a", "b"]))
    assert all(p.json == SCHEMA for p in _params(guided_json=SCHEMA))
    assert all(p.grammar == 'root ::= "a"' for p in _params(guided_grammar='root ::= "a"'))
    assert _params(guided_decoding_backend="xgrammar") == [None, None]  # a backend alone constrains nothing
    with pytest.raises(SamplingParamsError) as e:
        _params(guided_regex="(")
    assert e.value.param == "structured_outputs"
    with pytest.raises(pydantic.ValidationError, match="not both"):
        CompletionRequest(model="m", prompt="hi", guided_regex="x", structured_outputs={"regex": "y"})
