"""No import circles among the kernel modules (issue #38): kivi_attention imported kivi_attention_mma,
which imported kivi_attention back inside a function. Pure parsing with `ast`, nothing imported, so
the check is fast and sees the imports inside functions as well as those at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file imports anywhere (module level, functions, classes):
    for `from package import name`, the submodule package.name where there is one, else the package
    (whose __init__ defines the name)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):  # `..x` is x in the package above this one
                base = base.rpartition(".")[0]
            source = ".".join(part for part in (base if node.level else "", node.module or "") if part)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {module for module in found if module in modules and module != name}


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package (dotted name, e.g. "kvcompress.kernels") -> the package's modules it imports."""
    paths = sorted((root / package.replace(".", "/")).rglob("*.py"))
    modules = {module_name(path, root) for path in paths}
    return {module_name(path, root): imports_of(path, root, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted: every
    module of one imports every other, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_finds_a_circle_through_a_function_level_import(tmp_path):
    # the shape of the circle that was: a imports b at the top, b imports a inside a function
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import TILE\n    return TILE\n")
    (package / "c.py").write_text("from .b import f\nimport circle.a\n")
    graph = import_graph("circle", tmp_path)
    assert graph == {"circle": set(), "circle.a": {"circle.b"}, "circle.b": {"circle.a"},
                     "circle.c": {"circle.a", "circle.b"}}
    assert cycles(graph) == [["circle.a", "circle.b"]]


def test_no_import_circle_among_the_kernels():
    graph = import_graph("kvcompress.kernels")
    assert "kvcompress.kernels.kivi_attention_mma" in graph["kvcompress.kernels.kivi_attention"]
    found = cycles(graph)
    assert not found, f"import circles among the kernel modules: {found}"
