"""What verifying each draft length costs this target on this machine, measured once per
model shape and machine and kept on disk (the weights' values do not change it; their
shapes, dtype, the device and the MLX build do). Measured when the pair opens
(loading.open_pair), never inside a reply, and quickly: a few lengths, one forward each (a
second for a length that came out slower than a longer one), the lengths between interpolated.
The loop refines it from its own rounds (fit.VerifyCost), but only for the lengths it
verifies: a length measured too slow is never tried, so one slow pass would price it for good."""

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

MOST = 16  # draft lengths priced: 0..MOST (a lookup's first draft is 8; doubled, 16)
MEASURED = (0, 1, 2, 4, 8, 15, 16)  # forwarded (15: a BLAS block of 16 rows, often a dip); others interpolated
PREFIX = 64  # tokens in the cache before the measured forwards (a prompt's worth of attention)
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
        "measured": "bumps again",  # curves measured another way are measured again
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def measure(model, lengths=MEASURED) -> dict[int, float]:
    """Seconds of a target forward over y + n draft tokens after PREFIX tokens, for every n in
    0..MOST: one forward for each of `lengths`, a second (the faster kept) for a length slower
    than a longer one (a burst of other work, or a real bump: either way worth a second look, since
    a length priced too high is never tried), the others interpolated linearly between their
    measured neighbours. 7 to 13 forwards where two or three passes took 14 to 21: a forward of the
    0.5B target takes ~0.2 s on a 2-core CPU, and a new machine's first run pays them."""
    slot = KVSlot.fresh(model)
    slot.extend(model, [0] * PREFIX)  # its forward also allocates: the passes below run warm

    def forward(n: int) -> float:
        x = mx.array([[0] * (n + 1)])
        start = time.perf_counter()
        mx.eval(model(x, cache=slot.cache).argmax(axis=-1))
        seconds = time.perf_counter() - start
        trim_cache(slot.cache, n + 1)
        return seconds

    seconds = {n: forward(n) for n in lengths}
    for n in lengths:
        if any(seconds[n] > seconds[m] for m in lengths if m > n):
            seconds[n] = min(seconds[n], forward(n))
    return interpolate(seconds)


def interpolate(measured: dict[int, float]) -> dict[int, float]:
    """Every length 0..MOST: a measured one's seconds, or the line between the measured lengths
    either side (monotone between them: no dip or bump that was not measured)."""
    known = sorted(measured)
    curve = {}
    for n in range(MOST + 1):
        lo = max((m for m in known if m <= n), default=known[0])
        hi = min((m for m in known if m >= n), default=known[-1])
        share = (n - lo) / (hi - lo) if hi != lo else 0.0
        curve[n] = measured[lo] + share * (measured[hi] - measured[lo])
    return curve


def saved_costs(model) -> dict[int, float] | None:
    """The curve measured for this model here, from disk (None: not measured yet)."""
    try:
        saved = json.loads(costs_path().read_text())
    except (OSError, ValueError):
        return None
    curve = saved.get(shape_key(model)) if isinstance(saved, dict) else None
    return {int(n): s for n, s in curve.items()} if curve else None


def verify_costs(model) -> dict[int, float]:
    """The measured curve for this model here: from disk, or measured now and saved."""
    if (seconds := saved_costs(model)) is not None:
        return seconds
    log.info("measuring what verifying 0-%d draft tokens costs (once for this model here)", MOST)
    seconds = measure(model)
    path = costs_path()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    try:
        atomic_write_text(path, json.dumps({**saved, shape_key(model): seconds}))
    except (OSError, OmniDraftError) as e:  # a cache: decoding goes on without it
        log.warning("could not save %s: %s", path, e)
    return seconds
