"""response_format / structured_outputs -> SamplingParams.structured_outputs on chat and
completions (no server): every accepted form, and the 400s naming the field (also over
HTTP in process on chat, completions and Responses, and offline). Also the bench's
--structured-output-schema body and StructuredOutputsConfig parsing."""
from __future__ import annotations

import json

import pydantic
import pytest
from test_app import _output, app_and_engine  # noqa: F401  (fixture)

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
    # the exact field, as OpenAI names it
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "value": 5}}, "response_format.value"),
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


# ---- malformed structured_outputs: a 400 naming structured_outputs.<key>, never Python's
# own TypeError text ("__init__() got an unexpected keyword argument 'foo'")
MALFORMED = [
    ({"foo": 1}, "structured_outputs.foo"),
    ({"regex": "a", "foo": 1, "bar": 2}, "structured_outputs.bar"),  # every unknown key is named
    ({"regex": 5}, "structured_outputs.regex"),  # was compiled as the regex "5"
    ({"grammar": 3}, "structured_outputs.grammar"),
    ({"choice": "abc"}, "structured_outputs.choice"),  # was taken as the choices "a", "b", "c"
    ({"choice": [1, 2]}, "structured_outputs.choice"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": 5}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"json_object": 1}, "structured_outputs.json_object"),
    ({"structural_tag": 5}, "structured_outputs.structural_tag"),
    ({"regex": "a+", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
    ({"regex": "a+", "disable_additional_properties": 1}, "structured_outputs.disable_additional_properties"),
    ({"regex": "a+", "whitespace_pattern": 3}, "structured_outputs.whitespace_pattern"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),  # two constraint kinds
    ({}, "exactly one of"),
]
# well typed, but the constraint does not compile (checked by validate_structured_outputs:
# the front ends and the offline InputProcessor)
UNCOMPILABLE = [({"structural_tag": {"a": 1}}, "structured_outputs.structural_tag"),
                ({"regex": "("}, "structured_outputs.regex"), ({"grammar": "nonsense"}, "structured_outputs.grammar"),
                # JSON text with an integer past int_max_str_digits: was Python's "Exceeds the limit" without param
                ({"json": '{"type": "integer", "maximum": ' + "9" * 5000 + "}"}, "structured_outputs.json holds")]


@pytest.mark.parametrize("value,named", MALFORMED + UNCOMPILABLE)
def test_malformed_structured_outputs_name_the_key(value, named):
    for cls, extra in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                       (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(SamplingParamsError) as e:
            cls(model="m", **extra, structured_outputs=value).to_sampling_params(8, {})
        assert e.value.param == "structured_outputs" and named in str(e.value), str(e.value)
        assert "__init__" not in str(e.value) and "keyword argument" not in str(e.value)


def test_offline_structured_outputs_raise_a_clear_value_error():
    """The offline API takes StructuredOutputsParams or, as the server, a dict of its
    fields; anything malformed is a ValueError naming structured_outputs.<key>."""
    from llmserve import SamplingParams
    from llmserve.sampling_params import StructuredOutputsParams
    from llmserve.structured_output import validate_structured_outputs

    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    for value, named in MALFORMED:
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            SamplingParams(structured_outputs=value)
    for value in (5, "json", ["regex"]):
        with pytest.raises(ValueError, match="structured_outputs must be an object"):
            SamplingParams(structured_outputs=value)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex must be a string"):
        StructuredOutputsParams(regex=5)
    for value, named in UNCOMPILABLE:  # what the offline InputProcessor runs on each request
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            validate_structured_outputs(SamplingParams(structured_outputs=value).structured_outputs)
    with pytest.raises(ValueError, match=r"structured_outputs\[' x'\]"):  # a key that is no name: repr
        StructuredOutputsParams.from_dict({"regex": "a", " x": 1})


# the same over HTTP, on every route that takes structured_outputs (in process, the
# scripted engine of test_app.py)
ROUTES = {"/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
          "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 3},
          "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 3}}


@pytest.mark.parametrize("value,named", MALFORMED + UNCOMPILABLE + [([1], "structured_outputs"),
                                                                      ("json", "structured_outputs")])
def test_every_route_answers_malformed_structured_outputs_with_a_400(app_and_engine, value, named):  # noqa: F811
    client, engine = app_and_engine()
    for path, body in ROUTES.items():
        r = client.post(path, json={**body, "structured_outputs": value})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "structured_outputs" and named in err["message"], (path, err)
        assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert engine.prompts == []  # refused before the engine
    # the next request on each route is served (and constrained: Responses takes the field too)
    for path, body in ROUTES.items():
        engine.outputs = [_output("ab", "stop")]
        r = client.post(path, json={**body, "structured_outputs": {"regex": "a+b", "disable_any_whitespace": True}})
        assert r.status_code == 200, (path, r.text)
        assert engine.params[-1].structured_outputs.regex == "a+b", path


def test_responses_refuses_text_format_and_structured_outputs_together(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    body = {**ROUTES["/v1/responses"], "structured_outputs": {"choice": ["x"]}, "text": {"format": {"type": "json_object"}}}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    engine.outputs = [_output("x", "stop")]
    r = client.post("/v1/responses", json={**body, "text": {"format": {"type": "text"}}})
    assert r.status_code == 200 and engine.params[-1].structured_outputs.choice == ["x"], r.text
