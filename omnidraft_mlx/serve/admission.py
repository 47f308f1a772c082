"""Who may wait for the engine of `omnidraft serve`, and in what order.

A request is refused rather than left to wait without end: 429 with Retry-After when --max-queue
requests wait already (Waiting), or when its client (its API key's name where the server has keys,
else its address) has --max-per-client requests under way (ClientShare: one client's flood does
not starve the others); 503 once the server is shutting down. --max-connections (uvicorn's
limit_concurrency, server.py) bounds the open connections, so a flood of them cannot use up the
process's open files.

The engine admits waiting requests, and feeds the prompts it has begun, in turn() order (with all
--batch places taken, a waiting request whose turn comes first takes a prompt being fed's place): the
fewest prompt tokens left to feed first (a short prompt does not wait behind other clients' long
prefills), each request its client has decoding counting as HELD_TOKENS more (one client's flood
does not crowd out another's turn), and every second waited as CREDIT_PER_S fewer (a long prompt
is never starved: it waits at most its length / CREDIT_PER_S behind later, shorter ones).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from omnidraft_mlx.serve.keys import SCOPE_NAME
from omnidraft_mlx.serve.schema import ApiError

if TYPE_CHECKING:
    from omnidraft_mlx.serve.jobs import Job

CREDIT_PER_S = 100.0  # prompt tokens of precedence a request earns per second it waits
HELD_TOKENS = 512  # each request its client has decoding counts as this many prompt tokens more
RETRY_AFTER_S = 1  # what a refused client is told to wait before it tries again


def busy(message: str) -> ApiError:
    """A 429: the client may try again soon (Retry-After)."""
    return ApiError(
        429, message, code="rate_limit_exceeded", kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", headers={"Retry-After": "5"})


def turn(job: Job, left: int, now: float, held: int) -> tuple:
    """A request's place in line for prefill, smallest first: `left`, the prompt tokens it has left to
    feed, plus HELD_TOKENS for each of the `held` requests its client has decoding, less CREDIT_PER_S
    for each second it has waited; then by arrival. (Once every request has waited a while, a cut-off
    age would serve them in arrival order, the long before the short: the credit keeps their order.)"""
    return (left + HELD_TOKENS * held - CREDIT_PER_S * (now - job.arrived), job.arrived)


def prompt_left(job: Job) -> int:
    """The prompt tokens a queued request will feed (its prompt cache's share is not looked up until
    it is admitted), in the model's tokens that has more of them, as Prefill.left counts."""
    return max(len(job.draft_ids), len(job.target_ids)) - 1


class Waiting:
    """The requests queued for the engine: at most `most`; none once closed (shutting down).
    Requests are put in from the HTTP side; only the engine's thread takes them out."""

    def __init__(self, most: int):
        self.most, self.jobs, self.closed = most, [], False
        self.changed = threading.Condition()

    def __len__(self) -> int:
        return len(self.jobs)

    def put(self, job: Job) -> None:
        with self.changed:
            if self.closed:
                raise shutting_down()
            if len(self.jobs) >= self.most:
                raise busy(
                    f"{len(self.jobs)} requests are waiting already, as many as this server queues "
                    "(its --max-queue): try again shortly"
                )
            self.jobs.append(job)
            self.changed.notify()

    def wait(self, timeout: float) -> bool:
        """Whether a request waits, after waiting up to `timeout` seconds for one."""
        with self.changed:
            return self.changed.wait_for(lambda: self.jobs, timeout)

    def first(self, now: float, held: Counter[str]) -> Job | None:
        """The request whose turn() comes first (`held`: the requests each client has decoding)."""
        with self.changed:
            return min(self.jobs, key=lambda job: turn(job, prompt_left(job), now, held[job.client]), default=None)

    def put_back(self, job: Job) -> None:
        """A request the engine took out to feed, back to wait (beyond --max-queue: it had its place)."""
        with self.changed:
            self.jobs.append(job)

    def remove(self, job: Job) -> None:
        with self.changed:
            self.jobs.remove(job)

    def cancelled(self) -> list[Job]:
        """Take out the requests whose clients went away."""
        with self.changed:
            gone = [job for job in self.jobs if job.cancelled.is_set()]
            self.jobs = [job for job in self.jobs if not job.cancelled.is_set()]
        return gone

    def longest_wait(self) -> float:
        """Seconds the request waiting longest has waited (0: none waits)."""
        with self.changed:
            return time.monotonic() - min(job.arrived for job in self.jobs) if self.jobs else 0.0

    def close(self) -> list[Job]:
        """Refuse requests from now on (503); the ones waiting, taken out."""
        with self.changed:
            self.closed = True
            jobs, self.jobs = self.jobs, []
        return jobs


def client_of(scope) -> str:
    """Whose request it is: its API key's name where the server has keys, else its address."""
    if name := scope.get(SCOPE_NAME):
        return "key " + name
    return "address " + (scope.get("client") or ("unknown",))[0]


class ClientShare:
    """ASGI middleware: a client (client_of) has at most `most` POST requests under way (queued, being
    encoded or decoded, being sent); past that, a 429. `refuse(path, error)` is the error response in
    the shape of the path's API. It runs inside the key check, so a request's key name is known."""

    def __init__(self, app, most: int, refuse):
        self.app, self.most, self.refuse = app, most, refuse
        self.held: Counter[str] = Counter()  # only the event loop's thread counts: no lock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        client = client_of(scope)
        if self.held[client] >= self.most:
            error = busy(
                f"this client has {self.most} requests under way, as many as one client may have "
                "(the server's --max-per-client): wait for one to end"
            )
            return await self.refuse(scope["path"], error)(scope, receive, send)
        self.held[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.held[client] -= 1
            if not self.held[client]:
                del self.held[client]
