"""The imports point one way: the library (omnidraft_mlx/) never imports the command line,
the model catalog or the bench, and the command line imports the bench only in its bench
command. Every import statement counts, those inside functions too."""

import ast
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
