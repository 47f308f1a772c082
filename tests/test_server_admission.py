"""Admission in `omnidraft serve` (serve/admission.py): who may wait, in what order, and who is let go.
The real server process on the tiny pair over real HTTP, slowed where a test needs time by failpoints
aimed at single requests: a full queue and a client past its share get 429 with Retry-After, too
many connections 503, the requests waiting at shutdown 503; a client that hangs up on a whole reply
is cancelled within a round; short prompts are not made to wait behind a long prefill (over HTTP, and
in the engine's own steps: what it feeds, whom it admits)."""

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
from test_server import chat_greedy, idle, start

from omnidraft_mlx.decode.speculative import SpecConfig
from omnidraft_mlx.prompts import encode_prompt
from omnidraft_mlx.serve.admission import CREDIT_PER_S, Waiting, prompt_left, turn
from omnidraft_mlx.serve.config import ServeConfig
from omnidraft_mlx.serve.engine import PAUSE_S, Engine
from omnidraft_mlx.serve.jobs import Job
from omnidraft_mlx.serve.schema import ApiError, ChatRequest


def job(tokens: int, arrived: float, client: str = "address 127.0.0.1") -> Job:
    return Job(list(range(tokens)), list(range(tokens)), SpecConfig(), [], None, None, arrived=arrived, client=client)


def test_fewest_prompt_tokens_go_first_and_a_long_wait_goes_before_later_arrivals():
    now = 1000.0
    long, short = job(1500, now - 1), job(20, now - 0.5)
    assert turn(short, prompt_left(short), now, 0) < turn(long, prompt_left(long), now, 0)  # short first
    waited = (1500 + 1) / CREDIT_PER_S  # long enough to go before a fresh one-token prompt
    aged, fresh = job(1500, now - waited), job(2, now)
    assert turn(aged, prompt_left(aged), now, 0) < turn(fresh, prompt_left(fresh), now, 0)  # not starved
    together = [job(1500, now - 60), job(20, now - 60)]  # all waited long: still the short first
    assert min(together, key=lambda j: turn(j, prompt_left(j), now, 0)) is together[1]

    waiting = Waiting(most=2)
    waiting.put(long)
    waiting.put(short)
    assert waiting.first(now, Counter()) is short
    with pytest.raises(ApiError) as full:
        waiting.put(job(5, now))
    assert full.value.status == 429 and "--max-queue" in full.value.message
    assert full.value.headers["Retry-After"]
    assert waiting.close() == [long, short] and len(waiting) == 0
    with pytest.raises(ApiError) as closed:
        waiting.put(job(5, now))
    assert closed.value.status == 503


def test_a_client_with_fewer_requests_decoding_goes_first():
    """A flood's requests wait behind another client's, however short they are: turn() counts
    what each client has decoding already, before the prompts' lengths."""
    now, waiting = 1000.0, Waiting(most=8)
    flood = [job(5, now - 2 + i / 10, "key mallory") for i in range(4)]
    alice = job(200, now - 0.1, "key alice")
    for j in [*flood, alice]:
        waiting.put(j)
    assert waiting.first(now, Counter({"key mallory": 4})) is alice
    assert waiting.first(now, Counter()) is flood[0]  # nothing decoding: the shortest first


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat_body(text: str, max_tokens: int, stream: bool = False) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}


