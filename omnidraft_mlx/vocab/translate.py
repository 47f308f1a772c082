"""Translating drafted tokens into target tokens the target can verify.

Two translations:
- `tokens` (the paper's): scan left to right, longest cached n-gram first,
  else the direct mapping, else stop. Each target token knows which draft
  tokens it came from, so proposal probabilities q' are well defined.
- `text` (greedy only): re-tokenize the drafted text with the target's own
  tokenizer. It also handles many-to-many splits (`:` + `\\n   ` against
  `:\\n` + `   `) that no token-level map can express.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnidraft_mlx.vocab.ngram import NGramCache
from omnidraft_mlx.vocab.tokenmap import VocabMap


@dataclass
class Translation:
    target_ids: list[int]
    spans: list[tuple[int, int]]  # draft token range [start, end) behind each target id
    consumed: int  # draft tokens covered by target_ids
    open_ngram: bool  # the unconsumed draft tail may still complete a cached n-gram


def translate_tokens(draft_ids: list[int], vmap: VocabMap, ngrams: NGramCache | None) -> Translation:
    target_ids, spans, i = [], [], 0
    while i < len(draft_ids):
        gram = ngrams.match(draft_ids, i) if ngrams is not None else None
        if gram is not None:
            target_ids.append(ngrams.entries[gram])
            spans.append((i, i + len(gram)))
            i += len(gram)
            continue
        mapped = int(vmap.draft_to_target[draft_ids[i]])
        if mapped < 0:
            break
        target_ids.append(mapped)
        spans.append((i, i + 1))
        i += 1
    open_ngram = i < len(draft_ids) and ngrams is not None and ngrams.is_open_prefix(draft_ids, i)
    return Translation(target_ids, spans, i, open_ngram)


def complete_utf8(data: bytes) -> bytes:
    """`data` without a trailing, incomplete UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead < 0x80:  # ASCII: complete
            return data
        if lead >= 0xC0:  # lead byte of a sequence of this many bytes
            need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


def translate_text(draft_ids: list[int], vmap: VocabMap, target_tok) -> list[int]:
    """Target tokenization of the drafted text (greedy verification only)."""
    pieces, eos = [], False
    for d in draft_ids:
        if d in vmap.draft_eos:
            eos = True
            break
        pieces.append(vmap.draft_bytes[d] or b"")
    text = complete_utf8(b"".join(pieces)).decode("utf-8", errors="replace")
    ids = list(target_tok.encode(text, add_special_tokens=False)) if text else []
    return ids + [vmap.target_eos] if eos else ids
