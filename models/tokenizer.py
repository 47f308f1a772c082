"""Build a fast tokenizer from the vocabulary a GGUF file carries.

transformers' `convert_gguf_tokenizer` does most of the work without torch,
but as is it differs from the reference tokenizers for all three families we
ship; `_fix` makes them exact (checked against published tokenizer.json
files and llama.cpp's vocab tests, see tests/test_models_tokenizers.py).
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

from omnidraft_mlx.errors import OmniDraftError

# GGUF key (after "tokenizer.ggml.") -> the name transformers' builders expect.
_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}

_WHITESPACE = "\u2581\n\t"


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_tokenizer_dict(reader) -> dict:
    """The tokenizer metadata of an open gguf.GGUFReader, keyed the transformers way."""
    out = {}
    for key, name in _TOKENIZER_KEYS.items():
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = value
    if "tokens" not in out:
        raise OmniDraftError("this GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    return out


def _whitespace_merges_first(tok: Tokenizer) -> Tokenizer:
    """Gemma: merges building runs of one whitespace char go first, longest result first.

    The merges are rebuilt from the vocabulary order, which would otherwise
    merge a space with the next word before the run of spaces is complete.
    """
    data = json.loads(tok.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]

    def is_run(merge):
        s = merge[0] + merge[1]
        return len(set(s)) == 1 and s[0] in _WHITESPACE

    runs = sorted((m for m in merges if is_run(m)), key=lambda m: -len(m[0] + m[1]))
    data["model"]["merges"] = [list(m) for m in runs] + [list(m) for m in merges if not is_run(m)]
    return Tokenizer.from_str(json.dumps(data))


def _fix(tok: Tokenizer, arch: str, td: dict, add_bos: bool) -> Tokenizer:
    pre = td.get("pre_tokenizer_type")
    if pre in ("smollm", "starcoder"):
        # Every digit apart, then the GPT-2 byte-level regex (llama.cpp groups the
        # two; its starcoder vocab test checks this path).
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    if arch.startswith("gemma"):
        tok = _whitespace_merges_first(tok)
        # Runs of '▁' match whole, as in the reference tokenizer.json.
        tokens = td["tokens"]
        runs = [
            AddedToken("\u2581" * len(t), normalized=False, special=False)
            for t in tokens
            if len(t) > 1 and not t.strip(" ")
        ]
        tok.add_tokens(runs)
    if add_bos and td.get("bos_token_id") is not None:
        bos = td["tokens"][td["bos_token_id"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, td["bos_token_id"])]
        )
    return tok


def build_tokenizer(reader, arch: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one the GGUF describes."""
    # Imported here: transformers is slow to import and only conversion needs it.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    td = read_tokenizer_dict(reader)
    try:
        tok, _ = convert_gguf_tokenizer(arch, td)
    except ValueError as e:
        raise OmniDraftError(f"cannot build the tokenizer of this GGUF: {e}") from None
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", td.get("tokenizer_type") == "llama"))
    return _fix(tok, arch, td, add_bos)


def tokenizer_config(reader) -> dict:
    """tokenizer_config.json contents: special tokens, BOS policy, chat template."""
    td = read_tokenizer_dict(reader)
    tokens = td["tokens"]

    def token(key):
        i = td.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_context_length(reader)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


def _context_length(reader):
    arch = _field(reader, "general.architecture", "")
    return _field(reader, f"{arch}.context_length", 32768)


def save_tokenizer(reader, arch: str, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    build_tokenizer(reader, arch).save(str(out_dir / "tokenizer.json"))
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(reader), f, indent=2, ensure_ascii=False)
