"""Drafts that cost no model forward: looked up in the context and in history.

Both work in target tokens, so they need no translation and serve any pair.
- Context lookup (prompt lookup decoding): the longest n-gram ending the text so
  far (prompt + reply: in chat, the whole conversation) that occurred before
  proposes what followed the occurrence whose match runs back furthest (the
  latest of equals), as a suffix array would find it. Code being edited, a
  passage being quoted, an earlier turn: replies repeat what is on screen. In
  code a short n-gram ("):\n    ") occurs all over; the latest occurrence of a
  4-gram is often not where the copy is.
- History (after SuffixDecoding): an index over this target's earlier replies,
  the counts of what followed each n-gram; the most frequent continuation of
  the reply's tail is proposed, token by token while it stays the clear favourite.
Drafts are keyed by source and match length ("context:3"; a context match
of 5-15 tokens is "context:8", of 16 or more "context:16": a copy under way):
the scheduler learns how often each kind holds (a copy under way holds far
more often than a short match: bench/results/free-drafts/README.md). A lookup
drafts `max_len` tokens, twice as many after a round whose whole draft held (up
to 4 x max_len: a copied block runs long), and max_len again after a rejection,
as assisted generation grows k.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from omnidraft_mlx.decode.drafts import Context, Draft, DraftSource
from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.profile.learned import deferred_interrupt


class LookupSource(DraftSource):
    free = True

    def __init__(self, max_len: int):
        self.max_len = self.length = max_len

    def draft(self, tokens: list[int], match: int) -> Draft | None:
        """A draft of looked-up tokens that adapts the next draft's length to how it fares."""

        if not tokens:
            return None

        def settle(accepted: int, timing: dict) -> None:
            held = accepted >= len(tokens)  # (cut to the token budget, a draft that held ends the reply)
            self.length = min(4 * self.max_len, 2 * self.length) if held else self.max_len

        return Draft(tokens, f"{self.name}:{match}", settle=settle)


class ContextLookup(LookupSource):
    name = "context"
    reach = 32  # tokens a match is followed back over
    candidates = 64  # latest occurrences of an n-gram compared

    def __init__(self, max_ngram: int = 4, max_len: int = 8, views: list[int] = ()):
        """views: target ids of other renderings of the context, searched as if they came first."""
        super().__init__(max_len)
        self.max_ngram = max_ngram
        self.seq: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its continuations start
        for t in views:
            self._append(t)
        self.view_tokens = len(views)  # seq holds the views, then the context

    def start(self, ctx: Context) -> None:
        self._catch_up(ctx)

    def _append(self, token: int) -> None:
        p = len(self.seq)
        for n in range(1, min(self.max_ngram, p) + 1):
            self.after.setdefault(tuple(self.seq[p - n : p]), []).append(p)
        self.seq.append(token)

    def _catch_up(self, ctx: Context) -> None:
        while (p := len(self.seq) - self.view_tokens) < len(ctx.prompt) + len(ctx.committed):
            self._append(ctx.prompt[p] if p < len(ctx.prompt) else ctx.committed[p - len(ctx.prompt)])

    def propose(self, ctx: Context, limit: int, guess: list[int] = ()) -> Draft | None:
        self._catch_up(ctx)
        tokens, match = self._follow(self.seq[-self.reach :], min(limit, self.length))
        return self.draft(tokens, match_class(match)) if tokens else None

    def extend(self, ctx: Context, draft: tuple[int, ...], count: int) -> list[int]:
        self._catch_up(ctx)
        return self._follow(self.seq[-self.reach :] + list(draft), count)[0]

    def _follow(self, tail: list[int], count: int) -> tuple[list[int], int]:
        """What followed the earlier occurrence of the longest n-gram ending tail whose match
        runs back furthest, and the match's length (0: none)."""
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            starts = self.after.get(tuple(tail[-n:]))
            if starts:
                start, match = max(
                    ((s, self._match(tail, s, n)) for s in starts[-self.candidates :]), key=lambda sm: (sm[1], sm[0])
                )
                return self.seq[start : start + count], match
        return [], 0

    def _match(self, tail: list[int], start: int, n: int) -> int:
        """How far back tail matches the text before start, given its last n match."""
        while n < min(len(tail), start) and self.seq[start - 1 - n] == tail[-1 - n]:
            n += 1
        return n


def escaped_views(tokenizer, prompt: list[int]) -> list[int]:
    """The prompt's text as a model writes it into a JSON string, in target ids: escaped as a
    chat template's tojson escapes it, and with only its line breaks escaped (as small models
    write code into a tool call: quotes left bare). Empty where escaping changes nothing."""
    text = tokenizer.decode(prompt)
    views = {json.dumps(text, ensure_ascii=False)[1:-1], text.replace("\n", "\\n")} - {text}
    return [t for view in sorted(views) for t in tokenizer.encode(view, add_special_tokens=False)]


