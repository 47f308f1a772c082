"""The online n-gram cache: runs of draft tokens that spell one target token.

Many target tokens are several draft tokens long ('flake' = 'fl' + 'ake').
Without this cache the target would reject such runs in favour of its own
merged token. Entries are learned from verified text, bounded in number with
least-frequently-used eviction, and saved atomically so they survive runs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from omnidraft_mlx.atomic import atomic_write_text


class NGramCache:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.entries: dict[tuple[int, ...], int] = {}  # draft ids -> target id
        self.uses: dict[tuple[int, ...], int] = {}  # lookups that proposed it (LFU)
        self.by_first: dict[int, list[tuple[int, ...]]] = defaultdict(list)  # longest first
        self.hits = 0  # proposals made from the cache in this process

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, draft_ids: tuple[int, ...], target_id: int) -> None:
        if len(draft_ids) < 2 or draft_ids in self.entries:
            return
        if len(self.entries) >= self.capacity:
            self._evict()
        self.entries[draft_ids] = target_id
        self.uses[draft_ids] = 0
        bucket = self.by_first[draft_ids[0]]
        bucket.append(draft_ids)
        bucket.sort(key=len, reverse=True)

    def _evict(self) -> None:
        victim = min(self.uses, key=self.uses.__getitem__)
        del self.entries[victim], self.uses[victim]
        self.by_first[victim[0]].remove(victim)

    def match(self, draft_ids: list[int], start: int) -> tuple[int, ...] | None:
        """Longest cached n-gram that draft_ids[start:] begins with."""
        for gram in self.by_first.get(draft_ids[start], ()):
            if tuple(draft_ids[start : start + len(gram)]) == gram:
                return gram
        return None

    def is_open_prefix(self, draft_ids: list[int], start: int) -> bool:
        """Whether draft_ids[start:] is a strict prefix of some cached n-gram."""
        tail = tuple(draft_ids[start:])
        return any(
            len(g) > len(tail) and g[: len(tail)] == tail for g in self.by_first.get(tail[0], ())
        )

    def record_use(self, gram: tuple[int, ...]) -> None:
        self.uses[gram] += 1
        self.hits += 1

    def save(self, path: str | Path) -> None:
        rows = [[list(g), t, self.uses[g]] for g, t in self.entries.items()]
        atomic_write_text(path, json.dumps({"capacity": self.capacity, "entries": rows}))

    @classmethod
    def load(cls, path: str | Path) -> "NGramCache":
        data = json.loads(Path(path).read_text())
        cache = cls(data["capacity"])
        for gram, target_id, uses in data["entries"]:
            cache.add(tuple(gram), target_id)
            cache.uses[tuple(gram)] = uses
        return cache
