"""Atomic, durable writes: a file is either the old version or the complete new one, and once
a write returns, the new one survives a crash or a power cut (its data and its directory entry
are synced)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from omnidraft_mlx.errors import OmniDraftError


def durable_replace(src: str | Path, dst: str | Path) -> None:
    """Rename a synced file over dst, then sync the directory so the rename itself is on disk."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        durable_replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise OmniDraftError(
                f"disk full while saving {path}: free some space; the previous version is intact"
            ) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
