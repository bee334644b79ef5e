"""response_format ``structural_tag`` (vLLM's two forms) -> the grammar the engine runs:
which whole outputs it accepts (xgrammar's own string matcher), and the 400s for
malformed tags. The real-model requests are tests/e2e/test_structured_outputs.py."""
from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from llmserve.entrypoints.openai.common.structured import ResponseFormat, structured_outputs_params
from llmserve.sampling_params import SamplingParamsError
from llmserve.structured_output.grammar import build_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
LEGACY = {"type": "structural_tag", "triggers": ["<function="],
          "structures": [{"begin": "<function=add>", "schema": SCHEMA, "end": "</function>"}]}
FORMAT = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                               "content": {"type": "json_schema", "json_schema": SCHEMA}}}


def _grammar(rf: dict):
    params = structured_outputs_params(ResponseFormat(**rf), None)
    return build_grammar(("structural_tag", params.structural_tag, False))


def test_legacy_form_free_text_then_tagged_json_follows_its_schema():
    g = _grammar(LEGACY)
    assert accepts(g, "Let me add them.")  # no trigger: free text
    assert accepts(g, 'Sure. <function=add>{"a": 1}</function> done')
    assert not accepts(g, 'Sure. <function=add>{"a": "one"}</function>')  # the schema holds inside the tag
    assert not accepts(g, 'Sure. <function=sub>{"a": 1}</function>')  # a trigger must open a known tag


def test_xgrammar_format_form_is_the_whole_output():
    g = _grammar(FORMAT)
    assert accepts(g, '<answer>{"a": 5}</answer>')
    assert not accepts(g, 'The answer: <answer>{"a": 5}</answer>')
    assert not accepts(g, '<answer>{"b": 5}</answer>')


@pytest.mark.parametrize("rf,words", [
    ({"type": "structural_tag"}, "'structures' and 'triggers'"),
    ({"type": "structural_tag", "structures": LEGACY["structures"]}, "'structures' and 'triggers'"),
    ({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>"}]}, "structures[0]"),
    ({**LEGACY, "triggers": "<function="}, "'triggers' must be a list"),
    ({**LEGACY, "structures": {"begin": "<f>"}}, "'structures' must be a list"),
    ({"type": "structural_tag", "format": {"type": "no_such_format"}}, "no_such_format"),
])
def test_malformed_structural_tags_are_errors_naming_response_format(rf, words):
    with pytest.raises(SamplingParamsError) as e:
        structured_outputs_params(ResponseFormat(**rf), None)
    assert e.value.param == "response_format" and words in str(e.value), str(e.value)


def test_the_tag_passed_on_is_the_whole_object_as_vllm():
    params = structured_outputs_params(ResponseFormat(**LEGACY), None)
    assert json.loads(params.structural_tag) == LEGACY
