"""Adaptation over several processes or machines on MLX's own engine (mx.distributed).

`mlx.launch -n 2 --backend ring -- omnidraft adapt ...` starts the ranks (collectives.py
shares between them). A corpus is consumed in updates of consecutive global prompts; each
update's prompts are cut into the drafter's gradient batches and every batch is shared round
robin between the ranks (`shard`). So the position saved in the profile is global, and a
resumed run may use another number of ranks.
"""

from __future__ import annotations


def shard(start: int, stop: int, batch: int, rank: int, size: int) -> list[list[int]]:
    """Global prompt indices [start, stop) cut into gradient batches of `batch`,
    then this rank's members of each batch (every size-th one)."""
    return [list(range(b + rank, min(b + batch, stop), size)) for b in range(start, stop, batch)]
