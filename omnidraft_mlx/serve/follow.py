"""`omnidraft serve` under mlx.launch: rank 0 answers HTTP, the other ranks follow its replies.

    mlx.launch -n 2 --backend ring -- omnidraft serve --shard tensor ...

Every forward of a target split over ranks is a collective (decode/ranks.py), so every rank
decodes the same replies, in the same order, round by round:
- before each reply the lead shares its job (share_job: the prompt's target ids and the reply's
  settings, by collectives.broadcast_bytes); a follower decodes it with the same Decoding and
  drops the text: stop strings, log-probabilities and the HTTP reply stay on the lead;
- a reply the lead leaves before it is done (a stop string, a client gone, a failure) ends on
  every rank at the same round (Ranks.end: the others' next plan raises Ended);
- when the server stops (Ctrl-C or SIGTERM: the lead stops between two steps, so never inside
  a round), the lead shares an empty job and the followers return.

What the server does differently over ranks (on_ranks): one reply at a time, its whole prompt
prefilled at once (a batch and chunked prefill would need every admission shared too); no
prompt cache (a rank's caches hold its own part of the heads or layers, so a byte budget would
evict differently on each, and a cached prefix must be the same on all); no drafter updates
while serving (an update runs the target's forward, which every rank would have to join). The
n-gram cache, the acceptance head and the history index learn on the lead as in one process,
and are saved in its profile: they never run the target, and greedy output stays the target's
whatever they learn.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import asdict, replace

from omnidraft_mlx.collectives import broadcast_bytes, handle_signals
from omnidraft_mlx.decode.ranks import Ended, Ranks
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_alone
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.serve.config import ServeConfig

log = logging.getLogger("omnidraft.serve")


def on_ranks(cfg: ServeConfig, ranks: int) -> tuple[ServeConfig, str]:
    """The settings of a server over `ranks` ranks, and the line that says what changes."""
    batch = f" (--batch {cfg.batch} is for one process)" if cfg.batch > 1 else ""
    said = (
        f"{ranks} ranks: rank 0 answers HTTP; one request decoded at a time{batch}, no prompt cache, "
        "no drafter updates while serving"
    )
    return replace(cfg, batch=1, cache_bytes=0, adapt=False), said


def share_job(ranks: Ranks, target_ids: list[int], spec: SpecConfig) -> None:
    """The lead: the reply to decode next, to the followers (follow)."""
    if ranks.group is not None:
        broadcast_bytes(json.dumps({"target_ids": target_ids, "spec": asdict(spec)}).encode(), ranks.group)


def stop_following(ranks: Ranks) -> None:
    """The lead: no more replies; the followers return."""
    if ranks.group is not None:
        broadcast_bytes(b"", ranks.group)


def follow(pair: Pair) -> None:
    """A follower: decode the lead's replies until it stops serving. A stop signal here waits for
    the lead's (Ctrl-C reaches every rank); a follower left waiting on a lead that ended, ends
    (collectives.handle_signals)."""
    group = pair.ranks.group

    def on_signal(signum, frame):
        log.warning("rank %d: %s: stopping when rank 0 stops serving", group.rank(), signal.Signals(signum).name)

    with handle_signals(on_signal, (signal.SIGINT, signal.SIGTERM), group, log.warning):
        while job := broadcast_bytes(b"", group):
            shared = json.loads(job)
            decoding = Decoding(pair, [], shared["target_ids"], SpecConfig(**shared["spec"]), SpecStats())
            try:
                for _ in decode_alone(decoding):
                    pass
            except Ended:
                pass
            finally:
                decoding.close()
