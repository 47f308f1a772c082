"""The model drafter as a draft source: it drafts in its own vocabulary, and
its draft is translated into target tokens the target can verify.

The drafter's context is its own tokenization of prompt + accepted text. It
re-synchronizes lazily, only when it is asked for a draft: rounds drafted by
another source (a lookup) cost it nothing, and the next sync feeds all the
text they accepted in one forward.

A lookup's draft, when there is one, is a guess at what the drafter will
draft: once the drafter's first token is the guess's, it reads the whole guess
in one forward and takes its next tokens from there while its own choices keep
matching the guess (lookahead for the drafter). Its draft stays exactly the one
it would have drafted token by token (the same tokens, or under sampling the
same distribution), at one forward instead of one a token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from omnidraft_mlx.anatomy import output_head
from omnidraft_mlx.decode.drafts import Context, Draft, DraftSource
from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.policy import DraftPolicy
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.vocab.align import as_draft_tokens, byte_ends, common_prefix, spelled_bytes
from omnidraft_mlx.vocab.translate import complete_utf8, translate_text, translate_tokens

BRANCHES = 3  # next-best drafter tokens per drafted position offered as branches (trees)
CONTEXT_KEEP, CONTEXT_STEP = 1024, 2048  # draft_context: the drafter reads 1024 to 3072 prompt tokens back


def draft_context(prompt_ids: list[int], keep: int = CONTEXT_KEEP, step: int = CONTEXT_STEP) -> list[int]:
    """The end of its prompt that the drafter reads: from a multiple of `step` tokens, at least
    `keep` tokens before the end. Attention's cost grows with the context and the heads, not the
    model's width, so a small drafter pays much of what the target pays for a long prompt: an
    agent's 5,300-token prompt took the server 1.45x plain prefill (bench/results/agents-cli,
    the run before this); what the drafter guesses depends on the last lines, and lookups still
    read the whole prompt.
    The start moves only every `step` tokens, so a conversation's next turn finds the drafter's
    cache of the turn before (the prompt cache) most of the time."""
    return prompt_ids[max(0, len(prompt_ids) - keep) // step * step :]


def softmax(logits: mx.array, temp: float) -> np.ndarray:
    return np.array(mx.softmax(logits.astype(mx.float32) / temp, axis=-1))


class DraftState:
    """The drafter's KV cache over its own tokenization of prompt + accepted text."""

    def __init__(self, pair: Pair, prompt_ids: list[int], lookbehind: int, slot: KVSlot | None = None):
        self.pair, self.prompt, self.lookbehind = pair, draft_context(prompt_ids), lookbehind
        self.slot = slot or KVSlot.fresh(pair.draft)  # ids in the cache, drafted ones included
        self.text_ids: list[int] = []  # draft tokenization of the accepted text
        self.text_ends: list[int] = []  # byte offset where each of those ends
        self.synced = -1  # accepted tokens the cache was last synced to
        self.last: tuple[mx.array, mx.array] | None = None  # logits and hidden state after that sync
        self.forwards = 0  # drafter forwards so far

    def feed(self, ids: list[int], rows: int = 0) -> tuple[mx.array, mx.array]:
        """Logits and hidden state after the last of ids (rows > 0: after each of the last rows)."""
        self.forwards += 1
        hidden = self.slot.extend(self.pair.draft, ids, rows)
        return output_head(self.pair.draft)(hidden), hidden

    def sync(self, text: bytes, committed: list[int]) -> tuple[mx.array, mx.array]:
        """Point the drafter at the accepted text; logits (and hidden state) for its next token."""
        if self.synced == len(committed):
            return self.last
        if self.pair.vmap.same_vocab:
            self.text_ids = list(committed)
        else:
            # Re-tokenize a few tokens behind the new text: a merge may cross it.
            keep = max(0, len(self.text_ids) - self.lookbehind)
            start = self.text_ends[keep - 1] if keep else 0
            tail = complete_utf8(text[start:]).decode("utf-8", errors="replace")
            tail_ids = list(self.pair.draft_tok.encode(tail, add_special_tokens=False)) if tail else []
            ends = np.cumsum([len(self.pair.vmap.draft_bytes[d] or b"") for d in tail_ids]) + start
            self.text_ids = self.text_ids[:keep] + tail_ids
            self.text_ends = self.text_ends[:keep] + ends.tolist()
        context = self.prompt + self.text_ids
        self.slot.rewind(min(self.slot.common_prefix(context), len(context) - 1))  # feed >= 1: logits
        self.synced = len(committed)
        self.last = self.feed(context[len(self.slot.tokens) :])
        return self.last


