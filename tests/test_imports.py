"""Imports run one way: no circle between lorafit's modules, counting the imports inside functions, and no import of
lorafit's own pure-Python modules inside a function of the core (a lazy import is for heavy libraries)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
# the modules every command and the page go through (pyproject's [tool.mypy] checks the same)
CORE = (
    "lorafit.choices",
    "lorafit.options",
    "lorafit.schema",
    "lorafit.stacks",
    "lorafit.memory",
    "lorafit.serving",
    "lorafit.plan",
    "lorafit.answers",
    "lorafit.models",
    "lorafit.hardware",
    "lorafit.units",
    "lorafit.errors",
    "lorafit.files",
)
# lazy imports of lorafit's own modules that stay, and why
LAZY = {
    ("lorafit.answers", "lorafit.data"): "the data package (tens of ms) loads only for --data: `plan` starts in 0.3 s",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "lorafit").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """(lorafit module imported, whether inside a function) for each import in `path`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    local = {
        id(node)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("lorafit.") and target != name:
                yield target, id(node) in local


def test_the_core_is_in_no_import_circle() -> None:
    known = modules()
    graph = {name: {target for target, _ in imports(name, path, known)} for name, path in known.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo += graph.get(name, ())
        return False

    circles = [
        (module, target) for module in CORE if module in graph for target in graph[module] if reaches(target, module)
    ]
    assert not circles, f"imported both ways (directly or through others): {circles}"


def test_the_core_imports_lorafit_at_the_top() -> None:
    known = modules()
    lazy = [
        (module, target)
        for module in CORE
        if module in known
        for target, inside in imports(module, known[module], known)
        if inside and not any(module == m and (target + ".").startswith(t + ".") for m, t in LAZY)
    ]
    assert not lazy, f"imported inside a function (move the shared piece down instead): {lazy}"
