"""Prompt caching for a drafter/target pair: both models' KV caches kept between replies.

After a reply each model's cache holds its prompt and the reply. The next
prompt (the conversation so far plus a new message, or a tool resending the
same long system prompt) shares a long token prefix with something cached: the
cache of the nearest stored sequence goes to the decode loop in a KVSlot, the
loop trims it to the common prefix and prefills only the rest, and the slots it
returns (prompt + reply) are stored back. The target's output is the same as
after a fresh prefill (greedy: token for token).

mlx-lm's LRUPromptCache keeps the sequences: a trie of token ids per key,
least recently stored evicted first, bounded in bytes, so different
conversations do not evict each other at once. Each model has its own key (the
two tokenize the same text differently). A drafter update changes the drafter's
weights and so every cache it made: its key carries the update count, and the
older caches, never fetched again, age out.

Every sequence is kept under a namespace (the server's clients: one per API key): a
request reuses only what its own namespace stored, so a client cannot reuse, nor learn
from `cached_tokens`, another client's prompt. The namespaces share the byte budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from mlx_lm.models.cache import LRUPromptCache

from omnidraft_mlx.decode.drafter import draft_context
from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.policy import DraftPolicy
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_alone
from omnidraft_mlx.pair import Pair

DEFAULT_CACHE_BYTES = 2 << 30
MAX_SEQUENCES = 64  # per cache, both models together; the byte budget usually binds first


@dataclass
class CacheUse:
    """Prompt tokens whose keys and values came from the cache, in each model's tokens."""

    draft_tokens: int = 0
    target_tokens: int = 0


@dataclass
class PromptCache:
    max_bytes: int = DEFAULT_CACHE_BYTES
    drafter_version: int = 0  # bumped by drafter_changed(): caches of older weights are never reused
    lru: LRUPromptCache = field(init=False)

    def __post_init__(self):
        self.lru = LRUPromptCache(max_size=MAX_SEQUENCES, max_bytes=self.max_bytes)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    def _keys(self, namespace: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """The LRU's keys of (the drafter's, the target's) sequences in the namespace."""
        return (namespace, f"draft@{self.drafter_version}"), (namespace, "target")

    def make_room(self, n_bytes: int) -> None:
        """Keep at most n_bytes of cached prompts (least recently stored out first)."""
        self.lru.trim_to(n_bytes=n_bytes)

    def drafter_changed(self) -> None:
        self.drafter_version += 1

    def _slot(self, model, key: tuple[str, str], ids: list[int]) -> KVSlot:
        cache, rest = self.lru.fetch_nearest_cache(key, ids)
        if cache is None:
            return KVSlot.fresh(model)
        return KVSlot(cache, list(ids[: len(ids) - len(rest)]))  # a copy: the stored one stays intact

    def slots(
        self, pair: Pair, draft_ids: list[int], target_ids: list[int], namespace: str = ""
    ) -> tuple[KVSlot, KVSlot]:
        """(draft slot, target slot) holding the namespace's cached sequences nearest to these prompts."""
        draft_key, target_key = self._keys(namespace)
        return self._slot(pair.draft, draft_key, draft_ids), self._slot(pair.target, target_key, target_ids)

    def take(
        self,
        pair: Pair,
        draft_ids: list[int],
        target_ids: list[int],
        use: CacheUse | None = None,
        namespace: str = "",
    ) -> tuple[KVSlot, KVSlot]:
        """slots(), and how many prompt tokens they hold into `use`."""
        draft_ids = draft_context(draft_ids)  # what the drafter reads of its prompt
        draft_slot, target_slot = self.slots(pair, draft_ids, target_ids, namespace)
        if use is not None:
            # The loop always feeds each model its prompt's last token afresh.
            use.draft_tokens = min(draft_slot.common_prefix(draft_ids), len(draft_ids) - 1)
            use.target_tokens = min(target_slot.common_prefix(target_ids), len(target_ids) - 1)
        return draft_slot, target_slot

    def store(self, draft_slot: KVSlot, target_slot: KVSlot, namespace: str = "") -> None:
        """Keep both slots in the namespace (the cache takes them over: do not use them afterwards)."""
        for key, slot in zip(self._keys(namespace), (draft_slot, target_slot)):
            if slot.tokens:
                self.lru.insert_cache(key, list(slot.tokens), slot.cache)

    def start(
        self,
        pair: Pair,
        draft_ids: list[int],
        target_ids: list[int],
        cfg: SpecConfig,
        stats: SpecStats,
        policy: DraftPolicy | None = None,
        use: CacheUse | None = None,
        slots: tuple[KVSlot, KVSlot] | None = None,
        **options,
    ) -> Decoding:
        """A Decoding (with further `options` of its own) on slots from the cache (or `slots`,
        from take(), partly prefilled since); how many prompt tokens it reused goes into `use`.
        Give it back with finish()."""
        draft_slot, target_slot = slots or self.take(pair, draft_ids, target_ids, use)
        return Decoding(
            pair, draft_ids, target_ids, cfg, stats, policy, target_slot=target_slot, draft_slot=draft_slot, **options
        )

    def finish(self, decoding: Decoding, intact: bool = True, namespace: str = "") -> None:
        """Close the decoding and keep its slots in the namespace it took them from: only when
        `intact` (an exception inside a round may leave a cache out of step with its tokens)."""
        decoding.close()
        if intact:
            self.store(decoding.draft_slot, decoding.target, namespace)

    def generate(
        self,
        pair: Pair,
        draft_ids: list[int],
        target_ids: list[int],
        cfg: SpecConfig,
        stats: SpecStats,
        policy: DraftPolicy | None = None,
        use: CacheUse | None = None,
        **options,
    ) -> Iterator[tuple[list[int], list[bool]]]:
        """start(), its rounds decoded alone; the slots are stored back when the loop ended or
        was closed between rounds (a consumer that stops early)."""
        decoding = self.start(pair, draft_ids, target_ids, cfg, stats, policy, use, **options)
        rounds = decode_alone(decoding)
        in_round = False
        try:
            while True:
                in_round = True
                try:
                    out = next(rounds)
                except StopIteration:
                    in_round = False
                    break
                in_round = False
                yield out
        finally:
            rounds.close()
            self.finish(decoding, intact=not in_round)