def test_a_full_queue_and_a_client_past_its_share_get_429_then_shutdown_503(tiny_dirs, tiny, tmp_path):
    """--batch 1, --max-queue 2, --max-per-client 2, two keys: alice's stream runs (slowed), her
    second request waits; her third is past her share; bob's first waits, the queue is then full
    and his second is refused. Each 429 says which limit and when to retry; the waiting requests
    are served as alone once the stream ends, and alice may send again. Too many open connections
    get 503. At SIGTERM a waiting request gets 503."""
    keys = tmp_path / "keys"
    keys.write_text("alice:key-alice\nbob:key-bob\n")
    srv = start(
        tiny_dirs,
        tmp_path / "home",
        tmp_path / "server.log",
        *("--api-keys-file", str(keys), "--no-profile", "--batch", "1", "--max-queue", "2"),
        *("--max-per-client", "2", "--max-connections", "12"),
        failpoints="draft#SLOWSTREAM~0.05",
        key="key-alice",
    )
    url = srv.url + "/v1/chat/completions"
    replies = {}

    def ask(name: str, key: str, text: str) -> None:
        replies[name] = httpx.post(url, json=chat_body(text, 12), headers=auth(key), timeout=300)

    def waiting(n: int) -> None:
        deadline = time.monotonic() + 60
        while srv.health()["queued"] < n:
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.05)

    try:
        body = chat_body("def add_1(x):  # SLOWSTREAM", 1000, stream=True)
        with httpx.stream("POST", url, json=body, headers=auth("key-alice"), timeout=300) as stream:
            lines = stream.iter_lines()
            while '"content": "' not in next(lines):  # alice's stream runs
                pass
            threads = [threading.Thread(target=ask, args=("alice", "key-alice", "def add_3(x):"))]
            threads[0].start()
            waiting(1)
            over_share = httpx.post(url, json=chat_body("print(add_", 4), headers=auth("key-alice"), timeout=60)
            threads.append(threading.Thread(target=ask, args=("bob", "key-bob", "print(add_")))
            threads[1].start()
            waiting(2)
            queue_full = httpx.post(url, json=chat_body("def add_7(x):", 4), headers=auth("key-bob"), timeout=60)
        for t in threads:
            t.join(300)

        for refused, limit in ((over_share, "--max-per-client"), (queue_full, "--max-queue")):
            assert refused.status_code == 429, refused.text
            assert limit in refused.json()["error"]["message"] and int(refused.headers["Retry-After"]) >= 1
        for name, text in (("alice", "def add_3(x):"), ("bob", "print(add_")):
            assert replies[name].status_code == 200, replies[name].text
            content = replies[name].json()["choices"][0]["message"]["content"]
            assert content == chat_greedy(tiny, [{"role": "user", "content": text}], 12)[1]
        idle(srv)
        again = httpx.post(url, json=chat_body("print(add_", 4), headers=auth("key-alice"), timeout=60)
        assert again.status_code == 200, again.text

        # Connections past --max-connections: uvicorn answers 503 until some close.
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(12)]
        try:
            assert httpx.get(srv.url + "/v1/models", headers=auth("key-bob"), timeout=30).status_code == 503
        finally:
            for s in held:
                s.close()
        time.sleep(0.5)
        assert httpx.get(srv.url + "/v1/models", headers=auth("key-bob"), timeout=30).status_code == 200

        # At shutdown, a waiting request is told 503, not dropped.
        with httpx.stream("POST", url, json=body, headers=auth("key-alice"), timeout=300) as stream:
            lines = stream.iter_lines()
            while '"content": "' not in next(lines):
                pass
            waiter = threading.Thread(target=ask, args=("late", "key-bob", "def add_3(x):"))
            waiter.start()
            waiting(1)
            srv.proc.terminate()
            waiter.join(60)
        assert replies["late"].status_code == 503 and "shutting down" in replies["late"].text
        assert srv.proc.wait(30) == 0, srv.log.read_text()
    finally:
        srv.stop()


