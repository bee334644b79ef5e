"""Structured outputs on the server (issue 12 points 1-2, case C26): response_format
json_schema / json_object and vLLM's structured_outputs field on chat and completions,
streamed and not, with the real SmolLM2 on the shared session server."""
from __future__ import annotations

import json

import jsonschema
import pytest

from e2e_utils import MODEL, finish_reasons, stream_text
from test_errors import assert_error

# C26's schema.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
          "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
J1 = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a person."}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
      "max_tokens": 64, "temperature": 0}


def _person(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    assert obj["name"] in ("Ada", "Alan", "Grace") and type(obj["age"]) is int
    return obj


def test_c26_j1_j2_schema_enforced_streamed_equals_non_streamed(server):
    r = server.post("/v1/chat/completions", J1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    _person(choice["message"]["content"])
    chunks = server.stream_chunks("/v1/chat/completions", {**J1, "stream": True})
    assert stream_text(chunks, chat=True) == choice["message"]["content"]
    assert [f for f in finish_reasons(chunks) if f] == ["stop"]


def test_c26_j3_json_object(server):
    r = server.post("/v1/chat/completions", {**J1, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("rf", [{"type": "json_object", "value": SCHEMA}, {"type": "json", "value": SCHEMA}])
def test_tgi_response_format_shapes_enforce_the_schema(server, rf):
    """TGI's shapes (what the Hugging Face client sends): the schema in ``value`` is
    enforced, not dropped to "any JSON object"."""
    r = server.post("/v1/chat/completions", {**J1, "response_format": rf})
    assert r.status_code == 200, r.text
    _person(r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("rf", [
    {"type": "json_object", "value": "not a schema"},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": "nonsense"}, "strict": True}},  # J4
    {"type": "bogus"},  # J5
    {"type": "json_schema"},  # no schema object
    {"type": "structural_tag"},  # neither structures+triggers nor format
    {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]},  # no schema
    {"type": "structural_tag", "format": {"type": "no_such_format"}},
])
def test_c26_j4_j5_bad_response_format_is_400(server, rf):
    for path, body in (("/v1/chat/completions", {**J1, "response_format": rf}),
                       ("/v1/completions", {"model": MODEL, "prompt": "A person:", "response_format": rf})):
        assert_error(server.post(path, body), 400, "response_format")
        assert_error(server.post(path, {**body, "stream": True}), 400, "response_format")
    server.assert_healthy()


@pytest.mark.parametrize("so,param", [({"json": {"type": "nonsense"}}, "structured_outputs"),
                                      ({"regex": "a(b"}, "structured_outputs"),
                                      ({"grammar": "root ::= undefined_rule"}, "structured_outputs"),
                                      ({"choice": ["a"], "regex": "a"}, "structured_outputs"),
                                      ({"jsn": {}}, "structured_outputs")])
def test_bad_structured_outputs_is_400(server, so, param):
    assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": so}),
                 400, param)


def test_completions_response_format_and_structured_outputs(server):
    base = {"model": MODEL, "prompt": "A person as JSON:", "max_tokens": 64, "temperature": 0}
    r = server.post("/v1/completions", {**base, "response_format": J1["response_format"]})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    _person(text)
    chunks = server.stream_chunks("/v1/completions", {**base, "response_format": J1["response_format"],
                                                      "stream": True})
    assert stream_text(chunks) == text
    r = server.post("/v1/completions", {**base, "n": 3, "temperature": 1.0,
                                        "structured_outputs": {"choice": ["cat", "dog", "bird"]}})
    assert r.status_code == 200, r.text
    assert all(c["text"] in ("cat", "dog", "bird") and c["finish_reason"] == "stop" for c in r.json()["choices"])
    r = server.post("/v1/chat/completions", {**J1, "response_format": None,
                                             "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200, r.text
    import re
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["message"]["content"])


def test_max_tokens_inside_json_value_finishes_with_length(server):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}},
              "required": ["story"], "additionalProperties": False}
    body = {**J1, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith('{')
    chunks = server.stream_chunks("/v1/chat/completions", {**body, "stream": True})
    assert [f for f in finish_reasons(chunks) if f] == ["length"]


def test_openai_client_parse_with_pydantic_model(server):
    """The official client's parse() sends a strict schema (additionalProperties false)."""
    from typing import Literal

    from pydantic import BaseModel

    class Person(BaseModel):
        name: Literal["Ada", "Alan", "Grace"]
        age: int

    client = server.client()
    done = client.chat.completions.parse(model=MODEL, messages=J1["messages"], response_format=Person,
                                         max_tokens=64, temperature=0)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"


def _tagged_person(text: str, begin: str, end: str) -> dict:
    assert text.startswith(begin) and text.endswith(end), text
    return _person(text[len(begin):-len(end)])


def test_structural_tag_response_format_both_forms(server):
    """vLLM's ``response_format`` ``structural_tag``: xgrammar's ``format`` form (here one
    tag the whole output must be: begin, a schema'd JSON, end) on chat and completions,
    streamed equal to whole; vLLM's legacy ``structures``/``triggers`` form is accepted."""
    tag = {"type": "tag", "begin": "<person>", "end": "</person>",
           "content": {"type": "json_schema", "json_schema": SCHEMA}}
    rf = {"type": "structural_tag", "format": tag}
    r = server.post("/v1/chat/completions", {**J1, "response_format": rf})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    _tagged_person(text, "<person>", "</person>")
    chunks = server.stream_chunks("/v1/chat/completions", {**J1, "response_format": rf, "stream": True})
    assert stream_text(chunks, chat=True) == text
    c = server.post("/v1/completions", {"model": MODEL, "prompt": "A person:", "max_tokens": 64, "temperature": 0,
                                        "response_format": rf})
    assert c.status_code == 200, c.text
    _tagged_person(c.json()["choices"][0]["text"], "<person>", "</person>")
    legacy = {"type": "structural_tag", "triggers": ["<person>"],
              "structures": [{"begin": "<person>", "schema": SCHEMA, "end": "</person>"}]}
    r = server.post("/v1/chat/completions", {**J1, "response_format": legacy,
                                             "messages": [{"role": "user", "content": "Write <person> then a person."}]})
    assert r.status_code == 200, r.text  # was a 400; what it accepts: tests/structured_output/test_structural_tag.py
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
