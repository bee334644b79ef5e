"""The part of Go's text/template that Ollama's prompt templates use, for ``/api/generate``'s
``template`` (a request's override of the model's template).

Ollama renders such a template with ``.System``, ``.Prompt``, ``.Suffix``, ``.Response``
(empty) and ``.Messages`` (the system and user turns as ``.Role`` / ``.Content``), and
keeps only what comes before ``{{ .Response }}`` (``template.Execute``: the model writes
the response). Supported here, as Go reads them:

- text, ``{{ pipeline }}`` (a field, ``$`` or ``.``, a string literal, or a call of
  ``not`` / ``and`` / ``or`` / ``eq`` / ``ne`` / ``len``), ``{{/* comments */}}``;
- ``{{- ...}}`` / ``{{... -}}``: the whitespace before / after the action is trimmed;
- ``if`` / ``else if`` / ``else`` / ``end``, ``range PIPELINE`` (``.`` the element,
  ``$`` the top) / ``else`` / ``end``, ``with`` / ``else`` / ``end``;
- truth as Go's: empty strings, lists and maps, 0, false and nil are false.

Anything else (variables ``$x :=``, ``template``, ``block``, other functions) is a
:class:`TemplateError` naming what is not supported, which the route answers as a 400
naming ``template``. The interpreter only reads the values it is given: no code runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

# One action: {{, optional "-" + space trim, the body, optional space + "-" trim, }}.
_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`|\(|\)|[^\s()]+')
MAX_TEMPLATE_CHARS = 100_000
MAX_OUTPUT_CHARS = 4_000_000  # a range over a long list cannot grow past this
MAX_DEPTH = 64  # nested if / range / with
MAX_STEPS = 100_000  # nodes run: nested ranges that write nothing still end
RESPONSE_FIELD = ".Response"


class TemplateError(ValueError):
    """A template this interpreter cannot read or run (the message says which part)."""


@dataclass
class _Node:
    kind: str  # "text", "expr", "if", "range", "with", "response"
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    body: list["_Node"] = field(default_factory=list)
    orelse: list["_Node"] = field(default_factory=list)


def _lex(source: str) -> list[tuple[str, str]]:
    """The template as ("text", s) and ("action", body) parts, trim markers applied."""
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(source):
        text = source[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if parts and parts[-1][0] == "trim":
            parts.pop()
            text = text.lstrip()
        if text:
            parts.append(("text", text))
        parts.append(("action", m.group(2).strip()))
        if m.group(3):
            parts.append(("trim", ""))
        pos = m.end()
    rest = source[pos:]
    if parts and parts[-1][0] == "trim":
        parts.pop()
        rest = rest.lstrip()
    if "{{" in rest:
        raise TemplateError("an action opened with '{{' is not closed with '}}'")
    if rest:
        parts.append(("text", rest))
    return parts


def _tokens(body: str) -> list[str]:
    return _TOKEN.findall(body)


def parse(source: str) -> list[_Node]:
    """The template's nodes. Raises TemplateError for an unsupported or unbalanced one."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"it is longer than {MAX_TEMPLATE_CHARS} characters")
    nodes, end = _parse_block(_lex(source), 0, top=True)
    return nodes


