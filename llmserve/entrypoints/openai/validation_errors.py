"""Pydantic validation errors as a client reads them: the field named as the client wrote
it (``stop``, ``stop.0``, ``messages.2.content``) and a human message, for the OpenAI and
Anthropic error bodies (server_utils._validation_message is the one caller).

Pydantic writes a union member's schema label into an error's location
(``stop.constrained-str``, ``prompt.list[list[int]].0``, ``x.function-after[check(), str]``,
a tagged union's tag) and reports every member that failed. Here a location keeps only the
keys and indexes found in the request body (:func:`client_path`), and the errors of one
union are cut to those of the member that got furthest (a value over a limit, or a problem
inside it, beats "should be a list" from the other members); when every member failed on
the value's type alone, one problem says what the field accepts ("stop: must be a string
or a list of strings"). Input values are never echoed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# pydantic-core's schema labels for union members: a type name with its parameters in
# brackets, a constrained/function/... schema, or a model class (CamelCase; the request
# fields are snake_case)
_LABEL_PREFIXES = ("constrained-", "function-", "tagged-union", "json-or-python", "lax-or-strict", "nullable",
                   "literal", "is-instance", "is-subclass", "union", "chain", "default", "typed-dict", "model",
                   "dataclass", "definition-ref", "enum")
_PLAIN_LABELS = frozenset({"str", "int", "float", "bool", "none", "any", "dict", "list", "set", "tuple", "bytes",
                           "frozenset", "decimal", "date", "datetime", "time", "timedelta", "uuid", "url",
                           "callable", "generator", "json"})
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9_]*$")

# errors that say only "not this type": a union member failing this way at the union's
# own location did not match at all
_TYPE_ERRORS = frozenset({"string_type", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type",
                          "bool_parsing", "list_type", "tuple_type", "set_type", "dict_type", "model_type",
                          "model_attributes_type", "dataclass_type", "none_required", "literal_error", "enum",
                          "is_instance_of", "union_tag_invalid", "union_tag_not_found", "bytes_type",
                          "string_sub_type", "iterable_type", "mapping_type", "callable_type"})
_NOUN_OF_TYPE_ERROR = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
                       "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
                       "bool_parsing": "a boolean", "list_type": "a list", "tuple_type": "a list",
                       "set_type": "a list", "dict_type": "an object", "model_type": "an object",
                       "model_attributes_type": "an object", "typed_dict_type": "an object",
                       "none_required": "null", "bytes_type": "a string"}
_NOUN_OF_LABEL = {"str": "a string", "constrained-str": "a string", "int": "an integer",
                  "constrained-int": "an integer", "float": "a number", "constrained-float": "a number",
                  "bool": "a boolean", "none": "null", "any": "any value", "dict": "an object", "list": "a list",
                  "bytes": "a string", "typed-dict": "an object", "model": "an object"}
_PLURAL = {"a string": "strings", "an integer": "integers", "a number": "numbers", "a boolean": "booleans",
           "an object": "objects", "a list": "lists", "null": "nulls", "any value": "values"}


def is_label(item: Any) -> bool:
    """Whether a location item is a pydantic union-member label rather than a field name."""
    if not isinstance(item, str):
        return False
    return ("[" in item or item in _PLAIN_LABELS or item.startswith(_LABEL_PREFIXES)
            or _CAMEL.match(item) is not None)


@dataclass
class Problem:
    """One pydantic error: ``path``: the client's keys and indexes; ``labels``: the union
    member labels met on the way, each with how many path items came before it."""

    path: list[Any]
    labels: list[tuple[int, str]]
    type: str
    msg: str
    ctx: dict[str, Any] = field(default_factory=dict)


_MISSING = object()


def client_path(loc: tuple, body: Any, err_type: str) -> tuple[list[Any], list[tuple[int, str]]]:
    """Split a location (without FastAPI's leading ``body``) into the client's path and the
    union labels, walking ``body`` (the parsed request, or None when unknown): a key that is
    in the object at that point, or an index, is the client's, and so is the last key of a
    "missing" or "extra_forbidden" error even when it looks like a label (the required
    ``model`` of a ``{}`` body); a label (:func:`is_label`), or a string the object does not
    hold (a tagged union's tag), is pydantic's; without a body only the label's look decides."""
    path: list[Any] = []
    labels: list[tuple[int, str]] = []
    cur = body if isinstance(body, (dict, list)) else _MISSING
    for i, item in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(item, int) and not isinstance(item, bool):
            path.append(item)
            cur = cur[item] if isinstance(cur, list) and 0 <= item < len(cur) else _MISSING
        elif isinstance(cur, dict) and item in cur:  # the body's own key, whatever it looks like
            path.append(item)
            cur = cur[item]
        elif last and err_type in ("missing", "extra_forbidden"):
            # pydantic ends these locations with the field's own name, never a label: a
            # missing field called like a label ("model") is still the client's field
            path.append(item)
        elif is_label(item):
            labels.append((len(path), str(item)))
        elif cur is _MISSING:  # nothing to check it against (no body, or below a missing item)
            path.append(item)
        else:  # a string the body does not hold here: a tagged union's tag
            labels.append((len(path), str(item)))
    return path, labels


# pydantic's strict-mode type errors (a request field of the wrong JSON type), whose own
# words ("Input should be a valid integer") do not say what was sent
_STRICT_TYPE_ERRORS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
                       "string_type": "a string"}
_MISSING_INPUT = object()


def _json_kind(value: Any) -> str:
    """A JSON value's kind as a client reads it ("a string", "a number with a fractional
    part"...), never the value itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        if value in (float("inf"), float("-inf")):  # 1e400: too large for a double, read as infinity
            return "a number too large to represent (it reads as infinity)"
        return "a number with a fractional part" if value == value and not value.is_integer() else "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a " + type(value).__name__)


def _type_message(err: dict[str, Any]) -> Optional[str]:
    """"Input should be an integer, not a string" for a strict-mode type error whose input
    is known (OpenAI's "expected an integer, but got a string"); None for any other error."""
    noun = _STRICT_TYPE_ERRORS.get(err.get("type", ""))
    value = err.get("input", _MISSING_INPUT)
    if noun is None or value is _MISSING_INPUT or not str(err.get("msg", "")).startswith("Input should be a valid "):
        return None
    return f"Input should be {noun}, not {_json_kind(value)}"


def problems_of(errors: list[dict[str, Any]], body: Any, strip: int = 0) -> list[Problem]:
    """The errors as Problems (``strip``: leading location items to drop, FastAPI's source).
    A value of the wrong JSON type is told what it was ("max_tokens: must be an integer,
    not a string"), by its kind only."""
    out = []
    for err in errors:
        loc = tuple(err.get("loc", ()))[strip:]
        path, labels = client_path(loc, body, err.get("type", ""))
        msg = _type_message(err) or err.get("msg", "invalid value")
        if err.get("type") == "string_unicode" and isinstance(err.get("input"), str):
            # a lone surrogate in a constrained string (stop, stop_sequences): the words and
            # position every other field gets (tokenizer.check_encodable), not pydantic's
            from llmserve.tokenizer import lone_surrogate_problem

            msg = lone_surrogate_problem(err["input"]) or msg
        out.append(Problem(path, labels, err.get("type", ""), msg, dict(err.get("ctx") or {})))
    return out


def dotted(path: list[Any]) -> str:
    return ".".join(str(p) for p in path)


def resolve_unions(problems: list[Problem]) -> list[Problem]:
    """The problems to report: for each union (problems sharing their first label's place),
    those of the member that got furthest, recursively for unions inside it; or one
    "must be A or B" problem when every member failed on the value's type at the union."""
    order: list[Union[Problem, tuple]] = []  # problems outside unions, and each union's key, in order
    groups: dict[tuple, list[Problem]] = {}
    for p in problems:
        if not p.labels:
            order.append(p)
            continue
        depth = p.labels[0][0]
        key = (depth, *p.path[:depth])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(p)
    result: list[Problem] = []
    for item in order:
        result.extend([item] if isinstance(item, Problem) else _resolve_one(groups[item]))
    return result


def _resolve_one(members: list[Problem]) -> list[Problem]:
    """The problems of one union: ``members`` all have its label first."""
    depth = members[0].labels[0][0]
    by_member: dict[str, list[Problem]] = {}
    for p in members:
        by_member.setdefault(p.labels[0][1], []).append(p)

    def score(ps: list[Problem]) -> tuple[int, int, int]:
        deepest = max(len(p.path) for p in ps)
        matched = any(len(p.path) > depth or p.type not in _TYPE_ERRORS for p in ps)
        # a JSON boolean where a number goes (common.protocol.BOOLEAN_REFUSED): the number
        # member names it ("prompt.0: must be an integer, not a boolean"), not the string one
        refused = any(p.ctx.get("refused") == "boolean" for p in ps)
        return int(matched), deepest, int(refused)

    best = max(by_member.values(), key=score)
    # One member got furthest: its problems. Several as far (``input: [1.5]`` is a list
    # element that is neither a string nor a token id): which one the client meant is
    # unknown, so the field is named with what it accepts, as when none matched.
    if score(best)[0] and sum(score(ps) == score(best) for ps in by_member.values()) == 1:
        inner = [Problem(p.path, p.labels[1:], p.type, p.msg, p.ctx) for p in best]
        return resolve_unions(inner)
    nouns = []
    for label, ps in by_member.items():
        noun = describe_label(label) or _noun_of_error(ps[0])
        if noun not in nouns:
            nouns.append(noun)
    return [Problem(members[0].path[:depth], [], "union_type", "must be " + _either(nouns))]


def _noun_of_error(p: Problem) -> str:
    if p.type in ("literal_error", "enum") and p.ctx.get("expected"):
        return f"one of {p.ctx['expected']}"
    return _NOUN_OF_TYPE_ERROR.get(p.type, "a valid value")


def _either(nouns: list[str]) -> str:
    return nouns[0] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " or " + nouns[-1]


def _split_args(inner: str) -> list[str]:
    """``a,b[c,d],e`` -> ``["a", "b[c,d]", "e"]`` (commas outside brackets)."""
    parts, level, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "[(":
            level += 1
        elif ch in "])":
            level -= 1
        elif ch == "," and level == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def describe_label(label: str) -> Optional[str]:
    """What a union member's label accepts, in words ("a list of strings"); None when
    the label is not one this knows (the member's error type then says it)."""
    label = label.strip()
    if label in _NOUN_OF_LABEL:
        return _NOUN_OF_LABEL[label]
    if _CAMEL.match(label):
        return "an object"
    name, bracket, rest = label.partition("[")
    if not bracket or not rest.endswith("]"):
        return None
    args = _split_args(rest[:-1])
    if name in ("list", "set", "frozenset", "tuple", "generator"):
        inner = describe_label(args[0]) if args else None
        if inner in (None, "any value"):
            return "a list"
        return "a list of " + _plural_of_label(args[0])
    if name in ("dict", "typed-dict", "model", "tagged-union", "dataclass"):
        return "an object"
    if name == "literal":
        return "one of " + ", ".join(args) if len(args) > 1 else (args[0] if args else None)
    if name.startswith("function-") or name in ("chain", "default", "nullable", "constrained"):
        return describe_label(args[-1]) if args else None
    if name in ("json-or-python", "lax-or-strict"):  # json=..., python=... / lax=..., strict=...
        for arg in args:
            noun = describe_label(arg.partition("=")[2] or arg)
            if noun:
                return noun
        return None
    if name == "union":
        nouns = [n for n in (describe_label(a) for a in args) if n]
        return _either(nouns) if nouns else None
    return None


def _plural_of_label(label: str) -> str:
    """The plural of what ``label`` accepts, a union's members each made plural ("integers
    or strings", not the plural of the phrase "an integer or a string")."""
    name, bracket, rest = label.strip().partition("[")
    args = _split_args(rest[:-1]) if bracket and rest.endswith("]") else []
    if args and (name.startswith("function-") or name in ("chain", "default", "nullable", "constrained")):
        return _plural_of_label(args[-1])
    if args and name == "union":
        nouns = [_plural_of_label(a) for a in args if describe_label(a)]
        return _either(nouns) if nouns else "values"
    noun = describe_label(label)
    return _plural(noun) if noun else "values"


def _plural(noun: str) -> str:
    """"a string" -> "strings", "a list of integers" -> "lists of integers"."""
    if noun in _PLURAL:
        return _PLURAL[noun]
    if noun.startswith("a list of "):
        return "lists of " + noun[len("a list of "):]
    if noun.startswith("one of "):
        return noun
    return noun.split(" ", 1)[-1] + "s" if noun.startswith(("a ", "an ")) else noun


def human(msg: str) -> str:
    """Pydantic's message as the tail of "<field>: ...": "Input should be X" -> "must be X",
    a validator's own text without pydantic's "Value error, " / "Assertion failed, ", else
    its first letter lower-cased (not in an acronym such as "JSON")."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    if msg.startswith("Input should be "):
        return "must be " + msg[len("Input should be "):]
    if len(msg) > 1 and msg[0].isupper() and not msg[1].isupper():
        return msg[0].lower() + msg[1:]
    return msg