def test_a_client_that_hangs_up_on_a_whole_reply_is_cancelled_within_a_round(tiny_dirs, tmp_path):
    """A non-streamed request for 2000 tokens, each round slowed to 0.05 s: its client gives up
    after 2 s; the server cancels it at once (not after decoding the rest for nobody) and is idle."""
    srv = start(tiny_dirs, tmp_path / "home", tmp_path / "server.log", "--no-profile", failpoints="draft#HANGUP~0.05")
    try:
        before = idle(srv)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/chat/completions", json=chat_body("def add_1(x):  # HANGUP", 2000), timeout=2)
        left = time.monotonic()
        while (h := srv.health())["generating"] or h["cancelled"] == before["cancelled"]:
            assert time.monotonic() - left < 2.0, (h, srv.log.read_text())
            time.sleep(0.05)
        assert h["cancelled"] == before["cancelled"] + 1 and h["failed"] == 0
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_short_prompts_are_not_made_to_wait_behind_a_long_prefill(tiny_dirs, tiny, tmp_path):
    """A long prompt's prefill, each of its steps stalled 0.4 s (a failpoint aimed at it), is under
    way when three short prompts arrive: their first tokens come before the long one's, and every
    reply, the long one's too, equals its request decoded alone."""
    tok = tiny["target"][1]
    long = "LONGPROMPT " + "print(add_3(9)) " * 400
    while max(len(encode_prompt(t, [{"role": "user", "content": long}])) for t in (tok, tiny["draft"][1])) > 1900:
        long = long[:-16]
    assert len(encode_prompt(tok, [{"role": "user", "content": long}])) > 2 * 512 + 1  # three prefill steps at least
    shorts = ["def add_3(x):", "print(add_", "def add_7(x):"]
    srv = start(
        tiny_dirs, tmp_path / "home", tmp_path / "server.log", "--no-profile", failpoints="prefill#LONGPROMPT~0.4"
    )
    first, text = {}, {}

    def ask(prompt: str) -> None:
        body = chat_body(prompt, 16, stream=True)
        pieces = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (piece := json.loads(line[6:])["choices"][0]["delta"].get("content")):
                    first.setdefault(prompt, time.monotonic())  # its first token
                    pieces.append(piece)
        text[prompt] = "".join(pieces)

    try:
        asker = threading.Thread(target=ask, args=(long,))
        asker.start()
        deadline = time.monotonic() + 60
        while not srv.health()["generating"]:  # its prefill has begun
            assert time.monotonic() < deadline
            time.sleep(0.05)
        threads = [threading.Thread(target=ask, args=(p,)) for p in shorts]
        for t in threads:
            t.start()
        for t in [*threads, asker]:
            t.join(300)
        assert all(first[p] < first[long] for p in shorts), {p[:12]: first[p] - first[long] for p in shorts}
        for prompt in [*shorts, long]:
            assert text[prompt] == chat_greedy(tiny, [{"role": "user", "content": prompt}], 16)[1], prompt
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_a_long_prompt_is_fed_a_pause_at_a_time_and_gives_its_place_to_a_short_one(
    tiny_dirs, tiny, tmp_path, monkeypatch
):
    """The engine's steps run here, one at a time (--batch 2). A long prompt alone is fed what the
    measured rate feeds in PAUSE_S, not a whole chunk (on a slow machine, seconds in which requests
    that arrive wait). Two short prompts arrive: the first takes the free place, the second the long
    one's, which waits again, what it fed kept in the prompt cache. Every reply equals its request
    decoded alone, the long one's too."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    cfg = ServeConfig(
        draft=str(tiny_dirs["draft"]), target=str(tiny_dirs["target"]), batch=2, profile=False, adapt=False
    )
    engine, loop = Engine(cfg), asyncio.new_event_loop()
    engine.load()

    def request(text: str) -> Job:
        messages = [{"role": "user", "content": text}]
        return engine.jobs.prepare(messages, False, ChatRequest(messages=messages, max_tokens=16), loop)

    long_text, short_texts = "print(add_3(9)) " * 60, ["def add_3(x):", "print(add_"]
    long = request(long_text)
    engine.submit(long)
    engine.prefill_rate = 100.0  # prompt tokens a second, as measured on a slow machine
    engine._step()
    assert [p.job for p in engine.prefilling] == [long] and not engine.active
    assert prompt_left(long) - engine.prefilling[0].left == int(100.0 * PAUSE_S)

    shorts = [request(text) for text in short_texts]
    for j in shorts:
        engine.submit(j)
    engine._step()
    assert [r.job for r in engine.active] == shorts and not engine.prefilling
    assert engine.waiting.jobs == [long]

    while engine.generating or engine.queued:
        engine._step()
    loop.run_until_complete(asyncio.sleep(0))  # the events the engine emitted
    done = {}
    for j, text in [(long, long_text), *zip(shorts, short_texts)]:
        events = [j.events.get_nowait() for _ in range(j.events.qsize())]
        assert events[-1][0] == "done", events[-1]
        reply = "".join(piece for kind, piece in events if kind == "text")
        assert reply == chat_greedy(tiny, [{"role": "user", "content": text}], 16)[1], text
        done[text] = events[-1][1]
    assert done[long_text].cached_tokens >= int(100.0 * PAUSE_S)  # what it fed before it gave its place
    loop.close()
