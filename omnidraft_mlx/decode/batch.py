"""One target forward over the draft trees of several replies (concurrent requests).

Each reply keeps its own caches (KVSlot): rolled back on its own, stored in the
prompt cache on its own. For the forward, each layer's caches are seen through a
RowsView: every row's new keys and values go into that row's cache, and attention
reads the rows' caches padded to the longest, with a mask per row (its cached
prefix, within the window, and its tree's ancestors; padding masked out) and a
position per token (its prefix length plus its depth). So a row's logits are those
of its own forward, and afterwards its cache is exactly what KVSlot.forward_tree leaves.
The copy into the padded batch costs a pass over the rows' caches per forward.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.layouts import batch_layout, takes_trees
from omnidraft_mlx.decode.recurrent import StepsCache, finish_rows, layers, rows_view
from omnidraft_mlx.decode.tree import TokenTree, attention_window, positions_rope, tree_mask


class RowsView:
    """One layer's caches of the batch's rows, seen as one cache by the model's attention."""

    def __init__(self, caches: list, lengths: list[int], rows: list[tuple[np.ndarray, np.ndarray]], layout: str):
        self.caches, self.lengths, self.rows, self.layout = caches, lengths, rows, layout
        self.offset = max(lengths)  # unused by attention (positions_rope and make_mask stand in)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        width = max(length + len(depth) for length, (depth, _) in zip(self.lengths, self.rows))
        out_k, out_v = [], []
        for i, (cache, (depth, _)) in enumerate(zip(self.caches, self.rows)):
            k, v = cache.update_and_fetch(keys[i : i + 1, :, : len(depth)], values[i : i + 1, :, : len(depth)])
            pad = [(0, 0), (0, 0), (0, width - k.shape[2]), (0, 0)]
            out_k.append(mx.pad(k, pad))
            out_v.append(mx.pad(v, pad))
        return mx.concatenate(out_k), mx.concatenate(out_v)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        width = max(length + len(depth) for length, (depth, _) in zip(self.lengths, self.rows))
        mask = np.zeros((len(self.rows), 1, N, width), bool)
        mask[:, :, :, 0] = True  # padding rows attend somewhere (their output is dropped)
        for i, (length, (depth, ancestors)) in enumerate(zip(self.lengths, self.rows)):
            own = np.array(tree_mask(length, depth, ancestors, attention_window(self.caches[i], length, window_size)))
            mask[i, 0, : own.shape[0], : own.shape[1]] = own
        return mx.array(mask[:, :, None] if self.layout == "5d" else mask)


def batchable(slots: list[KVSlot]) -> bool:
    """Rows can share a forward when every layer's cache is a plain (or windowed) KVCache, or a
    recurrent layer's StepsCache (each row keeps its own states: recurrent.RowsStates)."""
    return all(isinstance(s, (KVCache, StepsCache)) for slot in slots for c in slot.cache for s in layers(c))


def forward_trees(model, slots: list[KVSlot], roots: list[int], trees: list[TokenTree]) -> list[mx.array]:
    """KVSlot.forward_tree for each (slot, root, tree), in one forward where the caches and the model
    allow (layouts.py; else one forward each): each row's logits after its root and each of its
    nodes. On an exception every cache holds what it held before."""
    for slot, tree in zip(slots, trees):
        slot.fit_tree(tree)  # recurrent layers verify chains: cut first, so the rows can still batch
    one_by_one = len(slots) == 1 or not batchable(slots)
    one_by_one = one_by_one or (not all(t.is_chain for t in trees) and not takes_trees(model))
    layout = None if one_by_one else batch_layout(model)
    if layout is None:
        held = [len(slot.tokens) for slot in slots]
        try:
            return [slot.forward_tree(model, root, tree) for slot, root, tree in zip(slots, roots, trees)]
        except BaseException:  # the rows forwarded before the failing one go back too
            for slot, n in zip(slots, held):
                slot.rewind(n)
            raise
    return batch_forward(model, slots, roots, trees, layout)


def batch_forward(model, slots: list[KVSlot], roots: list[int], trees: list[TokenTree], layout: str) -> list:
    """One forward over every slot's root and tree, its mask in the given layout (layouts.py)."""
    rows = [tree.rows() for tree in trees]
    lengths = [slot.cache[0].offset for slot in slots]
    n = max(len(depth) for depth, _ in rows)
    inputs = np.zeros((len(slots), n), np.int32)
    positions = np.zeros((len(slots), n), np.int32)
    for i, (root, tree, (depth, _), length) in enumerate(zip(roots, trees, rows, lengths)):
        inputs[i, : len(depth)] = [root, *tree.tokens]
        positions[i, : len(depth)] = length + depth
    widths = [len(depth) for depth, _ in rows]
    views = [
        rows_view([slot.cache[layer] for slot in slots], widths, lambda caches: RowsView(caches, lengths, rows, layout))
        for layer in range(len(slots[0].cache))
    ]
    try:
        with positions_rope(model, mx.array(positions)):
            out = model(mx.array(inputs), cache=views)
            finish_rows(views)
            mx.eval(out)
    except BaseException:
        for slot, length in zip(slots, lengths):
            for c in slot.cache:
                c.trim(c.offset - length)
        raise
    for slot, root, tree in zip(slots, roots, trees):
        slot.tokens += [root, *tree.tokens]
    return [out[i, : len(depth)] for i, (depth, _) in enumerate(rows)]


def forward_rounds(decodings: list, trees: list[TokenTree]) -> list[tuple[mx.array, float]]:
    """The target's verification of each planned Decoding (speculative.py) in one forward: per
    decoding, its logits and its share of the forward's seconds (by its rows), for take()."""
    t0 = time.perf_counter()
    outs = forward_trees(decodings[0].pair.target, [d.target for d in decodings], [d.y for d in decodings], trees)
    mx.eval(outs)
    seconds, widths = time.perf_counter() - t0, [len(tree.tokens) + 1 for tree in trees]
    return [(out, seconds * width / sum(widths)) for out, width in zip(outs, widths)]
