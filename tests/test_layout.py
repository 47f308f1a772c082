"""The imports point one way: the library (omnidraft_mlx/) never imports the command line,
the model catalog or the bench, and the command line imports the bench only in its bench
command; no module of the library imports itself through others (no import circle), and each
sub-package imports only what the "May import:" line of its __init__.py docstring names (the
top-level modules, as a group, what omnidraft_mlx/__init__.py's names). Every import statement
counts, those inside functions and under `if TYPE_CHECKING:` too."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPS = ("omnidraft_mlx.cli", "omnidraft_mlx.models", "omnidraft_mlx.bench")


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved against its package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.parent.name in ("cli", "models", "bench") and path.parent.parent == ROOT:
        package = f"omnidraft_mlx.{path.parent.name}"  # installed under omnidraft_mlx
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def offending(files, banned, allowed=()) -> list[str]:
    return [
        f"{f.relative_to(ROOT)}:{line} imports {module}"
        for f in files
        if f.relative_to(ROOT).as_posix() not in allowed
        for line, module in imported(f)
        if any(module == b or module.startswith(b + ".") for b in banned)
    ]


def library_graph(library: Path) -> dict[str, dict[str, int]]:
    """Each module of the library (a package by its __init__) -> {module it imports: first line}."""
    modules = {}
    for f in sorted(library.rglob("*.py")):
        parts = f.relative_to(library.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in modules.items():
        graph[name] = {}
        for line, module in imported(f):
            while module and module not in modules:  # an imported name: the module that holds it
                module = module.rpartition(".")[0]
            if module and module != name:
                graph[name].setdefault(module, line)
    return graph


def import_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """A circle of imports (its first module again at its end), or []."""
    done, path = set(), []

    def visit(name: str) -> list[str]:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return []
        path.append(name)
        for imported_module in graph[name]:
            if found := visit(imported_module):
                return found
        path.pop()
        done.add(name)
        return []

    return next((found for name in graph if (found := visit(name))), [])


def allowed_imports(init: Path) -> list[str]:
    """What a package's docstring's "May import: a, b.c, d." names (it may go on over lines)."""
    found = re.search(r"^May import: (.+?)\.$", ast.get_docstring(ast.parse(init.read_text())) or "", re.M | re.S)
    assert found, f"{init}: no 'May import: ...' line in its docstring"
    return [name.strip() for name in found[1].split(",")]


def forbidden_imports(library: Path, graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a sub-package's module (or a top-level module) that its package's docstring
    (omnidraft_mlx/__init__.py's) does not allow: a package's own modules always are."""
    root = library.name
    packages = sorted(p.name for p in library.iterdir() if (p / "__init__.py").exists())
    rules = {p: allowed_imports(library / p / "__init__.py") for p in packages}
    rules[""] = allowed_imports(library / "__init__.py")

    def group(module: str) -> str:
        first = module.removeprefix(root + ".").split(".")[0]
        return first if first in packages else ""

    return [
        f"{name}:{line} imports {module}"
        for name, imports in graph.items()
        for module, line in imports.items()
        if module != root and group(module) != group(name)
        if not any(module == f"{root}.{a}" or module.startswith(f"{root}.{a}.") for a in rules[group(name)])
    ]


def test_no_import_circle():
    graph = library_graph(ROOT / "omnidraft_mlx")
    assert len(graph) > 30
    cycle = import_cycle(graph)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_each_package_imports_only_what_its_docstring_allows():
    library = ROOT / "omnidraft_mlx"
    assert forbidden_imports(library, library_graph(library)) == []


def test_the_checks_see_a_circle_and_a_forbidden_import(tmp_path, monkeypatch):
    # A circle through an import inside a function and one under `if TYPE_CHECKING:`; a package
    # importing a sibling its docstring leaves out; a top-level module importing what the group may.
    monkeypatch.setattr("test_layout.ROOT", tmp_path)
    library = tmp_path / "omnidraft_mlx"
    for package, allowed in (("", "low"), ("low", "errors"), ("high", "low.leaf, errors")):
        (library / package).mkdir(parents=True, exist_ok=True)
        (library / package / "__init__.py").write_text(f'"""A package.\nMay import: {allowed}.\n"""\n')
    (library / "errors.py").write_text("")
    (library / "top.py").write_text("from omnidraft_mlx.errors import E\nfrom omnidraft_mlx.low import leaf\n")
    (library / "low" / "leaf.py").write_text("from omnidraft_mlx.errors import E\n")
    (library / "low" / "a.py").write_text("def f():\n    from omnidraft_mlx.high.b import g\n")
    (library / "high" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom . import c\n\nif TYPE_CHECKING:\n    from ..low import a\n"
    )
    (library / "high" / "c.py").write_text("from omnidraft_mlx.low.leaf import x\nimport omnidraft_mlx.low.a\n")
    graph = library_graph(library)
    assert import_cycle(graph) == [
        "omnidraft_mlx.high.b",
        "omnidraft_mlx.high.c",
        "omnidraft_mlx.low.a",
        "omnidraft_mlx.high.b",
    ]
    assert forbidden_imports(library, graph) == [
        "omnidraft_mlx.high.b:6 imports omnidraft_mlx.low",
        "omnidraft_mlx.high.b:6 imports omnidraft_mlx.low.a",
        "omnidraft_mlx.high.c:2 imports omnidraft_mlx.low.a",
        "omnidraft_mlx.low.a:2 imports omnidraft_mlx.high.b",
    ]
    del graph["omnidraft_mlx.high.c"]["omnidraft_mlx.low.a"]
    assert import_cycle(graph) == ["omnidraft_mlx.high.b", "omnidraft_mlx.low.a", "omnidraft_mlx.high.b"]
    del graph["omnidraft_mlx.high.b"]["omnidraft_mlx.low.a"]
    assert import_cycle(graph) == []


def test_library_imports_no_application():
    files = sorted((ROOT / "omnidraft_mlx").rglob("*.py"))
    assert len(files) > 30
    assert offending(files, APPS) == []


def test_cli_imports_bench_only_in_the_bench_command():
    files = sorted((ROOT / "cli").glob("*.py"))
    assert offending(files, ("omnidraft_mlx.bench",), allowed=("cli/bench_cmd.py",)) == []


def test_the_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    # A library module that imports the catalog lazily (as loading.py once did), one relatively.
    monkeypatch.setattr("test_layout.ROOT", tmp_path)
    (tmp_path / "omnidraft_mlx").mkdir()
    lazy = tmp_path / "omnidraft_mlx" / "loading.py"
    lazy.write_text("def load():\n    from omnidraft_mlx.models.pull import resolve_model\n")
    relative = tmp_path / "omnidraft_mlx" / "x.py"
    relative.write_text("from .models import pull\n")
    assert offending([lazy, relative], APPS) == [
        "omnidraft_mlx/loading.py:2 imports omnidraft_mlx.models.pull",
        "omnidraft_mlx/loading.py:2 imports omnidraft_mlx.models.pull.resolve_model",
        "omnidraft_mlx/x.py:1 imports omnidraft_mlx.models",
        "omnidraft_mlx/x.py:1 imports omnidraft_mlx.models.pull",
    ]


def test_readme_stays_short():
    # Detail belongs in docs/; the README keeps the set-up, the results table and the map.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 8000
    assert readme.index("./run.sh omnidraft generate") < readme.index("./run.sh pytest -q") < 400
