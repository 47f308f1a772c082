"""Build a fast tokenizer from the vocabulary a GGUF file carries.

transformers' `convert_gguf_tokenizer` does most of the work without torch,
but as is it differs from the reference tokenizers for many families; `_fix`
makes them exact by doing what llama.cpp does for the GGUF's pre-tokenizer
type (`tokenizer.ggml.pre`, see llama.cpp's src/llama-vocab.cpp). Checked
against published tokenizer.json files (tests/test_models_tokenizers.py) and
llama.cpp's own vocab tests (tests/test_gguf_vocab.py).
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

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

# llama.cpp's pre-tokenizer regexes per `tokenizer.ggml.pre` where transformers has none or a wrong
# one. llama.cpp applies them in turn, each cutting every piece into its matches and the text between
# them: tokenizers' Split with behavior "isolated". Byte-level encoding comes after, on each piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2]
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
    "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
    "]+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_SPLITS = {
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _DIGITS_THEN_GPT2,
    ),
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "deepseek-llm": [
        "[\r\n]",
        _DEEPSEEK_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
}
# Pre-tokenizer types whose words are looked up whole before merging (llama.cpp's ignore_merges,
# tokenizers' BPE `ignore_merges`): a word in the vocabulary is one token even where merges would
# not build it.
_IGNORE_MERGES = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "minicpm5",
    "youtu",
    "glm4",
    "glm5",
    "tekken",
    "granite-embed-multi-97m",
}
# Qwen's tokenizers normalize their input to NFC.
_NFC = {"qwen2", "deepseek-r1-qwen"}
# llama.cpp token types
_NORMAL = 1
_USER_DEFINED = 4  # an added token, matched whole in the raw text


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


def _sentencepiece_spaces(tok: Tokenizer, td: dict) -> None:
    """llama.cpp prepends a space to every SentencePiece text (add_space_prefix, on unless the GGUF
    says otherwise), even one that starts with a space; Metaspace would not add a second one."""
    prefix = td.get("add_prefix_space", True)
    steps = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    if not prefix:  # no space was added, so decoding takes none off
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])


def _byte_level(tok: Tokenizer, td: dict) -> Tokenizer:
    """Pre-tokenizer, whole-word lookup and raw added tokens as llama.cpp has them for this `pre`."""
    pre = td.get("pre_tokenizer_type")
    if pre in _SPLITS:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[pre]]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
        )
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    data = json.loads(tok.to_str())
    model = data["model"]
    model["ignore_merges"] = pre in _IGNORE_MERGES
    # transformers respells a token stored as raw text byte-level ("  " -> "ĠĠ"). Where that is the
    # text of another token (MPT: a user-defined run of spaces and the normal token 245 "ĠĠ";
    # Command-R: raw emoji pieces), the other token keeps its name and the raw one gets its raw
    # text. A user-defined token (MPT's runs of spaces) is matched whole in the text before anything
    # else, as llama.cpp does: an added token. Merges building a name no token has any more go: the
    # raw text is matched first, so they could never apply.
    tokens, kinds = td["tokens"], td.get("token_type") or [_NORMAL] * len(td["tokens"])
    own = {t: i for i, t in enumerate(tokens)}
    by_id = {i: t for t, i in model["vocab"].items()}
    gone, raw = set(), []
    for i, (text, kind) in enumerate(zip(tokens, kinds)):
        name = by_id.get(i)
        if name == text:
            continue
        if name is None:  # its byte-level name went to a later token
            if text not in model["vocab"]:
                model["vocab"][text] = i
        elif own.get(name, i) != i:
            model["vocab"][name] = own[name]
            model["vocab"][text] = i
        elif kind == _USER_DEFINED:
            del model["vocab"][name]
            model["vocab"][text] = i
            gone.add(name)
        if kind == _USER_DEFINED:
            raw.append(AddedToken(text, normalized=False, special=False))
    if gone:
        pairs = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
        model["merges"] = [m for m in pairs if not {m[0], m[1], m[0] + m[1]} & gone]
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_tokens(raw)
    return tok


def _fix(tok: Tokenizer, arch: str, td: dict, add_bos: bool) -> Tokenizer:
    kind = td.get("tokenizer_type")
    if kind == "gpt2":
        tok = _byte_level(tok, td)
    elif kind == "llama" and not arch.startswith("gemma"):
        _sentencepiece_spaces(tok, td)
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