def proposal_dist(pair: Pair, probs, draft_ids, span, target_id) -> np.ndarray:
    """q' over the target vocabulary at one proposed position (paper's Eq. 2 for n-grams)."""
    q = probs[span[0]]
    qt = np.bincount(pair.mapped_target, q[pair.mapped_draft], minlength=len(pair.vmap.target_bytes))
    if span[1] - span[0] > 1:
        merged = float(np.prod([probs[j][draft_ids[j]] for j in range(*span)]))
        qt[target_id] += merged
        first = pair.vmap.draft_to_target[draft_ids[span[0]]]
        if first >= 0:
            qt[first] = max(0.0, qt[first] - merged)
    return qt


def drafted_and_kept(vmap, draft_ids: list[int], accepted: list[int]) -> list[bool]:
    """Per drafted token: is its text within the accepted target tokens? (labels
    across vocabularies; text that only the target's own next token spells made
    no token of the draft's kept)"""
    drafted = spelled_bytes(draft_ids, vmap.draft_bytes)
    kept = spelled_bytes(accepted, vmap.target_bytes)
    matched = common_prefix(drafted, kept)
    return (byte_ends(draft_ids, vmap.draft_bytes) <= matched).tolist()


def follows(ids: list[int], guess: list[int]) -> bool:
    """Is the draft so far the start of the guess?"""
    return len(ids) <= len(guess) and ids == guess[: len(ids)]


