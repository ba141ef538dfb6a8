"""YAML and JSON from a user's file, parsed with bounds, so that a hostile or broken file is one line, not a crash.

`yaml.safe_load` and `json.loads` are safe from code execution but not from size: an alias that holds itself,
a few hundred bytes of nested aliases that expand to billions of nodes ("billion laughs"), 20,000 nested
brackets (a RecursionError in PyYAML's composer or json's scanner) and a 5,000-digit number (Python's int-string
limit raises ValueError) each end in a traceback or exhaust memory. Here each is the error a syntax error is
(yaml.YAMLError, ValueError), which the caller words in one line naming the file. Settings files are a few levels
deep and a few hundred values long, so the bounds below are far above any real one.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_DEPTH = 100  # mappings and lists inside one another, aliases expanded
MAX_NODES = 100_000  # values in the whole document, each alias counted as what it expands to
MAX_INT_DIGITS = 4300  # Python's default int-string limit (sys.get_int_max_str_digits)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` within the bounds above: every problem, a bound included, is a yaml.YAMLError
    with the line it is at (`problem_mark`) and what it is (`problem`)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_json(text: str) -> Any:
    """`json.loads(text)` within the bounds above: every problem is a ValueError (json.JSONDecodeError for a
    syntax error, with its line)."""
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise TooBig(f"nested more than {MAX_DEPTH} deep") from None
    if _depth(value) > MAX_DEPTH:
        raise TooBig(f"nested more than {MAX_DEPTH} deep")
    return value


class TooBig(ValueError):
    """A JSON document past a bound: its message says which."""


class Refused(ComposerError):
    """A YAML document past a bound, or a value YAML's types cannot hold; one line as a string."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(None, None, problem, mark)

    def __str__(self) -> str:
        mark = self.problem_mark
        return f"line {mark.line + 1}: {self.problem}" if mark is not None else str(self.problem)


def _bounded_int(text: str) -> int:
    digits = sum(character.isdigit() for character in text)
    if digits > MAX_INT_DIGITS:
        raise TooBig(_too_many_digits(digits))
    return int(text)


def _too_many_digits(digits: int) -> str:
    return f"a number of {digits} digits; lorafit reads numbers of up to {MAX_INT_DIGITS}"


def _depth(value: Any) -> int:
    """How deep lists and mappings nest in a parsed JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:
                stack += [(child, level + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses an alias to a node that holds it, nesting past MAX_DEPTH, a document
    that expands past MAX_NODES values, and integers past MAX_INT_DIGITS digits."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._open_anchors: set[str] = set()

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            if event.anchor in self._open_anchors:
                raise Refused(
                    f"the alias *{event.anchor} is inside its own anchor (a value that holds itself)", event.start_mark
                )
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise Refused(f"nested more than {MAX_DEPTH} deep", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)

    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, 1)
        return node

    def construct_yaml_int(self, node: ScalarNode) -> int:
        text = str(node.value)
        digits = sum(character.isdigit() for character in text)
        if digits > MAX_INT_DIGITS:
            raise Refused(_too_many_digits(digits), node.start_mark)
        return super().construct_yaml_int(node)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """A scalar that YAML's types cannot hold (a date like 2024-02-30) is a problem at its line."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as error:
            raise Refused(str(error), node.start_mark) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _expanded_size(node: Node, measured: dict[int, tuple[int, int]], level: int) -> tuple[int, int]:
    """(values, levels) under `node` with every alias expanded: a shared node is counted at each use but
    measured once. Past MAX_DEPTH levels or MAX_NODES values, Refused at the node."""
    if level > MAX_DEPTH:
        raise Refused(f"nested more than {MAX_DEPTH} deep once aliases expand", node.start_mark)
    if id(node) not in measured:
        children = node.value if isinstance(node, SequenceNode) else []
        if isinstance(node, MappingNode):
            children = [child for pair in node.value for child in pair]
        size, height = 1, 1
        for child in children:
            child_size, child_height = _expanded_size(child, measured, level + 1)
            size, height = size + child_size, max(height, child_height + 1)
            if size > MAX_NODES:
                raise Refused(f"more than {MAX_NODES} values once aliases expand (an alias bomb?)", node.start_mark)
        measured[id(node)] = (size, height)
    size, height = measured[id(node)]
    if level + height - 1 > MAX_DEPTH:
        raise Refused(f"nested more than {MAX_DEPTH} deep once aliases expand", node.start_mark)
    return size, height
