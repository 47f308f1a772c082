"""What drafting and verifying a draft cost, measured as decoding runs."""

from __future__ import annotations

import numpy as np


class VerifyCost:
    """Seconds of verification by draft length.

    Two views of the same rounds, on sums that decay per round (the machine's load
    changes): the least-squares slope over all lengths (what one more token costs on
    average: on a CPU a 1.5B target's forward grows by about 0.1 s, an eighth of a
    step, per token it verifies), and a mean per length measured (widths.py seeds
    it). The cost is not smooth in the length: on this CPU's BLAS a 1.5B target
    verifies 15 draft tokens in less time than 3 (0.94 s against 0.98 s; 8 take 1.2 s),
    so a shorter draft padded to a cheaper length loses nothing (cheapest_length)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sums = np.zeros(5)  # rounds, n, n^2, s, n*s
        self.by_length: dict[int, list[float]] = {}  # draft length -> [weight, weighted seconds]

    def add(self, tokens: int, seconds: float) -> None:
        self.sums = self.decay * self.sums + (1, tokens, tokens**2, seconds, tokens * seconds)
        weight, total = self.by_length.get(tokens, (0.0, 0.0))
        self.by_length[tokens] = [self.decay * weight + 1, self.decay * total + seconds]

    def seed(self, seconds_by_length: dict[int, float], rounds: float = 1.0) -> None:
        """Start from a measured curve, as if each length's cost was measured over `rounds` rounds
        (widths.py: one forward each); lengths measured here are kept."""
        for tokens, seconds in seconds_by_length.items():
            self.by_length.setdefault(int(tokens), [rounds, rounds * float(seconds)])

    def seconds(self, tokens: int) -> float | None:
        """Expected verification time of a draft of `tokens` tokens (None: nothing measured)."""
        if tokens in self.by_length:
            weight, total = self.by_length[tokens]
            return total / weight
        w, n, _, s, _ = self.sums
        if not w:
            return None
        return (s - self.per_token * n) / w + self.per_token * tokens

    def cheapest_length(self, tokens: int, most: int) -> int:
        """The draft length in tokens..most that verifies fastest (the longest of equals):
        tokens itself unless a longer length was measured to cost no more."""
        base = self.seconds(tokens)
        if base is None:
            return tokens
        longer = [n for n in self.by_length if tokens < n <= most and self.seconds(n) <= base]
        return min(longer, key=lambda n: (self.seconds(n), -n)) if longer else tokens

    @property
    def per_token(self) -> float:
        w, n, nn, s, ns = self.sums
        spread = w * nn - n * n  # draft lengths must vary to show what one more token costs
        return max(0.0, (w * ns - n * s) / spread) if spread > 1e-6 * w * w else 0.0


class DraftCost:
    """What rounds of model drafting cost and made, on sums that decay per round, for
    gamma auto (policy.LearnedPolicy): one more draft token adds prod P(accept) expected
    tokens and costs a drafter forward plus the target's verification of one more token
    (the slope of VerifyCost), worth it while prod P exceeds what decoding makes, on
    average, in that time. So a drafter that is cheap next to its target drafts further,
    and the threshold follows the machine's load as it changes."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sums = np.zeros(4)  # drafting s, drafter forwards, round s, tokens emitted
        self.verify = VerifyCost(decay)
        self.rounds = 0  # rounds in those sums

    def add(self, draft_s: float, forwards: int, verify_s: float, drafted: int, round_s: float, tokens: int) -> None:
        """What one round cost and made (a round without a drafter forward tells nothing)."""
        if forwards:
            self.sums = self.decay * self.sums + (draft_s, forwards, round_s, tokens)
            self.verify.add(drafted, verify_s)
            self.rounds += 1

    def gamma(self, forward: bool) -> float | None:
        """gamma = 1 - (s per drafter forward + s to verify a draft token) * (tokens per s), the
        P(a rejection) above which one more draft token is not worth it; forward=False: its
        drafter forward is already paid. None until four rounds were measured."""
        if self.rounds < 4:
            return None
        draft_s, forwards, round_s, tokens = self.sums
        per_token = (draft_s / forwards if forward else 0.0) + self.verify.per_token
        return float(np.clip(1.0 - per_token * tokens / round_s, 0.0, 1.0))
