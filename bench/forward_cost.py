"""What one model costs here: plain decode speed and one forward over 1/4/8 tokens.

Speculative decoding wins when verifying n tokens in one target forward costs
much less than n single-token forwards, and when a drafter step is cheap next
to a target step; these two numbers per model say how much room there is.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from omnidraft_mlx.decode.kvcache import make_cache, prefill, trim_cache
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.timing import context_ids, widths_ms

CACHED = 200  # tokens already in the KV cache, as mid-generation
WIDTHS = (1, 4, 8)
DECODE_TOKENS = 32


def graph_build_ms(model, cache, x: mx.array, repeats: int) -> float:
    """Python time to build one forward's graph, not run: the most that compiling
    the step (or overlapping its building with the previous step) could save."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x, cache=cache)
        times.append(time.perf_counter() - start)
        trim_cache(cache, x.shape[1])
    mx.eval([c.state for c in cache])  # the unrun cache updates, past the trimmed offset
    return 1000 * float(np.median(times))


def forward_cost(model, tokenizer, repeats: int = 5) -> dict:
    ids = context_ids(tokenizer, CACHED + max(WIDTHS))
    cache = make_cache(model)
    prefill(model, cache, ids[:CACHED])
    forward_ms = widths_ms(model, cache, ids[CACHED:], WIDTHS, repeats)
    build_ms = graph_build_ms(model, cache, mx.array(ids[CACHED : CACHED + 1])[None], repeats)
    stats = PlainStats()
    for _ in plain_generate(model, tokenizer, ids[:CACHED], stats, max_tokens=DECODE_TOKENS):
        pass
    return {
        "cached_tokens": CACHED,
        "forward_ms": forward_ms,
        "graph_build_ms": build_ms,
        "decode_tokens": stats.emitted,
        "decode_tokens_per_s": stats.tokens_per_s,
    }


def run_forward_cost(names: list[str], progress=None) -> dict:
    """Forward cost of each named model (loaded one at a time) and the environment."""
    from omnidraft_mlx.bench.run import environment_base
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER, model_hash

    task = progress.add_task("forward cost", total=len(names)) if progress else None
    models = {}
    for name in names:
        if progress:
            progress.update(task, description=f"forward cost {name}")
        model, tokenizer = load_model(name, CATALOG_RESOLVER)
        models[name] = {"gguf_sha256": model_hash(name), **forward_cost(model, tokenizer)}
        del model
        if progress:
            progress.advance(task)
    return {"environment": environment_base(), "models": models}
