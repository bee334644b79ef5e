"""From ``StructuredOutputsParams`` to an xgrammar ``Grammar`` (no tokenizer needed), shared
by the front end's validation and the engine's compiler.

A constraint is keyed by ``(kind, spec, any_whitespace)``: kind is one of "json",
"json_object", "regex", "choice", "grammar", "structural_tag"; spec is its text (a JSON
schema as JSON text, the regex, the EBNF, the choices as a JSON list...). The same key
names the compiled grammar in the engine's cache. Follows vLLM's
``v1/structured_output/backend_xgrammar.py`` (``compile_grammar``) conversions.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Optional

from llmserve.sampling_params import SamplingParamsError, StructuredOutputsParams

GrammarKey = tuple[str, str, bool]


def grammar_key(params: StructuredOutputsParams, any_whitespace: bool = True) -> GrammarKey:
    """The cache key of a constraint. ``any_whitespace`` comes from the engine's config and
    the request's own ``disable_any_whitespace``. Raises SamplingParamsError (param
    ``structured_outputs``) for a JSON schema that is neither a dict, a bool nor JSON text."""
    any_ws = any_whitespace and not params.disable_any_whitespace
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SamplingParamsError(f"structured_outputs.json is not valid JSON: {e}",
                                          "structured_outputs") from None
            except ValueError:  # an integer past int_max_str_digits (not a JSONDecodeError): never Python's words
                raise SamplingParamsError("structured_outputs.json holds an integer with more digits than this "
                                          "server reads from JSON; send a smaller number.",
                                          "structured_outputs") from None
            except RecursionError:  # past ~1000 levels; the depth check below catches the rest
                raise SamplingParamsError("structured_outputs.json is nested too deeply.", "structured_outputs") \
                    from None
        if not isinstance(schema, (dict, bool)):
            raise SamplingParamsError("structured_outputs.json must be a JSON schema object, got "
                                      f"{type(schema).__name__}", "structured_outputs")
        # jsonschema's meta-schema check and xgrammar recurse over the schema: bound it
        # (the same limit as request bodies), so a deep schema is a 400, not a RecursionError
        from llmserve.json_limits import check_json_depth

        check_json_depth(schema, "structured_outputs")
        # Not sort_keys: the schema's property order is the order the output must follow
        # (xgrammar and OpenAI emit properties in schema order; "reasoning before answer"
        # schemas rely on it). Sorted, {"zeta", "alpha"} came out as {"alpha": ..., "zeta": ...}.
        return "json", json.dumps(schema), any_ws
    if params.json_object:
        return "json_object", "", any_ws
    if params.regex is not None:
        return "regex", str(params.regex), any_ws
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) for c in params.choice):
            raise SamplingParamsError("structured_outputs.choice must be a non-empty list of strings",
                                      "structured_outputs")
        return "choice", json.dumps(list(params.choice)), any_ws
    if params.grammar is not None:
        return "grammar", str(params.grammar), any_ws
    tag = params.structural_tag
    return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag), any_ws


def build_grammar(key: GrammarKey) -> Any:
    """The xgrammar ``Grammar`` of a key. Raises ValueError (xgrammar's message) when the
    schema, regex, grammar or structural tag is invalid or unsupported."""
    import xgrammar as xgr

    kind, spec, any_ws = key
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=any_ws, strict_mode=True)
        if kind == "json_object":
            # vLLM: response_format json_object is "any JSON object".
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        return _structural_tag(spec)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ValueError(_short(e)) from None


def _structural_tag(spec: str) -> Any:
    """vLLM's two formats: the legacy ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}`` and xgrammar's own structural-tag JSON."""
    import xgrammar as xgr

    obj = json.loads(spec)
    if isinstance(obj, dict) and "structures" in obj:
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in _legacy_structures(obj)]
        return xgr.Grammar.from_structural_tag(tags, obj["triggers"])
    return xgr.Grammar.from_structural_tag(spec)


def _legacy_structures(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """``obj["structures"]`` checked: a list of ``{"begin": str, "schema": object, "end":
    str}`` with a list of string ``triggers``; else ValueError naming what is wrong."""
    structures, triggers = obj["structures"], obj.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise ValueError("structural tag 'triggers' must be a list of strings")
    if not isinstance(structures, list):
        raise ValueError("structural tag 'structures' must be a list")
    for i, s in enumerate(structures):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict)):
            raise ValueError(f"structural tag structures[{i}] must be an object with string 'begin' and 'end' "
                             "and a JSON schema object 'schema'")
    return structures


# xgrammar's own words around the reason, left out of the 400: its C++ check and the
# client's whole schema quoted back after the reason.
_CHECK_PREFIX = "Check failed: (error.empty()) is false: "
_QUOTED_INPUT = ". The JSON string is:"


def _short(e: BaseException) -> str:
    """xgrammar's error without its ``[time] /project/cpp/file.cc:line:`` prefix, its
    ``Check failed`` words and the input it quotes back."""
    msg = str(e).strip()
    if msg.startswith("[") and ": " in msg:
        head, _, rest = msg.partition(": ")
        if ".cc:" in head or ".h:" in head:
            msg = rest.split(": ", 1)[-1] if rest[:1].isdigit() else rest
    msg = msg.removeprefix(_CHECK_PREFIX).split(_QUOTED_INPUT, 1)[0]
    return msg.splitlines()[0] if msg else type(e).__name__


_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "structural_tag")


def _check_unicode(params: StructuredOutputsParams, where: str, param: str) -> None:
    """Raise SamplingParamsError naming ``param`` when a string of the constraint (object
    keys too) holds a lone surrogate: valid JSON, but no grammar compiler takes it
    (xgrammar's parser answered with its C++ check and the whole schema quoted back)."""
    for name in _CONSTRAINT_FIELDS:
        value = getattr(params, name, None)
        if value is None:
            continue
        try:
            (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode("utf-8")
        except UnicodeEncodeError:
            raise SamplingParamsError(f"Invalid {where}: a string in it holds a lone surrogate code point, which is "
                                      "not valid Unicode; send UTF-8 text.", param) from None


def json_schema_error(schema: Any) -> Optional[str]:
    """Where and why ``schema`` breaks the JSON Schema meta-schema of its ``$schema`` draft
    (2020-12 when it names none), e.g. ``at properties/a/minLength: -3 is less than the
    minimum of 0``; None when it is valid. xgrammar converts some invalid schemas and only
    fails when compiling against the tokenizer, in the engine, too late for a 400."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"at {where}: {e.message}"
    return None


@functools.lru_cache(maxsize=512)
def _check_key(key: GrammarKey) -> None:
    if key[0] == "json":
        err = json_schema_error(json.loads(key[1]))
        if err is not None:
            raise ValueError(f"not a valid JSON schema {err}")
    build_grammar(key)


def validate_structured_outputs(params: StructuredOutputsParams, param: str = "structured_outputs",
                                any_whitespace: bool = True) -> GrammarKey:
    """Check that the constraint converts to a grammar (cheap: no tokenizer, results cached
    per key), so a bad schema/regex/grammar is refused before the request runs.

    Returns the grammar key. Raises SamplingParamsError naming ``param`` (the OpenAI field
    the constraint came from: ``response_format`` or ``structured_outputs``); for
    ``structured_outputs`` the message names the key too (``structured_outputs.regex``)."""
    try:
        key = grammar_key(params, any_whitespace)
    except SamplingParamsError as e:
        raise SamplingParamsError(str(e), param) from None
    where = f"{param}.{key[0]}" if param == "structured_outputs" else param
    _check_unicode(params, where, param)
    try:
        _check_key(key)
    except ValueError as e:
        raise SamplingParamsError(f"Invalid {where}: {e}", param) from None
    return key
