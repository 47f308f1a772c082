"""Which draft to verify each round, and the guard that keeps speculation from losing.

Options each round: a free draft (a lookup that found a match, at no model
cost), the model drafter's draft (drafter forwards), or no draft at all (a
plain decoding step through the same loop). Each option is scored by what it
has realized: tokens emitted per second over its recent rounds (decaying
means), lookups per kind and match length, since a long match holds far more
often than a one-token one. The option expected to make tokens fastest wins.

The guard is the plain option: a plain step makes exactly what plain decoding
makes, so while no source is expected to beat it the loop decodes plainly,
and a source not chosen for `probe_every` rounds is tried again (the text may
have changed: a list, a copied block). Without the guard some source drafts
every round.
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

    def add(self, tokens: int, seconds: float, decay: float, now: int) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.rounds += 1
        self.last = now

    def per_s(self, prior: float) -> float:
        """Tokens per second; before any round, the optimistic prior (so it gets tried)."""
        return self.tokens / self.seconds if self.rounds and self.seconds > 0 else prior


class Scheduler:
    def __init__(self, sources: list, guard: bool = True, decay: float = 0.8, probe_every: int = 24):
        self.sources, self.guard = sources, guard
        self.decay, self.probe_every = decay, probe_every
        self.rates: dict[str, Rate] = {}
        self.round = 0

    def start(self, ctx: Context) -> None:
        for s in self.sources:
            s.start(ctx)

    def _rate(self, key: str) -> Rate:
        return self.rates.setdefault(key, Rate())

    def _stale(self, key: str) -> bool:
        return self.round - self._rate(key).last >= self.probe_every

    def propose(self, ctx: Context, limit: int) -> Draft:
        """The draft to verify this round (no tokens: a plain step)."""
        self.round += 1
        # Free drafts first: they cost nothing to look at.
        options = [(d.source, d) for s in self.sources if s.free and (d := s.propose(ctx, limit))]
        options += [(s.name, s) for s in self.sources if not s.free]
        if self.guard or not options:
            options.append((PLAIN, None))
        plain = self._rate(PLAIN).per_s(0.0)
        # Untried or long-unused options are probed; the best measured one otherwise.
        key, choice = max(options, key=lambda o: (self._stale(o[0]), self._rate(o[0]).per_s(plain * 2 + 1e9)))
        if choice is None:
            return Draft([], PLAIN)
        return choice if isinstance(choice, Draft) else choice.propose(ctx, limit)

    def settle(self, draft: Draft, accepted: int, timing: dict) -> None:
        """Learn from a verified round: the source's own learning, then the option's rate."""
        draft.settle(accepted, timing)
        self._rate(draft.source).add(timing["tokens"], timing["round_s"], self.decay, self.round)

    def end_reply(self, ctx: Context) -> None:
        for s in self.sources:
            s.end_reply(ctx)
