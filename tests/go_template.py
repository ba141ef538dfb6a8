"""A small interpreter of the Go text/template subset Ollama TEMPLATEs use, rendering a TEMPLATE over messages as
Ollama does for a `.Messages` template. A test tool: the tests render the TEMPLATE lorafit derives with it and
compare it with the model's Jinja chat template (lorafit itself checks the layout the TEMPLATE is written from)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


# --- A small interpreter for the Go template subset --------------------------------------------------------------


def render_template(go_template: str, messages: Sequence[Message]) -> str:
    """Render an Ollama TEMPLATE over `messages` as Ollama does for a .Messages template (template/template.go
    Execute): consecutive messages of one role are joined with a blank line, `.System` holds the system messages.

    Understands the Go text/template subset Ollama templates use: text, `{{- -}}` trimming, comments, `if` /
    `else if` / `else`, `range` with variables, `$x :=` and `$x =`, fields (`.Role`, `$.Messages`,
    `(index .Messages 0).Role`), string literals and the functions eq, ne, not, and, or, len, slice, index.
    Anything else raises ValueError.
    """
    collated: list[dict[str, str]] = []
    for message in messages:
        if collated and collated[-1]["Role"] == message["role"] and message["role"] != "tool":
            collated[-1]["Content"] += "\n\n" + message["content"]
        else:
            collated.append({"Role": message["role"], "Content": message["content"]})
    system = "\n\n".join(message["content"] for message in messages if message["role"] == "system")
    data = {"System": system, "Messages": collated, "Tools": [], "Response": "", "Think": False}
    out: list[str] = []
    _execute(_parse(_lex(go_template)), data, [{"$": data}], out)
    return "".join(out)


_SPACE = " \t\r\n"


def _lex(source: str) -> list[tuple[str, str]]:
    """("text", text) and ("action", inside of {{ }}) items, with Go's trim markers applied to the texts."""
    items: list[tuple[str, str]] = []
    position = 0
    trim_next = False
    while True:
        start = source.find("{{", position)
        text = source[position:] if start < 0 else source[position:start]
        if trim_next:
            text = text.lstrip(_SPACE)
        if start < 0:
            if text:
                items.append(("text", text))
            return items
        inner_start = start + 2
        if source[inner_start : inner_start + 1] == "-" and source[inner_start + 1 : inner_start + 2] in tuple(_SPACE):
            text = text.rstrip(_SPACE)
            inner_start += 1
        if text:
            items.append(("text", text))
        end = _action_end(source, inner_start)
        inner = source[inner_start:end]
        trim_next = len(inner) >= 2 and inner[-1] == "-" and inner[-2] in _SPACE
        if trim_next:
            inner = inner[:-1]
        items.append(("action", inner.strip(_SPACE)))
        position = end + 2


def _action_end(source: str, position: int) -> int:
    """Where the `}}` closing the action at `position` is, skipping string literals and comments."""
    index = position
    while index < len(source):
        char = source[index]
        if source.startswith("/*", index):
            close = source.find("*/", index + 2)
            if close < 0:
                raise ValueError("unclosed comment in template")
            index = close + 2
        elif char == '"':
            index += 1
            while index < len(source) and source[index] != '"':
                index += 2 if source[index] == "\\" else 1
            index += 1
        elif char == "`":
            index = source.index("`", index + 1) + 1
        elif source.startswith("}}", index):
            return index
        else:
            index += 1
    raise ValueError("unclosed action in template")


_TOKEN = re.compile(
    r"""\s*(?:(?P<string>"(?:[^"\\]|\\.)*"|`[^`]*`)|(?P<number>-?\d+)|(?P<op>:=|=|\(|\)|,|\|)"""
    r"""|(?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)|(?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)"""
    r"""|(?P<word>[A-Za-z_][A-Za-z0-9_]*))"""
)


