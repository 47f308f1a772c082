"""A multi-turn chat that speculates: conversation state, context trimming,
streaming text, per-reply statistics and learning from the replies.

Each turn encodes the whole conversation in each model's own chat template
and runs one speculative generation over it; both models' KV caches are kept
across turns (promptcache.PromptCache), so a turn prefills only what is new
since the last reply. The terminal UI (commands, help, display) lives in
cli/chat_cmd.py and cli/chat_view.py.

With the target split over the ranks of mlx.launch (decode/ranks.py) the lead (rank 0)
converses; before each reply it shares the message and the conversation (share_turn), so
every rank encodes the same prompts and decodes the same reply with it (follow).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omnidraft_mlx.collectives import broadcast_bytes
from omnidraft_mlx.decode.lookup import HistoryIndex
from omnidraft_mlx.decode.policy import DraftPolicy
from omnidraft_mlx.decode.promptcache import CacheUse, PromptCache
from omnidraft_mlx.decode.ranks import Ended
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.adapt import OnlineLearner, UpdateReport
from omnidraft_mlx.learn.online import Learning
from omnidraft_mlx.pair import Pair, context_limit, reply_room
from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.profile.store import Profile
from omnidraft_mlx.prompts import encode_prompt
from omnidraft_mlx.settings import check_settings, setting
from omnidraft_mlx.vocab.textstream import TextStream

ROLES = ("system", "user", "assistant")


@dataclass(kw_only=True)
class ChatConfig:
    # Decoding: a reply's max_tokens is this one's or what the context leaves; its seed moves on each reply.
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(max_tokens=512))
    context: int | None = setting(None, flag="--context", low=64)  # cap on prompt + reply; None: the models' limit
    adapt: bool = True  # drafter updates from the replies (when a learner is attached)
    adapt_every: int = setting(4, flag="--adapt-every", low=1)  # replies gathered per drafter update

    def __post_init__(self):
        check_settings(self)


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user/assistant messages, oldest first
    first: int = 0  # turns before this one were trimmed: no longer sent to the models

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def sent(self) -> list[dict]:
        """The messages the models see."""
        return self._head() + self.turns[self.first :]

    def drop_oldest_exchange(self) -> int:
        """Stop sending the oldest user message and the replies after it; how many went."""
        end = self.first + 1
        while end < len(self.turns) and self.turns[end]["role"] != "user":
            end += 1
        if end >= len(self.turns):  # only the newest user message is left
            return 0
        dropped, self.first = end - self.first, end
        return dropped

    def to_json(self) -> str:
        return json.dumps({"messages": self.all_messages()}, indent=2, ensure_ascii=False)

    def all_messages(self) -> list[dict]:
        return self._head() + self.turns

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path).expanduser(), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Conversation:
        """A saved conversation: {"messages": [...]} or a bare list of {role, content}."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise OmniDraftError(f"no such file: {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OmniDraftError(f"cannot read {path} as a JSON conversation: {e}") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
        ):
            raise OmniDraftError(
                f"{path} is not a conversation: expected a list of "
                '{"role": "system"|"user"|"assistant", "content": "..."} messages'
            )
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
        return cls(system, [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"])


def plain_step_seconds(model, prompt_ids: list[int], steps: int = 4) -> float:
    """Median time of one plain decoding step (a one-token target forward)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from omnidraft_mlx.decode.kvcache import prefill
    from omnidraft_mlx.timing import forward_seconds

    cache = make_prompt_cache(model)
    prefill(model, cache, prompt_ids)
    times = forward_seconds(model, mx.array([[prompt_ids[-1]]]), cache, steps + 1, trim=False)
    return statistics.median(times[1:])  # the first step warms up


@dataclass
class Reply:
    """One reply in progress: stream() it, then hand it to ChatSession.finish()."""

    draft_ids: list[int]
    target_ids: list[int]
    max_tokens: int  # this reply's budget: --max-tokens or what the context leaves
    notes: list[str] = field(default_factory=list)  # to show before the reply (trimming)
    stats: SpecStats = field(default_factory=SpecStats)
    ids: list[int] = field(default_factory=list)  # target ids generated so far
    text: str = ""
    ttft_s: float | None = None  # time to the first token: cache lookup, prefill, first round
    cached: CacheUse = field(default_factory=CacheUse)  # prompt tokens not prefilled again


class ChatSession:
    """A conversation with a drafter/target pair; learns from every reply."""

    def __init__(
        self,
        pair: Pair,
        cfg: ChatConfig,
        conversation: Conversation | None = None,
        learner: OnlineLearner | None = None,
        profile: Profile | None = None,
        policy: DraftPolicy | None = None,
        prompt_cache: PromptCache | None = None,
        history: HistoryIndex | None = None,
    ):
        self.pair, self.cfg = pair, cfg
        self.history = history  # earlier replies, for lookup drafts; learns from every reply
        self.scheduler = Scheduler()  # which draft source pays, measured across replies
        self.prompt_cache = prompt_cache or PromptCache()  # both models' caches, kept across turns
        self.policy = policy  # draft length (default: fixed k); a learned one keeps learning across replies
        self.conv = conversation or Conversation()
        # What the pair learned is saved into the profile after every reply; the drafter (with a
        # learner: learn.online.make_learner) updates between turns, every cfg.adapt_every replies.
        self.learning = Learning(pair, profile, learner, self.prompt_cache)
        self.totals = SpecStats()
        self.reply_stats: list[SpecStats] = []  # per reply, for the speedup estimate
        self.replies = 0
        self.ngrams_at_start = len(pair.ngrams)
        self.plain_step_s: float | None = None
        self.limit = context_limit((pair.draft, pair.target), cfg.context)

    def measure_plain_speed(self) -> float:
        ids = list(self.pair.target_tok.encode("Hello! Can you help me write a small function today?"))
        self.plain_step_s = plain_step_seconds(self.pair.target, ids)
        return self.plain_step_s

    def _encode(self) -> tuple[list[int], list[int]]:
        messages = self.conv.sent()
        return encode_prompt(self.pair.draft_tok, messages), encode_prompt(self.pair.target_tok, messages)

    def start(self, text: str) -> Reply:
        """Add the user's message, trimming the oldest turns until it fits the context."""
        self.conv.turns.append({"role": "user", "content": text})
        draft_ids, target_ids = self._encode()
        spec, notes = self.cfg.spec, []
        max_tokens = spec.max_tokens
        if self.limit:
            # Leave room for a reply: a quarter of the context at most.
            wanted, dropped = min(spec.max_tokens, self.limit // 4), 0
            while (room := reply_room(self.limit, [len(draft_ids), len(target_ids)], spec.k)) < wanted:
                n = self.conv.drop_oldest_exchange()
                if not n:
                    self.conv.turns.pop()
                    raise OmniDraftError(
                        f"this message is too long for the context ({max(len(draft_ids), len(target_ids))} "
                        f"tokens of {self.limit}, {wanted + spec.k} kept for the reply): shorten it"
                    )
                dropped += n
                draft_ids, target_ids = self._encode()
            if dropped:
                notes.append(f"context nearly full: the {dropped} oldest messages are no longer sent to the models")
            max_tokens = min(max_tokens, room)
        return Reply(draft_ids, target_ids, max_tokens, notes)

    def stream(self, reply: Reply) -> Iterator[tuple[str, bool]]:
        """Yield (text, drafted) per accepted target token, as verification commits them."""
        spec = self.cfg.spec
        cfg = spec.for_reply(max_tokens=reply.max_tokens, seed=spec.seed + self.replies)
        out = TextStream(self.pair.vmap.target_bytes)
        start = time.perf_counter()
        try:
            for new, drafted in self.prompt_cache.generate(
                self.pair,
                reply.draft_ids,
                reply.target_ids,
                cfg,
                reply.stats,
                self.policy,
                reply.cached,
                history=self.history,
                scheduler=self.scheduler,
            ):
                if reply.ttft_s is None:
                    reply.ttft_s = time.perf_counter() - start
                for t, d in zip(new, drafted):
                    reply.ids.append(t)
                    piece = out.add(t)
                    reply.text += piece
                    yield piece, d
        finally:
            reply.text += out.finish()

    def share_turn(self, text: str | None) -> str | None:
        """The lead's message (None: the chat ends) on every rank, and on the others its conversation
        too (its /reset, /load and trimming included): the same prompts everywhere. The lead passes
        its message, the others None; in one process, text itself."""
        ranks = self.pair.ranks
        if ranks.group is None:
            return text
        mine = json.dumps({"text": text, "conversation": asdict(self.conv)}) if ranks.lead and text is not None else ""
        sent = broadcast_bytes(mine.encode(), ranks.group)
        if not sent:
            return None
        turn = json.loads(sent)
        if not ranks.lead:
            self.conv = Conversation(**turn["conversation"])
        return turn["text"]

    def follow(self) -> None:
        """A rank other than the lead: decode every reply the lead decodes, showing nothing, until
        the lead ends the chat, between replies or inside one (Ended)."""
        while (text := self.share_turn(None)) is not None:
            try:
                reply = self.start(text)
            except OmniDraftError:
                continue  # the lead's start refused it too (too long for the context)
            try:
                for _ in self.stream(reply):
                    pass
            except Ended:
                return
            self.finish(reply)

    @property
    def learner(self) -> OnlineLearner | None:
        """The drafter's learner (None: --no-adapt, or its updates kept failing)."""
        return self.learning.learner

    def finish(self, reply: Reply) -> str | None:
        """Commit a (possibly interrupted) reply; a note on why it stopped early, if it did."""
        # Verified tokens count, interrupted or not; with /adapt off the drafter does not queue them.
        self.learning.observe(reply.draft_ids, reply.target_ids, reply.ids if self.cfg.adapt else [])
        self.conv.turns.append({"role": "assistant", "content": reply.text})
        self.replies += 1
        self.totals += reply.stats
        self.reply_stats.append(reply.stats)
        self.learning.save()
        if len(reply.ids) >= reply.max_tokens:
            return (
                "stopped: the context is full"
                if reply.max_tokens < self.cfg.spec.max_tokens
                else (f"stopped at --max-tokens {self.cfg.spec.max_tokens}")
            )
        return None

    @property
    def update_due(self) -> bool:
        """Whether enough replies have gathered for a drafter update."""
        return self.cfg.adapt and self.learning.update_due

    def adapt(self) -> UpdateReport | None:
        """Update the drafter on the gathered replies (between turns), then save the profile. The
        update's report, or None when none was due; a failure is an OmniDraftError that says
        what comes next (the conversation goes on)."""
        return self.learning.update() if self.cfg.adapt else None

    def reset(self) -> None:
        self.conv = Conversation(self.conv.system)
