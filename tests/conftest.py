import pytest
from mlx_lm import load

from tiny_models import build_tiny_models


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    """Paths of the tiny trained models: "draft", "target", "same"."""
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dirs) -> dict:
    """(model, tokenizer) per tiny model name."""
    return {name: load(str(path)) for name, path in tiny_dirs.items()}
