"""What one more draft token costs the target's verification, fitted as decoding runs."""

from __future__ import annotations

import numpy as np


class VerifyCost:
    """Seconds of verification per draft token: the least-squares slope of a round's
    verification time over its draft length, on sums that decay per round (the
    machine's load changes). On a CPU it is not small: a 1.5B target's forward
    grows by about 0.1 s (an eighth of a step) per token it verifies."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sums = np.zeros(5)  # rounds, n, n^2, s, n*s

    def add(self, tokens: int, seconds: float) -> None:
        self.sums = self.decay * self.sums + (1, tokens, tokens**2, seconds, tokens * seconds)

    def seconds(self, tokens: int) -> float | None:
        """Expected verification time of a draft of `tokens` tokens (None: nothing measured)."""
        w, n, _, s, _ = self.sums
        if not w:
            return None
        return (s - self.per_token * n) / w + self.per_token * tokens

    @property
    def per_token(self) -> float:
        w, n, nn, s, ns = self.sums
        spread = w * nn - n * n  # draft lengths must vary to show what one more token costs
        return max(0.0, (w * ns - n * s) / spread) if spread > 1e-6 * w * w else 0.0
