"""The target's verification of the rounds of several replies (concurrent requests) in one forward.

Each reply keeps its own caches (KVSlot): rolled back on its own, stored in the
prompt cache on its own. Where every row's caches and the model allow (layouts.py:
batch_forward, its mask layout found by trying), the rows share one forward, padded
to the longest; else each row is verified in a forward of its own. Either way a row's
logits are those of its own forward, and afterwards its cache is exactly what
layouts.forward_tree leaves. The copy into the padded batch costs a pass over the
rows' caches per forward.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.layouts import batch_forward, batch_layout, forward_tree, takes_trees
from omnidraft_mlx.decode.recurrent import StepsCache, layers
from omnidraft_mlx.decode.tree import TokenTree


def batchable(slots: list[KVSlot]) -> bool:
    """Rows can share a forward when every layer's cache is a plain (or windowed) KVCache, or a
    recurrent layer's StepsCache (each row keeps its own states: recurrent.RowsStates)."""
    return all(isinstance(s, (KVCache, StepsCache)) for slot in slots for c in slot.cache for s in layers(c))


def forward_trees(model, slots: list[KVSlot], roots: list[int], trees: list[TokenTree]) -> list[mx.array]:
    """layouts.forward_tree for each (slot, root, tree), in one forward where the caches and the
    model allow (else one forward each): each row's logits after its root and each of its nodes.
    Each tree is one its slot verifies (layouts.fit_tree). On an exception every cache holds
    what it held before."""
    one_by_one = len(slots) == 1 or not batchable(slots)
    one_by_one = one_by_one or (not all(t.is_chain for t in trees) and not takes_trees(model))
    layout = None if one_by_one else batch_layout(model)
    if layout is None:
        held = [len(slot.tokens) for slot in slots]
        try:
            return [forward_tree(model, slot, root, tree) for slot, root, tree in zip(slots, roots, trees)]
        except BaseException:  # the rows forwarded before the failing one go back too
            for slot, n in zip(slots, held):
                slot.rewind(n)
            raise
    return batch_forward(model, slots, roots, trees, layout)


def forward_rounds(decodings: list, trees: list[TokenTree]) -> list[tuple[mx.array, float]]:
    """The target's verification of each planned Decoding (speculative.py: its plan() gave the tree)
    in one forward: per decoding, its logits and its share of the forward's seconds (by its rows),
    for take()."""
    t0 = time.perf_counter()
    outs = forward_trees(decodings[0].pair.target, [d.target for d in decodings], [d.y for d in decodings], trees)
    mx.eval(outs)
    seconds, widths = time.perf_counter() - t0, [len(tree.tokens) + 1 for tree in trees]
    return [(out, seconds * width / sum(widths)) for out, width in zip(outs, widths)]
