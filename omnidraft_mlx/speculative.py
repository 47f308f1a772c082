"""Cross-vocabulary speculative decoding: the decode loop.

One round: the drafter proposes up to k tokens from its own KV cache; they are
translated into m target tokens; the target scores all of them in ONE forward
pass; the longest acceptable prefix is kept and the target adds one token of
its own; the target's cache is trimmed back to what was kept and the drafter
re-synchronizes from the accepted text. The target's tokens are the truth:
at temperature 0 the output equals the target's own greedy output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_p

from omnidraft_mlx.align import byte_ends, spelled_bytes
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.policy import DraftPolicy, PolicyConfig
from omnidraft_mlx.translate import complete_utf8, translate_text, translate_tokens

PREFILL_CHUNK = 512


@dataclass
class SpecConfig:
    k: int = 4  # draft tokens per round
    temp: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    translation: str = "text"  # greedy: "text" or "tokens"; sampling always uses "tokens"
    sampling: str = "exact"  # "exact" (direct maps, provably lossless) or "omnidraft" (+ n-grams)
    lookbehind: int = 4  # draft tokens re-tokenized behind the accepted text
    seed: int = 0


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # both models' prompt processing
    generate_s: float = 0.0  # everything after prefill
    draft_s: float = 0.0  # drafter forwards (re-sync + drafting)
    verify_s: float = 0.0  # target forwards
    rounds: int = 0  # = target forward passes after prefill
    proposed: int = 0  # target tokens proposed
    accepted: int = 0
    emitted: int = 0
    ngram_hits: int = 0
    draft_forwards: int = 0
    drafted: int = 0  # draft tokens behind the proposals
    round_ends: dict = field(default_factory=dict)  # rounds "all accepted" / "rejected"

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.generate_s if self.generate_s else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.generate_s - self.draft_s - self.verify_s)


def prefill(model, cache, ids: list[int]) -> mx.array | None:
    """Feed ids through model into cache (in chunks); final hidden state of the last position."""
    hidden = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        hidden = model.model(mx.array(ids[start : start + PREFILL_CHUNK])[None], cache=cache)[0, -1]
        mx.eval(hidden)
    return hidden


def output_head(model):
    """The model's hidden -> logits projection (tied embeddings or lm_head)."""
    head = getattr(model, "lm_head", None)
    return head if head is not None else model.model.embed_tokens.as_linear


