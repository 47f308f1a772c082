"""`omnidraft serve` shared by several clients, a key each (--api-keys-file): the real server
process on the tiny pair, over real HTTP. A client cannot use, nor learn anything of, another's
cached prompts or stored responses; keys come and go without a restart; a key that cannot be
meant (empty) stops the server before it starts."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import error_of, idle, start

KEYS = "# who may call\nalice:key-alice\n\nbob: key-bob\n"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory, keys_file):
    root = tmp_path_factory.mktemp("serve-keys")
    srv = start(
        tiny_dirs,
        root / "home",
        root / "server.log",
        "--api-keys-file",
        str(keys_file),
        "--learn-from",
        "alice",
        "--no-adapt",
        "--max-tokens",
        "8",
        key="key-alice",
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def chat(server, key: str, messages: list[dict], max_tokens: int = 4) -> dict:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": max_tokens},
        headers=auth(key),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_key_learns_nothing_of_the_firsts_prompt(server):
    secret = "The vault code is 4417-9902. " + " ".join(f"Rule {i}: never tell it." for i in range(30))
    wrong = "Say nothing about vaults. " + " ".join(f"Rule {i}: be brief." for i in range(30))
    ask = [{"role": "user", "content": "What is the code?"}]
    first = chat(server, "key-alice", [{"role": "system", "content": secret}, *ask])
    assert first["usage"]["prompt_tokens"] > 200
    again = chat(server, "key-alice", [{"role": "system", "content": secret}, *ask])  # her own cache serves her
    assert cached(again) == again["usage"]["prompt_tokens"] - 1

    # Bob, after a request of his own (the template's start is then in his cache), guesses wrong, then right.
    chat(server, "key-bob", [{"role": "system", "content": "Hello there."}, *ask])
    wrong_guess = chat(server, "key-bob", [{"role": "system", "content": wrong}, *ask])
    right_guess = chat(server, "key-bob", [{"role": "system", "content": secret}, *ask])
    assert cached(right_guess) == cached(wrong_guess) < 10
    spec = right_guess["usage"]["speculative"]
    assert spec["draft_cached_tokens"] == wrong_guess["usage"]["speculative"]["draft_cached_tokens"]


def test_a_key_cannot_continue_anothers_response(server):
    url = server.url + "/v1/responses"
    body = {"input": "def add_3(x):", "max_output_tokens": 4}
    first = httpx.post(url, json=body, headers=auth("key-alice"), timeout=300).json()
    follow = {"input": "print(add_", "max_output_tokens": 4, "previous_response_id": first["id"]}
    theirs = error_of(httpx.post(url, json=follow, headers=auth("key-bob"), timeout=300), 404)
    unknown = error_of(
        httpx.post(url, json={**follow, "previous_response_id": "resp_unknown"}, headers=auth("key-bob"), timeout=300),
        404,
    )
    assert theirs["code"] == unknown["code"] == "previous_response_not_found"
    assert theirs["message"].replace(first["id"], "resp_unknown") == unknown["message"]  # as if it did not exist
    mine = httpx.post(url, json=follow, headers=auth("key-alice"), timeout=300)
    assert mine.status_code == 200 and mine.json()["previous_response_id"] == first["id"]


def test_keys_are_checked_and_the_file_is_read_again_when_it_changes(server, keys_file, tiny_dirs):
    models = server.url + "/v1/models"
    assert error_of(httpx.get(models), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(models, headers=auth("key-wrong")), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(models, headers=auth("key-carol")), 401)["code"] == "invalid_api_key"
    assert httpx.get(models, headers={"x-api-key": "key-bob"}).status_code == 200  # as Anthropic's clients send it

    # /health too needs a key, and shows no path of this machine.
    assert error_of(httpx.get(server.url + "/health"), 401)["code"] == "invalid_api_key"
    health = httpx.get(server.url + "/health", headers=auth("key-bob"))
    assert health.status_code == 200
    assert health.json()["model"] == tiny_dirs["target"].name and health.json()["draft"] == tiny_dirs["draft"].name
    assert str(tiny_dirs["target"].parent) not in health.text and not re.search(r'"(/|[A-Za-z]:\\\\)', health.text)

    try:
        keys_file.write_text(KEYS + "carol:key-carol\n")  # a new client, no restart
        deadline = time.monotonic() + 10
        while httpx.get(models, headers=auth("key-carol")).status_code != 200:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
        keys_file.write_text("alice:key-alice\ncarol:key-carol\n")  # bob's key withdrawn
        while httpx.get(models, headers=auth("key-bob")).status_code != 401:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
        keys_file.write_text("alice:key-alice\nbroken line\n")  # a file it cannot use: logged, kept
        while "the keys read before stay in use" not in server.log.read_text():  # read on a request
            assert httpx.get(models, headers=auth("key-carol")).status_code == 200
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
    finally:
        keys_file.write_text(KEYS)
    while httpx.get(models, headers=auth("key-bob")).status_code != 200:
        assert time.monotonic() < deadline + 10, server.log.read_text()
        time.sleep(0.2)


def test_the_pair_learns_only_from_the_keys_learn_from_names(server):
    """--learn-from alice: alice's replies are learned (and saved); bob's leave nothing to save."""
    saves = idle(server)["profile_saves"]
    chat(server, "key-alice", [{"role": "user", "content": "def add_5(x):"}])
    deadline = time.monotonic() + 30
    while (learned := idle(server)["profile_saves"]) == saves:
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.2)
    chat(server, "key-bob", [{"role": "user", "content": "def add_6(x):"}])
    time.sleep(3.0)  # past the 2 s of quiet after which a learned reply is saved
    assert idle(server)["profile_saves"] == learned


def serve_fails(tiny_dirs, *args: str, env: dict | None = None) -> str:
    """`serve` with these flags exits 2 before loading anything: its one line of error."""
    argv = [sys.executable, "-m", "omnidraft_mlx.cli.main", "serve", "--draft", str(tiny_dirs["draft"])]
    argv += ["--target", str(tiny_dirs["target"]), *args]
    done = subprocess.run(argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def test_a_key_that_cannot_be_meant_stops_the_server_before_it_starts(tiny_dirs, tmp_path):
    assert "OMNIDRAFT_API_KEY" in serve_fails(tiny_dirs, env={"OMNIDRAFT_API_KEY": ""})  # set, but empty
    assert "the key is empty" in serve_fails(tiny_dirs, "--api-key", "")
    keys = tmp_path / "keys"
    keys.write_text("alice:\n")
    assert "line 1" in serve_fails(tiny_dirs, "--api-keys-file", str(keys))
    keys.write_text("alice:k1\nbob:k1\n")
    assert "line 2" in serve_fails(tiny_dirs, "--api-keys-file", str(keys))
    keys.write_text("# nobody yet\n")
    assert "no keys" in serve_fails(tiny_dirs, "--api-keys-file", str(keys))
    assert "--api-keys-file" in serve_fails(tiny_dirs, "--api-keys-file", str(tmp_path / "missing"))
    assert "--learn-from" in serve_fails(tiny_dirs, "--learn-from", "alice")  # names keys it does not have


def test_every_interface_without_a_key_is_warned_about(tiny_dirs, tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "omnidraft_mlx.cli.main", "serve", "--draft", str(tiny_dirs["draft"])]
    argv += ["--target", str(tiny_dirs["target"]), "--host", "0.0.0.0", "--port", str(port), "--no-profile"]
    env = {**os.environ, "OMNIDRAFT_HOME": str(tmp_path / "home")}
    with subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        limit = threading.Timer(120, proc.kill)  # no warning: it would serve on
        limit.start()
        try:
            warned = next((line for line in proc.stderr if "NO API KEY" in line), None)
        finally:
            limit.cancel()
            proc.kill()
    assert warned is not None and "0.0.0.0" in warned and "--api-key" in warned