class DrafterSource(DraftSource):
    """Drafts with the model drafter, as far as the draft-length policy says."""

    name = "drafter"
    free = False  # every drafted token costs a drafter forward

    def __init__(self, pair: Pair, draft_prompt: list[int], cfg, policy: DraftPolicy, slot: KVSlot | None = None):
        self.pair, self.cfg, self.policy = pair, cfg, policy
        vmap, self.greedy = pair.vmap, cfg.temp == 0
        self.by_text = self.greedy and cfg.translation == "text" and not vmap.same_vocab
        exact = not self.greedy and cfg.sampling == "exact"
        self.ngrams = None if vmap.same_vocab or exact else pair.ngrams
        # Exact sampling drafts only from the vocabulary intersection, renormalized (TLI).
        self.draft_mask = None if self.greedy or self.ngrams is not None else vmap.draft_to_target >= 0
        self.tree = cfg.tree
        self.state = DraftState(pair, draft_prompt, cfg.lookbehind, slot)
        self.in_step = 0  # accepted tokens after which the next sync is this source's usual one
        policy.begin_reply()

    def start(self, ctx: Context) -> None:
        """Prefill the drafter's prompt (timed as prompt processing)."""
        self.state.sync(bytes(ctx.text), ctx.committed)

    def propose(self, ctx: Context, limit: int, guess: list[int] = ()) -> Draft:
        forwards, catch_up = self.state.forwards, len(ctx.committed) != self.in_step
        logits, hidden = self.state.sync(bytes(ctx.text), ctx.committed)
        ids, probs, feats, seen = self._draft(
            logits,
            hidden,
            min(limit, self.policy.max_len),
            ctx.rng,
            as_draft_tokens(guess, self.pair.vmap, self.pair.draft_tok),
        )
        tokens, spans, used = self._translate(ids)
        branches, expected = self._branches(ids, seen, used) if self.tree else ([], 0.0)
        ids = ids[:used]

        def q(n: int, t: int) -> np.ndarray:
            return proposal_dist(self.pair, probs, ids, spans[n], t)

        def settle(accepted: int, timing: dict) -> None:
            self.policy.observe(feats[: len(ids)], drafted_and_kept(self.pair.vmap, ids, tokens[:accepted]))
            for s, e in (spans or [])[:accepted]:
                if e - s > 1:
                    self.ngrams.record_use(tuple(ids[s:e]))
            if not catch_up:  # gamma auto prices the usual round
                self.policy.time_round(forwards=self.state.forwards - forwards, drafted=len(ids), **timing)
            self.in_step = len(ctx.committed) + timing["tokens"]

        return Draft(
            tokens,
            self.name,
            None if self.greedy else q,
            settle,
            drafted=len(ids),
            forwards=self.state.forwards - forwards,
            merged=[e - s > 1 for s, e in spans or []],
            catch_up=catch_up,
            branches=branches,
            expected=expected,
        )

    def _translate(self, ids: list[int]) -> tuple[list[int], list | None, int]:
        """Target tokens for drafted ids, the draft tokens behind each (tokens translation), and
        how many of the ids they cover."""
        if self.by_text:
            return translate_text(ids, self.pair.vmap, self.pair.target_tok), None, len(ids)
        tr = translate_tokens(ids, self.pair.vmap, self.ngrams)
        return tr.target_ids, tr.spans, tr.consumed

    def _branches(self, ids: list[int], seen: list[np.ndarray], used: int) -> tuple[list, float]:
        """The drafter's next-best tokens at each drafted position as branches (the draft up to
        there, then that token, in target tokens), each scored by the drafter's chance that the
        target gets there and takes it; and the tokens of the chain it expects to be accepted."""
        branches, reach, expected = [], 1.0, 0.0
        for i, probs in enumerate(seen[:used]):
            for alt in np.argpartition(-probs, BRANCHES)[: BRANCHES + 1].tolist():
                if alt != ids[i] and probs[alt] > 0:
                    branches.append((reach * float(probs[alt]), lambda ids=ids[:i] + [alt]: self._translate(ids)[0]))
            reach *= float(probs[ids[i]])
            expected += reach
        return branches, expected

    def _read(self, ids: list[int], guess: list[int], ahead: list) -> tuple[mx.array, mx.array]:
        """Logits and hidden state after the draft so far: while it follows the guess, from one
        forward over the whole guess (rows kept in `ahead`), else a forward over its last token."""
        n = len(ids)
        if follows(ids, guess):
            if not ahead:
                logits, hidden = self.state.feed(guess, rows=len(guess))
                ahead += zip(logits, hidden)
            return ahead[n - 1]
        if ahead:  # the draft left the guess here: drop the guessed tokens it did not draft
            self.state.slot.rewind(len(self.state.slot.tokens) - len(ahead) + n - 1)
            ahead.clear()
        return self.state.feed(ids[-1:])

    def _draft(self, logits, hidden, limit: int, rng, guess: list[int] = ()):
        """Up to `limit` draft tokens: ids, their distributions (sampling), head features, and (trees)
        the drafter's distribution at each position."""
        vmap, policy = self.pair.vmap, self.policy
        ids, probs, feats, seen = [], [], [], []
        guess, ahead = guess[: limit - 1], []  # the last drafted token needs no logits after it
        policy.begin_round()
        for i in range(limit):
            if self.greedy:
                d, q = int(mx.argmax(logits).item()), None
            else:
                q = softmax(logits, self.cfg.temp)[: len(vmap.draft_to_target)]
                q = np.where(self.draft_mask, q, 0.0) if self.draft_mask is not None else q
                q = q / q.sum()
                d = int(rng.choice(len(q), p=q))
            f = policy.features_of(hidden, logits, d, i) if policy.needs_features else None
            ids.append(d), probs.append(q), feats.append(f)
            if self.tree:
                seen.append(softmax(logits, 1.0)[: len(vmap.draft_to_target)] if q is None else q)
            if d in vmap.draft_eos:
                break
            if self.by_text and vmap.draft_bytes[d] is None:
                break
            if not self.by_text:
                t = translate_tokens(ids, vmap, self.ngrams)
                if t.consumed < len(ids) and not t.open_ngram:
                    break  # unverifiable: drafting further is wasted
            # A drafter forward is the price of the next token (none where the guess was read ahead):
            # pay it only if the policy expects a keeper.
            read = bool(ahead) and follows(ids, guess)
            if i == limit - 1 or not policy.wants_more(logits, d, f, forward=not read):
                break
            logits, hidden = self._read(ids, guess, ahead)
        return ids, probs, feats, seen
