"""Speculative decoding: the decode loop.

One round: propose a draft in target tokens (the model drafter's, translated
from its vocabulary, or one looked up for free: drafts.py, drafter.py,
lookup.py; the scheduler picks, or no draft at all when none pays) -> one
target forward over all of it -> verify (the longest acceptable prefix, plus
one token of the target's own) -> trim the target's cache back to what was
kept -> settle (the source learns, statistics) -> yield. A Decoding is one
reply between rounds (plan, then take the target's logits), so that one target
forward can verify the rounds of several replies (round_together, the one round
of a batch, where a reply that fails fails alone; batch.py: concurrent
requests). The target's tokens are the truth: at temperature 0 the output
equals the target's own greedy output, and sampled output has the target's
distribution.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from omnidraft_mlx.decode.batch import forward_rounds
from omnidraft_mlx.decode.drafter import DrafterSource, softmax
from omnidraft_mlx.decode.drafts import SOURCES, Context, Draft, check_sources
from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.layouts import fit_tree
from omnidraft_mlx.decode.lookup import ContextLookup, HistoryIndex, HistorySource, escaped_views
from omnidraft_mlx.decode.policy import DraftPolicy, FixedPolicy, PolicyConfig
from omnidraft_mlx.decode.scheduler import Round, Scheduler
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.settings import check_settings, setting

log = logging.getLogger("omnidraft.decode")
SAMPLING_MODES = ("exact", "omnidraft")  # exact: direct maps only, provably lossless; omnidraft: + n-grams


@dataclass(kw_only=True)
class SpecConfig:
    k: int = setting(4, flag="--k", low=1)  # draft tokens per round (the drafter's, under the fixed policy)
    temp: float = setting(0.0, flag="--temp", low=0)  # 0 = greedy
    top_p: float = setting(1.0, flag="--top-p", low=0, high=1, open_low=True)
    max_tokens: int = setting(256, flag="--max-tokens", low=1)
    # Greedy: "text" or "tokens"; sampling always uses "tokens".
    translation: str = setting("text", flag="--translation", choices=("text", "tokens"))
    # "exact" (direct maps, provably lossless) or "omnidraft" (+ n-grams).
    sampling: str = setting("exact", flag="--sampling", choices=SAMPLING_MODES)
    lookbehind: int = 4  # draft tokens re-tokenized behind the accepted text
    seed: int = 0
    sources: tuple[str, ...] = SOURCES  # draft sources to choose from each round
    guard: bool = True  # decode plainly while no source is expected to pay
    lookup_len: int = setting(8, flag="--lookup-len", low=1)  # most tokens a lookup proposes
    tree: bool = False  # the drafter's next-best tokens as branches, verified in the same forward where they pay

    def __post_init__(self):
        self.sources = check_sources(self.sources)
        check_settings(self)

    def for_reply(self, **given) -> SpecConfig:
        """These settings with one reply's own values where it gives them (None: not given), checked:
        how a front end (a chat turn, an HTTP request) makes a reply's settings from its defaults."""
        return replace(self, **{name: value for name, value in given.items() if value is not None})


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the target's cache already held
    prefill_s: float = 0.0  # both models' prompt processing
    generate_s: float = 0.0  # everything after prefill
    draft_s: float = 0.0  # proposing (drafter forwards, lookups, translation)
    verify_s: float = 0.0  # target forwards
    rounds: int = 0  # = target forward passes after prefill
    proposed: int = 0  # target tokens verified (a tree's nodes)
    accepted: int = 0
    branched: int = 0  # rounds that verified a tree, not a chain
    branch_held: int = 0  # accepted tokens that were a branch's, not the chain's
    emitted: int = 0
    ngram_hits: int = 0  # accepted tokens that were n-gram cache merges
    padded: int = 0  # looked-up tokens padding drafts to a length that verifies no slower
    pad_held: int = 0  # of those, accepted
    draft_forwards: int = 0  # drafter forwards after prefill (re-syncs included)
    drafted: int = 0  # draft tokens behind the proposals
    round_ends: dict = field(default_factory=dict)  # rounds "all accepted" / "rejected"
    by_source: dict = field(default_factory=dict)  # source -> [rounds, proposed, accepted]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def nodes_per_round(self) -> float:
        return self.proposed / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.generate_s if self.generate_s else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.generate_s - self.draft_s - self.verify_s)

    def __add__(self, other: SpecStats) -> SpecStats:
        """Two replies' statistics summed, every field (tallies by source and by round end merged):
        the one sum that a chat's totals, an evaluation and a bench's aggregates use."""
        total = SpecStats()
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                merged = {key: _sum(mine.get(key), theirs.get(key)) for key in {**mine, **theirs}}
                setattr(total, f.name, merged)
            else:
                setattr(total, f.name, mine + theirs)
        return total

    def record(self) -> dict:
        """Every field and the figures made from them, JSON-ready: how statistics are written out
        (a bench row, an adaptation record, the server's usage)."""
        derived = ("acceptance", "nodes_per_round", "tokens_per_forward", "tokens_per_s", "other_s")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}

    def add_round(self, draft: Draft, tree: TokenTree, path: list[int], draft_s: float, verify_s: float) -> None:
        on_chain = tree.on_chain(path)
        self.rounds += 1
        self.proposed += len(tree.tokens)
        self.accepted += len(path)
        self.branched += len(tree.tokens) > tree.chain
        self.branch_held += len(path) - on_chain
        self.drafted += draft.drafted
        self.padded += draft.padding
        self.pad_held += max(0, on_chain - draft.own)
        self.draft_forwards += draft.forwards
        self.ngram_hits += sum(draft.merged[:on_chain])
        self.draft_s += draft_s
        self.verify_s += verify_s
        if draft.tokens:
            why = "all accepted" if on_chain == len(draft.tokens) else "rejected"
            self.round_ends[why] = self.round_ends.get(why, 0) + 1
        counts = self.by_source.setdefault(draft.source.split(":")[0], [0, 0, 0])
        for i, x in enumerate((1, len(tree.tokens), len(path))):
            counts[i] += x


