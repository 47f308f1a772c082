"""Which draft to verify each round, and the guard that keeps speculation from losing.

Options each round: a free draft (a lookup that found a match, at no model
cost), the model drafter's draft (drafter forwards), or no draft at all (a
plain decoding step through the same loop). The option expected to make
tokens fastest wins.

A looked-up draft is scored before it is verified, by kind (source and match
length: "context:8"): from how often that kind's earlier drafts held at each
position, the tokens a round makes verifying its first 1..n tokens, over what
that verification costs (fitted from every round: on a CPU the target's
forward grows with the tokens it verifies, Qwen 1.5B 0.1 s a token, an eighth
of a step). The draft is cut to the length that makes tokens fastest: a copy
that holds keeps its full length, a lookup whose first token holds a third of
the time drafts one token. A kind never seen is expected to hold (so it is
tried); its counts fade with its own drafts, not with time, so a kind that
fails stays out however rarely it is tried. Rated instead on the rounds it had
won, a lookup round made no more tokens a second than a plain step on the 1.5B
target's math and chat (7 tokens drafted, under one held) and still took the
rounds from a drafter that paid.

The guard is the plain option: a plain step costs a verification of no draft
tokens (the same fit), and makes exactly what plain decoding makes, so while
no source is expected to beat it the loop decodes plainly. It needs no probe.

The drafter is scored by what it realized: tokens per second over its recent
rounds (sums that decay by the rounds since they were measured, about the last
twenty). Not chosen for a while, it is probed (the text may have changed):
tried for a few rated rounds, then judged against the best of the others; each
lost probe doubles the wait before the next. A drafter's rounds vary (1 to k+1
tokens): rated on its last five rounds and judged on one, a drafter that paid
1.5x plain on average got 12 % of the rounds (test_lookup.py) and sat out
whole replies where it paid.
Without the guard some source drafts every round.

A round in which the drafter first caught up on text that lookups drafted
costs more than its usual round; it is not rated (nor counted in a probe).
Charged for the catch-up, a probing drafter always lost and was shut out
where it paid.

A scheduler outlives a reply (chat, serve and bench keep one), so a new
reply starts from what the last ones measured instead of probing afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnidraft_mlx.drafts import PLAIN, Context, Draft, DraftSource
from omnidraft_mlx.fit import VerifyCost

MAX_DRAFT = 64  # draft positions whose hold rates are kept (a longer lookup is cut there)


@dataclass
class Rate:
    """Decaying sums of what an option's rounds emitted and cost."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0
    last: int = -(10**9)  # round it last ran
    wait: int = 0  # rounds before it is probed again
    trial: int = 0  # rated rounds left in the probe under way
    # Per draft position: drafts that reached it (all before it held) and those whose token held there.
    reached: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DRAFT))
    held: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DRAFT))

    def add(self, tokens: int, seconds: float, proposed: int, accepted: int, decay: float, now: int) -> None:
        old = decay ** (now - self.last)  # weighed by how many rounds ago it was measured
        self.tokens = old * self.tokens + tokens
        self.seconds = old * self.seconds + seconds
        # Hold counts fade with the kind's own drafts, not with time: a kind tried now and
        # then keeps what its drafts showed.
        self.reached *= decay
        self.held *= decay
        self.reached[: min(accepted + 1, proposed, MAX_DRAFT)] += 1
        self.held[: min(accepted, MAX_DRAFT)] += 1
        self.rounds += 1
        self.last = now

    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.rounds and self.seconds > 0 else None

    def expected_tokens(self, n: int) -> np.ndarray:
        """What a round makes verifying the first 1..n tokens of a draft of this kind: the
        target's own token plus those expected to hold. A position's hold rate leans on the one
        before it where it has few counts (none: 1, so a new kind is tried)."""
        p, prev = np.empty(n), 1.0
        for i in range(n):
            p[i] = prev = (self.held[i] + prev) / (self.reached[i] + 1)
        return 1 + np.cumsum(np.cumprod(p))


class Scheduler:
    def __init__(self, decay: float = 0.95, probe_every: int = 16, probe_rounds: int = 4, max_wait: int = 256):
        self.decay, self.probe_every, self.probe_rounds, self.max_wait = decay, probe_every, probe_rounds, max_wait
        self.rates: dict[str, Rate] = {}
        self.verify = VerifyCost(decay)
        self.round = 0
        self.sources: list = []
        self.guard = True
        self.rival: float | None = None  # the best rate among the options not chosen this round

    def begin_reply(self, sources: list, guard: bool, ctx: Context) -> None:
        """This reply's sources (their prompt processing: prefill)."""
        self.sources, self.guard = sources, guard
        for s in sources:
            s.start(ctx)

    def _rate(self, key: str) -> Rate:
        return self.rates.setdefault(key, Rate(wait=self.probe_every))

    def propose(self, ctx: Context, limit: int) -> Draft:
        """The draft to verify this round (no tokens: a plain step)."""
        self.round += 1
        # Free drafts first: they cost nothing to look at.
        options = [(d.source, d) for s in self.sources if s.free and (d := s.propose(ctx, limit))]
        options += [(s.name, s) for s in self.sources if not s.free]
        if self.guard or not options:
            options.append((PLAIN, None))
        scores = {}
        for key, choice in options:
            if isinstance(choice, Draft):
                scores[key] = self._cut(key, choice)
            elif choice is None:  # a plain step costs a verification of no draft tokens
                if self.verify.rounds:
                    scores[key] = 1 / float(self.verify.seconds(0))
            elif (rate := self._rate(key).per_s()) is not None:
                scores[key] = rate
        best = max(scores, key=scores.get) if scores else None
        # Only the drafter is probed: the others' rates are expected before they are verified.
        drafters = [o for o in options if isinstance(o[1], DraftSource)]
        probes = [o for o in drafters if self._rate(o[0]).trial]  # probes under way first
        probes += [o for o in drafters if o[0] != best and self.round - self._rate(o[0]).last >= self._rate(o[0]).wait]
        key, choice = probes[0] if probes else next((o for o in options if o[0] == best), options[-1])
        if probes and not self._rate(key).trial:
            self._rate(key).trial = self.probe_rounds
        self.rival = max((score for k, score in scores.items() if k != key), default=None)
        if choice is None:
            return Draft([], PLAIN)
        return choice if isinstance(choice, Draft) else choice.propose(ctx, limit)

    def _cut(self, key: str, draft: Draft) -> float:
        """Cut a looked-up draft to the length expected to make tokens fastest; that rate."""
        n = min(len(draft.tokens), MAX_DRAFT)
        per_s = self._rate(key).expected_tokens(n) / self.verify.seconds(np.arange(1, n + 1))
        draft.tokens = draft.tokens[: int(per_s.argmax()) + 1]
        return float(per_s.max())

    def settle(self, draft: Draft, accepted: int, timing: dict) -> None:
        """Learn from a verified round: the source's own learning, then the option's rate."""
        draft.settle(accepted, timing)
        self.verify.add(len(draft.tokens), timing["verify_s"])
        if draft.catch_up:
            return  # not rated: it cost more than this source's rounds usually do
        rate = self._rate(draft.source)
        rate.add(timing["tokens"], timing["round_s"], len(draft.tokens), accepted, self.decay, self.round)
        if rate.trial:
            rate.trial -= 1
            if not rate.trial:  # the probe is over: judge it
                lost = self.rival is not None and rate.per_s() < self.rival
                rate.wait = min(2 * rate.wait, self.max_wait) if lost else self.probe_every

    def end_reply(self, ctx: Context) -> None:
        for s in self.sources:
            s.end_reply(ctx)
