"""`omnidraft serve` when something fails inside it: the real server process on the tiny pair, with
failpoints (omnidraft_mlx/failpoints.py) aimed at single requests by a marker in their text.
A failure in one request's prefill, drafting, verification or finishing fails that request with
an OpenAI error and no other; one in learning from a reply or in saving costs only that lesson
or that save; SIGTERM inside a save exits cleanly with everything learned saved; and many
clients encoding long prompts at once do not share a tokenizer."""

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI
from test_server import chat_greedy, greedy, idle, start

FAILING = ("prefill", "draft", "verify", "finish")
ARMED = ",".join([f"{name}#FAIL_{name.upper()}" for name in (*FAILING, "learn")] + ["save@1"])


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    srv = start(tiny_dirs, root / "home", root / "server.log", "--max-tokens", "20", "--no-adapt", failpoints=ARMED)
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_failure_inside_one_request_fails_that_request_only(server, client, tiny, tiny_dirs):
    model = str(tiny_dirs["target"])
    before = idle(server)
    # A long reply decoded beside the others, so the failing verification is a batched one.
    companion, companion_tokens = "def add_1(x):", 600
    got, errors = {}, {}

    def ask(text: str) -> None:
        try:
            reply = client.chat.completions.create(model=model, messages=messages(text), max_tokens=20)
            got[text] = reply.choices[0].message.content
        except openai.APIStatusError as e:
            errors[text] = e

    streamed: list[str] = []
    first = threading.Event()

    def follow() -> None:
        stream = client.chat.completions.create(
            model=model, messages=messages(companion), max_tokens=companion_tokens, stream=True
        )
        for chunk in stream:
            streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if streamed[-1]:
                first.set()

    follower = threading.Thread(target=follow)
    follower.start()
    assert first.wait(120)
    marked = {name: f"def add_3(x): # FAIL_{name.upper()}" for name in (*FAILING, "learn")}
    plain = ["print(add_", "def add_7(x):"]
    threads = [threading.Thread(target=ask, args=(text,)) for text in [*marked.values(), *plain]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    follower.join(300)

    for name in FAILING:  # each failed with an OpenAI error body, not a traceback
        e = errors.pop(marked[name])
        assert e.status_code == 500 and "FailpointError" in e.message and "Traceback" not in e.message, name
    assert not errors
    for text in [*plain, marked["learn"]]:  # the others: as each decodes alone (learning failed after the reply)
        assert got[text] == chat_greedy(tiny, messages(text), 20)[1], text
    assert "".join(streamed) == chat_greedy(tiny, messages(companion), companion_tokens)[1]

    after = idle(server)
    assert after["failed"] == before["failed"] + len(FAILING)
    assert after["served"] == before["served"] + len(plain) + 2
    deadline = time.monotonic() + 60
    while "could not save the profile" not in (log := server.log.read_text()):  # the first save failed ...
        assert time.monotonic() < deadline, log  # (saves wait for 2 s without a reply)
        time.sleep(0.2)
    assert "verifying them one at a time" in log  # the batch was retried row by row, not failed whole
    assert "learning from a reply failed" in log
    while server.health()["profile_saves"] < 1:  # ... and the next one, after the next reply, did not
        client.chat.completions.create(model=model, messages=messages("print(add_"), max_tokens=4)
        assert time.monotonic() < deadline, log
        time.sleep(1.0)


def test_many_clients_encoding_long_prompts_at_once(server, tiny, tiny_dirs):
    """The HTTP threads encode prompts while the engine decodes: each gets its own prompt's reply."""
    model, tok = str(tiny_dirs["target"]), tiny["target"][1]
    # A client of its own: no kept-alive connection that the server may be closing as it is reused.
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [f"# {i}\n" + "".join(f"def add_{i + j}(x): return x + {i * j}\n" for j in range(60)) for i in range(16)]
    got, errors = {}, []

    def ask(prompt: str) -> None:
        try:
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=3)
            got[prompt] = (reply.usage.prompt_tokens, reply.choices[0].text)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    for prompt in prompts:
        ids = list(tok.encode(prompt))
        assert len(ids) > 700
        assert got[prompt] == (len(ids), greedy(tiny, ids, 3)[1])


def test_sigterm_inside_saves_exits_cleanly_with_everything_learned(tiny_dirs, tmp_path, monkeypatch):
    from omnidraft_mlx.profile.store import load_profile

    home, log = tmp_path / "home", tmp_path / "server.log"
    srv = start(tiny_dirs, home, log, "--max-tokens", "24", "--no-adapt", failpoints="save~3")  # every save takes 3 s
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            for text in ("def add_3(x):", "print(add_"):
                c.chat.completions.create(model=str(tiny_dirs["target"]), messages=messages(text))
        learned = idle(srv)["ngrams"]
        assert learned > 0
        time.sleep(1.5)  # the queue has been empty 0.5 s: the save is under way
        sent = time.monotonic()
        srv.proc.terminate()
        time.sleep(2.0)  # the first save is over; the final one, on the way out, is under way
        srv.proc.terminate()  # a second SIGTERM does not cut it short
        assert srv.proc.wait(10) == 0, srv.log.read_text()
        assert time.monotonic() - sent < 10
    finally:
        srv.stop()
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    assert len(load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"])).ngrams) == learned
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/health", timeout=2)


def test_sigterm_mid_stream_ends_the_stream_saves_and_exits_within_10_s(tiny_dirs, tmp_path, monkeypatch):
    from omnidraft_mlx.profile.store import load_profile

    # Learning on, as `serve` runs by default.
    srv = start(tiny_dirs, tmp_path / "home", tmp_path / "server.log", "--adapt-every", "1")
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            c.chat.completions.create(model=str(tiny_dirs["target"]), messages=messages("print(add_"), max_tokens=16)
        deadline = time.monotonic() + 60
        while "drafter update 1:" not in srv.log.read_text():  # its update over (one a request would pause)
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.1)
        body = {"messages": messages("def add_1(x):"), "max_tokens": 1900, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            while '"content": "' not in next(lines):  # the reply has begun
                pass
            while not (learned := srv.health()["ngrams"]):  # the reply's n-grams so far: some
                next(lines)
            sent = time.monotonic()
            srv.proc.terminate()
            rest = [line for line in lines if line.startswith("data: ")]
        assert "shutting down" in rest[-2] and rest[-1] == "data: [DONE]"  # the client is told, not cut off
        assert srv.proc.wait(10) == 0, srv.log.read_text()
        assert time.monotonic() - sent < 10
    finally:
        srv.stop()
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    assert len(load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"])).ngrams) >= learned > 0
