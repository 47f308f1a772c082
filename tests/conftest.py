import hashlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from mlx_lm import load
from tiny_models import build_tiny_models

from omnidraft_mlx.pair import make_pair


@pytest.fixture(autouse=True)
def ctrl_c_interrupts():
    """Ctrl-C (SIGINT) raises KeyboardInterrupt in every test, however the suite was started: a
    background job (nohup, `&` in a script) starts with SIGINT ignored, and Python then installs no
    handler; tests that interrupt themselves, and the children they start, rely on it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _built_once(name: str, build) -> Path:
    """build(dir) -> the models in dir, kept between test sessions under a digest of the code
    that builds them (training them costs minutes on 2 cores); built aside, then renamed."""
    digest = hashlib.sha256((Path(__file__).parent / "tiny_models.py").read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("OMNIDRAFT_TEST_CACHE", Path.home() / ".cache" / "omnidraft-tests"))
    done = root / f"{name}-{digest}"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
        build(tmp)
        try:
            os.rename(tmp, done)
        except OSError:  # another session finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    return done


@pytest.fixture(scope="session")
def tiny_dirs() -> dict:
    """Paths of the tiny trained models: "draft", "target", "same"."""
    root = _built_once("tiny", build_tiny_models)
    return {name: root / f"tiny-{name}" for name in ("draft", "target", "same")}


@pytest.fixture(scope="session")
def tiny(tiny_dirs) -> dict:
    """(model, tokenizer) per tiny model name."""
    return {name: load(str(path)) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="module")
def cross(tiny):
    """The tiny cross-vocabulary pair, fresh per test module (its n-gram cache grows in use)."""
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    return make_pair(dm, dt, tm, tt)
