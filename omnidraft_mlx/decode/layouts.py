"""Whether a model takes a draft tree, or several replies' rows, in one forward: found by trying.

mlx-lm's families place tokens and shape attention in many ways (RoPE under any
name, partial rotary, learned position tables, ALiBi, no positions; queries 4-D
or grouped 5-D; sliding windows, sinks, shared KV layers, masks of their own).
tree.py hands positions and masks to what it recognises; whether that suffices
for a model is checked once per model on a few made-up tokens: the tree's rows
must equal the rows of plain forwards over each of its paths, a batch's rows
those of one forward per reply (trying the mask in each layout queries take).
A model that fails keeps working, exactly, at more forwards: trees are verified
as chains (one forward per root-to-leaf path) and batched rows one reply at a
time. Each fallback is said once per family and process in the log.
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omnidraft_mlx.anatomy import family, vocab_size

log = logging.getLogger("omnidraft.layouts")
MASK_LAYOUTS = ("4d", "5d")  # batch mask [B, 1, L, W], or [B, 1, 1, L, W] for grouped [B, kv, groups, L, D] queries
_said: set[tuple[str, str]] = set()


def offset(c) -> int:
    """Positions a layer's cache holds (a CacheList's: its first attention cache's; 0 for state alone)."""
    if hasattr(c, "offset"):
        return c.offset
    return next((offset(s) for s in getattr(c, "caches", ()) if hasattr(s, "offset") or hasattr(s, "caches")), 0)


def say_once(model, what: str) -> None:
    key = (family(model), what)
    if key not in _said:
        _said.add(key)
        log.warning("%s: %s", *key)


def _probe_ids(model, n: int, salt: int) -> list[int]:
    return [(7 * i + 3 * salt + 1) % vocab_size(model) for i in range(n)]


def _close(got: mx.array, want: mx.array) -> bool:
    """Equal up to the dtype's rounding: a misplaced token or key changes logits far more."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    tol = 1e-4 if want.dtype == mx.float32 and got.dtype == mx.float32 else 3e-2
    return got.shape == want.shape and (mx.abs(got - want).max() <= tol * (mx.abs(want).max() + 1)).item()


def _remembered(model, key: str, probe):
    memo = model.__dict__.setdefault("_omnidraft_layouts", {})
    if key not in memo:
        try:
            memo[key] = probe(model)
        except Exception as e:  # noqa: BLE001 - a layout the model does not take: fall back
            log.debug("%s: %s probe failed: %s", family(model), key, e)
            memo[key] = None
    return memo[key]


def _path(tree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def _probe_trees(model) -> bool:
    from omnidraft_mlx.decode.kvcache import make_cache, prefill
    from omnidraft_mlx.decode.tree import TokenTree, tree_attention

    a, b, c, d, e, f, root = _probe_ids(model, 7, 1)
    tree = TokenTree.of([a, b, c], [[d, e], [a, f]])
    cache = make_cache(model)
    prefill(model, cache, _probe_ids(model, 4, 2))
    with tree_attention(model, cache, tree):
        got = model(mx.array([[root, *tree.tokens]]), cache=cache)[0]
    mx.eval(got)
    _trim_to(cache, 4)
    want = chains_forward(model, cache, root, tree)
    return _close(got, want)


def _trim_to(cache: list, length: int) -> None:
    for c in cache:
        c.trim(offset(c) - length)


def takes_trees(model) -> bool:
    """Does a tree forward (tree.tree_attention) give each node the logits of its own path?"""
    ok = _remembered(model, "trees", _probe_trees)
    if not ok:
        say_once(
            model,
            "draft trees are verified as chains, one forward per branch (its positions or masks "
            "are not the ones omnidraft hands to attention)",
        )
    return bool(ok)


def chains_forward(model, cache: list, root: int, tree) -> mx.array:
    """tree_forward's result, from one plain forward per root-to-leaf path: each node's logits and
    keys/values are those of its own path; the cache ends holding [root, *tree.tokens] in order.
    Caches whose keys cannot be placed by hand verify the main chain only (the tree cut in place)."""
    if not all(isinstance(c, KVCache) for c in cache):
        say_once(model, "draft trees are cut to their main chain (its caches take no tree's keys)")
        del tree.tokens[tree.chain :], tree.parents[tree.chain :]
        return model(mx.array([[root, *tree.tokens]]), cache=cache)[0]
    start, n = cache[0].offset, len(tree.tokens) + 1
    rows: list = [None] * n
    kv: list = [[None] * n for _ in cache]
    leaves = [i for i in range(len(tree.tokens)) if not tree.children(i)] or [-1]
    for leaf in leaves:
        path = _path(tree, leaf)
        out = model(mx.array([[root, *(tree.tokens[i] for i in path)]]), cache=cache)[0]
        for j, row in enumerate([0, *(i + 1 for i in path)]):
            if rows[row] is None:
                rows[row] = out[j]
                for layer, c in enumerate(cache):
                    kv[layer][row] = (
                        c.keys[..., start + j : start + j + 1, :],
                        c.values[..., start + j : start + j + 1, :],
                    )
        mx.eval(rows, kv)
        _trim_to(cache, start)
    for layer, c in enumerate(cache):
        c.update_and_fetch(
            mx.concatenate([k for k, _ in kv[layer]], axis=2), mx.concatenate([v for _, v in kv[layer]], axis=2)
        )
    return mx.stack(rows)


def _probe_batch(model) -> str | None:
    from omnidraft_mlx.decode.batch import batch_forward
    from omnidraft_mlx.decode.kvcache import KVSlot
    from omnidraft_mlx.decode.tree import TokenTree

    trees = [TokenTree.of(_probe_ids(model, 3, 3)), TokenTree.of(_probe_ids(model, 1, 4))]
    if takes_trees(model):
        trees[0].add(_probe_ids(model, 2, 5))
    slots, roots = [KVSlot.fresh(model), KVSlot.fresh(model)], _probe_ids(model, 2, 6)
    for slot, n in zip(slots, (4, 6)):
        slot.extend(model, _probe_ids(model, n, 7))
    want = []
    for slot, root, tree in zip(slots, roots, trees):
        want.append(slot.forward_tree(model, root, tree))
        mx.eval(want[-1])
        slot.rewind(len(slot.tokens) - len(tree.tokens) - 1)
    for layout in MASK_LAYOUTS:
        try:
            got = batch_forward(model, slots, roots, trees, layout)
        except ValueError:  # the mask does not broadcast against this layout's queries
            continue
        for slot, tree in zip(slots, trees):
            slot.rewind(len(slot.tokens) - len(tree.tokens) - 1)
        if all(_close(g, w) for g, w in zip(got, want)):
            return layout
    return None


def batch_layout(model) -> str | None:
    """The mask layout under which one forward over several replies' rows gives each row its own
    logits, or None (then rows are verified one reply at a time)."""
    layout = _remembered(model, "batch", _probe_batch)
    if layout is None:
        say_once(
            model,
            "concurrent replies are verified one at a time (its attention does not take rows of "
            "different lengths in one forward)",
        )
    return layout
