"""Which draft to verify each round, and the guard that keeps speculation from losing.

Options each round: a free draft (a lookup that found a match, at no model cost),
the model drafter's draft (drafter forwards), or no draft at all (a plain decoding
step through the same loop). The option expected to make tokens fastest wins.
- A lookup is judged before it is verified, by how its kind (source and match
  length, "context:3") has held: every lookup found is scored against what the
  target wrote next, verified or not: what verifying it would have kept (greedy:
  the same text; sampling: each token with p(token), the chance it is accepted).
  Its rate: expected tokens (held + the target's own) over the time verifying
  that many takes (fit.VerifyCost). Lookups need no probes.
- The drafter and plain steps are rated by what they realized: tokens emitted
  per second over their recent rounds (sums that decay by the rounds since).
The guard is the plain option: while no source is expected to beat plain
decoding, the loop decodes plainly. The drafter or plain, not chosen for a while,
is probed (the text may have changed): tried for a few rated rounds (plain for
one: a plain step always makes one token), then judged against the best of the
others; each probe lost by more than a few rounds' noise (`tie`) doubles the wait (a
near-tie lost by chance would otherwise shut out an option that pays for the rest of the
run). A round in which the drafter first caught up on text that lookups drafted costs
more than its usual round and is not rated. The best lookup found
is also the drafter's guess, read ahead in one forward (drafter.py). The chosen
draft is padded with looked-up tokens to the length that verifies fastest (not
monotone: widths.py). A scheduler outlives a reply (chat, serve and bench keep
one), so a new reply starts from what the last ones measured, and serves any
number of replies at once (serve's concurrent requests share what it measures). The measurements
behind these choices: bench/results/free-drafts/README.md (design record). OMNIDRAFT_SCHEDULE_LOG
names a file that gets one JSON line per round: the choice, the rates it was made among, the
probes' waits, the verification's price and its measured seconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from omnidraft_mlx.decode.drafts import PLAIN, Context, Draft
from omnidraft_mlx.decode.fit import VerifyCost
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.decode.widths import MOST, saved_costs
from omnidraft_mlx.vocab.align import common_prefix

SCHEDULE_LOG = "OMNIDRAFT_SCHEDULE_LOG"  # a file: each round's choice and why, one JSON line a round


@dataclass
class Rate:
    """Decaying sums of what an option's rounds emitted and cost."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0
    last: int = -(10**9)  # round it last ran
    wait: int = 0  # rounds before it is probed again
    trial: int = 0  # rated rounds left in the probe under way

    def add(self, tokens: int, seconds: float, decay: float, now: int) -> None:
        old = decay ** (now - self.last)  # weighed by how many rounds ago it was measured
        self.tokens = old * self.tokens + tokens
        self.seconds = old * self.seconds + seconds
        self.rounds += 1
        self.last = now

    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.rounds and self.seconds > 0 else None


@dataclass
class Hold:
    """Decaying sums over drafts: how many (or, for branches, the tokens they were expected to add),
    and how many of their tokens held."""

    drafts: float = 0.0
    held: float = 0.0

    def add(self, held: float, decay: float, drafts: float = 1.0) -> None:
        self.drafts = decay * self.drafts + drafts
        self.held = decay * self.held + held


@dataclass
class ReplySources:
    """One reply's part of the scheduling (begin_reply makes it): its draft sources, its guard,
    and the lookups found for it not yet scored (kind, start in the reply, tokens)."""

    sources: list
    guard: bool
    pending: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)


@dataclass(frozen=True)
class Round:
    """One round as proposed: the draft to verify and what settling it needs."""

    draft: Draft
    rival: float | None  # the best rate among the options not chosen
    looked_up: bool  # the draft is a lookup (scored in shadow, not rated)
    rates: dict[str, float] = field(default_factory=dict)  # every option's rate when it was chosen


