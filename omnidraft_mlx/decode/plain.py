"""Plain (non-speculative) generation: the reference every speedup is measured against."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import make_sampler

from omnidraft_mlx.decode.ranks import ranks_of


@dataclass
class PlainStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # time to the first token
    generate_s: float = 0.0  # after the first token
    emitted: int = 0

    @property
    def tokens_per_s(self) -> float:
        # The first token comes out of prefill; throughput counts the rest.
        return (self.emitted - 1) / self.generate_s if self.generate_s and self.emitted > 1 else 0.0


def plain_generate(
    model,
    tokenizer,
    prompt_ids: list[int],
    stats: PlainStats,
    temp: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 256,
    seed: int = 0,
    prompt_cache: list | None = None,
) -> Iterator[int]:
    """Yield the target's own tokens one by one (mlx-lm's generate_step), stopping at eos.
    Given a prompt_cache, prompt_ids are what follows the tokens it holds."""
    mx.random.seed(seed)
    # A target split over ranks decodes the lead's draws (decode/ranks.py).
    sampler = ranks_of(model).sampler(make_sampler(temp, top_p if 0 < top_p < 1 else 0.0))
    eos = set(tokenizer.eos_token_ids)
    stats.prompt_tokens = len(prompt_ids)
    start = time.perf_counter()
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=sampler, prompt_cache=prompt_cache
    )
    try:
        for token, _ in steps:
            token = int(token)
            now = time.perf_counter()
            if stats.emitted == 0:
                stats.prefill_s = now - start
            else:
                stats.generate_s = now - start - stats.prefill_s
            if token in eos:
                break
            stats.emitted += 1
            yield token
    finally:
        # generate_step computes a step ahead on its own stream; across ranks that step's collectives
        # would run beside the next ones on the default stream, in another order on each rank.
        mx.synchronize(generation_stream)
