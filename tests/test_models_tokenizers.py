"""Converted tokenizers give the reference token ids (see tests/fixtures/make_tokenizer_fixtures.py).

Each fixture is checked twice: on tokenizer.json itself, and through mlx-lm's
tokenizer loading (what the engine uses), which also applies the BOS policy
of tokenizer_config.json.
"""

import json
import unicodedata
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {
    "smollm2": "smollm2-135m",
    "qwen2": "qwen2.5-coder-0.5b",
    "gemma3": "gemma-3-270m",
}

pytestmark = pytest.mark.real


def _fixture(family):
    return json.loads((FIXTURES / f"tokenizer_{family}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request):
    from omnidraft_mlx.models.pull import pull

    return request.param, pull(MODELS[request.param], progress=False)


def test_fixtures_are_varied():
    for fam in MODELS:
        texts = [c["text"] for c in _fixture(fam)["cases"]]
        assert len(texts) >= 40
        assert any("\n\n\n" in t for t in texts) and any("    " in t for t in texts)
        assert any(ord(ch) > 0x1F000 for t in texts for ch in t)  # emoji
        assert any("1234567890" in t for t in texts)


def test_tokenizer_json_matches_reference(family):
    from tokenizers import Tokenizer

    fam, model_dir = family
    fixture = _fixture(fam)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bad = [
        (c["text"], got, c["ids"])
        for c in fixture["cases"]
        if (got := tok.encode(c["text"], add_special_tokens=fixture["add_special_tokens"]).ids) != c["ids"]
    ]
    assert not bad, f"{len(bad)} of {len(fixture['cases'])} differ, first: {bad[0]}"


def test_mlx_lm_tokenizer_matches_reference(family):
    from mlx_lm.tokenizer_utils import load

    fam, model_dir = family
    fixture = _fixture(fam)
    tok = load(Path(model_dir))
    bad = [(c["text"], got, c["ids"]) for c in fixture["cases"] if (got := tok.encode(c["text"])) != c["ids"]]
    assert not bad, f"{len(bad)} of {len(fixture['cases'])} differ, first: {bad[0]}"


def test_decode_round_trips(family):
    from mlx_lm.tokenizer_utils import load

    fam, model_dir = family
    tok = load(Path(model_dir))
    for case in _fixture(fam)["cases"]:
        text = case["text"]
        if fam == "gemma3" and "\u2581" in text:
            continue  # a literal '▁' decodes as a space in SentencePiece vocabularies
        if fam == "qwen2":
            text = unicodedata.normalize("NFC", text)  # Qwen normalizes its input
        assert tok.decode(case["ids"], skip_special_tokens=True) == text


def test_special_tokens(family):
    from mlx_lm.tokenizer_utils import load

    fam, model_dir = family
    tok = load(Path(model_dir))
    if fam in ("smollm2", "qwen2"):
        # Chat models: ChatML markers are single tokens and the template renders.
        assert len(tok.encode("<|im_start|>", add_special_tokens=False)) == 1
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert text.rstrip().endswith("<|im_start|>assistant")
        assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    else:
        assert tok.encode("x")[0] == tok.bos_token_id == 2
        assert tok.chat_template is None