class Scheduler:
    """What the rounds measured (rates, hold rates, verification costs), shared by every reply it
    serves, one at a time or interleaved round by round: a round's state travels in its Round, a
    reply's in its ReplySources."""

    def __init__(
        self,
        decay: float = 0.95,
        hold_decay: float = 0.8,
        probe_every: int = 16,
        probe_rounds: int = 4,
        max_wait: int = 256,
        tie: float = 0.15,
    ):
        self.decay, self.hold_decay = decay, hold_decay
        self.probe_every, self.probe_rounds, self.max_wait = probe_every, probe_rounds, max_wait
        self.tie = tie  # a probe's rate this far below its rival's is a tie, not a loss
        self.rates: dict[str, Rate] = {}
        self.holds: dict[str, Hold] = {}
        self.costs = VerifyCost(decay)  # seconds to verify each draft length
        self.round = 0  # rounds proposed, all replies together: the clock of rates and probes
        self.measured = False  # the verification cost per draft length seeded from widths.py
        self.branches = Hold()  # kept branches' scores (drafts) against the tokens they held (held)
        self.log = os.environ.get(SCHEDULE_LOG)  # where each round is written (None: nowhere)

    def begin_reply(self, sources: list, guard: bool, ctx: Context, target=None) -> ReplySources:
        """A reply's sources (their prompt processing: prefill); given the target, the first reply
        starts from the cost of each draft length measured when the pair opened (widths.py; not
        measured here: a reply never waits for it)."""
        if target is not None and not self.measured:
            if (seconds := saved_costs(target)) is not None:
                self.costs.seed(seconds)
            self.measured = True
        for s in sources:
            s.start(ctx)
        return ReplySources(sources, guard)

    def _rate(self, key: str) -> Rate:
        return self.rates.setdefault(key, Rate(wait=self.probe_every))

    def _score(self, reply: ReplySources, committed: list[int]) -> None:
        """Score the reply's lookups found earlier against what the target has written since."""
        waiting = []
        for key, start, tokens in reply.pending:
            written = committed[start : start + len(tokens)]
            held = common_prefix(tokens, written)
            if held < len(written) or len(written) == len(tokens):
                self.holds.setdefault(key, Hold()).add(held, self.hold_decay)
            else:
                waiting.append((key, start, tokens))
        reply.pending = waiting

    def _expected(self, draft: Draft, most: int) -> float | None:
        """Tokens per second a lookup is expected to make: its kind's held tokens, plus the
        target's own, over the time to verify it, padded (None: its kind never scored yet)."""
        hold = self.holds.get(draft.source)
        seconds = self.costs.seconds(self.costs.cheapest_length(len(draft.tokens), most))
        if hold is None or seconds is None or seconds <= 0:
            return None
        return (min(hold.held / hold.drafts, len(draft.tokens)) + 1) / seconds

    def propose(self, reply: ReplySources, ctx: Context, limit: int) -> Round:
        """This round of the reply, `limit` tokens left to write: the draft to verify, cut to leave
        room for the target's own token (no tokens: a plain step)."""
        self.round += 1
        self._score(reply, ctx.committed)
        # Free drafts first: they cost nothing to look at.
        free = {d.source: d for s in reply.sources if s.free and (d := s.propose(ctx, limit))}
        reply.pending += [(key, len(ctx.committed), d.tokens) for key, d in free.items()]
        options = [(s.name, s) for s in reply.sources if not s.free]
        if reply.guard or not (options or free):
            options.append((PLAIN, None))
        measured = {key: rate for key, _ in options if (rate := self._rate(key).per_s()) is not None}
        expected = {key: rate for key, d in free.items() if (rate := self._expected(d, limit - 1)) is not None}
        guess = max(free, key=lambda key: expected.get(key, 0.0)) if free else None
        everything = {**measured, **expected}
        best = max(everything, key=everything.get) if everything else None
        probes = [o for o in options if self._rate(o[0]).trial]  # probes under way first
        probes += [o for o in options if o[0] != best and self.round - self._rate(o[0]).last >= self._rate(o[0]).wait]
        if probes:
            key, choice = probes[0]
            if not self._rate(key).trial:  # plain steps all make one token: one round tells their rate
                self._rate(key).trial = 1 if key == PLAIN else self.probe_rounds
        elif best in free or not options:  # without the guard and a drafter, some lookup is verified
            key = best if best in free else guess
            choice = free[key]
        else:
            key, choice = next(o for o in options if o[0] == best) if best else options[0]
        if choice is None:
            draft = Draft((), PLAIN)
        elif isinstance(choice, Draft):
            draft = choice
        else:
            draft = choice.propose(ctx, limit, free[guess].tokens if guess else ())
        # Padded within the budget, branched; the cut leaves room for the target's own token.
        draft = self._branch(self._pad(reply, draft, ctx, limit - 1)).cut(limit - 1)
        rival = max((rate for k, rate in everything.items() if k != key), default=None)
        return Round(draft, rival, looked_up=key in free, rates=everything)

    def _pad(self, reply: ReplySources, draft: Draft, ctx: Context, most: int) -> Draft:
        """The draft padded with looked-up tokens to the length that verifies fastest, where that
        is longer: the extra tokens cost nothing and may hold."""
        want = self.costs.cheapest_length(len(draft.tokens), most) - len(draft.tokens)
        for s in reply.sources if want > 0 else ():
            extra = s.extend(ctx, draft.tokens, want)
            if extra:
                return draft.padded(extra)
        return draft

    def _branch(self, draft: Draft) -> Draft:
        """The draft with its branches kept, most likely first, while each pays for the width it adds:
        expected tokens (the draft's own, its branches', the target's) per second of verifying
        (translating a branch costs a tokenizer call: the rest are not looked at)."""
        tree, kept = TokenTree.of(draft.tokens), []
        tokens, seconds = draft.expected + 1, self.costs.seconds(len(draft.tokens))
        # A source's scores are its own guesses: scaled by how branches have held (1 before any did).
        scale = (self.branches.held + 1) / (self.branches.drafts + 1)
        for score, translate in sorted(draft.branches, key=lambda b: -b[0]):
            path = translate()
            width = len(tree.tokens) + tree.new_nodes(path)
            if width == len(tree.tokens):
                continue  # the chain or a kept branch spells it already
            cost = self.costs.seconds(width) if width <= MOST else None
            if cost is None or seconds is None or (tokens + scale * score) * seconds < tokens * cost:
                break
            tree = tree.add(path)
            kept.append((score, path))
            tokens, seconds = tokens + scale * score, cost
        return draft.branched(kept) if kept else draft

    def settle(self, proposed: Round, accepted: int, timing: dict, width: int, branch_held: int) -> None:
        """Learn from a verified round (`accepted` tokens of its draft's chain, `width` tokens verified,
        `branch_held` tokens accepted on its branches): the source's own learning, the verification
        cost, how branches hold, the option's rate."""
        draft = proposed.draft
        if self.log:
            self._write(proposed, accepted, width, timing)
        draft.settle(accepted, timing)
        self.costs.add(width, timing["verify_s"])
        if draft.kept:
            self.branches.add(branch_held, self.decay, drafts=sum(s for s, _ in draft.kept))
        if draft.catch_up or proposed.looked_up:  # not rated: a catch-up costs more than the
            return  # source's usual round; a lookup is judged by its kind's hold rate
        rate = self._rate(draft.source)
        rate.add(timing["tokens"], timing["round_s"], self.decay, self.round)
        if rate.trial:
            rate.trial -= 1
            if not rate.trial:  # the probe is over: judge it
                lost = proposed.rival is not None and rate.per_s() < (1 - self.tie) * proposed.rival
                rate.wait = min(2 * rate.wait, self.max_wait) if lost else self.probe_every

    def _write(self, proposed: Round, accepted: int, width: int, timing: dict) -> None:
        """The round as one line of the schedule log: what was chosen among which rates, the measured
        options' probe state before it settles (a probe under way: trial > 0; the next one after
        wait rounds), the price the scheduler had for verifying its width, what it made and cost."""
        draft = proposed.draft
        row = {
            "round": self.round,
            "source": draft.source,
            "tokens": len(draft.tokens),
            "padding": draft.padding,
            "accepted": accepted,
            "catch_up": draft.catch_up,
            "rates": proposed.rates,
            "rival": proposed.rival,
            "probes": {
                k: {"wait": r.wait, "trial": r.trial, "since": self.round - r.last} for k, r in self.rates.items()
            },
            "priced_s": self.costs.seconds(width),
            **timing,
        }
        with open(self.log, "a") as f:
            f.write(json.dumps(row) + "\n")

    def end_reply(self, reply: ReplySources, ctx: Context) -> None:
        self._score(reply, ctx.committed)
        for s in reply.sources:
            s.end_reply(ctx)
