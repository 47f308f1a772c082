"""How fast: forwards timed one way (over several widths, on ordinary text), and the speedup every
report gives (the chat's estimate, the bench's tables)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from omnidraft_mlx.decode.kvcache import trim_cache


def forward_seconds(model, x: mx.array, cache, repeats: int, trim: bool = True) -> list[float]:
    """Seconds of each of `repeats` evaluated forwards of `x` after what `cache` holds; the cache is
    trimmed back after each (trim=False: it keeps them, as decoding step after step does)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - start)
        if trim:
            trim_cache(cache, x.shape[1])
    return times


def context_ids(tokenizer, n: int) -> list[int]:
    """n token ids of ordinary English text."""
    text = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 40
    return list(tokenizer.encode(text))[:n]


def widths_ms(model, cache, ids: list[int], widths, repeats: int) -> dict[str, float]:
    """Median milliseconds of a forward over the first w of `ids` after what `cache` holds, for each
    width w (the cache trimmed back after each; one more forward first, a warm-up)."""
    ms = {}
    for w in widths:
        times = forward_seconds(model, mx.array(ids[:w])[None], cache, repeats + 1)
        ms[str(w)] = 1000 * float(np.median(times[1:]))
    return ms


def prompt_speedup(tokens_per_s: float | None, plain_tokens_per_s: float | None) -> float | None:
    """One prompt's speedup: the method's tokens/s over plain decoding's on the same prompt."""
    return tokens_per_s / plain_tokens_per_s if tokens_per_s is not None and plain_tokens_per_s else None


def speedup(rates) -> dict | None:
    """The speedup every report gives: the median of per-prompt speedups (prompt_speedup of each
    (method tokens/s, plain tokens/s) pair in `rates`), with the smallest and largest; None without any."""
    ratios = [s for tps, plain in rates if (s := prompt_speedup(tps, plain)) is not None]
    if not ratios:
        return None
    return {
        "median": float(np.median(ratios)),
        "min": float(min(ratios)),
        "max": float(max(ratios)),
        "prompts": len(ratios),
    }
