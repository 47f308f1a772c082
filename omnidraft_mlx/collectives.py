"""The ranks `mlx.launch` started and the collectives between them, on MLX's own engine
(mx.distributed): what adaptation shares between ranks (learn/distributed.py) and what a target
split over ranks shares each round (decode/ranks.py). Outside a launcher the group has one rank
and every collective is the identity. Collectives run on the CPU stream (the ring backend has no
GPU kernels).
"""

from __future__ import annotations

import atexit
import io
import itertools
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map


def world() -> mx.distributed.Group:
    """The group mlx.launch set up (a single rank when not launched)."""
    return mx.distributed.init()


def all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu) if group.size() > 1 else x


class LostRank(RuntimeError):
    """A rank of the group has ended: what the collectives gave since cannot be trusted."""


_checks = itertools.count(1)


def check_ranks(group: mx.distributed.Group) -> None:
    """Raise LostRank unless every rank is still there. When a rank ends, MLX's ring backend
    fails the collectives under way, but some of them return whatever their buffers held instead
    of raising: a check after them keeps that from being used (a gather) or saved (an update).
    Every rank calls it as often, so each check's number is the same on every rank."""
    if group.size() == 1:
        return
    n = next(_checks)
    try:
        rows = np.array(mx.distributed.all_gather(mx.array([[group.rank(), n]]), group=group, stream=mx.cpu))
    except RuntimeError as e:
        raise LostRank(f"a rank has ended ({e})") from e
    if rows.tolist() != [[r, n] for r in range(group.size())]:
        raise LostRank("a rank has ended (a collective came back with what its buffer held)")


def lost_a_rank(error: BaseException) -> bool:
    """Whether an error says a rank of the group has ended (ours, or MLX's backend failing a collective)."""
    return isinstance(error, LostRank) or (
        isinstance(error, RuntimeError) and str(error).startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]"))
    )


def all_gather_bytes(data: bytes, group: mx.distributed.Group) -> list[bytes]:
    """Every rank's bytes, in rank order."""
    if group.size() == 1:
        return [data]
    sizes = np.array(mx.distributed.all_gather(mx.array([len(data)]), group=group, stream=mx.cpu)).tolist()
    check_ranks(group)
    padded = np.zeros(max(sizes) or 1, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(padded)[None], group=group, stream=mx.cpu))
    check_ranks(group)
    return [rows[r, :n].tobytes() for r, n in enumerate(sizes)]


def gather_arrays(arrays: dict[str, np.ndarray], group: mx.distributed.Group) -> list[dict[str, np.ndarray]]:
    """Every rank's named numpy arrays, in rank order (serialised as .npz)."""
    if group.size() == 1:
        return [arrays]
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    out = []
    for data in all_gather_bytes(buf.getvalue(), group):
        with np.load(io.BytesIO(data)) as f:
            out.append({k: f[k] for k in f.files})
    return out


def gather_rows(rows: dict[int, np.ndarray], group: mx.distributed.Group) -> dict[int, np.ndarray]:
    """Arrays keyed by global index, each held by one rank: all of them, on every rank."""
    if group.size() == 1:
        return dict(rows)
    return {int(k): v for part in gather_arrays({str(i): a for i, a in rows.items()}, group) for k, v in part.items()}


def broadcast_bytes(data: bytes, group: mx.distributed.Group) -> bytes:
    """Rank 0's bytes on every rank (a sum where the other ranks add zeros)."""
    if group.size() == 1:
        return data
    mine = data if group.rank() == 0 else b""
    size = int(all_sum(mx.array(len(mine)), group).item())
    buf = np.zeros(max(size, 1), np.uint8)
    buf[: len(mine)] = np.frombuffer(mine, np.uint8)
    return np.array(all_sum(mx.array(buf), group))[:size].tobytes()


