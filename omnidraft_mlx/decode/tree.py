"""Token trees: several candidate continuations verified in one target forward.

A draft's main chain and its branches (other continuations: the drafter's
next-best tokens) are merged as a trie of target tokens, flattened parents
first, the chain's nodes first. The target reads the whole tree in one forward:
each node attends to the cached prefix and to its own ancestors (an ancestor
mask handed to attention through the caches' `make_mask`), at the position its
depth gives it (each attention's `rope` wrapped for the call). mlx-lm's models
are used as they are. Afterwards the accepted path's keys and values move to the
front of the new block and the caches keep exactly what a chain would have kept.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omnidraft_mlx.anatomy import context_length
from omnidraft_mlx.decode.layouts import chains_forward, offset, takes_trees


@dataclass
class TokenTree:
    """Nodes in target tokens, parents first; the root (-1) is the last committed token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    chain: int = 0  # the first `chain` nodes are the main chain, each the child of the one before

    @classmethod
    def of(cls, chain: list[int], branches: list[list[int]] = ()) -> TokenTree:
        """The chain, then each branch (target tokens from the root) merged in."""
        tree = cls(list(chain), list(range(-1, len(chain) - 1)), len(chain))
        for branch in branches:
            tree.add(branch)
        return tree

    def child(self, node: int, token: int) -> int | None:
        return next((i for i in self.children(node) if self.tokens[i] == token), None)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def add(self, path: list[int]) -> None:
        """Merge a path from the root."""
        node = -1
        for token in path:
            found = self.child(node, token)
            if found is None:
                self.tokens.append(token), self.parents.append(node)
                found = len(self.tokens) - 1
            node = found

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

    def on_chain(self, path: list[int]) -> int:
        """How many of a path's first nodes are the chain's."""
        return next((i for i, node in enumerate(path) if node != i), len(path))

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row of the forward (row 0: the root, row i + 1: node i): its depth, and
        its ancestors (itself included) as a boolean matrix."""
        n = len(self.tokens) + 1
        depth, ancestors = np.zeros(n, np.int32), np.eye(n, dtype=bool)
        for i, parent in enumerate(self.parents):
            depth[i + 1] = depth[parent + 1] + 1
            ancestors[i + 1] |= ancestors[parent + 1]
        return depth, ancestors


def attention_window(c, offset: int, window_size: int | None) -> int | None:
    """The keys a query sees in a layer: the window the model asks for, but past the prompt never
    more than a sliding-window cache's size (a rotating cache holds no more; mlx-lm's plamo3 asks
    for one more than it keeps)."""
    own = getattr(c, "window", None)
    return min(window_size or own, own) if own and offset else window_size or own


def tree_mask(offset: int, depth: np.ndarray, ancestors: np.ndarray, window: int | None) -> mx.array:
    """Which keys each tree row attends to: the cached prefix (within the window) and its ancestors."""
    q_pos = offset + depth
    k_pos = np.concatenate([np.arange(offset), q_pos])
    mask = np.concatenate([np.ones((len(depth), offset), bool), ancestors], axis=1)
    if window:
        mask &= (q_pos[:, None] - k_pos[None, :]) < window
    return mx.array(mask)


class PositionsRoPE:
    """A layer's rope with a given position per token (rows x tokens): the tokens move onto
    the batch axis, where mx.fast.rope takes an offset per row."""

    def __init__(self, rope, positions: mx.array):
        self.rope, self.positions = rope, positions.reshape(-1)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        B, H, N, D = x.shape
        y = self.rope(x.transpose(0, 2, 1, 3).reshape(B * N, H, 1, D), offset=self.positions)
        return y.reshape(B, N, H, D).transpose(0, 2, 1, 3)


class PositionsTable:
    """A learned position table (gpt2's wpe) that looks up the given positions, whatever ids the
    model computed from its cache's offset."""

    def __init__(self, table, positions: mx.array):
        self.table, self.positions = table, positions

    def __call__(self, ids) -> mx.array:
        return self.table(self.positions)


def _is_rope(module) -> bool:
    """A rotary embedding, by its type: nn.RoPE, or any class named for it (mlx-lm's rope_utils and
    the families' own: SuScaledRoPE, YarnRoPE, Llama3RoPE, ...), whatever attribute holds it."""
    name = type(module).__name__.lower()
    return isinstance(module, nn.RoPE) or "rope" in name or "rotary" in name


def _position_modules(model) -> list[tuple[object, object, object]]:
    """(parent, key, module) of every rotary embedding and learned position table in the model."""
    context = context_length(model)
    found = []
    for path, module in model.named_modules():
        table = isinstance(module, nn.Embedding) and context is not None and module.weight.shape[0] == context
        if path and (table or _is_rope(module)):
            *up, key = path.split(".")
            parent = model
            for k in up:
                parent = parent[int(k)] if isinstance(parent, list) else parent[k]
            found.append((parent, int(key) if isinstance(parent, list) else key, module))
    return found


@contextmanager
def positions_rope(model, positions: mx.array):
    """For one forward: token (b, i) at position positions[b, i] in every rotary embedding and
    learned position table (found by type, under any name)."""
    found = _position_modules(model)
    for parent, key, module in found:
        parent[key] = (PositionsTable if isinstance(module, nn.Embedding) else PositionsRoPE)(module, positions)
    try:
        yield
    finally:
        for parent, key, module in found:
            parent[key] = module


@contextmanager
def tree_attention(model, cache: list, tree: TokenTree):
    """For one forward over [root, *tree.tokens]: ancestor masks and per-token positions."""
    depth, ancestors = tree.rows()
    for c in cache:

        def make_mask(N, return_array=False, window_size=None, c=c):
            return tree_mask(c.offset, depth, ancestors, attention_window(c, c.offset, window_size))

        c.make_mask = make_mask
    try:
        with positions_rope(model, mx.array(cache[0].offset + depth)[None]):
            yield
    finally:
        for c in cache:
            del c.make_mask


def tree_forward(model, cache: list, root: int, tree: TokenTree) -> mx.array:
    """The target's logits for each row of [root, *tree.tokens], written into its cache; a
    chain takes the plain path, a model that takes no trees (layouts.py) one path per leaf. On
    an exception the caches hold what they held before."""
    held = [offset(c) for c in cache]
    inputs = mx.array([root, *tree.tokens])[None]
    try:
        if tree.is_chain:
            return model(inputs, cache=cache)[0]
        if not takes_trees(model):
            return chains_forward(model, cache, root, tree)
        with tree_attention(model, cache, tree):
            out = model(inputs, cache=cache)[0]
            mx.eval(out)
            return out
    except BaseException:
        for c, length in zip(cache, held):
            c.trim(offset(c) - length)
        raise


def keep_path(cache: list, start: int, path: list[int]) -> None:
    """Move the keys and values of the accepted path's nodes (the tree's block starts at
    `start`) to the front of the block; the trim after it is the caller's. A chain's
    accepted nodes are its front already."""
    if path == list(range(len(path))):
        return
    index = mx.array(path) + start
    end = start + len(path)
    for c in cache:
        for arrays in (c.keys, c.values):
            for a in arrays if isinstance(arrays, (list, tuple)) else (arrays,):
                a[..., start:end, :] = a[..., index, :]
