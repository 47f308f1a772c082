"""What a drafter/target pair learns from use, kept on disk between runs."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from omnidraft_mlx.ngram import NGramCache


def _slug(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name.rstrip("/")).name)[:40]
    return f"{base}-{hashlib.sha1(name.encode()).hexdigest()[:6]}" if ("/" in name) else base


def profile_dir(draft: str, target: str) -> Path:
    from omnidraft_mlx.models.pull import model_home

    return model_home() / "profiles" / f"{_slug(draft)}__{_slug(target)}"


def load_ngrams(draft: str, target: str) -> NGramCache:
    path = profile_dir(draft, target) / "ngrams.json"
    return NGramCache.load(path) if path.exists() else NGramCache()


def save_ngrams(draft: str, target: str, cache: NGramCache) -> None:
    cache.save(profile_dir(draft, target) / "ngrams.json")