def _sum(a, b):
    """Two tallies summed (a count or a list of counts), either possibly missing."""
    if a is None or b is None:
        return b if a is None else a
    return [x + y for x, y in zip(a, b)] if isinstance(a, list) else a + b


def target_probs(logits: mx.array, temp: float, top_p: float) -> np.ndarray:
    """The target's sampling distribution per position, exactly as mlx-lm's sampler draws."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    return softmax(logprobs, temp)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Where to sample after a rejection: norm(max(0, p - q)); this makes it lossless."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def accept(out: mx.array, tree: TokenTree, draft: Draft, cfg: SpecConfig, rng) -> tuple[list[int], int]:
    """The acceptance rule: (the accepted path of tree nodes, the target's next token). Row 0 of `out` is the
    root's, row i + 1 node i's. Greedy: follow the child the target's argmax names.
    Sampling (SpecInfer's multi-draft rule), a node's children in turn: accept t with
    min(1, p(t)/q(t)), else p <- norm(max(0, p - q)) and try the next; none accepted:
    sample from that p. A chain node's q is its source's; a branch node is a point mass
    (accepted with p(t), else t leaves p)."""
    node, path = -1, []
    if cfg.temp == 0:
        choice = out.argmax(axis=-1).tolist()
        while (child := tree.child(node, choice[node + 1])) is not None:
            node = child
            path.append(node)
        return path, choice[node + 1]
    p = target_probs(out, cfg.temp, cfg.top_p)
    while True:
        row = p[node + 1]
        for child in tree.children(node):
            t = tree.tokens[child]
            q = draft.proposal(child, t, len(row))
            if rng.random() * q[t] < row[t]:
                break
            row = residual(row, q)
        else:
            return path, int(rng.choice(len(row), p=row / row.sum()))
        node = child
        path.append(node)


def make_sources(
    pair: Pair,
    draft_prompt: list[int],
    target_prompt: list[int],
    cfg: SpecConfig,
    policy: DraftPolicy,
    history: HistoryIndex | None = None,
    draft_slot: KVSlot | None = None,
    learn_history: bool = True,
) -> list:
    """The configured draft sources (history only with an index to draw on)."""
    sources = []
    if "context" in cfg.sources:
        sources.append(ContextLookup(max_len=cfg.lookup_len, views=escaped_views(pair.target_tok, target_prompt)))
    if "history" in cfg.sources and history is not None:
        sources.append(HistorySource(history, learn_history, cfg.lookup_len))
    if "drafter" in cfg.sources:
        sources.append(DrafterSource(pair, draft_prompt, cfg, policy, draft_slot))
    return sources


class Decoding:
    """One reply's decode, a round at a time: plan() the round's draft tree, the target
    verifies it (layouts.forward_tree, alone, or batched with other replies: batch.py), take()
    its logits. Prefill happens on construction; close() when done or abandoned.

    Given slots, their caches are reused (common prefix kept); afterwards each holds what
    its cache holds. A scheduler kept across replies starts each from what the earlier
    ones measured. on_logits gets, after each round, the target's logits that chose the
    round's new ids (a row each)."""

    def __init__(
        self,
        pair: Pair,
        draft_prompt: list[int],
        target_prompt: list[int],
        cfg: SpecConfig,
        stats: SpecStats,
        policy: DraftPolicy | None = None,
        history: HistoryIndex | None = None,
        target_slot: KVSlot | None = None,
        draft_slot: KVSlot | None = None,
        learn_history: bool = True,
        scheduler: Scheduler | None = None,
        on_logits: Callable[[mx.array], None] | None = None,
    ):
        self.pair, self.cfg, self.stats, self.on_logits = pair, cfg, stats, on_logits
        policy = policy or FixedPolicy(PolicyConfig(k=cfg.k))
        self.target_eos = set(pair.target_tok.eos_token_ids) | {pair.vmap.target_eos}
        self.ctx = Context(target_prompt, rng=np.random.default_rng(cfg.seed))
        t_start = time.perf_counter()
        self.target = target = target_slot or KVSlot.fresh(pair.target)
        self.draft_slot = draft_slot
        if pair.ranks.group is not None:  # every rank prefills the same tokens, whatever its own cache held
            target.rewind(pair.ranks.least(target.common_prefix(target_prompt[:-1])))
            target.rewind(pair.ranks.least(len(target.tokens)))  # a recurrent state that went back to none
        stats.cached_tokens = min(target.common_prefix(target_prompt), len(target_prompt) - 1)
        target.reuse(pair.target, target_prompt[:-1])
        self.scheduler = scheduler or Scheduler()
        # Over ranks (ranks.py) the lead alone drafts, chains only: a tree's probe would run on one rank.
        drafting = cfg if pair.ranks.group is None else replace(cfg, tree=False)
        sources = (
            make_sources(pair, draft_prompt, target_prompt, drafting, policy, history, draft_slot, learn_history)
            if pair.ranks.lead
            else []
        )
        self.sources = self.scheduler.begin_reply(
            sources,
            cfg.guard,
            self.ctx,
            pair.target,
        )
        stats.prompt_tokens = len(target_prompt)
        stats.prefill_s = time.perf_counter() - t_start
        self.t_gen, self.y = time.perf_counter(), target_prompt[-1]  # y: the last token, the next forward's root
        self.done = False
        self.round, self.tree, self.draft_s = None, None, 0.0

    def plan(self) -> TokenTree:
        """This round's draft (the scheduler's choice; no tokens: a plain step), as the tree to verify after y:
        cut to its chain where the target verifies only chains (layouts.fit_tree); take() reads the same tree.
        A target split over ranks verifies the lead's (ranks.py)."""
        t0 = time.perf_counter()
        self.round, self.tree = self.pair.ranks.plan(self._propose)
        self.draft_s = time.perf_counter() - t0
        return self.tree

    def _propose(self) -> tuple[Round, TokenTree]:
        proposed = self.scheduler.propose(self.sources, self.ctx, self.cfg.max_tokens - len(self.ctx.committed))
        return proposed, fit_tree(self.pair.target, self.target.cache, proposed.draft.tree())

    def take(self, out: mx.array, forward_s: float) -> tuple[list[int], list[bool]]:
        """The target's logits over [y, *tree] (evaluated in forward_s: in a batch, this reply's
        share) -> (new target ids, which of them were drafted); the caches keep them."""
        ctx, draft, tree, stats = self.ctx, self.round.draft, self.tree, self.stats
        t1 = time.perf_counter()
        path, self.y = self.pair.ranks.take(len(tree.tokens), lambda: accept(out, tree, draft, self.cfg, ctx.rng))
        verify_s = forward_s + time.perf_counter() - t1
        self.target.keep_path(tree, path)
        new = [*(tree.tokens[i] for i in path), self.y]
        timing = dict(draft_s=self.draft_s, verify_s=verify_s, round_s=self.draft_s + verify_s, tokens=len(new))
        on_chain = tree.on_chain(path)
        self.scheduler.settle(self.round, on_chain, timing, len(tree.tokens), len(path) - on_chain)
        stats.add_round(draft, tree, path, self.draft_s, verify_s)
        stop = next((i for i, t in enumerate(new) if t in self.target_eos), None)
        new = new[:stop][: self.cfg.max_tokens - len(ctx.committed)]
        ctx.committed += new
        for t in new:
            ctx.text += self.pair.vmap.target_bytes[t] or b""
        self.pair.learn_ngrams(new)
        if self.on_logits:
            self.on_logits(out[mx.array([0, *(i + 1 for i in path)][: len(new)])])
        stats.emitted, stats.generate_s = len(ctx.committed), time.perf_counter() - self.t_gen
        self.done = stop is not None or len(ctx.committed) >= self.cfg.max_tokens
        return new, [i < len(path) for i in range(len(new))]

    def close(self) -> None:
        self.scheduler.end_reply(self.sources, self.ctx)


Taken = tuple[list[int], list[bool]]  # a round's new target ids, and which of them were drafted


def round_together(decodings: list[Decoding], before: Callable[[str, int], None] = lambda step, i: None) -> list:
    """One round of each decoding, every draft verified in one target forward (batch.py): each
    one's Taken, or the exception that failed it (its plan, its take or its own verification), so
    one reply's failure is its own. If the shared forward fails (every cache then holds what it
    held before), each is verified in a forward of its own: one whose own forward fails, fails.
    before(step, i) runs before decoding i's "draft" and each "verify" of it (the server's failpoints)."""
    outcomes: list = [None] * len(decodings)
    planned = []
    for i, d in enumerate(decodings):
        try:
            before("draft", i)
            planned.append((i, d.plan()))
        except Exception as e:
            outcomes[i] = e
    for (i, _), verified in zip(planned, _verify(decodings, planned, before)):
        try:
            outcomes[i] = verified if isinstance(verified, Exception) else decodings[i].take(*verified)
        except Exception as e:
            outcomes[i] = e
    return outcomes


def _verify(decodings: list[Decoding], planned: list[tuple[int, TokenTree]], before) -> list:
    """Each planned (index, tree)'s (logits, seconds) from one forward; failing that, from a forward
    of its own, or the exception that failed it."""
    if not planned:  # every plan failed (on a follower of a split target: the lead ended the reply)
        return []

    def forward(rows: list[tuple[int, TokenTree]]) -> list:
        for i, _ in rows:
            before("verify", i)
        return forward_rounds([decodings[i] for i, _ in rows], [tree for _, tree in rows])

    try:
        return forward(planned)
    except Exception as e:
        if len(planned) == 1:
            return [e]
        log.warning("a verification of %d replies failed (%r): verifying them one at a time", len(planned), e)
    verified = []
    for row in planned:
        try:
            verified += forward([row])
        except Exception as e:
            verified.append(e)
    return verified


def decode_together(decodings: list[Decoding]) -> Iterator[dict[int, Taken | Exception]]:
    """Rounds of every decoding in the list not done (nor failed) yet, together (round_together);
    after each: {its index in the list: its Taken, or the exception that failed it (it takes no
    more rounds)}. The caller may change the list between rounds (replies joining, leaving);
    closing the decodings is the caller's."""
    failed: set[Decoding] = set()
    while active := [(i, d) for i, d in enumerate(decodings) if not d.done and d not in failed]:
        outcomes = round_together([d for _, d in active])
        failed.update(d for (_, d), out in zip(active, outcomes) if isinstance(out, Exception))
        yield {i: out for (i, _), out in zip(active, outcomes)}


def decode_alone(decoding: Decoding) -> Iterator[Taken]:
    """Yield (new target ids, which of them were drafted) after every round of one reply; a
    round's exception is raised (closing the decoding is the caller's)."""
    for taken in decode_together([decoding]):
        if isinstance(taken[0], Exception):
            raise taken[0]
        yield taken[0]


def speculative_generate(
    pair: Pair,
    draft_prompt: list[int],
    target_prompt: list[int],
    cfg: SpecConfig,
    stats: SpecStats,
    policy: DraftPolicy | None = None,
    **options,
) -> Iterator[tuple[list[int], list[bool]]]:
    """decode_alone on a new Decoding (`options`: its own)."""
    decoding = Decoding(pair, draft_prompt, target_prompt, cfg, stats, policy, **options)
    try:
        yield from decode_alone(decoding)
    finally:
        decoding.close()
