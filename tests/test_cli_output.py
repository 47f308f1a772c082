"""What the CLI prints into a pipe or a file stays whole: no name cut to "qwen2.5-cod…",
no line wrapped at the 80 columns rich assumes when stdout is not a terminal."""

import json
import os
import subprocess
import sys

import pytest

QUANTIZED = "qwen2.5-coder-0.5b-q4"  # a catalog model pulled with --dtype q4


@pytest.fixture
def home(tmp_path):
    """A model home deeper than 80 characters, holding one quantized catalog model."""
    home = tmp_path / ("a-folder-with-a-long-name-" * 3) / "home"
    model = home / "models" / QUANTIZED
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"quantization": {"bits": 4, "group_size": 64}}))
    (model / "model.safetensors").write_bytes(b"")
    assert len(str(home)) > 80
    return home


def piped(home, *args) -> list[str]:
    """The command's stdout lines, read through a pipe by a reader 80 columns wide."""
    env = dict(os.environ, OMNIDRAFT_HOME=str(home), COLUMNS="80")
    out = subprocess.run(
        [sys.executable, "-m", "omnidraft_mlx.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_models_list_keeps_names_whole(home):
    lines = piped(home, "models", "list")
    assert any(str(home) in line for line in lines)  # the title
    row = [line for line in lines if "q4" in line]  # what `omnidraft models list | grep q4` finds
    assert len(row) == 1 and f" {QUANTIZED} " in row[0] and " ready " in row[0], lines
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"):
        assert any(f" {name} " in line for line in lines), name
    assert any("Qwen2.5-Coder-1.5B-Instruct (qwen2), same vocab as 0.5B" in line for line in lines)
    assert not any("…" in line for line in lines)


def test_doctor_and_profile_keep_paths_whole(home):
    assert any(line.split() == ["model", "home", str(home)] for line in piped(home, "doctor"))
    [line] = piped(home, "profile", "show")
    assert line.startswith("no profile yet for ") and str(home / "profiles") in line
