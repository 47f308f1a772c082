"""The engine of `omnidraft serve`: one drafter/target pair serving queued requests in order.

Requests are queued, not batched: the decode loop speculates on one sequence
(one drafter cache and one target cache, rolled back per round), so one engine
owns the pair and serves requests in the order they arrive. It runs in the main
thread (MLX does all its work there: a process whose other threads ran a model
aborts at exit). A client that disconnects leaves the queue, or stops its
generation at the next round. Between requests, when the queue is empty, the
pair learns and saves (serve_learning.py).
"""

from __future__ import annotations

import logging
import queue
import traceback
from typing import Callable

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.serve_decode import Decoder, Job
from omnidraft_mlx.serve_learning import Learning
from omnidraft_mlx.serve_schema import ApiError

log = logging.getLogger("omnidraft.serve")
IDLE_S = 0.5  # queue empty this long: save what was learned, run a due drafter update


class Engine:
    """The pair's decoder and learning; serves the queued jobs in order (run())."""

    def __init__(self, cfg):
        self.cfg = cfg  # ServeConfig
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.current: Job | None = None
        self.served = self.cancelled = self.failed = 0
        self.decoder: Decoder | None = None  # set by load()
        self.learning: Learning | None = None

    @property
    def pair(self):
        return self.decoder.pair

    @property
    def profile(self):
        return self.learning.profile

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    @property
    def generating(self) -> bool:
        return self.current is not None

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def load(self) -> None:
        from omnidraft_mlx.chat import make_learner
        from omnidraft_mlx.loading import load_model
        from omnidraft_mlx.pair import context_length, make_pair
        from omnidraft_mlx.policy import make_policy
        from omnidraft_mlx.profile import load_profile
        from omnidraft_mlx.promptcache import PromptCache
        from omnidraft_mlx.scheduler import Scheduler

        cfg = self.cfg
        draft_model, draft_tok = load_model(cfg.draft)
        target_model, target_tok = load_model(cfg.target)
        profile = load_profile(cfg.draft, cfg.target, draft_model, trainable=cfg.adapt) if cfg.profile else None
        pair = make_pair(draft_model, draft_tok, target_model, target_tok, profile.ngrams if profile else None)
        learner = make_learner(pair, profile, cfg.adapt_every) if cfg.adapt else None
        policy, history = make_policy(cfg.policy), None
        if profile:  # the policy's head and the history index are saved with every profile save from now on
            profile.attach_policy(policy)
            history = profile.attach_history()
        limits = [x for x in (context_length(draft_model), context_length(target_model)) if x]
        prompt_cache = PromptCache(cfg.cache_bytes)
        # The scheduler measures which draft source pays, across requests.
        self.decoder = Decoder(cfg, pair, policy, history, Scheduler(), prompt_cache, min(limits) if limits else None)
        self.learning = Learning(pair, profile, learner, prompt_cache)

    def run(self, running: Callable[[], bool]) -> None:
        """Serve jobs while running(); between them, when idle, learn and save."""
        while running():
            try:
                job = self.jobs.get(timeout=IDLE_S if self.learning.pending else 1.0)
            except queue.Empty:
                if self.learning.pending:
                    self.learning.idle()
                continue
            self._serve(job)

    def shutdown(self) -> None:
        """The running and the queued requests get an error, not silence; then save what was learned."""
        stopping = ApiError(503, "the server is shutting down", kind="server_error")
        if self.current is not None:
            self.current.emit("error", stopping)
            self.current = None
        while True:
            try:
                self.jobs.get_nowait().emit("error", stopping)
            except queue.Empty:
                break
        self.learning.save()

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.cancelled += 1
            return
        self.current = job
        try:
            result, ids = self.decoder.generate(job)
            job.emit("done", result)
            self.served += 1
            self.cancelled += result.finish_reason == "cancelled"
            self.learning.observe(job.draft_ids, job.target_ids, ids)
        except OmniDraftError as e:
            self.failed += 1
            job.emit("error", ApiError(400, str(e)))
        except Exception as e:  # one bad request must not stop the server
            self.failed += 1
            log.error("generation failed:\n%s", traceback.format_exc())
            job.emit("error", ApiError(500, f"internal error ({type(e).__name__}): see the server's log",
                                       kind="server_error"))
        self.current = None  # not when interrupted (Ctrl-C): shutdown() tells the job's client
