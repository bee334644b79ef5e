"""The nesting bound on user JSON (request bodies, JSON schemas given as text), shared by
the HTTP layer (``entrypoints/openai/common/limits.py`` re-exports these names,
``entrypoints/openai/json_depth.py`` checks request bytes) and the structured-output
grammar code that the engine process runs, which must not import ``entrypoints/``.
"""
from __future__ import annotations

from typing import Any, Optional

from llmserve.sampling_params import SamplingParamsError

# JSON nesting: levels of arrays/objects in a request body (the body itself is level 1)
# and in a JSON schema given as text. Real requests nest < 20 levels; the recursive
# checks over user JSON (jsonschema's meta-schema check, _hoist_defs, Jinja, xgrammar)
# hit Python's recursion limit near 200 levels, which was a 500 (RecursionError).
MAX_JSON_DEPTH = 64


def json_too_deep(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Optional[str]:
    """The path (``a.0.b``, "" for the root) of the first array/object of the parsed JSON
    ``value`` nested deeper than ``max_depth`` levels (the root is level 1), or None.
    Iterative, so it never recurses itself; stops at the first level past the bound."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                where = f"{path}.{key}" if path else str(key)
                if depth + 1 > max_depth:
                    return where
                stack.append((child, depth + 1, where))
    return None


def check_json_depth(value: Any, param: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise SamplingParamsError (400 naming ``param``) when ``value`` nests more than
    ``max_depth`` levels (see :func:`json_too_deep`)."""
    where = json_too_deep(value, max_depth)
    if where is not None:
        raise SamplingParamsError(
            f"`{param}` is nested too deeply (at {(where or 'its root')[:120]}): at most {max_depth} levels of "
            "JSON arrays and objects are accepted.", param)
