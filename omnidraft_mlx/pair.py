"""A drafter and a target loaded side by side, with what connects them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnidraft_mlx.anatomy import context_length, vocab_size  # noqa: F401 - vocab_size imported from here by callers
from omnidraft_mlx.decode.ranks import Ranks, ranks_of
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.vocab.ngram import NGramCache
from omnidraft_mlx.vocab.tokenmap import VocabMap, build_vocab_map


def context_limit(models, cap: int | None = None) -> int | None:
    """The shortest context of `models` (and `cap`, a user's), where known: what a prompt and its reply share."""
    limits = [x for x in (*(context_length(m) for m in models), cap) if x]
    return min(limits) if limits else None


def reply_room(limit: int | None, prompts: list[int], k: int) -> int | None:
    """The context budget, one rule for every front end: the most tokens a reply may take after prompts of
    these lengths (each model's encoding) in a context of `limit` (None: no known limit). The target's
    cache ends at prompt + reply (a draft is cut to the tokens left), the drafter's runs a draft block
    (k) ahead of the reply."""
    return None if limit is None else limit - max(prompts) - k


@dataclass
class Pair:
    draft: object  # mlx_lm model
    target: object
    draft_tok: object  # mlx_lm TokenizerWrapper
    target_tok: object
    vmap: VocabMap
    ngrams: NGramCache = field(default_factory=NGramCache)
    spelled: set[int] = field(default_factory=set)  # target ids already checked for n-grams
    mapped_draft: np.ndarray = field(init=False)
    mapped_target: np.ndarray = field(init=False)

    def __post_init__(self):
        self.mapped_draft, self.mapped_target = self.vmap.mapped_pairs()

    @property
    def ranks(self) -> Ranks:
        """The ranks the target is split over (decode/ranks.py): who decides each round."""
        return ranks_of(self.target)

    def learn_ngrams(self, target_ids: list[int]) -> None:
        """Add the draft spelling of newly verified target tokens to the n-gram cache."""
        if self.vmap.same_vocab:
            return
        for t in target_ids:
            if t in self.spelled:
                continue
            self.spelled.add(t)
            spelling = self.vmap.target_bytes[t] if t < len(self.vmap.target_bytes) else None
            if not spelling:
                continue
            try:
                text = spelling.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a fragment of a character: no draft tokenization of its own
            ids = tuple(self.draft_tok.encode(text, add_special_tokens=False))
            if len(ids) >= 2 and b"".join(self.vmap.draft_bytes[d] or b"" for d in ids) == spelling:
                self.ngrams.add(ids, t)


def make_pair(draft, draft_tok, target, target_tok, ngrams: NGramCache | None = None) -> Pair:
    vmap = build_vocab_map(draft_tok, target_tok, vocab_size(draft), vocab_size(target))
    if vmap.size == 0:
        raise OmniDraftError(
            "the drafter and the target share no vocabulary: pick a drafter whose "
            "tokens spell text the same way (any byte-level or SentencePiece model does)"
        )
    # An empty cache is falsy: test for None, or the caller's cache would be replaced.
    return Pair(draft, target, draft_tok, target_tok, vmap, NGramCache() if ngrams is None else ngrams)
