"""Jobs: a request's decode for `omnidraft serve`, from the HTTP thread to the engine's: its
prompts encoded (Jobs.prepare, a Job), fed into caches from the prompt cache (a Prefill), its
decoding under way (a Running job: the engine verifies its rounds beside other requests'), its
text streamed back to the request as events, its caches given back (Jobs.finish, a Result).

A Job carries a request from the HTTP thread to the engine's thread; the decode
emits events as rounds finish: ("text", piece) cut at the request's stop
strings, ("tool_calls", [call]) once a call's text parses (text.py),
("logprobs", [entry]) if asked (logprobs.py); then ("done", Result) or
("error", ApiError). The client's request waits on them in the server's event loop.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnidraft_mlx.decode.drafter import draft_context
from omnidraft_mlx.decode.promptcache import CacheUse
from omnidraft_mlx.failpoints import armed, failpoint
from omnidraft_mlx.pair import reply_room
from omnidraft_mlx.serve.follow import share_job
from omnidraft_mlx.serve.logprobs import token_logprobs
from omnidraft_mlx.serve.schema import ApiError, ChatRequest, Sampling, stop_strings
from omnidraft_mlx.serve.text import ReplyText
from omnidraft_mlx.serve.tools import ToolPlan, encode, plan_tools

if TYPE_CHECKING:
    from omnidraft_mlx.decode.kvcache import KVSlot
    from omnidraft_mlx.decode.lookup import HistoryIndex
    from omnidraft_mlx.decode.policy import DraftPolicy
    from omnidraft_mlx.decode.promptcache import PromptCache
    from omnidraft_mlx.decode.scheduler import Scheduler
    from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats
    from omnidraft_mlx.pair import Pair
    from omnidraft_mlx.serve.config import ServeConfig


@dataclass(eq=False)  # one request: two are never the same, whatever they hold
class Job:
    """One request's generation: its prompts and settings; events flow back to the request's loop."""

    draft_ids: list[int]
    target_ids: list[int]
    spec: SpecConfig
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    tools: ToolPlan = field(default_factory=ToolPlan)
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    cancelled: threading.Event = field(default_factory=threading.Event)
    label: str = ""  # the request's messages, for a failpoint aimed at it (set only while one is armed)
    key_name: str = ""  # its API key's: its prompt-cache namespace; whether the pair learns from it
    client: str = ""  # whose it is (admission.client_of): its place in line counts what its client has under way
    # Its time to first token counts from here, as its client's does: waits in the queue (for a
    # drafter update's slice, for its turn to prefill) included.
    arrived: float = field(default_factory=time.monotonic)

    @property
    def longest(self) -> int:
        """Target tokens in its caches when its reply is as long as it may get."""
        return len(self.target_ids) + self.spec.max_tokens

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the server's loop has closed: nobody is listening
            self.cancelled.set()


@dataclass
class Result:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    speculative: dict
    stop: str | None = None  # the stop string that ended the reply, if one did


@dataclass
class Jobs:
    """What turns requests into jobs and jobs into decodings: the pair and what decoding keeps
    between requests (prompt cache, policy, history, scheduler)."""

    cfg: ServeConfig
    pair: Pair
    policy: DraftPolicy
    history: HistoryIndex | None  # None: --no-profile
    scheduler: Scheduler
    prompt_cache: PromptCache
    limit: int | None  # the shorter context of the two models, if known
    encoder: Pair = field(init=False, repr=False)  # the pair, with tokenizers of its own for prepare()
    encoding: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self):
        # Fast tokenizers are not thread-safe ("Already borrowed"): the engine's thread owns the
        # pair's, the HTTP threads encode prompts with copies, one request at a time.
        self.encoder = copy.copy(self.pair)
        self.encoder.draft_tok, self.encoder.target_tok = copy.deepcopy((self.pair.draft_tok, self.pair.target_tok))

    def prepare(self, messages: list[dict], raw: bool, req: Sampling, loop, key_name: str = "") -> Job:
        """Encode a request for both models and check it against the context (any thread)."""
        spec, chat = self.cfg.spec, isinstance(req, ChatRequest)
        with self.encoding:
            tools = plan_tools(req, self.encoder.target_tok) if chat else ToolPlan()
            draft_ids, target_ids = encode(self.encoder, messages, raw, tools)
        room = reply_room(self.limit, [len(draft_ids), len(target_ids)], spec.k)
        if room is not None and room < 1:
            raise ApiError(
                400,
                f"the prompt is {max(len(draft_ids), len(target_ids))} tokens and this model's context is "
                f"{self.limit} tokens: shorten the prompt",
                "messages" if not raw else "prompt",
                "context_length_exceeded",
            )
        max_tokens = req.max_completion_tokens or req.max_tokens or spec.max_tokens
        temp = req.temperature if req.temperature is not None else spec.temp
        seed = req.seed if req.seed is not None else (secrets.randbits(31) if temp > 0 else spec.seed)
        spec = spec.for_reply(
            temp=temp, top_p=req.top_p, seed=seed, max_tokens=min(max_tokens, room) if room is not None else max_tokens
        )
        logprobs = (req.top_logprobs or 0) if chat and req.logprobs else None
        label = json.dumps(messages, default=str) if armed() else ""
        draft_ids = draft_context(draft_ids)  # the end of its prompt the drafter reads
        stops, events = stop_strings(req), asyncio.Queue()
        return Job(draft_ids, target_ids, spec, stops, loop, events, tools, logprobs, label=label, key_name=key_name)

    def begin(self, job: Job) -> Prefill:
        """The job's slots from the prompt cache, to prefill (Prefill.feed, or start() at once)."""
        failpoint("prefill", job.label)
        use = CacheUse()
        slots = self.prompt_cache.take(self.pair, job.draft_ids, job.target_ids, use, job.key_name)
        return Prefill(job, slots, use)

    def start(self, job: Job, scheduler, prefill: Prefill | None = None) -> Running:
        """The job's decoding, prefilled on the prompt cache (what `prefill` has not fed yet fed
        now), its rounds to come (Running.take)."""
        from omnidraft_mlx.decode.speculative import SpecStats

        prefill = prefill or self.begin(job)
        stats, rows = SpecStats(), []
        reply = ReplyText(self.pair.vmap.target_bytes, job.stops, job.tools, job.emit)
        share_job(self.pair.ranks, job.target_ids, job.spec)  # under mlx.launch the others decode it too
        try:
            decoding = self.prompt_cache.start(
                self.pair,
                job.draft_ids,
                job.target_ids,
                job.spec,
                stats,
                self.policy,
                prefill.use,
                slots=prefill.slots,
                history=self.history,
                learn_history=self.cfg.learns_from(job.key_name),
                scheduler=scheduler,
                on_logits=rows.append if job.logprobs is not None else None,
            )
        except Exception:
            self.pair.ranks.end()  # the others' reply ends before its first round
            raise
        return Running(job, decoding, stats, prefill.use, reply, rows)

    def finish(self, running: Running, intact: bool = True) -> tuple[Result, list[int]]:
        """Give the running job's caches back to the prompt cache; (its result, the reply's target ids).
        A reply left before its decoding is done ends on the other ranks of mlx.launch too (follow.py)."""
        if not running.decoding.done:
            self.pair.ranks.end()
        failpoint("finish", running.job.label)
        self.prompt_cache.finish(running.decoding, intact, running.job.key_name)
        finish = running.finish_reason or "cancelled"
        stats, ids = running.stats, running.ids
        result = Result(
            finish,
            len(running.job.target_ids),
            len(ids),
            running.use.target_tokens,
            self.report(stats, running.use, running.ttft),
            running.reply.stop.reached,
        )
        return result, ids

    def token_bytes(self, token: int) -> bytes:
        """A target token's bytes; a special token's, its text."""
        return self.pair.vmap.target_bytes[token] or self.pair.target_tok.decode([token]).encode()

    def report(self, stats, use: CacheUse, ttft: float | None) -> dict:
        """usage.speculative: what the drafter did for one reply."""
        return {
            "draft_model": self.cfg.draft,
            **stats.record(),
            "draft_cached_tokens": use.draft_tokens,
            "time_to_first_token_s": round(ttft or 0.0, 4),
        }


