"""Byte strings of tokens and the draft -> target vocabulary map.

Text is the shared truth between two tokenizers: a draft token and a target
token map to each other when they decode to the same bytes. Special tokens map
by role (end of sequence), never by text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins -> raw bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    decoder = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            decoder[chr(256 + n)] = b
            n += 1
    return decoder


def _hf_tokenizer(tokenizer):
    """The transformers tokenizer behind an mlx-lm TokenizerWrapper (or itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _is_byte_level(hf_tok) -> bool:
    spec = json.loads(hf_tok.backend_tokenizer.to_str())
    return "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))


def token_bytes(tokenizer, size: int | None = None) -> list[bytes | None]:
    """Byte string of every token id; None for special tokens and unused ids.

    `size` pads to the model's embedding size, which is often larger than the
    tokenizer's vocabulary.
    """
    hf_tok = _hf_tokenizer(tokenizer)
    vocab = hf_tok.get_vocab()
    size = max(size or 0, max(vocab.values()) + 1)
    special = set(hf_tok.all_special_ids)
    special |= {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    # An added token matches its own text in the input, so it stands for that text, even where the
    # text reads as other bytes byte-level (DeepSeek's "õ", token 32000: b"\xc3\xb5", not b"\xf5").
    added = set(hf_tok.added_tokens_decoder)
    byte_level = _is_byte_level(hf_tok)
    byte_decoder = _gpt2_byte_decoder()
    out: list[bytes | None] = [None] * size
    for piece, idx in vocab.items():
        if idx in special:
            continue
        if byte_level and idx in added:
            out[idx] = piece.encode()
        elif byte_level:
            try:
                out[idx] = bytes(byte_decoder[c] for c in piece)
            except KeyError:  # a non-special added token stored as plain text
                out[idx] = piece.encode()
        elif m := _BYTE_FALLBACK.match(piece):
            out[idx] = bytes([int(m.group(1), 16)])
        else:
            out[idx] = piece.replace("\u2581", " ").encode()
    return out


@dataclass
class VocabMap:
    """Draft id -> target id over the byte-exact vocabulary intersection."""

    draft_to_target: np.ndarray  # int64 [draft vocab], -1 where unmapped
    draft_bytes: list[bytes | None]
    target_bytes: list[bytes | None]
    draft_eos: frozenset[int]
    target_eos: int
    same_vocab: bool

    @property
    def size(self) -> int:
        """Number of mapped draft tokens (the vocabulary intersection)."""
        return int((self.draft_to_target >= 0).sum())

    def mapped_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(draft ids, target ids) of every mapped draft token."""
        draft_ids = np.nonzero(self.draft_to_target >= 0)[0]
        return draft_ids, self.draft_to_target[draft_ids]


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return sorted(ids)
    return [_hf_tokenizer(tokenizer).eos_token_id]


def _target_eos(tokenizer) -> int:
    """The end-of-turn token a chat reply stops at (the template's, else eos)."""
    hf_tok = _hf_tokenizer(tokenizer)
    return hf_tok.eos_token_id if hf_tok.eos_token_id is not None else _eos_ids(tokenizer)[0]


def build_vocab_map(draft_tok, target_tok, draft_size: int, target_size: int) -> VocabMap:
    draft_bytes = token_bytes(draft_tok, draft_size)
    target_bytes = token_bytes(target_tok, target_size)
    draft_eos = frozenset(_eos_ids(draft_tok))
    target_eos = _target_eos(target_tok)
    same_vocab = _hf_tokenizer(draft_tok).get_vocab() == _hf_tokenizer(target_tok).get_vocab()

    by_bytes: dict[bytes, int] = {}
    for idx, b in enumerate(target_bytes):
        # Byte-fallback <0xNN> and a plain one-byte token can share bytes:
        # keep the first (lowest id), which is deterministic.
        if b and b not in by_bytes:
            by_bytes[b] = idx
    draft_to_target = np.full(len(draft_bytes), -1, dtype=np.int64)
    for idx, b in enumerate(draft_bytes):
        if same_vocab and idx < target_size:
            draft_to_target[idx] = idx
        elif b:
            draft_to_target[idx] = by_bytes.get(b, -1)
    for idx in draft_eos:
        if idx < len(draft_to_target):
            draft_to_target[idx] = target_eos
    return VocabMap(draft_to_target, draft_bytes, target_bytes, draft_eos, target_eos, same_vocab)
