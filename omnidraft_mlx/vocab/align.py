"""Aligning the drafter's tokenization of a text with the target's, by byte offsets.

The text is the shared truth and the target's token sequence is authoritative;
the drafter's tokens are its own tokenizer's encoding of the same text. Per
target token spanning bytes [s, e):
- direct: one draft token spans exactly [s, e) (same bytes, so directly mapped);
- n-gram: a run of two or more draft tokens starts at s and ends at e;
- neither: some draft token crosses s or e (no per-token training signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnidraft_mlx.vocab.tokenmap import VocabMap
from omnidraft_mlx.vocab.translate import complete_utf8


@dataclass
class Alignment:
    direct: list[tuple[int, int]]  # (draft index, target index): same span, directly mapped
    ngram: list[tuple[int, int]]  # (draft index, target index): sub-token of a multi-token spelling


def byte_ends(ids: list[int], spellings: list[bytes | None]) -> np.ndarray:
    """Byte offset where each token ends (special tokens spell nothing)."""
    return np.cumsum([len(spellings[i] or b"") for i in ids], dtype=np.int64)


def common_prefix(a, b) -> int:
    """How many leading items two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def spelled_bytes(ids: list[int], spellings: list[bytes | None]) -> bytes:
    return b"".join(spellings[i] or b"" for i in ids)


def draft_encode(text: bytes, draft_tok) -> list[int]:
    """The drafter's own tokenization of (the complete characters of) a text."""
    text = complete_utf8(text).decode("utf-8", errors="replace")
    return list(draft_tok.encode(text, add_special_tokens=False)) if text else []


def as_draft_tokens(target_ids: list[int], vmap: VocabMap, draft_tok) -> list[int]:
    """Target tokens as the drafter reads them: the same ids where the two share a vocabulary
    (the target's own tokenization, canonical or not), else their text up to the first special
    token, re-tokenized."""
    if vmap.same_vocab:
        return list(target_ids)
    text_end = next((i for i, t in enumerate(target_ids) if vmap.target_bytes[t] is None), len(target_ids))
    return draft_encode(spelled_bytes(target_ids[:text_end], vmap.target_bytes), draft_tok)


def align(draft_ids: list[int], target_ids: list[int], vmap: VocabMap) -> Alignment:
    """Direct and n-gram positions of two tokenizations of the same bytes.

    Where the two spell different bytes (a normalizing tokenizer, a trailing
    partial character) alignment stops at the first difference.
    """
    d_bytes = spelled_bytes(draft_ids, vmap.draft_bytes)
    t_bytes = spelled_bytes(target_ids, vmap.target_bytes)
    agree = common_prefix(d_bytes, t_bytes)
    d_ends, t_ends = byte_ends(draft_ids, vmap.draft_bytes), byte_ends(target_ids, vmap.target_bytes)
    d_starts = d_ends - [len(vmap.draft_bytes[d] or b"") for d in draft_ids]
    starts_at = {int(s): i for i, s in enumerate(d_starts) if d_ends[i] > s}  # first non-empty token
    ends_at = {int(e): i for i, e in enumerate(d_ends) if e > d_starts[i]}
    direct, ngram = [], []
    t_start = 0
    for j, t_end in enumerate(t_ends.tolist()):
        s, e, t_start = t_start, t_end, t_end
        if e > agree or e == s or s not in starts_at or e not in ends_at:
            continue
        a, b = starts_at[s], ends_at[e]
        if a == b:
            if vmap.draft_to_target[draft_ids[a]] == target_ids[j]:
                direct.append((a, j))
        elif all(vmap.draft_bytes[d] for d in draft_ids[a : b + 1]):
            ngram += [(i, j) for i in range(a, b + 1)]
    return Alignment(direct, ngram)