def _parse_block(parts: list[tuple[str, str]], i: int, top: bool = False, depth: int = 0,
                 ) -> tuple[list[_Node], int]:
    """Nodes from ``parts[i]`` up to an ``else`` / ``end`` (returned index points at it)."""
    if depth > MAX_DEPTH:
        raise TemplateError(f"if, range and with are nested more than {MAX_DEPTH} deep")
    nodes: list[_Node] = []
    while i < len(parts):
        kind, body = parts[i]
        if kind == "text":
            nodes.append(_Node("text", text=body))
            i += 1
            continue
        if body.startswith("/*"):
            i += 1
            continue
        words = _tokens(body)
        if words.count("(") > MAX_DEPTH:
            raise TemplateError(f"an action has more than {MAX_DEPTH} parentheses")
        head = words[0] if words else ""
        if head in ("end", "else"):
            if top:
                raise TemplateError(f"{{{{ {head} }}}} has no matching if, range or with")
            return nodes, i
        if head in ("if", "range", "with"):
            node, i = _parse_control(parts, i, head, words[1:], depth + 1)
            nodes.append(node)
            continue
        if head in ("template", "block", "define", "break", "continue") or ":=" in words or "=" in words:
            raise TemplateError(f"'{head if head in ('template', 'block', 'define', 'break', 'continue') else ':='}'"
                                " is not supported")
        if words == [RESPONSE_FIELD]:
            nodes.append(_Node("response"))
        else:
            nodes.append(_Node("expr", tokens=words))
        i += 1
    if not top:
        raise TemplateError("an if, range or with has no {{ end }}")
    return nodes, i


def _parse_control(parts: list[tuple[str, str]], i: int, head: str, cond: list[str], depth: int,
                   ) -> tuple[_Node, int]:
    if not cond:
        raise TemplateError(f"{{{{ {head} }}}} needs a value")
    node = _Node(head, tokens=cond)
    node.body, i = _parse_block(parts, i + 1, depth=depth)
    words = _tokens(parts[i][1])
    if words[0] == "else":
        if len(words) > 1 and words[1] == "if" and head == "if":
            inner, i = _parse_control(parts, i, "if", words[2:], depth + 1)  # ends at the shared {{ end }}
            node.orelse = [inner]
            return node, i
        if len(words) > 1:
            raise TemplateError("'else' followed by anything but 'if' (in an if) is not supported")
        node.orelse, i = _parse_block(parts, i + 1, depth=depth)
        if _tokens(parts[i][1])[0] != "end":
            raise TemplateError("an else is followed by another else")
    return node, i + 1


def _truth(value: Any) -> bool:
    return bool(value) if value is not None else False


class _Scope:
    def __init__(self, root: dict[str, Any], dot: Any, steps: Optional[list[int]] = None):
        self.root, self.dot = root, dot
        self.steps = steps if steps is not None else [0, 0]  # [nodes run, characters out]: one run's

    def at(self, dot: Any) -> "_Scope":
        return _Scope(self.root, dot, self.steps)


def _field(value: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        value = value.get(name) if isinstance(value, dict) else None
    return value


def _value(tokens: list[str], scope: _Scope) -> tuple[Any, list[str]]:
    """One operand of ``tokens``: a field, a literal or a parenthesised call; the rest."""
    if not tokens:
        raise TemplateError("a function is missing an argument")
    tok, rest = tokens[0], tokens[1:]
    if tok == "(":
        depth, j = 1, 0
        while j < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[j], 0)
            j += 1
        if depth:
            raise TemplateError("a '(' is not closed")
        return _call(rest[:j - 1], scope), rest[j:]
    if tok.startswith('"'):
        return tok[1:-1].encode().decode("unicode_escape"), rest
    if tok.startswith("`"):
        return tok[1:-1], rest
    if tok in ("true", "false"):
        return tok == "true", rest
    if re.fullmatch(r"-?\d+", tok):
        return int(tok), rest
    if tok == ".":
        return scope.dot, rest
    if tok.startswith("$"):
        return _field(scope.root, tok[1:]), rest
    if tok.startswith("."):
        return _field(scope.dot, tok), rest
    raise TemplateError("a word in an action is not a field, a value or a supported function")


FUNCTIONS = ("not", "and", "or", "eq", "ne", "len")


