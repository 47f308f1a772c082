"""The engine of `omnidraft serve`: one drafter/target pair decoding the active requests together.

Up to --batch requests are active (or being prefilled) at once and progress a round at a
time: each plans its own draft (its scheduler and guard choose drafter, lookup or none), one
target forward verifies every draft, and each keeps what it accepted and rolls its own caches
back (decode.speculative.round_together: a request that fails there fails alone). Queued
requests (admission.Waiting: bounded) are admitted between rounds, and their prompts fed
about PAUSE_S at a time (between two rounds of the requests under way; with none under way,
between two looks at the queue), a long prompt a piece at a time so the other streams go on
meanwhile and a request that arrives meanwhile gets its turn, fewest prompt tokens left first
(admission.turn: a short prompt does not wait behind long prefills, a flooding client's
requests behind other clients', and a waiting request earns precedence: none is starved).
With every --batch place taken, a waiting request whose turn comes before a prompt being fed
takes that one's place (it waits again, what it fed kept in the prompt cache). A request whose
caches at full length would not fit in --cache-bytes beside the others' (the prompt cache
gives way to them) waits for room. Every request uses the server's one scheduler, so what it
measured on each request serves them all. The engine runs in the main thread (MLX does all its
work there: a process whose other threads ran a model aborts at exit). A request whose client
went away leaves the queue, its prefill or its row before the next round. When no request is
active and the queue is empty, the pair learns and saves (learn/online.py); under constant
load it saves between two rounds too. Over the ranks of mlx.launch (a split target) the other
ranks decode each reply beside this one (follow.py).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from omnidraft_mlx.collectives import lost_a_rank
from omnidraft_mlx.decode.kvcache import PREFILL_CHUNK
from omnidraft_mlx.decode.speculative import round_together
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.failpoints import failpoint
from omnidraft_mlx.learn.online import Learning, make_learner
from omnidraft_mlx.paths import LOCAL, Resolver
from omnidraft_mlx.serve.admission import Waiting, prompt_left, shutting_down, turn
from omnidraft_mlx.serve.follow import stop_following
from omnidraft_mlx.serve.jobs import Job, Jobs, Prefill, Running
from omnidraft_mlx.serve.schema import ApiError

if TYPE_CHECKING:
    from omnidraft_mlx.serve.config import ServeConfig

log = logging.getLogger("omnidraft.serve")
IDLE_S = 0.5  # queue empty this long: save what was learned, run a due drafter update
PAUSE_S = 0.5  # prompt feeding between two rounds (none under way: two looks at the queue) aims at this long
MIN_CHUNK = 32  # prompt tokens fed between two rounds at least (a first guess, before a rate is measured)
SLOW_PAUSE_S = 2.0  # a pause between two rounds this long is logged, with what took it
RELEASE_S = 60.0  # this often, memory freed since goes back to the system (release_memory)


class Engine:
    """The pair's jobs and learning; serves the queued jobs, several at once (run())."""

    def __init__(self, cfg: ServeConfig, resolver: Resolver = LOCAL):
        self.cfg, self.resolver = cfg, resolver  # resolver: how the models' names find their weights
        self.waiting = Waiting(cfg.max_queue)
        self.active: list[Running] = []
        self.prefilling: list[Prefill] = []  # admitted, their prompts fed a chunk at a time between rounds
        self.served = self.cancelled = self.failed = 0
        self.most_active = 0  # the most requests decoded together so far
        # Stalls, the longest so far: between two rounds of the active requests (another's prefill chunk,
        # admissions), and a request's wait on learning (a drafter update's slice or a save) before admission.
        self.longest_round_pause_s = self.longest_learning_wait_s = 0.0
        self._round_ended: float | None = None  # when the last round ended, while requests stay active
        self.prefill_rate: float | None = None  # prompt tokens fed per second between rounds (a running mean)
        self.released = time.monotonic()  # when freed memory last went back to the system
        self.jobs: Jobs | None = None  # set by load()
        self.learning: Learning | None = None
        self.lost_rank = False  # under mlx.launch a rank has ended: no collective may run any more

    @property
    def pair(self):
        return self.jobs.pair

    @property
    def profile(self):
        return self.learning.profile

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def generating(self) -> int:
        return len(self.active) + len(self.prefilling)

    def submit(self, job: Job) -> None:
        """Queue a job (an ApiError when the queue is full, 429, or the server is shutting down, 503)."""
        self.waiting.put(job)

    def load(self) -> None:
        from omnidraft_mlx.decode.policy import make_policy
        from omnidraft_mlx.decode.promptcache import PromptCache
        from omnidraft_mlx.decode.scheduler import Scheduler
        from omnidraft_mlx.loading import open_pair
        from omnidraft_mlx.pair import context_limit

        cfg = self.cfg
        # The profile's adapter goes into the drafter: fused, or trainable when learning goes on.
        # Under mlx.launch the target is split over the ranks (cfg.shard).
        opened = open_pair(
            cfg.draft,
            cfg.target,
            resolver=self.resolver,
            shard=cfg.shard,
            profile=cfg.profile,
            trainable=cfg.adapt,
            policy=make_policy(cfg.policy),
        )
        pair, profile = opened.pair, opened.profile
        learner = make_learner(pair, profile, cfg.adapt_every) if cfg.adapt else None
        prompt_cache = PromptCache(cfg.cache_bytes)
        # The scheduler measures which draft source pays, across requests.
        self.jobs = Jobs(
            cfg,
            pair,
            opened.policy,
            opened.history,
            Scheduler(),
            prompt_cache,
            context_limit((pair.draft, pair.target)),
        )
        self.learning = Learning(pair, profile, learner, prompt_cache)

    def run(self, running: Callable[[], bool]) -> None:
        """Decode the active jobs round by round while running(), admitting queued ones between
        rounds; when nothing is active or queued, learn and save. A failure is its job's (the
        steps of one job catch their own); one outside them fails the active jobs, not the engine."""
        while running():
            try:
                self._step()
            except Exception as e:
                if lost_a_rank(e):  # under mlx.launch: the ranks can no longer decode together
                    self.lost_rank = True
                    raise
                log.error("the engine's round failed; its requests fail:\n%s", traceback.format_exc())
                for job in list(self.active):
                    self._drop(job, e)

    def _step(self) -> None:
        if time.monotonic() - self.released > RELEASE_S:
            release_memory()
            self.released = time.monotonic()
        if not self.active and not self.prefilling and not self.waiting.wait(IDLE_S if self.learning.pending else 1.0):
            if self.learning.pending:
                self.learning.idle(busy=lambda: len(self.waiting) > 0)
                self.longest_learning_wait_s = max(self.longest_learning_wait_s, self.waiting.longest_wait())
            return
        self.cancelled += len(self.waiting.cancelled())  # their clients went away
        budget, start = self._prefill_budget(), time.monotonic()
        fed = self._feed(budget)
        if fed:
            seconds = time.monotonic() - start
            rate = fed / max(seconds, 1e-6)
            self.prefill_rate = rate if self.prefill_rate is None else (self.prefill_rate + rate) / 2
            if self._round_ended is not None and seconds > SLOW_PAUSE_S:  # requests under way waited
                log.warning("%.1fs between two rounds feeding %d prompt tokens", seconds, fed)
        if self.active:
            self._round()
            self.learning.between_rounds()  # under constant load, saves at most SAVE_EVERY_S apart

    def _prefill_budget(self) -> int:
        """Prompt tokens to feed before the next round and the next look at the queue, new requests
        together: what feeds in about PAUSE_S at the rate measured so far, at most a chunk. So a burst
        of new requests or a long prompt waits a round or more, and the streams under way do not stall
        for it; with none under way, a request that arrives while a long prompt is fed waits about
        PAUSE_S for its turn, not a whole chunk's time (on a slow machine, many seconds). Over ranks:
        whole prompts (follow.py)."""
        if self.pair.ranks.group is not None:
            return sys.maxsize
        if self.prefill_rate is None:
            return MIN_CHUNK
        return int(min(PREFILL_CHUNK, max(MIN_CHUNK, self.prefill_rate * PAUSE_S)))

    def shutdown(self) -> None:
        """The running and the queued requests get an error, not silence; then save what was learned;
        then the other ranks of mlx.launch, if any, end the reply under way and stop (follow.py)."""
        stopping = shutting_down()
        ending = [r.decoding for r in self.active if not r.decoding.done]
        jobs = [r.job for r in self.active] + [p.job for p in self.prefilling] + self.waiting.close()
        self.active, self.prefilling = [], []
        for job in jobs:
            job.emit("error", stopping)
        self.learning.close()
        if self.lost_rank:  # a collective now may wait for ever
            return
        for _ in ending:
            self.pair.ranks.end()
        stop_following(self.pair.ranks)

    def _fits(self, job: Job) -> bool:
        """Room in --cache-bytes for the caches of the active requests, the prompts being fed and
        this job, each at its longest, at the bytes per token they hold now."""
        rows = [(r.nbytes, len(r.decoding.target.tokens), r.job.longest) for r in self.active]
        rows += [(p.nbytes(), len(p.slots[1].tokens), p.job.longest) for p in self.prefilling]
        held, tokens, longest = (sum(column) for column in zip(*rows)) if rows else (0, 0, 0)
        per_token = held / tokens if tokens else 0.0
        return per_token * (longest + job.longest) <= self.cfg.cache_bytes

    def _feed(self, budget: int) -> int:
        """Admit queued jobs and feed their prompts, in turn, up to `budget` prompt tokens (a prompt
        with more left goes on before later rounds). The prompt tokens fed."""
        fed = 0
        while fed < budget and (chosen := self._next()) is not None:
            if isinstance(chosen, Prefill):
                fed += self._prefill(chosen, budget - fed)
            else:
                self._admit(chosen)
        return fed

    def _next(self) -> Job | Prefill | None:
        """The prompt to feed next, first in turn (admission.turn): one being fed, or the queue's
        first if there is room for it (--cache-bytes; --batch, or else a prompt being fed whose turn
        comes after it: _admit puts that one back in the queue)."""
        now, held = time.monotonic(), self._held()
        options = [(turn(p.job, p.left, now, held[p.job.client]), p) for p in self.prefilling]
        if (job := self.waiting.first(now, held)) is not None:
            first = turn(job, prompt_left(job), now, held[job.client])
            room = self.generating < self.cfg.batch or any(first < theirs for theirs, _ in options)
            if room and self._fits(job):
                options.append((first, job))
        return min(options, key=lambda option: option[0])[1] if options else None

    def _held(self) -> Counter[str]:
        """The requests decoding, per client (admission.turn counts them)."""
        return Counter(r.job.client for r in self.active)

    def _admit(self, job: Job) -> None:
        """A queued job out of the queue, its caches from the prompt cache: its prompt is fed next
        (_prefill). With every --batch place taken, it takes that of the prompt being fed last in turn."""
        self.waiting.remove(job)
        if self.generating >= self.cfg.batch:
            now, held = time.monotonic(), self._held()
            self._requeue(max(self.prefilling, key=lambda p: turn(p.job, p.left, now, held[p.job.client])))
        try:
            self.prefilling.append(self.jobs.begin(job))
        except Exception as e:
            self._fail(job, e)
        self._make_room()

    def _requeue(self, prefill: Prefill) -> None:
        """A prompt being fed back to the queue (its arrival keeps its place in line there): what it fed
        goes to the prompt cache, where its next admission finds it."""
        self.prefilling.remove(prefill)
        self.jobs.prompt_cache.store(*prefill.slots, prefill.job.key_name)
        self.waiting.put_back(prefill.job)

    def _prefill(self, prefill: Prefill, most: int) -> int:
        """Up to `most` more tokens of a job's prompt; with its last, the job is active; a cancelled
        one is dropped. The prompt tokens it fed."""
        job, fed = prefill.job, 0
        if job.cancelled.is_set():
            self.prefilling.remove(prefill)
            self.jobs.prompt_cache.store(*prefill.slots, job.key_name)  # what it fed is a prefix worth keeping
            self.cancelled += 1
            return fed
        try:
            failpoint("prefill", job.label)
            fed = min(most, prefill.left)
            if prefill.left > most:
                prefill.feed(self.pair, most)
            else:
                self.prefilling.remove(prefill)
                self.active.append(self.jobs.start(job, self.jobs.scheduler, prefill))
        except Exception as e:  # its caches are not kept
            if prefill in self.prefilling:
                self.prefilling.remove(prefill)
            self._fail(job, e)
        self._make_room()
        return fed

    def _make_room(self) -> None:
        """The prompt cache keeps what the active (and prefilling) requests' caches leave of the budget."""
        held = sum(r.nbytes for r in self.active) + sum(p.nbytes() for p in self.prefilling)
        self.jobs.prompt_cache.make_room(self.cfg.cache_bytes - held)

    def _round(self) -> None:
        """One round of every active job (round_together: plan the drafts, verify them in one target
        forward, take); a job whose client went away finishes instead, one that fails is dropped."""
        if self._round_ended is not None:
            self.longest_round_pause_s = max(self.longest_round_pause_s, time.monotonic() - self._round_ended)
        self._round_ended = None
        for running in [r for r in self.active if r.job.cancelled.is_set()]:
            self._finish(running)
        rows = list(self.active)
        if not rows:
            return
        self.most_active = max(self.most_active, len(rows))
        over = []
        taken = round_together([r.decoding for r in rows], lambda step, i: failpoint(step, rows[i].job.label))
        for running, outcome in zip(rows, taken):
            if isinstance(outcome, Exception):
                self._drop(running, outcome)
                continue
            try:
                if running.add(outcome[0], self.jobs.token_bytes):
                    over.append(running)
            except Exception as e:
                self._drop(running, e)
        self._round_ended = time.monotonic()  # the replies that ended finish in the pause before the next round
        for running in over:
            self._finish(running)
        if over and (seconds := time.monotonic() - self._round_ended) > SLOW_PAUSE_S:
            log.warning("%.1fs between two rounds finishing %d replies", seconds, len(over))
        if not self.active:
            self._round_ended = None

    def _finish(self, running: Running) -> None:
        """A job whose reply is over: its caches to the prompt cache, its result to its client,
        its reply to learning. A failure here fails this job only."""
        try:
            result, ids = self.jobs.finish(running)
        except Exception as e:  # its caches are not kept
            self._fail_active(running, e)
            return
        self.served += 1
        self.cancelled += result.finish_reason == "cancelled"
        self.active.remove(running)  # once counted: /health never shows a reply neither generating nor counted
        running.job.emit("done", result)
        if not self.cfg.learns_from(running.job.key_name):  # the operator's choice (--learn-from)
            return
        try:  # the reply is out: a failure to learn from it costs only that lesson
            failpoint("learn", running.job.label)
            self.learning.observe(running.job.draft_ids, running.job.target_ids, ids)
        except Exception:
            log.error("learning from a reply failed:\n%s", traceback.format_exc())

    def _drop(self, running: Running, error: Exception) -> None:
        """A job whose round failed: out of the batch, its caches not kept, its client told."""
        try:
            self.jobs.finish(running, intact=False)
        except Exception as e:
            if not lost_a_rank(e):  # that one is said once, by _fail
                log.error("closing a failed request's decoding failed:\n%s", traceback.format_exc())
        self._fail_active(running, error)

    def _fail_active(self, running: Running, error: Exception) -> None:
        try:
            self._fail(running.job, error)
        finally:
            self.active.remove(running)  # once counted, as in _finish

    def _fail(self, job: Job, error: Exception) -> None:
        """Tell the job's client; a rank of mlx.launch that has ended ends the server (raised)."""
        self.failed += 1
        if isinstance(error, OmniDraftError):
            job.emit("error", ApiError(400, str(error)))
            return
        if lost_a_rank(error):
            job.emit("error", ApiError(503, "a rank of the server has ended", kind="server_error"))
            raise error
        log.error("generation failed:\n%s", "".join(traceback.format_exception(error)))
        job.emit(
            "error",
            ApiError(500, f"internal error ({type(error).__name__}): see the server's log", kind="server_error"),
        )


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_memory() -> None:
    """Give memory freed since back to the system: MLX's buffer cache (Metal keeps freed buffers
    for reuse) and, on glibc, the heap's free pages. Freed arrays of up to 32 MB stay resident in
    glibc's heaps otherwise, so a long-running server's memory follows the largest working set it
    has seen (a long prompt's prefill, a drafter update) rather than what it holds now."""
    mx.clear_cache()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
