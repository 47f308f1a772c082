"""What a draft source gives the decode loop, and what it sees.

A draft source proposes target tokens for one round; the target verifies them
in one forward. Sources: the model drafter (drafter.py), lookups in the
context and in the user's history (lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.settings import check_choice


@dataclass
class Context:
    """The decoding so far, as the sources see it."""

    prompt: list[int]  # target ids of the prompt
    committed: list[int] = field(default_factory=list)  # target ids of the reply so far
    text: bytearray = field(default_factory=bytearray)  # the reply's bytes
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def tail(self, n: int) -> list[int]:
        """The last n target ids of prompt + reply."""
        head = self.prompt[len(self.prompt) - max(0, n - len(self.committed)) :] if n > len(self.committed) else []
        return head + self.committed[-n:] if n else []


def _nothing(accepted: int, timing: dict) -> None:
    pass


@dataclass(frozen=True)
class Draft:
    """One round's proposal, in target tokens: a value. Padding, branches and the cut to the
    token budget make new drafts (padded, branched, cut); the source's callbacks see the one it made."""

    tokens: tuple[int, ...]
    source: str
    # Sampling: the proposal distribution over the target vocabulary at position n for token t.
    # None: a point mass on each token (lookups; any greedy draft).
    q: Callable[[int, int], np.ndarray] | None = None
    # Learn from the verification: (tokens accepted on the chain, the round's times and tokens emitted).
    settle: Callable[[int, dict], None] = _nothing
    drafted: int = 0  # drafter tokens behind the proposal
    forwards: int = 0  # drafter forwards paid for it
    merged: tuple[bool, ...] = ()  # per token: an n-gram cache merge
    # The source first caught up on text other sources drafted (the drafter's lazy re-sync):
    # this round cost more than its rounds usually do.
    catch_up: bool = False
    # The last `padding` tokens were looked up after the source's own, to fill a draft length
    # that verifies no slower (fit.VerifyCost.cheapest_length); they are point masses.
    padding: int = 0
    # Other continuations that may be verified beside the tokens, as a token tree (tree.py): each the
    # tokens it is expected to add and a function giving its target tokens from the root (translated
    # only if looked at); point masses. The scheduler keeps those that pay for the width they add.
    branches: tuple[tuple[float, Callable[[], list[int]]], ...] = ()
    kept: tuple[tuple[float, tuple[int, ...]], ...] = ()  # the branches kept, translated
    expected: float = 0.0  # tokens the source expects to be accepted of its own (branches are judged against it)

    def __post_init__(self):
        # Sources may hand over lists: the value keeps tuples.
        for name in ("tokens", "merged", "branches", "kept"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def padded(self, extra: list[int]) -> Draft:
        """The draft with looked-up tokens after its own (replacing any padding it had)."""
        return replace(self, tokens=self.tokens[: self.own] + tuple(extra), padding=len(extra))

    def cut(self, n: int) -> Draft:
        """The draft's first n tokens (the padding goes first) and the branches that fit in n."""
        if n >= len(self.tokens) and all(len(path) <= n for _, path in self.kept):
            return self
        kept = tuple((score, path) for score, path in self.kept if len(path) <= n)
        return replace(self, tokens=self.tokens[:n], padding=max(0, self.padding - len(self.tokens) + n), kept=kept)

    def branched(self, kept: list[tuple[float, list[int]]]) -> Draft:
        """The draft with the branches kept to verify beside its tokens."""
        return replace(self, kept=tuple((score, tuple(path)) for score, path in kept))

    def tree(self) -> TokenTree:
        return TokenTree.of(self.tokens, [path for _, path in self.kept])

    @property
    def own(self) -> int:
        """How many of the tokens are the source's own."""
        return len(self.tokens) - self.padding

    def proposal(self, node: int, token: int, vocab: int) -> np.ndarray:
        """The proposal distribution at a node of the draft's tree: the source's at its own
        tokens (sampling), a point mass at padding and branch nodes."""
        if self.q is not None and node < self.own:
            return self.q(node, token)
        return point_mass(token, vocab)


def point_mass(token: int, vocab: int) -> np.ndarray:
    """The proposal of a token chosen without sampling (a lookup, a padding token, a branch)."""
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


class DraftSource:
    name = "source"  # rounds are counted under it (a draft may add a detail: "context:3")
    free = False  # proposing costs no model forward: a draft can be looked at before choosing it

    def start(self, ctx: Context) -> None:
        """Prompt processing (timed as prefill)."""

    def propose(self, ctx: Context, limit: int, guess: list[int] = ()) -> Draft | None:
        """At most `limit` target tokens to verify next, or None. `guess`: target tokens a free
        source expects next (a model source may read them ahead in one forward)."""
        raise NotImplementedError

    def extend(self, ctx: Context, draft: tuple[int, ...], count: int) -> list[int]:
        """Up to `count` tokens expected after the reply so far followed by `draft` (free sources)."""
        return []

    def end_reply(self, ctx: Context) -> None:
        """The reply is over (interrupted or not): learn from it."""


SOURCES = ("drafter", "context", "history")  # the kinds of draft source
PLAIN = "plain"  # a round without a draft: one plain decoding step through the same loop


def check_sources(sources: str | tuple[str, ...]) -> tuple[str, ...]:
    """The sources of a --source value ("drafter,context") or tuple, checked."""
    if isinstance(sources, str):
        sources = tuple(s.strip() for s in sources.split(",") if s.strip())
    if not sources:
        raise OmniDraftError(f"--source needs at least one of {', '.join(SOURCES)}")
    for source in sources:
        check_choice("--source", source, SOURCES)
    return tuple(sources)
