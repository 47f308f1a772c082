"""`omnidraft serve` as its clients see it: the real server process on the tiny pair, over real
HTTP, with the official `openai` client (and raw httpx requests for what a client should not send)."""

import json
import random
import threading
import time

import httpx
import pytest
from openai import OpenAI

from omnidraft_mlx.bench.load_test import ServerProcess
from omnidraft_mlx.bench.load_test import main as load_test
from omnidraft_mlx.bench.soak import main as soak
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.prompts import encode_prompt

KEY = "test-key"


def start(tiny_dirs, home, log, *args, failpoints: str = "", key: str | None = None) -> ServerProcess:
    """`serve` on the tiny pair, its home under `home`, with these failpoints armed (failpoints.py);
    its /health asked with `key` (or its --api-key)."""
    env = {"OMNIDRAFT_HOME": str(home)} | ({"OMNIDRAFT_FAILPOINTS": failpoints} if failpoints else {})
    return ServerProcess(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), log, *args, env=env, key=key)


def idle(server, timeout: float = 120) -> dict:
    """/health once nothing is generating or queued."""
    deadline = time.monotonic() + timeout
    while (h := server.health())["generating"] or h["queued"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    return h


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = start(tiny_dirs, root / "home", root / "server.log", "--api-key", KEY, "--max-tokens", "32")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()  # SIGTERM, as Ctrl-C: a clean exit


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    """The one model the server lists: the target."""
    (listed,) = client.models.list().data
    return listed.id


def greedy(tiny, prompt_ids, max_tokens):
    """The target's own greedy reply: (ids, text)."""
    model, tok = tiny["target"]
    ids = list(plain_generate(model, tok, prompt_ids, PlainStats(), max_tokens=max_tokens))
    return ids, tok.decode(ids)


def chat_greedy(tiny, messages, max_tokens):
    return greedy(tiny, encode_prompt(tiny["target"][1], messages), max_tokens)


def test_openai_client_gets_the_targets_greedy_reply(client, model, tiny, tiny_dirs):
    assert model == str(tiny_dirs["target"])
    messages = [{"role": "user", "content": "def add_3(x):"}]
    ids, text = chat_greedy(tiny, messages, 24)

    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == len(ids) == 24
    assert reply.usage.prompt_tokens == len(encode_prompt(tiny["target"][1], messages))
    spec = reply.usage.speculative  # the extra field: what the drafter did
    assert spec["proposed"] >= spec["accepted"] >= 0 and spec["rounds"] >= 1
    assert spec["tokens_per_forward"] == pytest.approx(24 / spec["rounds"], abs=1e-3)

    stream = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.speculative["proposed"] > 0

    tok = tiny["target"][1]
    ids, text = greedy(tiny, list(tok.encode("def add_5(x):")), 16)
    done = client.completions.create(model=model, prompt="def add_5(x):", max_tokens=16)
    assert done.choices[0].text == text
    streamed = client.completions.create(model=model, prompt="def add_5(x):", max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_strings_cut_the_reply(client, model, tiny):
    messages = [{"role": "user", "content": "print(add_"}]
    _, text = chat_greedy(tiny, messages, 32)
    stop = text.strip()[3:6]  # somewhere inside the reply
    reply = client.chat.completions.create(model=model, messages=messages, stop=[stop])
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=model, messages=messages, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[: text.index(stop)]


def test_a_repeated_prompt_is_served_from_the_cache(client, model):
    system = "You are a terse Python assistant. " + " ".join(f"Rule {i}: name things plainly." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "def add_9(x):"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    assert first.usage.prompt_tokens > 300
    assert first.usage.prompt_tokens_details.cached_tokens < 5  # the template's opening, shared with earlier requests
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.usage.speculative["draft_cached_tokens"] > 300
    assert again.choices[0].message.content == first.choices[0].message.content


def error_of(response, status):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return err


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    url, auth = server.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    ok = {"messages": [{"role": "user", "content": "def add_3(x):"}], "max_tokens": 4}

    def post(body, **kw):
        body_arg = {"content": body} if isinstance(body, str) else {"json": body}
        headers = {"Content-Type": "application/json", **kw.get("headers", auth)}  # as a client sends JSON
        return httpx.post(url, headers=headers, timeout=60, **body_arg)

    assert "not valid JSON" in error_of(post('{"messages": [{"role": "user"'), 400)["message"]
    assert error_of(post({**ok, "temperature": 5}), 400)["param"] == "temperature"
    assert error_of(post({**ok, "top_p": 0}), 400)["param"] == "top_p"
    assert error_of(post({**ok, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert error_of(post({"messages": []}), 400)["param"] == "messages"
    assert error_of(post({**ok, "messages": [{"role": "robot", "content": "hi"}]}), 400)["param"] == "messages.0.role"
    assert "empty prompt" in error_of(post({**ok, "messages": [{"role": "user", "content": ""}]}), 400)["message"]
    assert error_of(post({**ok, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    long = {**ok, "messages": [{"role": "user", "content": "def add_3(x): " * 1500}]}
    err = error_of(post(long), 400)
    assert err["code"] == "context_length_exceeded" and "context is 2048 tokens" in err["message"]
    assert error_of(post(ok, headers={}), 401)["code"] == "invalid_api_key"
    assert error_of(post(ok, headers={"Authorization": "Bearer wrong"}), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(server.url + "/v1/nothing", headers=auth), 404)

    # Still serving, the good request as before.
    assert post(ok).json()["usage"]["completion_tokens"] == 4
    assert server.health()["failed"] == 0  # none of those reached the engine as a failure


def ask_together(client, model, prompts: list[str], max_tokens: int, started=lambda: None) -> dict[str, str]:
    """Each prompt's streamed reply, the requests sent at once (started() runs once they are sent)."""
    got, errors = {}, []

    def ask(prompt):
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
            )
            got[prompt] = "".join(c.choices[0].delta.content or "" for c in stream)
        except Exception as e:  # reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started()
    for t in threads:
        t.join(300)
    assert not errors
    return got


def test_concurrent_clients_are_decoded_together_and_a_disconnect_leaves_the_others_unchanged(
    server, client, model, tiny
):
    before = idle(server)
    prompts = ["def add_3(x):", "print(add_", "def add_7(x):", "print(add_7(21))"]
    expected = {p: chat_greedy(tiny, [{"role": "user", "content": p}], 20)[1] for p in prompts}
    # One client starts a long reply and goes away after its first tokens, while the others are decoded.
    long = {"messages": [{"role": "user", "content": "def add_1(x):"}], "max_tokens": 1900, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=long, timeout=300, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")

        def leave():
            for line in lines:
                if '"content": "' in line:
                    break

        got = ask_together(client, model, prompts, 20, started=leave)
    assert got == expected
    after = idle(server)
    assert after["most_active"] > 1  # the replies were decoded together
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["served"] == before["served"] + len(prompts) + 1 and after["failed"] == 0


def test_requests_whose_caches_would_not_fit_wait_their_turn(tiny_dirs, tiny, tmp_path):
    """--cache-bytes bounds the active requests' caches too: with room for one, one at a time."""
    srv = start(
        tiny_dirs,
        tmp_path / "home",
        tmp_path / "server.log",
        "--cache-bytes",
        "1",
        "--no-profile",
        failpoints="prefill#SLOW~0.5",
    )
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        prompts = ["def add_3(x):", "print(add_", "def add_7(x):"]
        expected = {p: chat_greedy(tiny, [{"role": "user", "content": p}], 16)[1] for p in prompts}
        assert ask_together(client, str(tiny_dirs["target"]), prompts, 16) == expected
        health = idle(srv)
        assert health["served"] == 3 and health["most_active"] == 1 and health["prompt_cache_bytes"] <= 1
        # A request's time to first token counts from its arrival, as its client's does: each of
        # these prefills 0.5 s longer (a failpoint), so the last one admitted waited over 1 s for
        # the two before it, then prefilled.
        timed = []  # (time to first token the server reports, the client's wait for the whole reply)

        def ask(prompt):
            sent = time.monotonic()
            reply = client.chat.completions.create(
                model=str(tiny_dirs["target"]), messages=[{"role": "user", "content": prompt}], max_tokens=16
            )
            timed.append((reply.usage.speculative["time_to_first_token_s"], time.monotonic() - sent))

        threads = [threading.Thread(target=ask, args=(f"# SLOW\n{p}",)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert max(t for t, _ in timed) > 1.2 and all(t < w for t, w in timed), timed
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_only_root_goes_without_the_key(server, model):
    assert httpx.get(server.url + "/").json()["status"] == "ok"
    assert httpx.get(server.url + "/health").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [model]


def test_kill_9_while_serving_and_saving_leaves_a_profile_that_loads(tiny_dirs, tmp_path, monkeypatch):
    """Drafter updates after every reply, the n-grams and acceptance head saved whenever the
    queue empties; kill -9 at random moments, then load the profile each time: every save the
    server finished before the kill is there, and the next start serves with it."""
    from mlx_lm import load

    from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
    from omnidraft_mlx.profile.store import load_profile, profile_dir

    home, rng = tmp_path / "home", random.Random(0)
    prompts = ["print(add_", "def add_3(x):", "def add_{}(x):"]
    saved_before, version = 0, 0
    for attempt in range(3):
        srv = start(tiny_dirs, home, tmp_path / f"server-{attempt}.log", "--adapt-every", "1", "--max-tokens", "24")
        stop = threading.Event()

        def traffic(srv=srv, stop=stop):
            with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
                for i in range(1000):
                    if stop.is_set():
                        return
                    try:
                        c.chat.completions.create(
                            model=str(tiny_dirs["target"]),
                            messages=[{"role": "user", "content": prompts[i % 3].format(i)}],
                        )
                    except Exception:  # the kill lands mid-request
                        return
                    time.sleep(rng.uniform(0.0, 0.6))  # idle moments: saves and updates happen then

        t = threading.Thread(target=traffic)
        t.start()
        deadline = time.monotonic() + 120
        while srv.health()["profile_saves"] < 1 + attempt:  # some saves behind it, then a random moment
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 2.0))
        finished = srv.health()["profile_saves"]  # saves this process completed (more may end before the kill)
        srv.proc.kill()  # SIGKILL: no handler runs, a save in flight is cut short
        srv.proc.wait()
        stop.set()
        t.join(60)

        monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
        path = profile_dir(str(tiny_dirs["draft"]), str(tiny_dirs["target"]))
        draft_model, _ = load(str(tiny_dirs["draft"]))
        profile = load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), draft_model, trainable=True)
        profile.attach_policy(LearnedPolicy(PolicyConfig(name="learned")))
        manifest = json.loads((path / "manifest.json").read_text())
        assert all((path / f).exists() for f in manifest["files"].values())
        assert profile.updates >= saved_before
        assert manifest["version"] >= version + finished  # each save writes the next version: none lost
        saved_before, version = profile.updates, manifest["version"]
    assert len(profile.ngrams) > 0 and profile.updates > 0  # the n-grams and the drafter updates were saved
    srv = start(tiny_dirs, home, tmp_path / "server-after.log")  # a restart after the last kill serves
    try:
        assert srv.health()["ngrams"] == len(profile.ngrams)
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_the_soak_runs_on_the_tiny_pair(tiny_dirs, tmp_path):
    """A short soak: its checks that a short run can meet (memory after 5 minutes, drafter updates
    and pauses need the long one), each judged."""
    argv = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    argv += ["--minutes", "0.4", "--clients", "6", "--think", "0.3", "--max-tokens", "16", "--out", str(tmp_path)]
    try:
        soak(argv)
    except SystemExit:
        pass
    result = json.loads((tmp_path / "soak.json").read_text())
    checks = result["checks"]
    for name in (
        "no 5xx",
        "no hangs or lost valid requests",
        "greedy replies equal the request alone",
        "bad requests answered 4xx",
        "SIGTERM: exit 0 within 10 s",
        "restart loads the saved n-grams",
    ):
        assert checks[name], (name, result["statuses"])
    assert result["requests"] >= 10 and result["distinct_greedy_requests"] > 0
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_the_load_test_runs_on_the_tiny_pair(tiny_dirs, tmp_path):
    load_test(
        [
            "--draft",
            str(tiny_dirs["draft"]),
            "--target",
            str(tiny_dirs["target"]),
            "--clients",
            "3",
            "--requests",
            "2",
            "--max-tokens",
            "16",
            "--repeat-examples",
            "15",
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "load_test.json").read_text())
    assert [run["batch"] for run in result["runs"]] == [8, 1]  # together, then one at a time
    for run in result["runs"]:
        assert run["requests"] == run["complete"] == run["equal_to_plain"] == 6
        assert run["latency_s"]["request"]["n"] == 6 and run["throughput"]["completion_tokens"] > 0
    assert result["runs"][0]["server_health"]["most_active"] > 1 == result["runs"][1]["server_health"]["most_active"]
    assert result["first_over_last"]["completion_tokens_per_s"] > 0
    repeated = result["repeated_prompt"]
    assert repeated["same_reply"] and repeated["cached_tokens"][1] == repeated["prompt_tokens"] - 1


def test_serve_learning_while_another_process_saves_the_profile_loses_nothing(tiny_dirs, tmp_path, monkeypatch):
    """The server learns and saves (n-grams, head, a drafter update per reply) while another
    process (tests/profile_writer.py, as `omnidraft adapt` would) saves drafter updates, n-grams
    and head labels into the same profile: the profile ends with both's contributions."""
    from test_profile_lock import finish, writer

    from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
    from omnidraft_mlx.profile.store import load_head, load_profile, profile_dir

    home, go, saves = tmp_path / "home", tmp_path / "go", 5
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    path = profile_dir(str(tiny_dirs["draft"]), str(tiny_dirs["target"]))
    other = writer(tiny_dirs, path, 7, saves, go)
    srv = start(tiny_dirs, home, tmp_path / "server.log", "--adapt-every", "1", "--max-tokens", "24")
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            go.touch()
            for i in range(6):
                prompt = ["print(add_", "def add_3(x):"][i % 2]
                c.chat.completions.create(
                    model=str(tiny_dirs["target"]), messages=[{"role": "user", "content": prompt}]
                )
                time.sleep(0.6)  # idle: the server updates the drafter and saves
        finish(other)
    finally:
        assert srv.stop() == 0, srv.log.read_text()  # saves what is left

    from mlx_lm import load

    profile = load_profile(
        str(tiny_dirs["draft"]), str(tiny_dirs["target"]), load(str(tiny_dirs["draft"]))[0], trainable=True
    )
    history = profile.manifest["history"]
    theirs = [r for r in history if r.get("writer") == 7]
    assert len(theirs) == saves and len(history) > saves  # the server's updates are there too
    assert profile.updates == len(history)
    grams = set(profile.ngrams.entries)
    assert {(7000 + i, 7) for i in range(saves)} <= grams and len(grams) > saves  # the server's n-grams too
    policy = LearnedPolicy(PolicyConfig(name="learned"))
    load_head(policy, path)
    rows = {round(float(f[0])) for f in policy.head.features}
    assert {700 + i for i in range(saves)} <= rows and len(policy.head.labels) > 3 * saves  # and its head labels


def test_a_long_prompt_is_prefilled_a_chunk_per_round_beside_the_other_streams(tiny_dirs, tiny, tmp_path):
    """A long prompt admitted mid-stream is fed a chunk (512 tokens) before each round: with each
    of its prefill steps stalled (a failpoint aimed at it), the stream already running keeps
    getting tokens throughout, and both replies equal their solo greedy decodes."""
    stall = 0.5
    tok = tiny["target"][1]
    long = [{"role": "user", "content": "LONGPROMPT " + "print(add_3(9)) " * 400}]
    while max(len(encode_prompt(t, long)) for t in (tok, tiny["draft"][1])) > 1900:
        long[0]["content"] = long[0]["content"][:-16]
    assert len(encode_prompt(tok, long)) > 2 * 512 + 1  # three prefill steps at least, then its start
    running = [{"role": "user", "content": "def add_1(x):  # SLOWSTREAM"}]
    _, long_text = chat_greedy(tiny, long, 16)
    _, running_text = chat_greedy(tiny, running, 1000)
    points = f"prefill#LONGPROMPT~{stall},draft#SLOWSTREAM~0.02"  # the stream's rounds slowed to outlast it
    srv = start(tiny_dirs, tmp_path / "home", tmp_path / "server.log", "--no-profile", failpoints=points)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        body = {"messages": running, "max_tokens": 1000, "stream": True}
        arrived, text = [], []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
            lines = r.iter_lines()
            long_reply = {}

            def ask_long():
                sent = time.monotonic()
                reply = client.chat.completions.create(model=str(tiny_dirs["target"]), messages=long, max_tokens=16)
                long_reply.update(text=reply.choices[0].message.content, sent=sent, done=time.monotonic())

            asker = None
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                text.append(delta)
                arrived.append(time.monotonic())
                if asker is None:
                    asker = threading.Thread(target=ask_long)
                    asker.start()
                elif not asker.is_alive():
                    break
            asker.join(300)
        assert long_reply["text"] == long_text
        assert running_text.startswith("".join(text))
        sent, done = long_reply["sent"], long_reply["done"]
        assert done - sent >= 3 * stall  # its prefill was stalled at each of its steps
        during = [t for t in arrived if sent <= t <= done]
        gaps = [b - a for a, b in zip([sent, *during], [*during, done])]
        assert len(during) >= 3 and max(gaps) < (done - sent) / 2, gaps  # tokens throughout, not one wait
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_a_drafter_update_pauses_for_a_request_and_goes_on_when_idle(tiny_dirs, tiny, tmp_path):
    """Learning on (as `serve` runs by default): the update after 8 replies runs a slice (one
    example's gradient) at a time, each stalled 0.5 s here (4 s in all); a request sent while it
    runs is answered at once, its reply the target's own, and the update ends afterwards."""
    srv = start(tiny_dirs, tmp_path / "home", tmp_path / "server.log", "--adapt-every", "8", failpoints="update~0.5")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        model = str(tiny_dirs["target"])
        for i in range(8):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"add_{i}("}], max_tokens=8
            )
        deadline = time.monotonic() + 60
        while "drafter update started" not in srv.log.read_text():
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.1)
        time.sleep(1.2)  # the update is two or three slices in: 4 s in all
        messages = [{"role": "user", "content": "def add_3(x):"}]
        sent = time.monotonic()
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
        waited = time.monotonic() - sent
        assert reply.choices[0].message.content == chat_greedy(tiny, messages, 16)[1]
        assert waited < 2.0, srv.log.read_text()
        idle(srv)
        deadline = time.monotonic() + 60
        while "drafter update 1:" not in (log := srv.log.read_text()):  # went on when idle, and ended
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        assert log.index("drafter update paused") < log.index("drafter update 1:")
    finally:
        assert srv.stop() == 0, srv.log.read_text()
