"""GGUF tokenizers against llama.cpp's own vocabulary tests.

llama.cpp ships vocab-only GGUFs (vendor/llama.cpp/models/ggml-vocab-<name>.gguf)
with test texts (.inp) and the ids the model's own Hugging Face tokenizer gives
them (.out). They come in the llama-cpp-python sdist on PyPI, fetched once into
the downloads directory (under OMNIDRAFT_HOME), sha256-checked, never committed.

Each vocabulary's tokenizer, as the GGUF import builds it, must give the
reference ids on every case, and spell every token in the bytes llama.cpp
gives it (cross-vocabulary translation maps tokens by those bytes).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import cache
from pathlib import Path

import pytest

from omnidraft_mlx.paths import downloads_dir

pytestmark = pytest.mark.real

SDIST = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
# The vocabularies of that version that have test cases (.inp/.out).
VOCABS = (
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
NOT_GENERATIVE = {"bert-bge": "BERT (WordPiece): an embedding model's vocabulary, not a generative one"}
SEPARATOR = "\n__ggml_vocab_test__\n"
# llama.cpp token types
NORMAL, USER_DEFINED, BYTE = 1, 4, 6


def _vocab_dir() -> Path:
    """The sdist's vocab files, fetched and unpacked once (atomically) into the downloads directory."""
    package, version, sha256 = SDIST
    done = downloads_dir() / f"llama-cpp-vocab-{version}"
    if done.is_dir():
        return done
    downloads_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".vocab-tmp-{os.getpid()}-", dir=downloads_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--disable-pip-version-check", "-d", tmp, f"{package}=={version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot download the {package} sdist: {(result.stderr or result.stdout).strip()[-200:]}")
        (sdist,) = Path(tmp).glob("*.tar.gz")
        assert hashlib.sha256(sdist.read_bytes()).hexdigest() == sha256, f"{sdist.name} is not the pinned file"
        out = Path(tmp) / "vocab"
        out.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/vendor/llama.cpp/models/" in member.name and name.startswith("ggml-vocab-") and member.isfile():
                    with tar.extractfile(member) as src, open(out / name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        try:
            os.rename(out, done)
        except OSError:  # another session unpacked it first
            pass
    return done


@cache
def _vocab(name: str):
    """(GGUF reader, converted tokenizer as saved and loaded again, [(text, reference ids)]) of one vocabulary."""
    import gguf
    from tokenizers import Tokenizer

    from omnidraft_mlx.models.tokenizer import build_tokenizer

    path = _vocab_dir() / f"ggml-vocab-{name}.gguf"
    # Every text ends with the separator, except the last one in some files (gemma-4).
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").removesuffix(SEPARATOR).split(SEPARATOR)
    lines = Path(f"{path}.out").read_text(encoding="utf-8").removesuffix("\n").split("\n")
    assert len(lines) == len(texts), f"{name}: {len(texts)} texts, {len(lines)} id lists"
    cases = [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]
    reader = gguf.GGUFReader(str(path))
    tok = build_tokenizer(reader, reader.fields["general.architecture"].contents())
    return reader, Tokenizer.from_str(tok.to_str()), cases


def _skip_not_generative(name):
    if name in NOT_GENERATIVE:
        pytest.skip(NOT_GENERATIVE[name])


@pytest.mark.parametrize("name", VOCABS)
def test_reference_ids(name):
    _skip_not_generative(name)
    _, tok, cases = _vocab(name)
    assert len(cases) >= 40
    bad = [(text, got, ref) for text, ref in cases if (got := tok.encode(text, add_special_tokens=False).ids) != ref]
    assert not bad, f"{name}: {len(bad)} of {len(cases)} differ, first: {bad[0]}"


def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _llama_cpp_piece(text: str, kind: int, model: str, decoder: dict) -> bytes:
    """The bytes llama.cpp's token_to_piece gives a normal, byte or user-defined token."""
    if kind == USER_DEFINED:
        return text.encode()
    if kind == BYTE:
        return bytes([int(text[3:-1], 16)])
    if model == "gpt2" and all(c in decoder for c in text):
        return bytes(decoder[c] for c in text)
    if model == "gpt2":
        # A normal token stored as raw text (Command-R's emoji pieces): its text, as Hugging Face's
        # byte-level decoder reads it (llama.cpp prints it as "[UNK_BYTE_...]").
        return text.encode()
    return text.replace("\u2581", " ").encode()


@pytest.mark.parametrize("name", VOCABS)
def test_token_spellings(name):
    """Every token spells as llama.cpp spells it, and the spellings of a text's tokens are its bytes."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from omnidraft_mlx.vocab.tokenmap import token_bytes

    _skip_not_generative(name)
    reader, tok, cases = _vocab(name)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    kinds = reader.fields["tokenizer.ggml.token_type"].contents()
    model = reader.fields["tokenizer.ggml.model"].contents()
    spelled = token_bytes(TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok)), len(tokens))
    decoder = _byte_level_decoder()
    wrong = [
        (i, text, spelled[i])
        for i, (text, kind) in enumerate(zip(tokens, kinds))
        if kind in (NORMAL, USER_DEFINED, BYTE) and spelled[i] != _llama_cpp_piece(text, kind, model, decoder)
    ]
    assert not wrong, f"{name}: {len(wrong)} tokens spelled differently, first: {wrong[:3]}"
    for text, ref in cases:
        # What the tokens stand for: the text after the tokenizer's normalizer (NFC, SentencePiece's
        # space prefix), '▁' read back as the space it replaced.
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text).replace("\u2581", " ")
        assert b"".join(spelled[i] for i in ref) == text.encode(), f"{name}: {text!r}"
