"""Imports run one way: no circle between lorafit's modules, and no function-local import of lorafit's own light
modules (a lazy import is for heavy libraries, or for a lorafit module that pulls one in at import time, so that
`lorafit plan` never loads torch).

The graph is read from the source with `ast`, so a circle hidden inside a function counts as much as one at the top
of a file. Imports under `if TYPE_CHECKING:` are for the type checker and never run; they are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lorafit"

# Libraries that cost real start-up time (or a GPU stack): a lorafit module that imports one of these at its top
# level may itself be imported lazily.
HEAVY = {
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "trl",
    "accelerate",
    "datasets",
    "deepspeed",
    "llama_cpp",
    "safetensors",
    "numpy",
    "gguf",
    "pyarrow",
    "matplotlib",
    "tokenizers",
    "starlette",
    "uvicorn",
    "huggingface_hub",
    "psutil",
    "jinja2",
}


# Light lorafit modules that may still load inside a function, each with the measurement that keeps it there.
KEPT_LAZY = {
    # `python -X importtime -c "import lorafit.cli, lorafit.data"`: about 20 ms more, against the 0.3 s start-up
    # budget of `lorafit plan` (make bench-startup); the data package loads only for --data
    ("lorafit.answers", "lorafit.data"): "start-up of lorafit plan",
}


@dataclass
class Module:
    name: str
    path: Path
    top: set[str] = field(default_factory=set)  # lorafit modules imported when this one is
    lazy: set[str] = field(default_factory=set)  # lorafit modules imported inside a function
    lazy_lines: dict[str, int] = field(default_factory=dict)
    heavy_top: bool = False  # imports a heavy library at import time


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, *, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it runs inside a function; TYPE_CHECKING blocks skipped."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and is_type_checking(child):
            yield from (
                item for node in child.orelse for item in imports(ast.Module([node], []), in_function=in_function)
            )
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from imports(child, in_function=inner)


def targets(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> set[str]:
    """The lorafit modules a statement imports, most specific first: `from X import y` imports X.y when that is a
    module, else X."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
    found = set()
    for dotted in names:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted.startswith("lorafit"):
            found.add(dotted)
    return found


def load_graph() -> dict[str, Module]:
    modules = {module_name(path): Module(module_name(path), path) for path in sorted(PACKAGE.rglob("*.py"))}
    known = set(modules)
    for module in modules.values():
        package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
        loaded = set(parents(module.name)) | {module.name}  # a module's own packages are imported before it
        for node, in_function in imports(ast.parse(module.path.read_text(), str(module.path))):
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not in_function and not (isinstance(node, ast.ImportFrom) and node.level):
                module.heavy_top |= any(root.split(".")[0] in HEAVY for root in roots)
            for target in targets(node, package, known) - loaded:
                # importing a submodule runs its packages' __init__ first
                for name in {target} | (set(parents(target)) & known) - loaded:
                    module.top.add(name) if not in_function else module.lazy.add(name)
                if in_function:
                    module.lazy_lines.setdefault(target, node.lineno)
    return modules


def parents(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over top-level and lazy imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in sorted(modules[name].top | modules[name].lazy):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def heavy_at_import(modules: dict[str, Module]) -> set[str]:
    """The lorafit modules that load a heavy library when imported (themselves or through their imports)."""
    heavy = {name for name, module in modules.items() if module.heavy_top}
    changed = True
    while changed:
        changed = False
        for name, module in modules.items():
            if name not in heavy and module.top & heavy:
                heavy.add(name)
                changed = True
    return heavy


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    return load_graph()


def test_no_module_imports_itself_through_others(graph: dict[str, Module]) -> None:
    assert circles(graph) == []


def test_lazy_imports_of_lorafit_modules_are_only_of_heavy_ones(graph: dict[str, Module]) -> None:
    heavy = heavy_at_import(graph)
    light = sorted(
        f"{module.path.relative_to(PACKAGE.parent)}:{module.lazy_lines[target]} imports {target} inside a function"
        for module in graph.values()
        for target in set(module.lazy_lines) - heavy
        if (module.name, target) not in KEPT_LAZY
    )
    assert light == []


def test_the_planner_loads_no_heavy_module(graph: dict[str, Module]) -> None:
    heavy = heavy_at_import(graph)
    assert {"lorafit.cli", "lorafit.plan", "lorafit.memory", "lorafit.options"} & heavy == set()


def test_the_checks_see_a_circle_and_a_light_lazy_import(tmp_path: Path) -> None:
    """The graph reader itself: a circle through a function-local import is found, and flagged as light."""
    package = tmp_path / "lorafit"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from lorafit import b\n")
    (package / "b.py").write_text("def f():\n    from lorafit.a import x\n    import torch\n")
    (package / "c.py").write_text("import torch\n")
    (package / "d.py").write_text("def g():\n    from lorafit import c\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        modules = load_graph()
    finally:
        PACKAGE = saved
    assert circles(modules) == [["lorafit.a", "lorafit.b"]]
    assert heavy_at_import(modules) == {"lorafit.c"}
    assert set(modules["lorafit.b"].lazy_lines) == {"lorafit.a"}
    assert set(modules["lorafit.d"].lazy_lines) - heavy_at_import(modules) == set()