def match_class(match: int) -> int:
    """A context match's kind: its length up to 4, then 8 (5-15 tokens) or 16 (16+: a copy)."""
    return match if match <= 4 else 8 if match < 16 else 16


class HistoryIndex:
    """Counts of the token that followed each n-gram (orders 1..order) in earlier replies.

    Bounded: past `capacity` n-grams, the least used tenth goes (a use: the
    n-gram was seen again). A part of the pair's profile
    (learned.py): it keeps what it learned since it was loaded or saved, so a
    save merges into what another process saved meanwhile."""

    def __init__(self, order: int = 4, capacity: int = 200_000):
        self.order, self.capacity = order, capacity
        self.next: dict[tuple[int, ...], Counter] = {}
        self.uses: Counter = Counter()
        self.fresh: list[tuple[list[int], int]] = []  # (ids, start) added since loaded or saved

    def __len__(self) -> int:
        return len(self.next)

    @property
    def changed(self) -> bool:
        """Learned anything since loaded or saved (a profile save skips it otherwise)."""
        return bool(self.fresh)

    def add(self, ids: list[int], start: int = 0) -> None:
        """Count what follows each n-gram at positions start.. of ids (ids before start: context)."""
        with deferred_interrupt():
            self._count(ids, start)
            self.fresh.append((list(ids), start))

    def _count(self, ids: list[int], start: int) -> None:
        for i in range(max(start, 1), len(ids)):
            for n in range(1, min(self.order, i) + 1):
                gram = tuple(ids[i - n : i])
                self.next.setdefault(gram, Counter())[ids[i]] += 1
                self.uses[gram] += 1
        if len(self.next) > self.capacity:
            self._evict(len(self.next) - self.capacity + self.capacity // 10)

    def _evict(self, n: int) -> None:
        for gram, _ in sorted(self.uses.items(), key=lambda kv: kv[1])[:n]:
            del self.next[gram], self.uses[gram]

    def continuation(self, tail: list[int], limit: int, min_share: float = 0.5) -> tuple[list[int], int]:
        """The most frequent continuation of tail, and the order of its first match (0: none)."""
        seq, out, first = list(tail), [], 0
        while len(out) < limit:
            for n in range(min(self.order, len(seq)), 0, -1):
                counts = self.next.get(tuple(seq[-n:]))
                if counts:
                    break
            else:
                break
            token, count = counts.most_common(1)[0]
            if out and count < min_share * sum(counts.values()):
                break  # no clear favourite: stop the draft here
            first = first or n
            out.append(token)
            seq.append(token)
        return out, first

    def merge(self, other: HistoryIndex) -> None:
        """Become `other` (as another process saved it) plus the replies added here since."""
        with deferred_interrupt():
            self.next = {g: Counter(c) for g, c in other.next.items()}
            self.uses = Counter(other.uses)
            for ids, start in self.fresh:
                self._count(ids, start)

    def save(self, path: str | Path) -> None:
        rows = [[list(g), list(c.items()), self.uses[g]] for g, c in self.next.items()]
        atomic_write_text(path, json.dumps({"order": self.order, "capacity": self.capacity, "entries": rows}))

    def mark_saved(self) -> None:
        """What was saved is shared from now on (the profile calls it once its manifest names the file)."""
        self.fresh = []

    @classmethod
    def load(cls, path: str | Path) -> HistoryIndex:
        data = json.loads(Path(path).read_text())
        index = cls(data["order"], data["capacity"])
        for gram, counts, uses in data["entries"]:
            index.next[tuple(gram)] = Counter(dict(counts))
            index.uses[tuple(gram)] = uses
        return index


class HistorySource(LookupSource):
    name = "history"

    def __init__(self, index: HistoryIndex, learn: bool = True, max_len: int = 8):
        super().__init__(max_len)
        self.index, self.learn = index, learn

    def propose(self, ctx: Context, limit: int, guess: list[int] = ()) -> Draft | None:
        return self.draft(*self.index.continuation(ctx.tail(self.index.order), min(limit, self.length)))

    def extend(self, ctx: Context, draft: tuple[int, ...], count: int) -> list[int]:
        return self.index.continuation((ctx.tail(self.index.order) + list(draft))[-self.index.order :], count)[0]

    def end_reply(self, ctx: Context) -> None:
        """Index the reply (the prompt's last tokens as its first context)."""
        if self.learn and ctx.committed:
            self.index.add(
                ctx.prompt[-self.index.order :] + ctx.committed, start=min(len(ctx.prompt), self.index.order)
            )
