"""Which draft to verify each round, and the guard that keeps speculation from losing.

Options each round: a free draft (a lookup that found a match, at no model
cost), the model drafter's draft (drafter forwards), or no draft at all (a
plain decoding step through the same loop). Each option is scored by what it
has realized: tokens emitted per second over its recent rounds (sums that
decay by the rounds since they were measured, about the last twenty), lookups
per kind and match length, since a long match holds far more often than a
one-token one. The option expected to make tokens fastest wins.

The guard is the plain option: a plain step makes exactly what plain decoding
makes, so while no source is expected to beat it the loop decodes plainly.
An option not chosen for a while is probed (the text may have changed, a
list, a copied block): tried for a few rated rounds, then judged against the
best of the others; each lost probe doubles the wait before the next. A
drafter's rounds vary (1 to k+1 tokens): rated on its last five rounds and
judged on one, a drafter that paid 1.5x plain on average got 12 % of the rounds
(test_lookup.py) and sat out whole replies where it paid.
An option that never pays still costs only a few rounds per hundred.
Without the guard some source drafts every round.

A round in which the drafter first caught up on text that lookups drafted
costs more than its usual round; it is not rated (nor counted in a probe).
Charged for the catch-up, a probing drafter always lost and was shut out
where it paid.

A scheduler outlives a reply (chat, serve and bench keep one), so a new
reply starts from what the last ones measured instead of probing afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnidraft_mlx.drafts import PLAIN, Context, Draft


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


class Scheduler:
    def __init__(self, decay: float = 0.95, probe_every: int = 16, probe_rounds: int = 4, max_wait: int = 256):
        self.decay, self.probe_every, self.probe_rounds, self.max_wait = decay, probe_every, probe_rounds, max_wait
        self.rates: dict[str, Rate] = {}
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
        free = [(d.source, d) for s in self.sources if s.free and (d := s.propose(ctx, limit))]
        options = free + [(s.name, s) for s in self.sources if not s.free]
        if self.guard or not options:
            options.append((PLAIN, None))
        measured = {key: rate for key, _ in options if (rate := self._rate(key).per_s()) is not None}
        # The best-rated free draft is the model drafter's guess (it may read it ahead).
        guess = max(free, key=lambda o: measured.get(o[0], 0.0))[1].tokens if free else []
        best = max(measured, key=measured.get) if measured else None
        probes = [o for o in options if self._rate(o[0]).trial]  # probes under way first
        probes += [o for o in options if o[0] != best and self.round - self._rate(o[0]).last >= self._rate(o[0]).wait]
        key, choice = probes[0] if probes else next(o for o in options if o[0] == best)
        if probes and not self._rate(key).trial:
            self._rate(key).trial = self.probe_rounds
        self.rival = max((rate for k, rate in measured.items() if k != key), default=None)
        if choice is None:
            return Draft([], PLAIN)
        return choice if isinstance(choice, Draft) else choice.propose(ctx, limit, guess)

    def settle(self, draft: Draft, accepted: int, timing: dict) -> None:
        """Learn from a verified round: the source's own learning, then the option's rate."""
        draft.settle(accepted, timing)
        if draft.catch_up:
            return  # not rated: it cost more than this source's rounds usually do
        rate = self._rate(draft.source)
        rate.add(timing["tokens"], timing["round_s"], self.decay, self.round)
        if rate.trial:
            rate.trial -= 1
            if not rate.trial:  # the probe is over: judge it
                lost = self.rival is not None and rate.per_s() < self.rival
                rate.wait = min(2 * rate.wait, self.max_wait) if lost else self.probe_every

    def end_reply(self, ctx: Context) -> None:
        for s in self.sources:
            s.end_reply(ctx)
