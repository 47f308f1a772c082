"""What verifying each draft length costs this target on this machine: the
fastest of PASSES forwards per length, measured once per model shape and machine
and kept on disk (the weights' values do not change it; their shapes, dtype, the
device and the MLX build do). The loop refines it from its own rounds
(fit.VerifyCost), but only for the lengths it verifies: a length measured too
slow is never tried, so one slow pass would price it for good."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import mlx.core as mx

from omnidraft_mlx.anatomy import settings
from omnidraft_mlx.decode.kvcache import KVSlot, trim_cache
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.paths import model_home
from omnidraft_mlx.profile.atomic import atomic_write_text

MOST = 16  # draft lengths measured: 0..MOST (a lookup's first draft is 8; doubled, 16)
PASSES = 3  # over all lengths, each length's fastest kept: a burst of other work slows one pass
log = logging.getLogger("omnidraft.widths")


def costs_path() -> Path:
    return model_home() / "verify-costs.json"


def shape_key(model) -> str:
    """What the forward's cost depends on: the model's configuration, its weights' format, the machine."""
    layers = {
        f"{type(m).__name__}:{m.weight.dtype}:{getattr(m, 'bits', '')}"
        for _, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), mx.array)
    }
    parts = {
        "args": {k: v for k, v in sorted(vars(settings(model)).items()) if isinstance(v, (int, float, str, bool))},
        "format": sorted(layers),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
        "measured": f"fastest of {PASSES}",  # curves measured in one pass are measured again
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def measure(model, slot: KVSlot, lengths=range(MOST + 1)) -> dict[int, float]:
    """Seconds of a target forward over y + n draft tokens after what `slot` holds, per n: the
    fastest of PASSES; the cache is left as it was."""
    filler = (slot.tokens or [0]) * (MOST + 2)
    seconds = {}
    for n in [*lengths] * PASSES:  # the first forward allocates: slower than its next passes
        x = mx.array([filler[: n + 1]])
        start = time.perf_counter()
        mx.eval(model(x, cache=slot.cache).argmax(axis=-1))
        seconds[n] = min(seconds.get(n, float("inf")), time.perf_counter() - start)
        trim_cache(slot.cache, n + 1)
    return seconds


def verify_costs(model, slot: KVSlot) -> dict[int, float]:
    """The measured curve for this model here: from disk, or measured now and saved."""
    path, key = costs_path(), shape_key(model)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if key in saved:
        return {int(n): s for n, s in saved[key].items()}
    log.info("measuring what verifying 0-%d draft tokens costs (once for this model here)", MOST)
    seconds = measure(model, slot)
    try:
        atomic_write_text(path, json.dumps({**saved, key: seconds}))
    except (OSError, OmniDraftError) as e:  # a cache: decoding goes on without it
        log.warning("could not save %s: %s", path, e)
    return seconds