def _tokens(action: str) -> list[tuple[str, str]]:
    tokens = []
    position = 0
    action = action.rstrip()
    while position < len(action):
        match = _TOKEN.match(action, position)
        if not match or match.end() == position:
            raise ValueError(f"cannot read the template action {{{{ {action} }}}}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        position = match.end()
    return tokens


@dataclass
class _Node:
    kind: str  # text, print, if, range
    text: str = ""
    tokens: list[tuple[str, str]] | None = None
    branches: list[tuple[list[tuple[str, str]] | None, list[_Node]]] | None = None  # if: (condition, body)
    variables: list[str] | None = None


def _parse(items: list[tuple[str, str]]) -> list[_Node]:
    stream = iter(items)
    body, ended = _parse_body(stream)
    if ended is not None:
        raise ValueError(f"unexpected {{{{ {ended} }}}} in template")
    return body


def _parse_body(stream: Iterator[tuple[str, str]]) -> tuple[list[_Node], str | None]:
    """Nodes up to an `end`, `else` or `else if` (returned as the second value), or to the end of the template."""
    nodes: list[_Node] = []
    for kind, value in stream:
        if kind == "text":
            nodes.append(_Node("text", text=value))
            continue
        if value.startswith("/*") or not value:
            continue
        word = value.split(None, 1)[0]
        if word in ("end", "else"):
            return nodes, value
        if word == "if":
            nodes.append(_parse_if(value[2:], stream))
        elif word == "range":
            nodes.append(_parse_range(value[5:], stream))
        elif word in ("with", "define", "template", "block", "break", "continue"):
            raise ValueError(f"{{{{ {word} }}}} is outside the template subset this interpreter knows")
        else:
            nodes.append(_Node("print", tokens=_tokens(value)))
    return nodes, None


def _parse_if(condition: str, stream: Iterator[tuple[str, str]]) -> _Node:
    branches: list[tuple[list[tuple[str, str]] | None, list[_Node]]] = []
    current: list[tuple[str, str]] | None = _tokens(condition)
    while True:
        body, ended = _parse_body(stream)
        branches.append((current, body))
        if ended is None:
            raise ValueError("{{ if }} without {{ end }} in template")
        if ended == "end":
            return _Node("if", branches=branches)
        rest = ended[4:].strip()
        if rest.startswith("if "):
            current = _tokens(rest[3:])
        elif not rest:
            current = None
        else:
            raise ValueError(f"cannot read {{{{ {ended} }}}}")


def _parse_range(header: str, stream: Iterator[tuple[str, str]]) -> _Node:
    tokens = _tokens(header)
    variables: list[str] = []
    if any(token == ("op", ":=") for token in tokens):
        split = tokens.index(("op", ":="))
        variables = [value for kind, value in tokens[:split] if kind == "var"]
        tokens = tokens[split + 1 :]
    body, ended = _parse_body(stream)
    branches: list[tuple[list[tuple[str, str]] | None, list[_Node]]] = [(tokens, body)]
    if ended is not None and ended.strip() == "else":
        otherwise, ended = _parse_body(stream)
        branches.append((None, otherwise))
    if ended != "end":
        raise ValueError("{{ range }} without {{ end }} in template")
    return _Node("range", branches=branches, variables=variables)


def _execute(nodes: list[_Node], dot: Any, scopes: list[dict[str, Any]], out: list[str]) -> None:
    for node in nodes:
        if node.kind == "text":
            out.append(node.text)
        elif node.kind == "print":
            assert node.tokens is not None
            tokens = node.tokens
            if len(tokens) >= 2 and tokens[0][0] == "var" and tokens[1] in (("op", ":="), ("op", "=")):
                value = _evaluate(tokens[2:], dot, scopes)
                if tokens[1][1] == ":=":
                    scopes[-1][tokens[0][1]] = value
                else:
                    _scope_of(tokens[0][1], scopes)[tokens[0][1]] = value
            else:
                out.append(_text(_evaluate(tokens, dot, scopes)))
        elif node.kind == "if":
            assert node.branches is not None
            for condition, body in node.branches:
                if condition is None or _truth(_evaluate(condition, dot, scopes)):
                    _execute(body, dot, [*scopes, {}], out)
                    break
        else:
            assert node.branches is not None and node.variables is not None
            collection = _evaluate(node.branches[0][0] or [], dot, scopes)
            items = list(collection.items()) if isinstance(collection, dict) else list(enumerate(collection or []))
            if not items and len(node.branches) > 1:
                _execute(node.branches[1][1], dot, [*scopes, {}], out)
            for key, item in items:
                scope: dict[str, Any] = {}
                if len(node.variables) == 1:
                    scope[node.variables[0]] = item
                elif len(node.variables) == 2:
                    scope[node.variables[0]], scope[node.variables[1]] = key, item
                _execute(node.branches[0][1], item, [*scopes, scope], out)


def _scope_of(name: str, scopes: list[dict[str, Any]]) -> dict[str, Any]:
    for scope in reversed(scopes):
        if name in scope:
            return scope
    raise ValueError(f"undefined variable {name} in template")


def _evaluate(tokens: list[tuple[str, str]], dot: Any, scopes: list[dict[str, Any]]) -> Any:
    """A command: a function applied to operands, or a single operand. No pipelines beyond one command."""
    if ("op", "|") in tokens:
        raise ValueError("pipelines are outside the template subset this interpreter knows")
    operands, rest = _operands(tokens, dot, scopes)
    if rest:
        raise ValueError("unbalanced parenthesis in template")
    if not operands:
        raise ValueError("empty action in template")
    head = operands[0]
    if callable(head):
        return head(*operands[1:])
    if len(operands) > 1:
        raise ValueError("a value cannot take arguments in template")
    return head


def _operands(tokens: list[tuple[str, str]], dot: Any, scopes: list[dict[str, Any]]) -> tuple[list[Any], list]:
    values: list[Any] = []
    index = 0
    while index < len(tokens):
        kind, value = tokens[index]
        if (kind, value) == ("op", ")"):
            return values, tokens[index:]
        if (kind, value) == ("op", "("):
            depth, close = 0, index
            for close in range(index, len(tokens)):
                depth += {("op", "("): 1, ("op", ")"): -1}.get(tokens[close], 0)
                if depth == 0:
                    break
            result = _evaluate(tokens[index + 1 : close], dot, scopes)
            index = close + 1
            while index < len(tokens) and tokens[index][0] == "field" and tokens[index][1] != ".":
                result = _fields(result, tokens[index][1])
                index += 1
            values.append(result)
            continue
        if kind == "string":
            values.append(_go_unquote(value))
        elif kind == "number":
            values.append(int(value))
        elif kind == "field":
            values.append(dot if value == "." else _fields(dot, value))
        elif kind == "var":
            name, _, path = value.partition(".")
            base = _scope_of(name, scopes)[name]
            values.append(_fields(base, "." + path) if path else base)
        elif kind == "word" and value in ("true", "false"):
            values.append(value == "true")
        elif kind == "word" and value in _FUNCTIONS:
            if values:
                raise ValueError(f"{value} must come first in its command")
            values.append(_FUNCTIONS[value])
        else:
            raise ValueError(f"{value!r} is outside the template subset this interpreter knows")
        index += 1
    return values, []


def _fields(value: Any, path: str) -> Any:
    for name in path.strip(".").split("."):
        if not isinstance(value, dict) or name not in value:
            raise ValueError(f"no field {name} in template data")
        value = value[name]
    return value


def _go_unquote(literal: str) -> str:
    if literal.startswith("`"):
        return literal[1:-1]
    escapes = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}

    def replace(match: re.Match[str]) -> str:
        escape = match.group(1)
        if escape[0] in "uUx":
            return chr(int(escape[1:], 16))
        return escapes[escape]

    return re.sub(r'\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{2}|[ntr"\\abfv])', replace, literal[1:-1])


def _truth(value: Any) -> bool:
    return bool(value)  # Go's truth: false, 0, nil and empty strings, slices and maps are false; as in Python


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<no value>"
    return str(value)


def _slice(value: Any, *bounds: int) -> Any:
    return value[bounds[0] : bounds[1]] if len(bounds) == 2 else value[bounds[0] :] if bounds else value


def _and(*values: Any) -> Any:
    for value in values:
        if not _truth(value):
            return value
    return values[-1]


def _or(*values: Any) -> Any:
    for value in values:
        if _truth(value):
            return value
    return values[-1]


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        value = value[key]
    return value


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "eq": lambda first, *others: any(first == other for other in others),
    "ne": lambda first, second: first != second,
    "not": lambda value: not _truth(value),
    "and": _and,
    "or": _or,
    "len": len,
    "slice": _slice,
    "index": _index,
}
