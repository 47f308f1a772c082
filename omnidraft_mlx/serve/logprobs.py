"""The target's own log-probabilities of the tokens it emitted, in OpenAI's shape.

They come from the verification forward that chose each token (speculative.py
hands each round's logits to a callback), unchanged by temperature or top_p, so
a drafted token's log-probability is the target's as much as any other's. One
entry per completion token (usage.completion_tokens), each with its text, bytes
and, if asked, the target's `top` likeliest tokens at that position.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

FLOOR = -9999.0  # what OpenAI sends for a log-probability of minus infinity (JSON has no -inf)


def token_logprobs(rows: mx.array, ids: list[int], top: int, token_bytes: Callable[[int], bytes]) -> list[dict]:
    """choices[0].logprobs.content entries for `ids`, chosen by the logits `rows` (a row each)."""
    if not ids:  # the round ended the reply (its token was the end of sequence)
        return []
    logprobs = rows.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(ids)[:, None], axis=-1)[:, 0].tolist()
    alternatives = [[] for _ in ids]
    if top:
        best = mx.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(logprobs, best, axis=-1)
        alternatives = [sorted(zip(v, b), reverse=True) for v, b in zip(values.tolist(), best.tolist())]
    return [
        {**entry(t, lp, token_bytes), "top_logprobs": [entry(b, v, token_bytes) for v, b in alt]}
        for t, lp, alt in zip(ids, chosen, alternatives)
    ]


def entry(token: int, logprob: float, token_bytes: Callable[[int], bytes]) -> dict:
    raw = token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, FLOOR), "bytes": list(raw)}
