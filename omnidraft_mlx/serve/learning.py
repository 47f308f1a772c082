"""What `omnidraft serve` learns from its replies, and saving it into the pair's profile.

The n-gram cache and the acceptance head learn as the pair decodes; here each
reply is also queued for the drafter's next update (as `omnidraft chat` does; the newest
--adapt-every replies: under load the older ones go unlearned, and updates stay short).
The engine calls idle() when its queue has been empty a moment: a due drafter
update runs then, a slice at a time (one example's gradient: OnlineLearner.update_slices),
and pauses as soon as a request arrives (the engine serves it, and the update goes on
when it is idle again: the replies meanwhile are drafted by the weights so far, and
verified as always); what was learned is saved into the profile, under its lock and
merged with what other processes saved meanwhile: once no reply has been served for
QUIET_S, and while requests keep coming at most every SAVE_EVERY_S (on exit always).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.failpoints import failpoint

if TYPE_CHECKING:
    from omnidraft_mlx.decode.promptcache import PromptCache
    from omnidraft_mlx.learn.adapt import OnlineLearner
    from omnidraft_mlx.pair import Pair
    from omnidraft_mlx.profile.store import Profile

log = logging.getLogger("omnidraft.serve")
QUIET_S = 2.0  # no reply served for this long: save what was learned
SAVE_EVERY_S = 10.0  # while replies keep coming, a save at most this often
SLOW_S = 1.0  # a save or an update slice this long is logged: a request arriving meanwhile waits for it


@dataclass
class Learning:
    pair: Pair
    profile: Profile | None  # None: --no-profile, nothing saved
    learner: OnlineLearner | None  # None: --no-adapt, or an update failed
    prompt_cache: PromptCache  # its drafter caches go stale with each update
    dirty: bool = False  # learned something not yet saved
    saves: int = 0
    updating: Generator | None = None  # a drafter update under way (paused while requests run)
    last_reply: float = 0.0  # time.monotonic() of the last reply served
    last_save: float = field(default_factory=time.monotonic)

    @property
    def pending(self) -> bool:
        """Something for idle() to do."""
        return self.dirty or self.update_due or self.updating is not None

    @property
    def update_due(self) -> bool:
        return self.learner is not None and len(self.learner.buffer) >= self.learner.interval

    def observe(self, draft_ids: list[int], target_ids: list[int], reply: list[int]) -> None:
        """A reply was served: save soon, and queue it for the drafter's next update, after the
        tail of each prompt (a training sequence must keep the reply within the learner's max_len)."""
        from omnidraft_mlx.learn.distill import make_example

        self.dirty, self.last_reply = True, time.monotonic()
        if reply and self.learner is not None:
            tail = self.learner.cfg.max_len // 4
            self.learner.add(
                make_example(self.pair, draft_ids[-tail:], target_ids[-tail:], reply, self.learner.cfg.max_len)
            )
            if self.updating is None:  # an update learns from the newest --adapt-every replies: under load
                del self.learner.buffer[: -self.learner.interval]  # it stays short and the buffer bounded

    def idle(self, busy: Callable[[], bool] = lambda: False) -> None:
        """Between requests: save the n-grams and the acceptance head, if no reply came for QUIET_S
        or none was saved for SAVE_EVERY_S (first: an update that keeps pausing must not hold them
        back); then a due drafter update, slice after slice until it ends or busy() (a request
        waits: the update pauses, to go on at the next idle())."""
        now = time.monotonic()
        if now - self.last_reply >= QUIET_S or now - self.last_save >= SAVE_EVERY_S:
            self.save()
        if self.updating is None and self.update_due and not busy():
            del self.learner.buffer[: -self.learner.interval]  # the newest replies: the update stays short
            self.updating = self.learner.update_slices(piece=1)
            log.info("drafter update started (%d replies)", len(self.learner.buffer))
        if self.updating is None:
            return
        try:
            while not busy():
                failpoint("update")
                start = time.monotonic()
                next(self.updating)
                if (seconds := time.monotonic() - start) > SLOW_S:
                    log.warning("a slice of the drafter update took %.1fs (a request arriving waits for it)", seconds)
            log.info("drafter update paused: a request arrived")
            return
        except StopIteration as done:  # saved the adapter into the profile
            report = done.value
            log.info("drafter update %d: loss %.3f, %.1fs", report.update, report.loss, report.seconds)
        except Exception:
            log.error("the drafter update failed; drafter learning stops:\n%s", traceback.format_exc())
            self.learner = None
        self.updating = None
        self.prompt_cache.drafter_changed()  # new drafter weights: its cached prefixes are stale

    def save(self) -> None:
        """The n-grams and the acceptance head into the profile (under its lock, merged
        with what other processes saved meanwhile; atomically)."""
        if self.profile is None or not self.dirty:
            return
        self.last_save = time.monotonic()
        try:
            self.profile.save()
            self.saves += 1
            if (seconds := time.monotonic() - self.last_save) > SLOW_S:
                log.warning("saving the profile took %.1fs", seconds)
        except (OSError, OmniDraftError) as e:
            log.error("could not save the profile: %s", e)
        except Exception:  # the previous save stays on disk; the server goes on, and saves again after a reply
            log.error("could not save the profile:\n%s", traceback.format_exc())
        self.dirty = False
