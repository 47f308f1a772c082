"""Failpoints: named places where a test makes the process fail (or stall) on purpose, to prove
that one request's failure stays its own and that a signal or a kill loses nothing.

Off unless the environment variable OMNIDRAFT_FAILPOINTS names them, comma-separated, each
    name[@n][#marker][~seconds]
e.g. "verify" (every hit), "finish@3" (the 3rd hit only), "draft#BOOM" (hits for a request
whose text holds BOOM), "save~3" (sleep 3 s there instead of raising). The places: prefill,
draft, verify, finish, learn, update (before each slice of a drafter update) (serve/engine.py,
serve/jobs.py, learn/online.py), save (inside the profile's lock; its subject "adapter" when the
save holds a drafter update) and manifest (before the manifest is written) (profile/store.py).
Off, a failpoint costs a dict lookup.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

ENV = "OMNIDRAFT_FAILPOINTS"
_SPEC = re.compile(r"(?P<name>\w+)(?:@(?P<nth>\d+))?(?:#(?P<marker>[^~]+))?(?:~(?P<sleep>[\d.]+))?")


class FailpointError(RuntimeError):
    """Raised where a failpoint is armed (what a real fault there would raise, for the caller)."""


@dataclass
class Armed:
    nth: int | None  # only this hit (1-based) of the matching ones; None: every one
    marker: str | None  # only hits whose subject holds this text
    sleep: float | None  # stall this long instead of raising
    hits: int = 0


def _parse(spec: str) -> dict[str, Armed]:
    armed = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _SPEC.fullmatch(item)
        if m is None:
            raise ValueError(f"{ENV}: '{item}' is not name[@n][#marker][~seconds]")
        nth, sleep = m["nth"], m["sleep"]
        armed[m["name"]] = Armed(int(nth) if nth else None, m["marker"], float(sleep) if sleep else None)
    return armed


_armed = _parse(os.environ.get(ENV, ""))


def armed() -> bool:
    """Whether any failpoint is on (callers skip building a subject text otherwise)."""
    return bool(_armed)


def failpoint(name: str, subject: str = "") -> None:
    """Raise FailpointError (or stall) here if the environment arms `name` for this hit."""
    point = _armed.get(name)
    if point is None or (point.marker is not None and point.marker not in subject):
        return
    point.hits += 1
    if point.nth is not None and point.hits != point.nth:
        return
    if point.sleep is not None:
        time.sleep(point.sleep)
        return
    raise FailpointError(f"failpoint '{name}'")