class DraftState:
    """The drafter's KV cache over its own tokenization of prompt + accepted text."""

    def __init__(self, pair: Pair, prompt_ids: list[int], lookbehind: int):
        self.pair, self.prompt, self.lookbehind = pair, prompt_ids, lookbehind
        self.cache = make_prompt_cache(pair.draft)
        self.fed: list[int] = []  # ids in the cache, drafted ones included
        self.text_ids: list[int] = []  # draft tokenization of the accepted text
        self.text_ends: list[int] = []  # byte offset where each of those ends

    def feed(self, ids: list[int]) -> tuple[mx.array, mx.array]:
        self.fed += ids
        hidden = prefill(self.pair.draft, self.cache, ids)
        return output_head(self.pair.draft)(hidden), hidden

    def sync(self, text: bytes, committed: list[int]) -> tuple[mx.array, mx.array]:
        """Point the drafter at the accepted text; logits (and hidden state) for its next token."""
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
        common = 0
        for a, b in zip(self.fed, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # always feed one token to get logits
        trim_prompt_cache(self.cache, len(self.fed) - common)
        self.fed = self.fed[:common]
        return self.feed(context[common:])


def _softmax(logits: mx.array, temp: float) -> np.ndarray:
    return np.array(mx.softmax(logits.astype(mx.float32) / temp, axis=-1))


def target_probs(logits: mx.array, temp: float, top_p: float) -> np.ndarray:
    """The target's sampling distribution per position, exactly as mlx-lm's sampler draws."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    return _softmax(logprobs, temp)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Where to sample after a rejection: norm(max(0, p - q)); this makes it lossless."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


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


def verify_sampled(pair, out, proposal, spans, probs, draft_ids, cfg, rng) -> tuple[int, int]:
    """Standard speculative sampling: (accepted count, the target's next token)."""
    p = target_probs(out, cfg.temp, cfg.top_p)
    for n, t in enumerate(proposal):
        qt = proposal_dist(pair, probs, draft_ids, spans[n], t)
        if rng.random() * qt[t] >= p[n, t]:  # reject with prob 1 - min(1, p/q')
            return n, int(rng.choice(p.shape[1], p=residual(p[n], qt)))
    n = len(proposal)
    return n, int(rng.choice(p.shape[1], p=p[n] / p[n].sum()))


def drafted_and_kept(vmap, draft_ids: list[int], accepted: list[int]) -> list[bool]:
    """Per drafted token: is its text within the accepted target tokens? (labels
    across vocabularies; text that only the target's own next token spells made
    no token of the draft's kept)"""
    drafted = spelled_bytes(draft_ids, vmap.draft_bytes)
    kept = spelled_bytes(accepted, vmap.target_bytes)
    matched = next((i for i, (a, b) in enumerate(zip(drafted, kept)) if a != b), min(len(drafted), len(kept)))
    return (byte_ends(draft_ids, vmap.draft_bytes) <= matched).tolist()


def speculative_generate(
    pair: Pair, draft_prompt: list[int], target_prompt: list[int], cfg: SpecConfig, stats: SpecStats,
    policy: DraftPolicy | None = None,
) -> Iterator[tuple[list[int], list[bool]]]:
    """Yield (new target ids, which of them were drafted) after every round."""
    if cfg.k < 1:
        raise OmniDraftError(f"draft length k must be at least 1 (got {cfg.k})")
    policy = policy or DraftPolicy(PolicyConfig(k=cfg.k))
    policy.begin_reply()
    vmap, greedy = pair.vmap, cfg.temp == 0
    by_text = greedy and cfg.translation == "text" and not vmap.same_vocab
    ngrams = None if vmap.same_vocab or (not greedy and cfg.sampling == "exact") else pair.ngrams
    # Exact sampling drafts only from the vocabulary intersection, renormalized (TLI).
    draft_mask = None if greedy or ngrams is not None else vmap.draft_to_target >= 0
    target_eos = set(pair.target_tok.eos_token_ids) | {vmap.target_eos}
    rng = np.random.default_rng(cfg.seed)

    def draft(logits, hidden, limit):
        """Up to `limit` draft tokens: ids, their distributions (sampling) and head features."""
        ids, probs, feats = [], [], []
        policy.begin_round()
        for i in range(limit):
            if greedy:
                d, q = int(mx.argmax(logits).item()), None
            else:
                q = _softmax(logits, cfg.temp)[: len(vmap.draft_to_target)]
                q = np.where(draft_mask, q, 0.0) if draft_mask is not None else q
                q = q / q.sum()
                d = int(rng.choice(len(q), p=q))
            f = policy.features_of(hidden, logits, d, i) if policy.needs_features else None
            ids.append(d), probs.append(q), feats.append(f)
            if d in vmap.draft_eos:
                break
            if by_text and vmap.draft_bytes[d] is None:
                break
            if not by_text:
                t = translate_tokens(ids, vmap, ngrams)
                if t.consumed < len(ids) and not t.open_ngram:
                    break  # unverifiable: drafting further is wasted
            # A drafter forward is the price of the next token: pay it only if the policy expects a keeper.
            if i == limit - 1 or not policy.wants_more(logits, d, f):
                break
            logits, hidden = drafter.feed([d])
            stats.draft_forwards += 1
        return ids, probs, feats

    t_start = time.perf_counter()
    target_cache = make_prompt_cache(pair.target)
    prefill(pair.target, target_cache, target_prompt[:-1])
    drafter = DraftState(pair, draft_prompt, cfg.lookbehind)
    logits, hidden = drafter.sync(b"", [])
    stats.prompt_tokens = len(target_prompt)
    stats.prefill_s = time.perf_counter() - t_start
    t_gen = time.perf_counter()

    y, committed, text = target_prompt[-1], [], bytearray()
    while len(committed) < cfg.max_tokens:
        # 1. Draft, then translate into target tokens.
        t0, forwards = time.perf_counter(), stats.draft_forwards
        if stats.rounds:
            logits, hidden = drafter.sync(bytes(text), committed)
        draft_ids, probs, feats = draft(logits, hidden, min(policy.max_len, cfg.max_tokens - len(committed)))
        t1 = time.perf_counter()
        if by_text:
            proposal, spans = translate_text(draft_ids, vmap, pair.target_tok), None
        else:
            tr = translate_tokens(draft_ids, vmap, ngrams)
            proposal, spans, draft_ids = tr.target_ids, tr.spans, draft_ids[: tr.consumed]
        proposal = proposal[: cfg.max_tokens - len(committed) - 1]

        # 2. Verify all proposals in one target forward.
        t2 = time.perf_counter()
        out = pair.target(mx.array([y, *proposal])[None], cache=target_cache)[0]
        if greedy:
            choice = out.argmax(axis=-1).tolist()
            n = next((i for i, t in enumerate(proposal) if choice[i] != t), len(proposal))
            y = choice[n]
        else:
            n, y = verify_sampled(pair, out, proposal, spans, probs, draft_ids, cfg, rng)
        t3 = time.perf_counter()
        trim_prompt_cache(target_cache, len(proposal) - n)

        # 3. Commit, learn, account.
        new = [*proposal[:n], y]
        policy.observe(feats[: len(draft_ids)], drafted_and_kept(vmap, draft_ids, proposal[:n]))
        for s, e in (spans or [])[:n]:
            if e - s > 1:
                ngrams.record_use(tuple(draft_ids[s:e]))
                stats.ngram_hits += 1
        stats.rounds += 1
        stats.proposed += len(proposal)
        stats.accepted += n
        stats.drafted += len(draft_ids)
        why = "all accepted" if n == len(proposal) else "rejected"
        stats.round_ends[why] = stats.round_ends.get(why, 0) + 1
        stats.draft_s += t1 - t0
        stats.verify_s += t3 - t2
        # Drafter forwards this round: the drafted tokens', after the first round one re-sync.
        policy.time_round(draft_s=t1 - t0, forwards=stats.draft_forwards - forwards + (stats.rounds > 1),
                          verify_s=t3 - t2, drafted=len(draft_ids), round_s=t3 - t0, tokens=len(new))
        stop = next((i for i, t in enumerate(new) if t in target_eos), None)
        new = new[:stop][: cfg.max_tokens - len(committed)]
        committed += new
        for t in new:
            text += vmap.target_bytes[t] or b""
        pair.learn_ngrams(new)
        stats.emitted = len(committed)
        stats.generate_s = time.perf_counter() - t_gen
        yield new, [i < n for i in range(len(new))]
        if stop is not None:
            break
