"""Speculative decoding with the target split over the ranks of `mlx.launch` (mx.distributed).

`mlx.launch -n 2 --backend ring -- omnidraft generate ...` loads the target split
with mlx-lm's own sharding (shard_target: tensor parallel through the family's
`model.shard(group)`, or a pipeline through `model.model.pipeline(group)`); every
target forward is then a collective that all ranks run together, on the same tokens.

The lead (rank 0) alone drafts: it holds the draft sources (drafter, lookups, the
scheduler that picks among them) and the sampler. The scheduler's choices rest on
measured timings, which differ from rank to rank, and a draft's proposal
distributions and the accept/reject draws must be one rank's for sampling to stay
lossless, so one rank decides and the others follow. Every rank loads the drafter
(small) for the vocabulary map; only the lead runs it. A round costs two shares at
its boundaries, three all_sums besides the target forward's own collectives:
- plan: the lead's draft as the tree to verify (tokens, parents, chain length), by
  collectives.broadcast_bytes (its size, then its bytes: two all_sums),
- take: the accepted path and the target's next token, in a buffer as long as the tree
  (collectives.share_tree: one all_sum).
Every rank then verifies the same tree and keeps the same path (its KV and recurrent
state roll back the same way). A reply the lead leaves before it is done (a server's stop
string or a client gone: serve/follow.py) ends on every rank at the same round: the lead's
end() comes in place of the next plan, and there the others' plan() raises Ended. Across
ranks the lead drafts chains, not trees (speculative.Decoding turns --tree off there):
whether a rank's layers take a tree is its own (a pipeline stage's recurrent layers), and
a probe run by one rank alone would wait forever on the others. Plain decoding (plain.py)
decodes the lead's draws too (Ranks.sampler: one all_sum a token). Before a reply's
prefill the ranks keep the shortest of their cached prefixes (Ranks.least): each rank's
prompt cache holds its own part of the heads or layers and evicts by its own byte count,
and every rank must feed the same tokens. On one rank (ALONE) every share is the identity.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from omnidraft_mlx.collectives import all_sum, broadcast_bytes, share_tree
from omnidraft_mlx.decode.drafts import Draft
from omnidraft_mlx.decode.scheduler import Round
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.errors import OmniDraftError

SHARDINGS = ("tensor", "pipeline")  # --shard: the way preferred where a family has both


class Ended(Exception):
    """The lead ended the reply before it was done (Ranks.end): no more rounds of it."""


class Ranks:
    """Who decides a round: the lead, then the others get its decisions (group None: one process)."""

    def __init__(self, group: mx.distributed.Group | None = None, shard: str | None = None):
        self.group, self.shard = group, shard  # shard: how the target was split (SHARDINGS)
        self.lead = group is None or group.rank() == 0
        self.share_s = 0.0  # seconds in the shares below, waiting on the slowest rank included (the bench's)

    @contextmanager
    def _timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.share_s += time.perf_counter() - start

    def plan(self, propose: Callable[[], tuple[Round, TokenTree]]) -> tuple[Round, TokenTree]:
        """The round to verify: the lead's propose(); the others get the lead's tree, as a round of
        no source of their own."""
        if self.group is None:
            return propose()
        if self.lead:
            proposed, tree = propose()
            with self._timed():
                broadcast_bytes(np.array([tree.chain, *tree.tokens, *tree.parents], np.int32).tobytes(), self.group)
            return proposed, tree
        with self._timed():
            sent = np.frombuffer(broadcast_bytes(b"", self.group), np.int32).tolist()
        if not sent:  # a plan has at least its chain length
            raise Ended
        n = (len(sent) - 1) // 2
        tree = TokenTree(sent[1 : 1 + n], sent[1 + n :], sent[0])
        return Round(Draft(tree.tokens, "lead"), None, looked_up=True), tree

    def take(self, width: int, accept: Callable[[], tuple[list[int], int]]) -> tuple[list[int], int]:
        """The round's accepted path and the target's next token: the lead's accept(), on every rank
        (width: the tree's nodes, the longest a path may be, so one all_sum of a size every rank knows)."""
        if self.group is None:
            return accept()
        sent = np.zeros(width + 2, np.int32)
        if self.lead:
            path, y = accept()
            sent[: len(path) + 2] = [y, len(path), *path]
        with self._timed():
            sent = np.array(share_tree(mx.array(sent), self.group))
        return sent[2 : 2 + sent[1]].tolist(), int(sent[0])

    def least(self, n: int) -> int:
        """The smallest of every rank's n (one all_gather; n itself in one process)."""
        if self.group is None:
            return n
        return int(np.array(mx.distributed.all_gather(mx.array([n]), group=self.group, stream=mx.cpu)).min())

    def end(self) -> None:
        """The lead leaves a reply before it is done: the others' next plan() raises Ended."""
        if self.group is not None and self.lead:
            broadcast_bytes(b"", self.group)

    def sampler(self, sample: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        """A sampler of mlx-lm's (plain decoding: plain.py) whose draw is the lead's on every rank, one
        all_sum a token (in the graph: no wait for it), so no near-tie or draw may part the ranks."""
        if self.group is None:
            return sample

        def shared(logprobs: mx.array) -> mx.array:
            token = sample(logprobs)
            return all_sum(token if self.lead else mx.zeros_like(token), self.group)

        return shared


ALONE = Ranks()


def shard_target(model, group: mx.distributed.Group, prefer: str = "tensor") -> None:
    """Split a (lazily loaded) target over the group with mlx-lm's own sharding, `prefer` where
    the family has both ways, then load this rank's part of the weights."""
    ways = {"tensor": hasattr(model, "shard"), "pipeline": hasattr(getattr(model, "model", None), "pipeline")}
    how = prefer if ways[prefer] else next((way for way, has in ways.items() if has), None)
    if how is None:
        family = type(model).__module__.rsplit(".", 1)[-1]  # mlx-lm's module: no forward (anatomy runs one)
        raise OmniDraftError(
            f"mlx-lm cannot split a {family} model over {group.size()} ranks (no tensor or pipeline "
            "sharding for the family): run it in one process, without mlx.launch"
        )
    model.shard(group) if how == "tensor" else model.model.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(all_sum(mx.array(1.0), group))  # every rank loaded: none times out waiting in the first forward
    object.__setattr__(model, "omnidraft_ranks", Ranks(group, how))  # not an mlx parameter


def ranks_of(model) -> Ranks:
    """The ranks a target was split over (shard_target), ALONE for a whole one."""
    return getattr(model, "omnidraft_ranks", ALONE)
