"""One verify forward laid out: a draft tree, or the trees of several replies (concurrent
requests), in one target forward; and which of those layouts a model takes, found by trying.

A tree's nodes attend to the cached prefix and to their own ancestors (an ancestor mask
handed to attention through the caches' `make_mask`), each at the position its depth
gives it (every rotary embedding and learned position table wrapped for the call). A
batch's rows each keep their own caches (KVSlot), seen by attention through a RowsView:
padded to the longest, a mask per row. mlx-lm's models are used as they are.

mlx-lm's families place tokens and shape attention in many ways (RoPE under any name,
partial rotary, learned position tables, ALiBi, no positions; queries 4-D or grouped 5-D;
sliding windows, sinks, shared KV layers, masks of their own). Whether what is handed to
attention suffices for a model is checked once per model on a few made-up tokens: the
tree's rows must equal the rows of plain forwards over each of its paths, a batch's rows
those of one forward per reply (trying the mask in each layout queries take). A model
that fails keeps working, exactly, at more forwards: trees are verified as chains (one
forward per root-to-leaf path) and batched rows one reply at a time. A target whose
recurrent layers would need a state per branch, or whose caches take no tree's keys,
verifies only the main chain: fit_tree cuts the tree before the round is verified, and
every forward here verifies exactly the tree it is given. Each fallback is said once per
family and process in the log.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from omnidraft_mlx.anatomy import context_length, family, vocab_size
from omnidraft_mlx.decode.kvcache import KVSlot, attention_window, is_recurrent, make_cache, prefill
from omnidraft_mlx.decode.recurrent import finish_rows, rows_view
from omnidraft_mlx.decode.tree import TokenTree

log = logging.getLogger("omnidraft.layouts")
MASK_LAYOUTS = ("4d", "5d")  # batch mask [B, 1, L, W], or [B, 1, 1, L, W] for grouped [B, kv, groups, L, D] queries
_said: set[tuple[str, str]] = set()


def offset(c) -> int:
    """Positions a layer's cache holds (a CacheList's: its first attention cache's; 0 for state alone)."""
    if hasattr(c, "offset"):
        return c.offset
    return next((offset(s) for s in getattr(c, "caches", ()) if hasattr(s, "offset") or hasattr(s, "caches")), 0)


def say_once(model, what: str, level: int = logging.WARNING) -> None:
    key = (family(model), what)
    if key not in _said:
        _said.add(key)
        log.log(level, "%s: %s", *key)


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


def fit_tree(model, cache: list, tree: TokenTree) -> TokenTree:
    """The tree as this target verifies it: cut to its main chain where a branch's recurrent state
    would depend on its own path, or where the caches take no tree's keys (chains_forward places
    them by hand) and attention takes no tree."""
    if tree.is_chain:
        return tree
    if is_recurrent(cache):
        say_once(model, "this target has recurrent layers: its drafts are verified as chains, not trees", logging.INFO)
        return tree.main_chain()
    if not all(isinstance(c, KVCache) for c in cache) and not takes_trees(model):
        say_once(model, "draft trees are cut to their main chain (its caches take no tree's keys)")
        return tree.main_chain()
    return tree


def _check_fits(model, cache: list, tree: TokenTree) -> None:
    if fit_tree(model, cache, tree) != tree:
        raise ValueError("this target verifies only the tree's main chain: verify the tree fit_tree gives")


def tree_forward(model, cache: list, root: int, tree: TokenTree) -> mx.array:
    """The target's logits for each row of [root, *tree.tokens], written into its cache; a chain
    takes the plain path, a model that takes no trees one path per leaf. The tree must be one the
    target verifies (fit_tree). On an exception the caches hold what they held before."""
    _check_fits(model, cache, tree)
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


def chains_forward(model, cache: list, root: int, tree: TokenTree) -> mx.array:
    """tree_forward's result, from one plain forward per root-to-leaf path: each node's logits and
    keys/values are those of its own path; the cache (KVCaches: their keys are placed by hand) ends
    holding [root, *tree.tokens] in order."""
    start, n = cache[0].offset, len(tree.tokens) + 1
    rows: list = [None] * n
    kv: list = [[None] * n for _ in cache]
    leaves = [i for i in range(len(tree.tokens)) if not tree.children(i)] or [-1]
    for leaf in leaves:
        path = tree.path(leaf)
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


def forward_tree(model, slot: KVSlot, root: int, tree: TokenTree) -> mx.array:
    """The model's logits after the root and after each of the tree's nodes (tree_forward), the
    root and the nodes written into the slot."""
    out = tree_forward(model, slot.cache, root, tree)
    slot.tokens += [root, *tree.tokens]
    return out


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


def batch_forward(model, slots: list[KVSlot], roots: list[int], trees: list[TokenTree], layout: str) -> list:
    """One forward over every slot's root and tree, its mask in the given layout (the trees: ones
    their slots verify, fit_tree); afterwards each slot holds what forward_tree leaves."""
    for slot, tree in zip(slots, trees):
        _check_fits(model, slot.cache, tree)
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


def _probe_trees(model) -> bool:
    a, b, c, d, e, f, root = _probe_ids(model, 7, 1)
    tree = TokenTree.of([a, b, c], [[d, e], [a, f]])
    cache = make_cache(model)
    if not all(isinstance(layer, KVCache) for layer in cache):
        return False  # no reference: chains_forward places keys in KVCaches only
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
    """Does a tree forward (tree_attention) give each node the logits of its own path?"""
    ok = _remembered(model, "trees", _probe_trees)
    if not ok:
        say_once(
            model,
            "draft trees are verified as chains, one forward per branch (its positions or masks "
            "are not the ones omnidraft hands to attention)",
        )
    return bool(ok)


def _probe_batch(model) -> str | None:
    trees = [TokenTree.of(_probe_ids(model, 3, 3)), TokenTree.of(_probe_ids(model, 1, 4))]
    if takes_trees(model):
        trees[0] = trees[0].add(_probe_ids(model, 2, 5))
    slots, roots = [KVSlot.fresh(model), KVSlot.fresh(model)], _probe_ids(model, 2, 6)
    for slot, n in zip(slots, (4, 6)):
        slot.extend(model, _probe_ids(model, n, 7))
    want = []
    for slot, root, tree in zip(slots, roots, trees):
        want.append(forward_tree(model, slot, root, tree))
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
