import pytest
from mlx_lm import load

from omnidraft_mlx.pair import make_pair

from tiny_models import build_tiny_models


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    """Paths of the tiny trained models: "draft", "target", "same"."""
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dirs) -> dict:
    """(model, tokenizer) per tiny model name."""
    return {name: load(str(path)) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="module")
def cross(tiny):
    """The tiny cross-vocabulary pair, fresh per test module (its n-gram cache grows in use)."""
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    return make_pair(dm, dt, tm, tt)
