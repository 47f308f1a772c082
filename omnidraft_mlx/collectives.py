"""The ranks `mlx.launch` started and the collectives between them, on MLX's own engine
(mx.distributed): what adaptation shares between ranks (learn/distributed.py) and what a target
split over ranks shares each round (decode/ranks.py). Outside a launcher the group has one rank
and every collective is the identity. Collectives run on the CPU stream (the ring backend has no
GPU kernels).
"""

from __future__ import annotations

import atexit
import io
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map


def world() -> mx.distributed.Group:
    """The group mlx.launch set up (a single rank when not launched)."""
    return mx.distributed.init()


def all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu) if group.size() > 1 else x


def all_gather_bytes(data: bytes, group: mx.distributed.Group) -> list[bytes]:
    """Every rank's bytes, in rank order."""
    if group.size() == 1:
        return [data]
    sizes = np.array(mx.distributed.all_gather(mx.array([len(data)]), group=group, stream=mx.cpu)).tolist()
    padded = np.zeros(max(sizes) or 1, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(padded)[None], group=group, stream=mx.cpu))
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
