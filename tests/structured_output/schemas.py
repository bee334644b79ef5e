"""50 JSON schemas of varied shape for the structured-output tests and the bench's
``--structured-output-schema builtin`` (nested objects, arrays, enums, bounded numbers,
optional fields, anyOf). Strings and arrays are bounded so a small model finishes within
a modest token budget."""
from __future__ import annotations

import itertools

S = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": 0, "maximum": 999}
NUM = {"type": "number", "minimum": -10, "maximum": 10}
BOOL = {"type": "boolean"}
ENUM = {"type": "string", "enum": ["red", "green", "blue"]}


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props if required is None else required),
            "additionalProperties": False}


def _shapes() -> list[dict]:
    leaves = [S, INT, NUM, BOOL, ENUM]
    names = ["name", "id", "score", "ok", "color"]
    out = []
    # 1-10: flat objects with 1..5 fields, all required / some optional.
    for k in range(1, 6):
        props = dict(zip(names[:k], leaves[:k]))
        out.append(_obj(props))
        out.append(_obj(props, required=names[:1]))
    # 11-20: arrays of each leaf (bounded), alone and inside an object.
    for leaf in leaves:
        arr = {"type": "array", "items": leaf, "minItems": 1, "maxItems": 3}
        out.append(_obj({"items": arr}))
        out.append(_obj({"title": S, "tags": arr}, required=["title"]))
    # 21-30: nested objects two and three levels deep.
    for a, b in itertools.islice(itertools.permutations(range(5), 2), 10):
        inner = _obj({names[a]: leaves[a], names[b]: leaves[b]})
        out.append(_obj({"outer": inner, "n": INT}) if a % 2 else _obj({"x": _obj({"y": inner})}))
    # 31-40: anyOf between leaves / objects, enums of numbers, consts.
    for a, b in itertools.islice(itertools.combinations(range(5), 2), 10):
        out.append(_obj({"value": {"anyOf": [leaves[a], leaves[b]]}, "kind": {"enum": [1, 2, 3]}}))
    # 41-50: arrays of objects, bounded integers/numbers, optional nested parts.
    for i in range(10):
        item = _obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5 + i}})
        extra = {"note": S} if i % 2 else {"price": {"type": "number", "minimum": 0, "maximum": 100 + i}}
        out.append(_obj({"order": {"type": "array", "items": item, "minItems": 1, "maxItems": 2}, **extra},
                        required=["order"]))
    return out


SCHEMAS: list[dict] = _shapes()
assert len(SCHEMAS) == 50
