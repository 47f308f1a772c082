import pytest
from mlx_lm import load

from tiny_models import build_tiny_pair


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """((draft model, draft tokenizer), (target model, target tokenizer))."""
    return load(str(tiny_dirs[0])), load(str(tiny_dirs[1]))
