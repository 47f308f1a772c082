"""What a pair learns besides the drafter's weights, as parts of its profile,
and keeping that state whole when Ctrl-C lands while it changes.

A part (the n-gram cache, the acceptance head, ...) is any object with
- save(path): write its whole state atomically;
- mark_saved(): what it last wrote counts as shared from now on (called once the manifest
  naming that file is on disk: a save that fails before keeps the learning for the next);
- merge(other): become `other` (the same part as another process saved it) plus what this
  one learned since it was loaded or last marked saved (a part tracks that itself);
and a reader, read(path) -> a copy of the part as saved there. The profile
(profile/store.py) loads, merges and saves every part the same way,
so a new part is one `Profile.attach` call.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Part:
    obj: Any  # has save(path), mark_saved() and merge(other); `changed` (optional): learned since loaded or saved
    suffix: str  # its file's ending, e.g. ".json"
    read: Callable[[Path], Any]  # a copy of the part as saved at a path


_held = 0  # depth of nested deferred_interrupt blocks in the main thread
DEFERRED = (signal.SIGINT, signal.SIGTERM)  # `omnidraft serve` makes SIGTERM a KeyboardInterrupt too


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a SIGINT or SIGTERM that arrives inside the block until the block ends, then
    deliver it, so learned state is never left half-updated (nor saved so on the way out).
    Only the main thread receives signals: elsewhere, or when nested, this does nothing; a
    signal without a Python handler (SIGTERM's default ends the process at once, as a kill
    does) is left as it is."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    caught: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in DEFERRED if callable(signal.getsignal(sig))}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    _held = 1
    try:
        yield
    finally:
        _held = 0
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])  # to the handler that was there (KeyboardInterrupt by default)