def _call(tokens: list[str], scope: _Scope) -> Any:
    """A pipeline without ``|``: a value, or one of FUNCTIONS applied to its arguments."""
    if "|" in tokens:
        raise TemplateError("pipelines with '|' are not supported")
    if tokens and tokens[0] in FUNCTIONS:
        name, rest, args = tokens[0], tokens[1:], []
        while rest:
            value, rest = _value(rest, scope)
            args.append(value)
        return _apply(name, args)
    if tokens and not tokens[0].startswith(("(", '"', "`", ".", "$")) and not re.fullmatch(r"-?\d+|true|false",
                                                                                           tokens[0]):
        raise TemplateError(f"an action calls a function that is not supported (only {', '.join(FUNCTIONS)})")
    value, rest = _value(tokens, scope)
    if rest:
        raise TemplateError("a value is followed by more words")
    return value


def _apply(name: str, args: list[Any]) -> Any:
    if name == "not" and len(args) == 1:
        return not _truth(args[0])
    if name == "and" and args:
        return next((a for a in args if not _truth(a)), args[-1])
    if name == "or" and args:
        return next((a for a in args if _truth(a)), args[-1])
    if name in ("eq", "ne") and len(args) >= 2:
        equal = any(args[0] == a for a in args[1:])
        return equal if name == "eq" else not equal
    if name == "len" and len(args) == 1:
        return len(args[0] or ())
    raise TemplateError(f"'{name}' got {len(args)} arguments")


def _text(value: Any) -> str:
    if value is None:
        return "<no value>"  # Go prints a missing map key so
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _step(scope: _Scope) -> None:
    scope.steps[0] += 1
    if scope.steps[0] > MAX_STEPS:
        raise TemplateError(f"it runs more than {MAX_STEPS} steps")


def _write(scope: _Scope, out: list[str], text: str) -> None:
    scope.steps[1] += len(text)
    if scope.steps[1] > MAX_OUTPUT_CHARS:
        raise TemplateError(f"its output is longer than {MAX_OUTPUT_CHARS} characters")
    out.append(text)


def _run(nodes: list[_Node], scope: _Scope, out: list[str]) -> bool:
    """Write ``nodes`` to ``out``; False once ``{{ .Response }}`` is reached (Ollama keeps
    only what comes before it)."""
    for node in nodes:
        _step(scope)
        if node.kind == "text":
            _write(scope, out, node.text)
        elif node.kind == "response":
            return False
        elif node.kind == "expr":
            _write(scope, out, _text(_call(node.tokens, scope)))
        elif node.kind == "if":
            branch = node.body if _truth(_call(node.tokens, scope)) else node.orelse
            if not _run(branch, scope, out):
                return False
        elif node.kind == "with":
            value = _call(node.tokens, scope)
            if not _run(node.body if _truth(value) else node.orelse, scope.at(value) if _truth(value) else scope, out):
                return False
        elif node.kind == "range":
            items = _call(node.tokens, scope)
            if isinstance(items, dict):
                items = list(items.values())
            if not isinstance(items, (list, tuple)) and items is not None:
                raise TemplateError("range needs a list")
            for item in items or ():
                _step(scope)
                if not _run(node.body, scope.at(item), out):
                    return False
            if not items and not _run(node.orelse, scope, out):
                return False
    return True


def render_prompt(source: str, system: Optional[str], prompt: str, suffix: Optional[str] = None) -> str:
    """The prompt Ollama makes of ``/api/generate`` with ``template``: the template run over
    ``.System``, ``.Prompt``, ``.Suffix``, ``.Messages`` (the system and user turns) and an
    empty ``.Response``, cut at ``{{ .Response }}``. Raises TemplateError."""
    messages = ([{"Role": "system", "Content": system}] if system else []) + [{"Role": "user", "Content": prompt}]
    root = {"System": system or "", "Prompt": prompt, "Suffix": suffix or "", "Response": "", "Messages": messages,
            "Tools": None, "Think": False, "ThinkLevel": "", "IsThinkSet": False}
    out: list[str] = []
    try:
        _run(parse(source), _Scope(root, root), out)
    except RecursionError:  # thousands of nested parentheses
        raise TemplateError("its actions are nested too deep") from None
    return "".join(out)
