"""Learning between replies, the same for `omnidraft chat` and `omnidraft serve`.

The n-gram cache, the acceptance head and the history index learn as the pair decodes
(decode/); here each reply served is also queued for the drafter's next update, as the
tails of its two prompts and its target ids (observe(): chat and serve feed it alike).
An update learns from the newest `interval` replies (under load the older ones go
unlearned, and an update stays short); it runs whole (update(): chat, between turns) or
a slice at a time (idle(): serve, while its queue is empty, pausing as soon as a request
arrives: the replies meanwhile are drafted by the weights so far, and verified as always).
After an update the prompt cache's drafter entries are stale.

What was learned is saved into the profile (under its lock, merged with what other
processes saved meanwhile): chat after each reply; serve once no reply came for QUIET_S,
and under constant load too, between two rounds, once learning has waited SAVE_EVERY_S
(a save of the n-grams and the head takes milliseconds on a small cache, about 0.5 s on
a full one); at exit always (close()). Nothing is dropped by a failure: a failed save
leaves the learning unsaved and is tried again after a backoff (BACKOFF_S, doubling up
to BACKOFF_MAX_S), a drafter update whose save failed is saved by the next save, and a
failed update is tried again at the next due one: only MAX_UPDATE_FAILURES in a row stop
drafter learning. A save waits LOCK_WAIT_S at most for another process's lock (EXIT_WAIT_S
at exit, when what it could not save is said to be lost).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.failpoints import failpoint
from omnidraft_mlx.learn.adapt import OnlineLearner, UpdateReport
from omnidraft_mlx.learn.distill import DistillConfig, make_example, setup_trainable

if TYPE_CHECKING:
    from omnidraft_mlx.decode.promptcache import PromptCache
    from omnidraft_mlx.pair import Pair
    from omnidraft_mlx.profile.store import Profile

log = logging.getLogger("omnidraft.learn")
QUIET_S = 2.0  # no reply for this long: save what was learned
SAVE_EVERY_S = float(os.environ.get("OMNIDRAFT_SAVE_EVERY_S", 60.0))  # learning unsaved this long: saved, load or not
LOCK_WAIT_S = 1.0  # a save waits this long for another process's lock, then tries again later
EXIT_WAIT_S = 5.0  # ... and at exit (a stopped `omnidraft adapt` holding it must not hang the exit)
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0  # after a failed save, the next try waits this long, doubling
MAX_UPDATE_FAILURES = 3  # drafter updates failing in a row: drafter learning stops
SLOW_S = 1.0  # a save or an update slice this long is logged: a request arriving meanwhile waits for it


def make_learner(pair: Pair, profile: Profile | None, interval: int) -> OnlineLearner:
    """An online learner of the drafter, which it makes trainable (unless the
    profile's adapter already did); updates are saved into the profile."""
    if profile is not None and profile.distill:
        cfg = DistillConfig.from_dict(profile.distill)
    else:
        cfg = DistillConfig()
        setup_trainable(pair.draft, cfg)
    return OnlineLearner(pair, cfg, interval, profile)


@dataclass
class Learning:
    pair: Pair
    profile: Profile | None  # None: --no-profile, nothing saved
    learner: OnlineLearner | None  # None: --no-adapt, or MAX_UPDATE_FAILURES updates failed in a row
    prompt_cache: PromptCache  # its drafter caches go stale with each update
    dirty: bool = False  # learned something not yet saved
    saves: int = 0
    updating: Generator | None = None  # a drafter update under way (serve: paused while requests run)
    last_reply: float = 0.0  # time.monotonic() of the last reply
    unsaved_since: float = field(default_factory=time.monotonic)  # when the oldest unsaved learning came
    save_failures: int = 0  # in a row
    retry_at: float = 0.0  # after a failed save, none before this (time.monotonic())
    update_failures: int = 0  # in a row

    @property
    def update_due(self) -> bool:
        """Whether enough replies have gathered for a drafter update (and none is under way)."""
        return self.updating is None and self.learner is not None and len(self.learner.buffer) >= self.learner.interval

    @property
    def save_due(self) -> bool:
        """Whether learning has waited SAVE_EVERY_S for a save (under load too)."""
        return self.dirty and time.monotonic() - self.unsaved_since >= SAVE_EVERY_S

    @property
    def pending(self) -> bool:
        """Something for idle() to do."""
        return self.dirty or self.update_due or self.updating is not None

    def observe(self, draft_ids: list[int], target_ids: list[int], reply: list[int]) -> None:
        """A reply to these prompts was served: save soon, and queue it for the drafter's next
        update, after the tail of each prompt (a training sequence keeps the reply within the
        learner's max_len); an empty reply queues nothing."""
        self._learned()
        self.last_reply = time.monotonic()
        if reply and self.learner is not None:
            tail = self.learner.cfg.max_len // 4
            self.learner.add(
                make_example(self.pair, draft_ids[-tail:], target_ids[-tail:], reply, self.learner.cfg.max_len)
            )
            self._keep_newest()

    def update(self) -> UpdateReport | None:
        """A due drafter update, whole (chat, between turns), then saved (save()). Its report, or
        None when none was due; a failure is an OmniDraftError saying what comes next."""
        if not self.update_due:
            return None
        self._start_update()
        return self._advance(busy=lambda: False)

    def idle(self, busy: Callable[[], bool] = lambda: False) -> None:
        """Between requests (serve's queue is empty): save, if no reply came for QUIET_S or
        learning has waited SAVE_EVERY_S; then a due drafter update, slice after slice until it
        ends or busy() (a request waits: the update pauses, to go on at the next idle())."""
        if time.monotonic() - self.last_reply >= QUIET_S or self.save_due:
            self.save()
        if self.update_due and not busy():
            self._start_update()
            log.info("drafter update started (%d replies)", len(self.learner.buffer))
        if self.updating is None:
            return
        try:
            report = self._advance(busy)
        except OmniDraftError as e:
            log.error("%s", e, exc_info=e.__cause__)
            return
        if report is None:
            log.info("drafter update paused: a request arrived")
        else:
            log.info("drafter update %d: loss %.3f, %.1fs", report.update, report.loss, report.seconds)

    def between_rounds(self) -> None:
        """Under constant load (serve's requests keep it busy): a save once learning has waited SAVE_EVERY_S."""
        if self.save_due:
            self.save()

    def save(self, wait_s: float = LOCK_WAIT_S) -> bool:
        """Save what was learned into the profile now (unless a failed save's backoff runs); whether
        all of it is saved. A failure is logged, and what was learned kept for the next save."""
        if self.profile is None or not self.dirty:
            return True
        if time.monotonic() < self.retry_at:
            return False
        try:
            self._save(wait_s)
        except Exception as e:
            log.warning("%s: what was learned is kept, and saved again in %gs", self._save_failed(e), self._backoff())
            return False
        return True

    def close(self) -> None:
        """The last save, at exit, dirty or not (replies cut short by the exit taught the n-grams
        too): whatever the backoff, waiting EXIT_WAIT_S at most for another process's lock; if it
        fails, says what is lost."""
        if self.profile is None:
            return
        try:
            self._save(EXIT_WAIT_S)
        except Exception as e:
            since = "its last save" if self.saves else "it started"
            log.error("%s: what this process learned since %s is lost (not saved)", self._save_failed(e), since)

    def _save(self, wait_s: float) -> None:
        start = time.monotonic()
        if self.learner is not None:  # with the drafter update its save missed, if any
            self.learner.save(wait_s)
        else:
            self.profile.save(wait_s=wait_s)
        self.dirty, self.saves, self.save_failures, self.retry_at = False, self.saves + 1, 0, 0.0
        if (seconds := time.monotonic() - start) > SLOW_S:
            log.warning("saving the profile took %.1fs", seconds)

    def _save_failed(self, e: Exception) -> str:
        """Note a failed save (the next waits for the backoff); what went wrong, in a line."""
        self.save_failures += 1
        self.retry_at = time.monotonic() + self._backoff()
        if isinstance(e, OmniDraftError):
            return str(e)
        return f"could not save the profile in {self.profile.path} ({type(e).__name__}: {e})"

    def _backoff(self) -> float:
        return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** max(0, self.save_failures - 1))

    def _learned(self) -> None:
        if not self.dirty:
            self.dirty, self.unsaved_since = True, time.monotonic()

    def _keep_newest(self) -> None:
        """Keep the newest `interval` replies while no update holds the buffer (an update stays short)."""
        if self.updating is None and self.learner is not None:
            del self.learner.buffer[: -self.learner.interval]

    def _start_update(self) -> None:
        self.updating = self.learner.update_slices(piece=1, save=False)  # saved as the rest is: save()

    def _advance(self, busy: Callable[[], bool]) -> UpdateReport | None:
        """The update under way, slice by slice until it ends, then saved (its report), or until
        busy() (None: paused)."""
        try:
            while not busy():
                failpoint("update")
                start = time.monotonic()
                next(self.updating)
                if (seconds := time.monotonic() - start) > SLOW_S:
                    log.warning("a slice of the drafter update took %.1fs (a request arriving waits for it)", seconds)
            return None
        except StopIteration as done:
            self._update_ended()
            self.update_failures = 0
            report = done.value
        except Exception as e:
            self._update_ended()
            raise self._update_failed(e) from e
        except BaseException:  # Ctrl-C: the update is postponed (its replies stay queued)
            self._update_ended()
            raise
        self.save()  # a failure keeps the update for the next save
        report.update = self.learner.updates  # the profile's count, other processes' updates in it
        return report

    def _update_ended(self) -> None:
        self.updating = None
        self._learned()
        self._keep_newest()
        self.prompt_cache.drafter_changed()  # new drafter weights: its cached prefixes are stale

    def _update_failed(self, e: Exception) -> OmniDraftError:
        """Note a failed drafter update (its training); what happens next, as an error to show."""
        self.update_failures += 1
        self.learner.buffer.clear()  # the next update learns from the next replies
        why = f"the drafter update failed ({type(e).__name__}: {e})"
        if self.update_failures < MAX_UPDATE_FAILURES:
            return OmniDraftError(f"{why}: tried again after the next {self.learner.interval} replies")
        self.learner = None
        return OmniDraftError(f"{why}, {MAX_UPDATE_FAILURES} times in a row: drafter learning stops")
