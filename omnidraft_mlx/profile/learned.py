"""What a pair learns besides the drafter's weights, as parts of its profile,
and keeping that state whole when Ctrl-C lands while it changes.

A part (the n-gram cache, the acceptance head, ...) is any object with
- save(path): write its whole state atomically; what was saved counts as shared from then on;
- merge(other): become `other` (the same part as another process saved it) plus what this
  one learned since it was loaded or last saved (a part tracks that itself);
and a reader, read(path) -> a copy of the part as saved there. The profile
(omnidraft_mlx/profile.py) loads, merges and saves every part the same way,
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
    obj: Any  # has save(path) and merge(other)
    suffix: str  # its file's ending, e.g. ".json"
    read: Callable[[Path], Any]  # a copy of the part as saved at a path


_held = 0  # depth of nested deferred_interrupt blocks in the main thread


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends,
    then deliver it, so learned state is never left half-updated. Only the main
    thread receives signals: elsewhere, when nested, or under a handler Python did
    not install, this does nothing."""
    global _held
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
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
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    _held = 1
    try:
        yield
    finally:
        _held = 0
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # to the handler that was there (KeyboardInterrupt by default)
