"""What one round trip of the target costs, whole or split over the ranks of mlx.launch: a
forward over w tokens (a round verifying w - 1 drafted ones), the collectives in its graph and
what one of them costs alone. Every rank runs it together (each forward is a collective).

Speculation pays per round trip: across machines a round's collectives cost the same for 1
token as for 8 (a few KB each), so the fewer round trips a reply takes, the less it waits on
the link. The bench records it beside its methods (bench.json "round_cost").
"""

from __future__ import annotations

import io
import time

import mlx.core as mx
import numpy as np

from omnidraft_mlx.collectives import all_sum
from omnidraft_mlx.decode.kvcache import make_cache, prefill, trim_cache
from omnidraft_mlx.decode.ranks import ranks_of
from omnidraft_mlx.timing import context_ids, widths_ms

WIDTHS = (1, 2, 4, 8)
PREFIX = 64  # tokens in the cache before the timed forwards
KINDS = ("AllReduce", "AllGather", "Send", "Recv")  # MLX's distributed primitives, as mx.export_to_dot names them


def collectives(model, cache, x: mx.array) -> dict[str, int]:
    """The collectives in one forward's graph, by kind (none for a whole target)."""
    out = model(x, cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    mx.eval(out)  # every rank runs the forward it built: a pipeline's sends wait on it
    trim_cache(cache, x.shape[1])
    nodes = [line for line in dot.getvalue().splitlines() if "label" in line]
    return {kind: n for kind in KINDS if (n := sum(kind in line for line in nodes))}


def collective_ms(group, hidden: int, width: int, dtype, repeats: int) -> float:
    """One all_sum of a forward's hidden state over `width` tokens, alone: its median milliseconds."""
    x = mx.zeros((1, width, hidden), dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(all_sum(x, group))
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times[1:]))  # the first is a warm-up


def round_cost(model, tokenizer, repeats: int = 6) -> dict:
    """Per width: the forward's median milliseconds and (split) one collective's; the forward's collectives."""
    ranks = ranks_of(model)
    ids = context_ids(tokenizer, PREFIX + max(WIDTHS))
    cache = make_cache(model)
    hidden = prefill(model, cache, ids[:PREFIX])  # its width and dtype: what a forward's collectives carry
    counts = collectives(model, cache, mx.array(ids[PREFIX : PREFIX + 1])[None])
    widths = {w: {"forward_ms": ms} for w, ms in widths_ms(model, cache, ids[PREFIX:], WIDTHS, repeats).items()}
    if ranks.group is not None:
        for w, cost in widths.items():
            cost["collective_ms"] = collective_ms(ranks.group, hidden.shape[-1], int(w), hidden.dtype, repeats + 1)
    size = 1 if ranks.group is None else ranks.group.size()
    return {"ranks": size, "shard": ranks.shard, "collectives": counts, "widths": widths}
