"""Issue 12 "Must show": 50 JSON schemas of varied shape, greedy and temperature 1.0, in
one offline batch each on the real SmolLM2: every output finishes with ``stop``, parses
and validates (jsonschema). Regex and choice the same; a bad schema is refused before it
runs. Also: n > 1 children each follow their own matcher."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmserve import SamplingParams
from llmserve.sampling_params import SamplingParamsError, StructuredOutputsParams as SO

from schemas import SCHEMAS

PROMPT = "Reply with one JSON object for this schema:\n{}\nJSON:"


@pytest.mark.slow  # ~20 s on the AVX2 CI CPU: 50 schemas generated to the end; json_schema per request: tests/e2e/test_structured_outputs.py, C26; `make test-all`
def test_50_json_schemas_all_finish_and_validate(llm_fp32):
    """Greedy and temperature 1.0 in one batch of 100 (one decode tail instead of two)."""
    prompts = [PROMPT.format(json.dumps(s)) for s in SCHEMAS] * 2
    params = [SamplingParams(max_tokens=160, temperature=t, seed=i, structured_outputs=SO(json=s))
              for t in (0.0, 1.0) for i, s in enumerate(SCHEMAS)]
    outs = llm_fp32.generate(prompts, params, use_tqdm=False)
    for p, out in zip(params, outs):
        c, schema = out.outputs[0], p.structured_outputs.json
        assert c.finish_reason == "stop", (p.temperature, schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice(llm_fp32, temperature):
    cases = [(r"\d{3}-\d{4}", "A phone number:"), (r"(yes|no)", "Is the sky blue?"),
             (r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", "A full name:"),
             (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)", "A date:"),
             (r"#[0-9a-f]{6}", "A colour in hex:")]
    choices = [["red", "green", "blue"], ["Paris", "London", "Rome"], ["a b", "c \"d\"", "ü"]]
    prompts = [p for _, p in cases] + ["Pick one:"] * len(choices)
    params = ([SamplingParams(max_tokens=32, temperature=temperature, seed=1, structured_outputs=SO(regex=r))
               for r, _ in cases]
              + [SamplingParams(max_tokens=32, temperature=temperature, seed=2, structured_outputs=SO(choice=ch))
                 for ch in choices])
    outs = llm_fp32.generate(prompts, params, use_tqdm=False)
    for (r, _), out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(r, out.outputs[0].text), out.outputs[0].text
    for ch, out in zip(choices, outs[len(cases):]):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ch


def test_n_children_and_unconstrained_neighbours(llm_fp32):
    """n=4 children each complete a valid object; an unconstrained request in the same
    batch gives the same tokens as alone (its row is never masked)."""
    schema = SCHEMAS[5]
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = llm_fp32.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm_fp32.generate(
        [PROMPT.format(json.dumps(schema)), "The capital of France is"],
        [SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=7, structured_outputs=SO(json=schema)), plain],
        use_tqdm=False)
    assert len(outs[0].outputs) == 4
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert outs[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("so", [SO(json={"type": "nonsense"}), SO(json={"type": "integer", "minimum": "x"}),
                                SO(json={"type": "string", "minLength": -3}),  # valid to xgrammar until compiled
                                SO(regex="a(b"), SO(grammar="root ::= nothing")])
def test_malformed_constraint_refused_before_running(llm_fp32, so):
    with pytest.raises(SamplingParamsError) as e:
        llm_fp32.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert e.value.param == "structured_outputs"


def test_properties_come_in_the_schemas_order(llm_fp32):
    """Fresh-user trial: the grammar was built from the schema with its keys sorted, so
    {"zeta", "alpha", "mid"} came out as {"alpha": .., "mid": .., "zeta": ..} on every
    route. OpenAI and xgrammar emit properties in the schema's order."""
    from xgrammar.testing import _is_grammar_accept_string

    from llmserve.structured_output.grammar import build_grammar, grammar_key
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha", "mid"],
              "properties": {"zeta": {"type": "string", "maxLength": 8}, "alpha": {"type": "integer"},
                             "mid": {"type": "boolean"}}}
    grammar = build_grammar(grammar_key(SO(json=schema)))
    assert _is_grammar_accept_string(grammar, '{"zeta": "a", "alpha": 1, "mid": true}')
    assert not _is_grammar_accept_string(grammar, '{"alpha": 1, "mid": true, "zeta": "a"}')
    out = llm_fp32.generate(["JSON please: "], SamplingParams(temperature=0, max_tokens=60,
                                                            structured_outputs=SO(json=schema)), use_tqdm=False)
    assert list(json.loads(out[0].outputs[0].text)) == ["zeta", "alpha", "mid"]


@pytest.mark.parametrize("so", [SO(json={"type": "object", "properties": {"\ud800": {"type": "string"}}}),
                                SO(json={"type": "string", "enum": ["ok", "\udfff"]}), SO(regex="a\ud800b"),
                                SO(choice=["x", "\ud800"]), SO(grammar='root ::= "\ud800"')])
def test_lone_surrogate_in_a_constraint_is_a_clean_400(so):
    """A lone surrogate (valid JSON, not Unicode) anywhere in a constraint, object keys
    included: xgrammar's parser answered "Check failed: (error.empty()) is false ... The
    JSON string is:" with the client's whole schema quoted back (fresh-user trial)."""
    from llmserve.structured_output.grammar import validate_structured_outputs

    with pytest.raises(SamplingParamsError) as e:
        validate_structured_outputs(so, "response_format")
    msg = str(e.value)
    assert e.value.param == "response_format" and "lone surrogate" in msg
    assert "Check failed" not in msg and "JSON string is" not in msg and "\\ud800" not in msg


def test_xgrammar_errors_leave_out_its_check_and_the_quoted_input():
    from llmserve.structured_output.grammar import _short

    raw = ValueError('[12:00:00] /project/cpp/json_schema_converter.cc:77: Check failed: (error.empty()) is false: '
                     'Failed to parse JSON: syntax error at line 1. The JSON string is:{"secret": 1}')
    assert _short(raw) == "Failed to parse JSON: syntax error at line 1"
