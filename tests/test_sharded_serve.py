"""`omnidraft serve` with the target split over two ranks (`mlx.launch -n 2 --backend ring`, over
loopback; serve/follow.py): rank 0 answers the `openai` client with the target's own greedy
replies, streamed or not, cut at a stop string or left by a client that hangs up (the other rank
ends each reply at the same round, or the next reply would differ); SIGTERM to rank 0, or Ctrl-C
in a terminal (SIGINT to every rank), stops both ranks cleanly, the lead's profile saved; a rank
killed mid-reply ends the server in one line, its client told."""

import json
import os
import signal
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI
from test_distributed import LAUNCH, free_ports, profile_path, rank_pids
from test_server import chat_greedy, idle

from omnidraft_mlx.bench.load_test import ServerProcess

MAX_TOKENS = 24


def ask(client, model, prompt: str, **options) -> tuple[str, str]:
    """(the reply's text, its finish reason); streamed with stream=True."""
    messages = [{"role": "user", "content": prompt}]
    if not options.pop("stream", False):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, **options)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = [
        c
        for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True, **options
        )
        if c.choices
    ]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@contextmanager
def a_long_reply_streaming(server, model):
    """A streamed request for a long reply, once its first text has come: the rest of its lines (leaving
    the block hangs up)."""
    body = {"model": model, "messages": [{"role": "user", "content": "def add_1(x):"}], "max_tokens": 1000}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        # Decoded text, not the opening chunk's empty content (sent before the job is even started).
        assert next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        yield lines


@contextmanager
def serving_on_two_ranks(home, tiny_dirs):
    """`omnidraft serve` on the tiny pair under `mlx.launch -n 2` (ring, loopback): the server and
    its ranks' pids; ranks left running at the end are killed (stopping a launcher does not)."""
    launch = (LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)), "--")
    server = ServerProcess(
        str(tiny_dirs["draft"]),
        str(tiny_dirs["target"]),
        home / "server.log",
        "--shard",
        "tensor",
        env={"OMNIDRAFT_HOME": str(home), "OMNIDRAFT_STUCK_S": "5"},  # a rank stuck on a killed one: 5 s
        launch=launch,
    )
    ranks = rank_pids(server.proc.pid)
    try:
        assert sorted(ranks) == [0, 1]
        yield server, ranks
    finally:
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()


@pytest.mark.parametrize("stopped", [[0], [0, 1]], ids=["SIGTERM to rank 0", "SIGINT to both ranks"])
def test_two_ranks_serve_the_targets_greedy_replies_and_stop_together(tmp_path, tiny_dirs, tiny, stopped):
    model = str(tiny_dirs["target"])
    with serving_on_two_ranks(tmp_path, tiny_dirs) as (server, ranks):
        # Ranks out of step would hang in a collective: a short timeout fails the test instead.
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        want = {
            p: chat_greedy(tiny, [{"role": "user", "content": p}], MAX_TOKENS)[1]
            for p in ("def add_3(x):", "print(add_")
        }
        assert ask(client, model, "def add_3(x):") == (want["def add_3(x):"], "length")
        assert ask(client, model, "print(add_", stream=True) == (want["print(add_"], "length")
        # The lead ends these replies before the target does: a stop string, a client gone.
        text = want["def add_3(x):"]
        stop = text.strip()[3:6]
        assert ask(client, model, "def add_3(x):", stop=[stop]) == (text[: text.index(stop)], "stop")
        with a_long_reply_streaming(server, model):
            pass  # the client hangs up
        assert ask(client, model, "print(add_") == (want["print(add_"], "length")  # the ranks are still in step
        health = idle(server)
        assert (health["served"], health["cancelled"], health["failed"]) == (5, 1, 0)
        for rank in stopped:  # the lead stops after the round under way, the other rank with it
            os.kill(ranks[rank], signal.SIGTERM if stopped == [0] else signal.SIGINT)
        assert server.proc.wait(120) == 0
    log = server.log.read_text()
    assert "was killed" not in log and "exited with code" not in log and "Traceback" not in log, log  # both exited 0
    assert log.count("serving '") == 1 and "2 ranks: rank 0 answers HTTP; one request decoded at a time" in log
    manifest = json.loads((profile_path(tmp_path) / "manifest.json").read_text())  # saved by the lead
    assert {"ngrams", "history"} <= set(manifest["files"])


def test_a_rank_killed_mid_reply_ends_the_server_in_one_line(tmp_path, tiny_dirs):
    with serving_on_two_ranks(tmp_path, tiny_dirs) as (server, ranks):
        with a_long_reply_streaming(server, str(tiny_dirs["target"])) as rest:
            os.kill(ranks[1], signal.SIGKILL)
            try:
                said = "\n".join(rest)
            except httpx.RemoteProtocolError:  # the lead ended without a word to the client (below)
                said = ""
        assert server.proc.wait(120) == 0  # the launcher's own status, whatever its ranks did
    log = server.log.read_text()
    assert "Node with rank 1 exited with code -9" in log and "Node with rank 0 exited with code 1" in log, log
    assert "Traceback" not in log, log
    # The lead's collective with the killed rank fails, or (MLX's ring backend does not always fail it) waits
    # until the launcher's SIGTERM makes the lead end itself (collectives.handle_signals: "in one call").
    if "in one call" not in log:
        assert "another rank of this mlx.launch has ended" in log, log
        assert '{"error": {"message": "a rank of the server has ended"' in said
