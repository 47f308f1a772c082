"""`omnidraft serve`: an OpenAI-compatible HTTP API over a drafter/target pair.

This module starts it: the engine (engine.py) loads the pair and decodes
in the main thread, the HTTP server (uvicorn, serving routes.py's app)
runs in another; Ctrl-C or SIGTERM stops both, and what the pair learned is
saved. Under mlx.launch rank 0 does all this and the other ranks follow (follow.py).
The parts, each its own module in serve/:
  config.py      the server's settings (ServeConfig)
  schema.py      the OpenAI request bodies, checked; ApiError
  routes.py      the FastAPI app: routes, error bodies, the API key
  replies.py     a job's events as one JSON reply or server-sent events
  engine.py      the queue and the active requests, decoded together a round at a time
  admission.py   who may wait (queue, per-client share: 429; shutting down: 503), in what order
  jobs.py        a request's decode: prompts encoded, its decoding on the prompt cache, its events
  text.py        the reply's text cut at stop strings, split into content and tool calls
  tools.py       tools to the chat template, tool_choice, the target's tool-call parser
  logprobs.py    the target's log-probabilities of the tokens it emitted
and decode/batch.py: one target forward over the active requests' drafts; learn/online.py:
learning from the replies and saving it into the profile (as chat does).
Prompt caches are kept between requests (decode.promptcache.PromptCache), so a resent
system prompt or conversation is not prefilled again.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading
import time
from contextlib import nullcontext

from omnidraft_mlx.collectives import handle_signals, world
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.paths import LOCAL, Resolver
from omnidraft_mlx.serve.config import ServeConfig
from omnidraft_mlx.serve.engine import Engine
from omnidraft_mlx.serve.follow import follow
from omnidraft_mlx.serve.keys import load_keys
from omnidraft_mlx.serve.routes import make_app

log = logging.getLogger("omnidraft.serve")


def loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def serve(
    cfg: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8080,
    on_ready=lambda engine: None,
    resolver: Resolver = LOCAL,
) -> None:
    """Load the pair (its models found by `resolver`), serve until interrupted (Ctrl-C,
    SIGTERM), then save what was learned. Under mlx.launch the ranks other than 0 follow."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    group = world()
    if group.rank() > 0:
        engine = Engine(cfg, resolver)
        engine.load()
        follow(engine.pair)
        return
    keys = load_keys(cfg.api_key, cfg.api_keys_file)  # a bad keys file stops it before the models load
    if keys is None and not loopback(host):
        log.warning(
            "WARNING: serving on %s with NO API KEY: anyone who can reach this address can use the models "
            "and read their replies. Give --api-key or --api-keys-file, or --host 127.0.0.1.",
            host,
        )
    engine = Engine(cfg, resolver)
    engine.load()
    http = uvicorn.Server(
        uvicorn.Config(
            make_app(engine, keys),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            limit_concurrency=cfg.max_connections,  # past it uvicorn answers 503 (admission.py)
        )
    )
    web = threading.Thread(target=http.run, name="omnidraft-http", daemon=True)
    web.start()
    while not http.started:  # uvicorn says why when it cannot listen, and its thread ends
        if not web.is_alive():
            raise OmniDraftError(f"could not listen on {host}:{port}: is another server using that port?")
        time.sleep(0.05)
    on_ready(engine)
    stop = threading.Event()
    if group.size() == 1:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
        signals = nullcontext()
    else:  # the engine stops between two steps, never inside a round the other ranks share (follow.py)
        signals = handle_signals(
            lambda signum, _: _stop(stop, signum), (signal.SIGINT, signal.SIGTERM), group, log.warning
        )
    with signals:
        try:
            engine.run(lambda: web.is_alive() and not stop.is_set())
        except KeyboardInterrupt:
            pass
        finally:
            # A second one must not cut the final save short (over ranks it is _stop's: the save comes
            # first, and a lead left waiting on a rank that ended must still end: handle_signals).
            for sig in (signal.SIGINT, signal.SIGTERM) if group.size() == 1 else ():
                signal.signal(sig, signal.SIG_IGN)
            http.should_exit = True  # lets the open requests end (they get the shutdown error), then stops
            engine.shutdown()
            web.join()


def _stop(stop: threading.Event, signum: int) -> None:
    log.warning("%s: stopping after the round under way", signal.Signals(signum).name)
    stop.set()
