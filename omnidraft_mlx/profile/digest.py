"""Which weights a local model directory holds: a digest of its config and every byte of its
weight files, so a fine-tune of the same shape is another model to the profile. Hashing a large
model takes seconds, so each file's digest is kept (digests.json in the models' home), keyed by
its path, size and modification time, and computed again only when one of them changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omnidraft_mlx.paths import model_home
from omnidraft_mlx.profile.atomic import atomic_write_text

CHUNK = 1 << 22


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors"))


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: computed again
        return {}
    return cache if isinstance(cache, dict) else {}


def file_digest(f: Path, cache: dict) -> str:
    """sha256 of a file's bytes, from `cache` when its path, size and mtime are unchanged (else
    computed and put there)."""
    st = f.stat()
    key, stamp = str(f.resolve()), [st.st_size, st.st_mtime_ns]
    if (known := cache.get(key)) and known[:2] == stamp:
        return known[2]
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    cache[key] = [*stamp, h.hexdigest()]
    return h.hexdigest()


def weights_digest(path: Path) -> str:
    """A digest of a model directory's config and weight files (each file hashed whole, once)."""
    cache_path = model_home() / "digests.json"
    cache = _read_cache(cache_path)
    before = dict(cache)
    h = hashlib.sha256()
    for f in _files(path):
        h.update(f.name.encode() + b"\0" + file_digest(f, cache).encode())
    if cache != before:
        try:
            atomic_write_text(cache_path, json.dumps(cache, indent=0))
        except OSError:  # a read-only home: computed again next time
            pass
    return h.hexdigest()[:32]


def sampled_digest(path: Path) -> str:
    """The identity profiles recorded before weights_digest: each file's size and its first and
    last 64 KiB (still recognised, so those profiles load; their next save records the new one)."""
    h = hashlib.sha256()
    for f in _files(path):
        with open(f, "rb") as fh:
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(1 << 16))
            fh.seek(max(0, f.stat().st_size - (1 << 16)))
            h.update(fh.read())
    return h.hexdigest()[:32]
