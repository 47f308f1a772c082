"""KV caches that speculation can roll back, and reuse of a cached prefix.

A speculative round writes draft positions into a model's cache and removes the
rejected ones again; a trim that trims less than asked leaves rejected tokens in
the cache and silently breaks losslessness, so every trim here is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from omnidraft_mlx.anatomy import hidden_states
from omnidraft_mlx.decode.recurrent import StepsCache, layers, steps_caches
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.vocab.align import common_prefix

PREFILL_CHUNK = 512


def attention_window(c, offset: int, window_size: int | None) -> int | None:
    """The keys a query sees in a layer: the window the model asks for, but past the prompt never
    more than a sliding-window cache's size (a rotating cache holds no more; mlx-lm's plamo3 asks
    for one more than it keeps)."""
    own = getattr(c, "window", None)
    return min(window_size or own, own) if own and offset else window_size or own


class WindowedKVCache(KVCache):
    """A sliding-window layer's cache that keeps every position.

    mlx-lm's RotatingKVCache overwrites positions older than the window, so once
    a reply passes the window it cannot remove rejected draft tokens. This one
    keeps them all (any trim is exact) and its mask limits attention to the
    window, so the layer sees the same keys a rotating cache would hold."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = attention_window(self, self.offset, window_size)
        if self.offset + N <= window and not return_array:
            return "causal" if N > 1 else None  # the whole history fits in the window
        return create_causal_mask(N, self.offset, window_size=window)


def _rollbackable(c):
    # keep > 0 (attention sinks) has no windowed equivalent: left as is, its trims fail loudly.
    return WindowedKVCache(c.max_size) if type(c) is RotatingKVCache and not c.keep else c


def make_cache(model) -> list:
    """A fresh per-layer cache for `model` that rolls back: the model's own,
    with sliding-window layers kept whole (WindowedKVCache) and recurrent layers
    keeping their recent states (recurrent.StepsCache)."""
    return [_rollbackable(c) for c in steps_caches(make_prompt_cache(model), model)]


def _can_trim(c, n: int) -> bool:
    return all(s.can_trim(n) if isinstance(s, StepsCache) else s.is_trimmable() for s in layers(c))


def is_recurrent(cache: list) -> bool:
    return any(isinstance(s, StepsCache) for c in cache for s in layers(c))


def trim_cache(cache: list, n: int) -> None:
    """Remove the last n positions from every layer, or fail loudly."""
    if n <= 0:
        return
    stuck = sorted({type(s).__name__ for c in cache for s in layers(c) if not _can_trim(s, n)})
    if "StepsCache" in stuck:
        raise OmniDraftError(f"a recurrent layer's state cannot go back {n} positions (it keeps its recent ones only)")
    if stuck:
        raise OmniDraftError(
            f"this model's {'/'.join(stuck)} layers cannot roll back rejected draft tokens "
            "(recurrent or rotated state): use plain decoding (--model) for it"
        )
    for c in cache:
        trimmed = c.trim(n)
        if trimmed != n:
            raise OmniDraftError(f"a KV cache could not roll back {n} positions (trimmed {trimmed})")


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


def prefill(model, cache: list, ids: list[int], rows: int = 0) -> mx.array | None:
    """Feed ids through model into cache (in chunks); final hidden state of the last position,
    or (rows > 0, at most a chunk) of each of the last `rows` positions."""
    hidden = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        hidden = hidden_states(model, mx.array(ids[start : start + PREFILL_CHUNK])[None], cache)[0]
        hidden = hidden[-rows:] if rows else hidden[-1]
        mx.eval(hidden)
    return hidden


@dataclass
class KVSlot:
    """A model's cache and the token ids it holds, in order."""

    cache: list
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def fresh(cls, model) -> KVSlot:
        return cls(make_cache(model))

    def common_prefix(self, ids: list[int]) -> int:
        return common_prefix(self.tokens, ids)

    def rewind(self, n: int) -> None:
        """Keep the first n tokens; a recurrent state that cannot go back that far starts
        afresh (no tokens: the callers feed what is missing)."""
        back = len(self.tokens) - n
        if back > 0 and is_recurrent(self.cache) and not all(_can_trim(c, back) for c in self.cache):
            for s in (s for c in self.cache for s in layers(c)):
                s.reset() if isinstance(s, StepsCache) else s.trim(s.offset)
            self.tokens.clear()
            return
        trim_cache(self.cache, len(self.tokens) - n)
        del self.tokens[n:]

    def extend(self, model, ids: list[int], rows: int = 0) -> mx.array | None:
        """Feed ids after what the cache holds; the last position's hidden state (prefill's rows)."""
        self.tokens += ids
        return prefill(model, self.cache, ids, rows)

    def keep_path(self, tree: TokenTree, path: list[int]) -> None:
        """After a forward over the root and the tree (layouts.forward_tree): keep the root and the
        accepted path's nodes, in order."""
        start = len(self.tokens) - len(tree.tokens)
        keep_path(self.cache, start, path)
        self.tokens[start : start + len(path)] = [tree.tokens[i] for i in path]
        trim_cache(self.cache, len(self.tokens) - start - len(path))  # within the forward just made, or loudly
        del self.tokens[start + len(path) :]

    def reuse(self, model, ids: list[int], keep_last: int = 0) -> mx.array | None:
        """Make the cache hold exactly ids: keep the common prefix, feed the rest.
        keep_last > 0 feeds at least that many tokens (to get their hidden state)."""
        self.rewind(min(self.common_prefix(ids), len(ids) - keep_last))
        return self.extend(model, ids[len(self.tokens) :])
