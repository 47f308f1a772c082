"""Results of record hold nothing of the machine they ran on: no home directory, no checkout path
(a run names its models by catalog name and its files from the checkout's root)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"/(root|home/[^/\s\"']+|Users/[^/\s\"']+)/")


def machine_paths(files: list[Path], checkout: str) -> list[str]:
    found = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line) or checkout in line:
                found.append(f"{f.relative_to(ROOT)}:{n}")
    return found


def test_results_of_record_hold_no_machine_paths():
    files = [f for f in (ROOT / "bench" / "results").rglob("*") if f.is_file() and f.suffix != ".png"]
    assert len(files) > 10
    assert machine_paths(files, str(ROOT) + "/") == []


def test_the_check_finds_a_home_directory_and_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setattr("test_results.ROOT", tmp_path)
    (tmp_path / "a.json").write_text('{"model": "/Users/ann/.cache/omnidraft/models/qwen"}\n')
    (tmp_path / "b.md").write_text(f"ok\nwrote {tmp_path}/x.py\n")
    (tmp_path / "c.log").write_text("serving 'qwen2.5-coder-0.5b' from /tmp/out\n")
    found = machine_paths(sorted(tmp_path.iterdir()), str(tmp_path) + "/")
    assert found == ["a.json:1", "b.md:2"]
