"""The import drawing of kvcompress/: no circle anywhere (issue 51; among the kernels, issue 38), a kernel
never imports a method, the two method families never import each other, and the library imports
neither Prefect nor DuckDB. Pure parsing with `ast`, nothing imported, so the check is fast and sees
the imports inside functions as well as those at the top of a module (a function-level import that
closes a circle is still a circle: kivi_attention <-> kivi_attention_mma, turboquant_attention <->
methods/turboquant.py and methods/eviction.py <-> methods/composed.py were such)."""

from __future__ import annotations

import ast
import tomllib
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


def external_imports(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package -> the top-level names of the packages outside it that it imports
    anywhere (absolute imports only: a relative one stays inside)."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add(node.module.partition(".")[0])
        found[module_name(path, root)] = names - {package.partition(".")[0]}
    return found


def test_finds_the_circle_a_function_level_import_closes_in_a_nested_package(tmp_path):
    # methods/eviction/base.py importing methods/composed.py inside a function, composed importing it back
    root = tmp_path / "lib"
    (root / "families" / "eviction").mkdir(parents=True)
    for init in (root, root / "families", root / "families" / "eviction"):
        (init / "__init__.py").write_text("")
    (root / "families" / "eviction" / "base.py").write_text("def f():\n    from ..composed import g\n    return g\n")
    (root / "families" / "composed.py").write_text("from .eviction.base import f\n")
    assert cycles(import_graph("lib", tmp_path)) == [["lib.families.composed", "lib.families.eviction.base"]]


def test_no_import_circle_in_the_library():
    graph = import_graph("kvcompress")
    assert "kvcompress.kernels.kivi_attention_mma" in graph["kvcompress.kernels.kivi_attention"]
    assert len(graph) > 70 and "kvcompress.methods.eviction.base" in graph["kvcompress.methods.composed"]
    found = cycles(graph)
    assert not found, "import circles in kvcompress/ (each: modules that import each other): " + "; ".join(
        " <-> ".join(circle) for circle in found)


def test_a_kernel_imports_no_method_and_the_families_not_each_other():
    graph = import_graph("kvcompress")
    upward = {m: sorted(t for t in targets if t.startswith("kvcompress.methods"))
              for m, targets in graph.items() if m.startswith("kvcompress.kernels")}
    assert not {m: t for m, t in upward.items() if t}, "kernels importing methods"
    family = {"eviction": "kvcompress.methods.eviction", "quantization": "kvcompress.methods.quantization"}
    for name, prefix in family.items():
        other = next(p for n, p in family.items() if n != name)
        crossing = {m: sorted(t for t in targets if t.startswith(other))
                    for m, targets in graph.items() if m.startswith(prefix)}
        assert not {m: t for m, t in crossing.items() if t}, f"the {name} family importing the other"
    # the composition sits above both: it builds on the eviction base and on neither family's methods
    assert "kvcompress.methods.eviction.base" in graph["kvcompress.methods.composed"]


def test_the_library_imports_neither_prefect_nor_duckdb():
    imports = external_imports("kvcompress")
    assert "mlx" in imports["kvcompress.methods.base"]  # the check sees absolute imports
    offending = {m: sorted(names & {"prefect", "duckdb"}) for m, names in imports.items() if names & {"prefect", "duckdb"}}
    assert not offending, f"kvcompress/ is the library, without Prefect or DuckDB: {offending}"


def test_pyproject_names_every_package():
    # an explicit list (setuptools' `packages`): a folder missing from it is missing from a wheel
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(init, ROOT) for init in (ROOT / "kvcompress").rglob("__init__.py")}
    assert found - listed == set(), "packages under kvcompress/ missing from pyproject.toml's packages"
