"""Token trees: several candidate continuations verified in one target forward.

A draft's main chain and its branches (other continuations: the drafter's
next-best tokens) are merged as a trie of target tokens, flattened parents
first, the chain's nodes first. A tree is a value: merging a path or cutting
to the chain makes a new tree, so the tree a round verified is the one its
acceptance reads. How a forward reads a tree (masks, positions) is layouts.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class TokenTree:
    """Nodes in target tokens, parents first; the root (-1) is the last committed token."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    chain: int = 0  # the first `chain` nodes are the main chain, each the child of the one before

    def __post_init__(self):
        # Callers may hand over lists: the value keeps tuples.
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "parents", tuple(self.parents))

    @classmethod
    def of(cls, chain: list[int], branches: list[list[int]] = ()) -> TokenTree:
        """The chain, then each branch (target tokens from the root) merged in."""
        tree = cls(chain, range(-1, len(chain) - 1), len(chain))
        for branch in branches:
            tree = tree.add(branch)
        return tree

    def child(self, node: int, token: int) -> int | None:
        return next((i for i in self.children(node) if self.tokens[i] == token), None)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def add(self, path: list[int]) -> TokenTree:
        """The tree with a path from the root merged in."""
        node = -1
        for depth, token in enumerate(path):
            found = self.child(node, token)
            if found is None:
                n, new = len(self.tokens), tuple(path[depth:])
                return replace(
                    self, tokens=self.tokens + new, parents=(*self.parents, node, *range(n, n + len(new) - 1))
                )
            node = found
        return self

    def new_nodes(self, path: list[int]) -> int:
        """How many nodes merging the path would add."""
        node = -1
        for depth, token in enumerate(path):
            node = self.child(node, token)
            if node is None:
                return len(path) - depth
        return 0

    @property
    def is_chain(self) -> bool:
        return len(self.tokens) == self.chain

    def main_chain(self) -> TokenTree:
        """The tree cut to its main chain."""
        return (
            self
            if self.is_chain
            else replace(self, tokens=self.tokens[: self.chain], parents=self.parents[: self.chain])
        )

    def on_chain(self, path: list[int]) -> int:
        """How many of a path's first nodes are the chain's."""
        return next((i for i, node in enumerate(path) if node != i), len(path))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row of the forward (row 0: the root, row i + 1: node i): its depth, and
        its ancestors (itself included) as a boolean matrix."""
        n = len(self.tokens) + 1
        depth, ancestors = np.zeros(n, np.int32), np.eye(n, dtype=bool)
        for i, parent in enumerate(self.parents):
            depth[i + 1] = depth[parent + 1] + 1
            ancestors[i + 1] |= ancestors[parent + 1]
        return depth, ancestors