@dataclass(eq=False)
class Prefill:
    """A job admitted, its prompts fed into its caches a chunk at a time between the active
    requests' rounds (chunked prefill: a long prompt does not hold the other streams for all of
    it). The target's in the same chunks as one prefill (kvcache.prefill's), so the same cache;
    the last prompt token each model is fed by the decoding's start."""

    job: Job
    slots: tuple[KVSlot, KVSlot]  # (draft, target)
    use: CacheUse

    def _prompts(self) -> list[tuple[KVSlot, list[int]]]:
        return list(zip(self.slots, (self.job.draft_ids[:-1], self.job.target_ids[:-1])))

    @property
    def left(self) -> int:
        """Prompt tokens still to feed, in the model's tokens that has more of them."""
        return max(len(ids) - slot.common_prefix(ids) for slot, ids in self._prompts())

    def feed(self, pair: Pair, most: int) -> None:
        """Up to `most` more of each model's prompt into its cache (after the part it holds)."""
        for model, (slot, ids) in zip((pair.draft, pair.target), self._prompts()):
            slot.reuse(model, ids[: slot.common_prefix(ids) + most])

    def nbytes(self) -> int:
        return sum(c.nbytes for slot in self.slots for c in slot.cache)


@dataclass
class Running:
    """A job being decoded: its decoding, between rounds, and the reply it has streamed so far."""

    job: Job
    decoding: Decoding
    stats: SpecStats
    use: CacheUse
    reply: ReplyText
    rows: list  # the target's logits of the last round, for log-probabilities
    ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    finish_reason: str | None = None  # set when the reply is over

    @property
    def nbytes(self) -> int:
        """What its caches (both models') hold now."""
        slots = (self.decoding.target, self.decoding.draft_slot)
        return sum(c.nbytes for slot in slots if slot is not None for c in slot.cache)

    def add(self, new: list[int], token_bytes) -> bool:
        """A round's new target ids (its decoding's take()) -> the reply's events; whether the reply is over."""
        job = self.job
        self.ttft = self.ttft if self.ttft is not None else time.monotonic() - job.arrived
        self.ids += new
        if self.rows and (logprobs := token_logprobs(self.rows.pop(), new, job.logprobs, token_bytes)):
            job.emit("logprobs", logprobs)
        if self.reply.add(new):
            self.finish_reason = "stop"
        elif job.cancelled.is_set():
            self.finish_reason = "cancelled"
        elif self.decoding.done:
            self.finish_reason = "length" if len(self.ids) >= job.spec.max_tokens else "stop"
            self.reply.finish()
        if self.finish_reason == "stop" and self.reply.called:
            self.finish_reason = "tool_calls"
        return self.finish_reason is not None
