"""The online n-gram cache: runs of draft tokens that spell one target token.

Many target tokens are several draft tokens long ('flake' = 'fl' + 'ake').
Without this cache the target would reject such runs in favour of its own
merged token. Entries are learned from verified text, bounded in number with
least-frequently-used eviction, and saved atomically so they survive runs.
A cache tracks what it learned since it was loaded or saved (new entries,
lookups), so that merging it with a copy another process saved keeps both
(a part of the pair's profile: omnidraft_mlx/profile/learned.py).
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from pathlib import Path

from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.profile.learned import deferred_interrupt


class NGramCache:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.entries: dict[tuple[int, ...], int] = {}  # draft ids -> target id
        self.uses: dict[tuple[int, ...], int] = {}  # lookups that proposed it (LFU)
        self.by_first: dict[int, list[tuple[int, ...]]] = defaultdict(list)  # longest first
        self.hits = 0  # proposals made from the cache in this process
        self.fresh: set[tuple[int, ...]] = set()  # entries added since loaded or saved
        self.used: Counter = Counter()  # lookups since loaded or saved

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def changed(self) -> bool:
        """Learned anything since loaded or saved (a profile save skips it otherwise)."""
        return bool(self.fresh or self.used)

    def add(self, draft_ids: tuple[int, ...], target_id: int) -> None:
        if len(draft_ids) < 2 or draft_ids in self.entries:
            return
        with deferred_interrupt():  # the entry, its count and its bucket change together
            if len(self.entries) >= self.capacity:
                self._evict(len(self.entries) - self.capacity + 1)
            self._insert(draft_ids, target_id, 0)
            self.fresh.add(draft_ids)

    def _insert(self, gram: tuple[int, ...], target_id: int, uses: int) -> None:
        self.entries[gram] = target_id
        self.uses[gram] = uses
        bucket = self.by_first[gram[0]]
        bucket.append(gram)
        bucket.sort(key=len, reverse=True)

    def _evict(self, n: int) -> None:
        """Drop the n least used entries."""
        for victim in heapq.nsmallest(n, self.uses, key=self.uses.__getitem__):
            del self.entries[victim], self.uses[victim]
            self.by_first[victim[0]].remove(victim)
            self.fresh.discard(victim)
            self.used.pop(victim, None)

    def match(self, draft_ids: list[int], start: int) -> tuple[int, ...] | None:
        """Longest cached n-gram that draft_ids[start:] begins with."""
        for gram in self.by_first.get(draft_ids[start], ()):
            if tuple(draft_ids[start : start + len(gram)]) == gram:
                return gram
        return None

    def is_open_prefix(self, draft_ids: list[int], start: int) -> bool:
        """Whether draft_ids[start:] is a strict prefix of some cached n-gram."""
        tail = tuple(draft_ids[start:])
        return any(len(g) > len(tail) and g[: len(tail)] == tail for g in self.by_first.get(tail[0], ()))

    def record_use(self, gram: tuple[int, ...]) -> None:
        with deferred_interrupt():
            self.uses[gram] += 1
            self.used[gram] += 1
            self.hits += 1

    def merge(self, other: NGramCache) -> None:
        """Become `other` (this cache as another process saved it) plus what this one
        learned since it was loaded or saved: its new entries, and its lookups added
        to the saved counts; least used entries go past the capacity."""
        with deferred_interrupt():
            fresh = {g: self.entries[g] for g in self.fresh}
            self.entries, self.uses, self.by_first = {}, {}, defaultdict(list)
            for gram, target_id in other.entries.items():
                self._insert(gram, target_id, other.uses[gram] + self.used.get(gram, 0))
            for gram, target_id in fresh.items():
                if gram not in self.entries:
                    self._insert(gram, target_id, self.used.get(gram, 0))
            self.used = Counter({g: n for g, n in self.used.items() if g in self.entries})
            if len(self.entries) > self.capacity:
                self._evict(len(self.entries) - self.capacity)

    def save(self, path: str | Path) -> None:
        rows = [[list(g), t, self.uses[g]] for g, t in self.entries.items()]
        atomic_write_text(path, json.dumps({"capacity": self.capacity, "entries": rows}))

    def mark_saved(self) -> None:
        """What was saved is shared from now on (the profile calls it once its manifest names the file)."""
        self.fresh, self.used = set(), Counter()

    @classmethod
    def load(cls, path: str | Path) -> NGramCache:
        data = json.loads(Path(path).read_text())
        cache = cls(data["capacity"])
        for gram, target_id, uses in data["entries"]:
            if len(gram) >= 2 and tuple(gram) not in cache.entries:
                cache._insert(tuple(gram), target_id, uses)
        return cache
