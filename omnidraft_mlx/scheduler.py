"""Which draft to verify each round, and the guard that keeps speculation from losing.

Options each round: a free draft (a lookup that found a match, at no model
cost), the model drafter's draft (drafter forwards), or no draft at all (a
plain decoding step through the same loop). Each option is scored by what it
has realized: tokens emitted per second over its recent rounds (decaying
means), lookups per kind and match length, since a long match holds far more
often than a one-token one. The option expected to make tokens fastest wins.

The guard is the plain option: a plain step makes exactly what plain decoding
makes, so while no source is expected to beat it the loop decodes plainly.
An option not chosen for a while is probed (tried once: the text may have
changed, a list, a copied block); each probe that loses doubles the wait
before the next, so an option that never pays costs a handful of rounds per
thousand. Without the guard some source drafts every round.

A round in which the drafter first caught up on text that lookups drafted
costs more than its usual round; it is not rated, and the drafter drafts again
next round, in step, to be rated on what it usually costs. Charged for the
catch-up, a probing drafter always lost and was shut out where it paid.

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

    def add(self, tokens: int, seconds: float, decay: float, now: int) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.rounds += 1
        self.last = now

    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.rounds and self.seconds > 0 else None


class Scheduler:
    def __init__(self, decay: float = 0.8, probe_every: int = 16, max_wait: int = 1024):
        self.decay, self.probe_every, self.max_wait = decay, probe_every, max_wait
        self.rates: dict[str, Rate] = {}
        self.round = 0
        self.sources: list = []
        self.guard = True
        self.probe: str | None = None  # the option this round probes, if it does
        self.best: str | None = None  # the measured best option this round
        self.again: str | None = None  # an option that caught up last round: rate it now

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
        measured = [(rate, key) for key, _ in options if (rate := self._rate(key).per_s()) is not None]
        self.best = max(measured)[1] if measured else None
        due = [o for o in options if o[0] != self.best and self.round - self._rate(o[0]).last >= self._rate(o[0]).wait]
        due.sort(key=lambda o: o[0] != self.again)
        key, choice = due[0] if due else next(o for o in options if o[0] == self.best)
        self.probe = key if due else None
        if choice is None:
            return Draft([], PLAIN)
        return choice if isinstance(choice, Draft) else choice.propose(ctx, limit)

    def settle(self, draft: Draft, accepted: int, timing: dict) -> None:
        """Learn from a verified round: the source's own learning, then the option's rate."""
        draft.settle(accepted, timing)
        self.again = draft.source if draft.catch_up else None
        if self.again:
            return  # not rated: still due (or best), it drafts again next round
        rate = self._rate(draft.source)
        rate.add(timing["tokens"], timing["round_s"], self.decay, self.round)
        if self.probe is not None and self.best is not None:
            lost = rate.per_s() < self._rate(self.best).per_s()
            rate.wait = min(2 * rate.wait, self.max_wait) if lost else self.probe_every

    def end_reply(self, ctx: Context) -> None:
        for s in self.sources:
            s.end_reply(ctx)