def share_folder(path: Path, group: mx.distributed.Group) -> Path:
    """Rank 0's `path` (its plain files) on every rank: the other ranks get a copy in a
    temporary folder, so ranks on other machines start from rank 0's profile."""
    if group.size() == 1:
        return path
    buf = io.BytesIO()
    if group.rank() == 0:
        files = [f for f in path.iterdir() if f.is_file() and not f.name.startswith(".")] if path.is_dir() else []
        np.savez(buf, **{f.name: np.frombuffer(f.read_bytes(), np.uint8) for f in files})
    data = broadcast_bytes(buf.getvalue(), group)
    if group.rank() == 0:
        return path
    copy = Path(tempfile.mkdtemp(prefix=f"omnidraft-rank{group.rank()}-"))
    atexit.register(shutil.rmtree, copy, True)
    with np.load(io.BytesIO(data)) as arrays:
        for name in arrays.files:
            (copy / name).write_bytes(arrays[name].tobytes())
    return copy


def share_tree(tree, group: mx.distributed.Group):
    """Rank 0's arrays of a tree (weights, optimizer state) on every rank: every rank must
    hold one of the same structure (a sum where the other ranks add zeros)."""
    if group.size() == 1:
        return tree
    lead = group.rank() == 0
    tree = tree_map(lambda a: all_sum(a if lead else mx.zeros_like(a), group), tree)
    mx.eval(tree)
    return tree


# After a stop signal, a main thread inside one call this long waits on a rank that has ended (a
# rank's longest call, a prefill or a drafter update's slice, takes seconds).
STUCK_S = float(os.environ.get("OMNIDRAFT_STUCK_S", "60"))


@contextmanager
def handle_signals(
    handler: Callable, signals: tuple[int, ...], group: mx.distributed.Group, say: Callable[[str], None]
) -> Iterator[None]:
    """`handler` for `signals` inside the block; under mlx.launch, a rank that cannot stop ends.
    When a rank ends, mlx.launch sends SIGTERM to the others, and one waiting in a collective with
    the rank that ended may wait for ever (MLX's ring backend does not always fail it), before
    the handler or after it. Python handlers run only when the main thread comes back from MLX, so
    a signal also wakes a thread (signal.set_wakeup_fd); from then on it ends the process, saying
    why, once the main thread stays inside one call for STUCK_S. What was saved is kept: saves
    are atomic, and an update is checked before it is saved (check_ranks)."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    if group.size() == 1:
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        return
    wake, woken = socket.socketpair()
    wake.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    done = threading.Event()
    threading.Thread(target=_end_when_stuck, args=(wake, woken, signals, done, group, say), daemon=True).start()
    try:
        yield
    except BaseException:
        # Left by an error (a lost rank, a second Ctrl-C), this rank is ending. mlx.launch sends the
        # other ranks SIGTERM when one ends, often while they unwind the error that caused: its default
        # action would end this rank before it said why. Signals now do nothing but wake the watcher,
        # which still ends a rank stuck on its way out.
        for sig in previous:
            signal.signal(sig, lambda signum, frame: None)
        raise
    else:
        signal.set_wakeup_fd(previous_fd)  # before the watcher closes its end (done)
        done.set()
        wake.close()
        for sig, old in previous.items():
            signal.signal(sig, old)


def _end_when_stuck(wake: socket.socket, woken: socket.socket, signals, done: threading.Event, group, say) -> None:
    """Once one of `signals` arrives (its byte on `woken`), end the process if the main thread stays in
    one call for STUCK_S; `wake`, the end signal.set_wakeup_fd writes to, is held open until then."""
    with wake, woken:  # open while the wakeup fd may be written to (a further signal): a closed one fails the write
        while (data := woken.recv(64)) and not any(s in signals for s in data):
            pass
        main, seen, since = threading.main_thread().ident, None, time.monotonic()
        while not done.wait(0.5):
            frame = sys._current_frames().get(main)
            if frame is None:
                return
            if seen is None or frame is not seen[0] or frame.f_lasti != seen[1]:
                seen, since = (frame, frame.f_lasti), time.monotonic()
            elif time.monotonic() - since > STUCK_S:
                say(
                    f"rank {group.rank()}: stopping, but this rank has waited {STUCK_S:g} s in one call (on a rank "
                    "that has ended?): ending now; what was saved is kept"
                )
                os._exit(1)
