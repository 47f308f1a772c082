"""`omnidraft serve` against hostile clients and web pages: the real server process on the tiny pair,
over real HTTP. What a client controls is bounded (a 4xx naming the flag that raises the limit), a web
page cannot use or read the server (Host and Origin checked, JSON bodies only), and a fuzz of every
route with malformed and oversized bodies gets no 5xx and leaves the server serving."""

import json
import random
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import KEY, start

from omnidraft_mlx.serve.text import StopText

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
BODY_BYTES = 1_000_000  # the server's --max-body-bytes here: oversized bodies stay cheap to send
OK_CHAT = {"messages": [{"role": "user", "content": "def add_3(x):"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-security")
    srv = start(
        tiny_dirs,
        root / "home",
        root / "server.log",
        *("--api-key", KEY, "--max-tokens", "8", "--max-body-bytes", str(BODY_BYTES)),
        *("--allowed-hosts", "mybox.lan", "--cors", "https://app.example"),
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()
    assert "Traceback" not in srv.log.read_text()  # no request failed inside the server


def post(server, path: str, body, headers=JSON, timeout: float = 60) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, dict) else body  # or str, bytes, or chunks
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def refused(response: httpx.Response, status: int) -> str:
    """The error message of a refusal with this status (OpenAI's or Anthropic's error shape)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert "Traceback" not in error["message"]
    return error["message"]


def serving(server) -> None:
    """The server still answers a normal request, and no request failed in the engine."""
    assert post(server, "/v1/chat/completions", OK_CHAT).json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health", headers=AUTH, timeout=30).json()["failed"] == 0


def test_long_stop_strings_are_refused_while_a_request_beside_them_completes(server):
    normal = {**OK_CHAT, "max_tokens": 8}
    alone = post(server, "/v1/chat/completions", normal).json()["choices"][0]["message"]["content"]
    hostile = {**OK_CHAT, "stop": ["x" * 200_000 + str(i) for i in range(4)]}
    got = {}

    def ask():
        got["normal"] = post(server, "/v1/chat/completions", normal)

    beside = threading.Thread(target=ask)
    beside.start()
    message = refused(post(server, "/v1/chat/completions", hostile), 400)
    beside.join(120)
    assert "stop.0: 200,001 characters" in message and "--max-stop-chars" in message
    assert got["normal"].json()["choices"][0]["message"]["content"] == alone
    # At the limit, a stop string is held back while it may begin, and the reply is as without it.
    at_limit = post(server, "/v1/chat/completions", {**normal, "stop": ["x" * 1023 + "\x00"] * 4})
    assert at_limit.json()["choices"][0]["message"]["content"] == alone
    assert "--max-stops" in refused(post(server, "/v1/chat/completions", {**OK_CHAT, "stop": ["a"] * 5}), 400)
    assert "--max-stops" in refused(post(server, "/v1/messages", {**OK_CHAT, "stop_sequences": ["a"] * 5}), 400)


def test_stop_text_holds_back_exactly_what_may_begin_a_stop_string():
    """StopText (a character at a time) against the definition, over random pieces: the text is cut
    where the first stop string ends (of two ending there, the first given), and until then what is
    held back is the longest end of the text so far that begins a stop string."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 24)))
        ends = [(i + len(s), j) for j, s in enumerate(stops) if (i := text.find(s)) >= 0]
        end, first = min(ends) if ends else (len(text), None)
        reached = None if first is None else stops[first]
        stop, sent, cuts = StopText(stops), "", sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            piece, stopped = stop.add(text[a:b])
            sent += piece
            if stopped:
                break
            begins = [n for s in stops for n in range(1, len(s)) if text[:b].endswith(s[:n])]
            assert sent == text[: b - max(begins, default=0)]
        assert (sent if stopped else sent + stop.flush(), stop.reached) == (text[: end - len(reached or "")], reached)


def test_an_oversized_body_is_refused_within_a_second(server):
    big = b'{"messages": [' + b'{"role": "user", "content": "hi"},' * (64_000_000 // 34) + b"]}"
    t0 = time.monotonic()
    message = refused(post(server, "/v1/chat/completions", big), 413)
    assert time.monotonic() - t0 < 1.0
    assert f"over this server's limit of {BODY_BYTES:,}" in message and "--max-body-bytes" in message

    def chunked():  # no Content-Length: refused while it is read
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    t0 = time.monotonic()
    assert "--max-body-bytes" in refused(post(server, "/v1/messages", chunked()), 413)
    assert time.monotonic() - t0 < 1.0
    serving(server)


def test_deep_nesting_and_counts_past_the_limits_are_refused(server):
    deep = '{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}"
    assert "--max-json-depth" in refused(post(server, "/v1/chat/completions", deep), 400)
    just_past = {**OK_CHAT, "metadata": json.loads("[" * 64 + "]" * 64)}  # 65 deep with the body's object
    assert "--max-json-depth" in refused(post(server, "/v1/chat/completions", just_past), 400)
    at_limit = {**OK_CHAT, "metadata": json.loads("[" * 63 + "]" * 63)}
    assert post(server, "/v1/chat/completions", at_limit).status_code == 200

    many = {**OK_CHAT, "messages": [{"role": "user", "content": "hi"}] * 4097}
    assert "messages: 4,097 messages" in refused(post(server, "/v1/chat/completions", many), 400)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert "--max-tools" in refused(post(server, "/v1/chat/completions", {**OK_CHAT, "tools": [tool] * 513}), 400)
    schema = {"type": "object", "description": "x" * 70_000}
    big_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    message = refused(post(server, "/v1/chat/completions", {**OK_CHAT, "tools": [big_tool]}), 400)
    assert "tools.0.function.parameters" in message and "--max-schema-bytes" in message
    serving(server)


def test_former_server_errors_are_400s(server):
    messages = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    message = refused(post(server, "/v1/messages", {**messages, "tools": [{"type": None, "name": "f"}]}), 400)
    assert "tools.0.type" in message
    namespace = {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": 3}]}
    assert "tools.0.tools" in refused(post(server, "/v1/responses", namespace), 400)
    assert "text.format" in refused(post(server, "/v1/responses", {"input": "hi", "text": {"format": "json"}}), 400)
    # Python's JSON reads NaN, Infinity and 1e400 (as inf); no JSON reply can carry them back.
    for number in ("Infinity", "-Infinity", "NaN", "1e400"):
        body = '{"input": "hi", "max_output_tokens": 4, "metadata": {"x": ' + number + "}}"
        assert number in refused(post(server, "/v1/responses", body), 400)
    serving(server)


def test_foreign_hosts_and_web_pages_are_refused(server):
    models = server.url + "/v1/models"
    for host in ("evil.example", f"evil.example:{server.port}", "localhost.evil.example"):
        assert "--allowed-hosts" in refused(httpx.get(models, headers={**AUTH, "Host": host}), 403)
    assert httpx.get(server.url + "/health", headers={"Host": "evil.example"}).status_code == 403  # before the key
    for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}", "mybox.lan", "a.localhost"):
        assert httpx.get(models, headers={**AUTH, "Host": host}).status_code == 200, host

    # A page on another site: its cross-site text/plain POST (sent without a preflight) is refused,
    # and no CORS header lets it read the answer.
    page = {**AUTH, "Content-Type": "text/plain", "Origin": "https://evil.example"}
    reply = post(server, "/v1/chat/completions", OK_CHAT, headers=page)
    assert "--cors" in refused(reply, 403) and "access-control-allow-origin" not in reply.headers
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert httpx.options(server.url + "/v1/chat/completions", headers=preflight).status_code == 403
    # Without an Origin, a body that is not declared JSON is refused too.
    message = refused(
        post(server, "/v1/chat/completions", OK_CHAT, headers={**AUTH, "Content-Type": "text/plain"}), 415
    )
    assert "application/json" in message
    assert refused(post(server, "/v1/messages", OK_CHAT, headers=AUTH), 415)

    # The origin --cors names may call it, preflight and all, and reads the answer.
    app = {"Origin": "https://app.example"}
    preflight = {**app, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    answer = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    reply = post(server, "/v1/chat/completions", OK_CHAT, headers={**JSON, **app})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"


# The fuzz: a valid body per route, then fields replaced by any JSON, dropped or added, or the body
# replaced by bytes, JSON that is not an object, or more than the server takes.
ROUTES = {
    "/v1/chat/completions": {
        **OK_CHAT,
        "stop": ["\n\n"],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
    },
    "/v1/completions": {"prompt": "def add_3(x):", "max_tokens": 4, "stop": "\n"},
    "/v1/responses": {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "Be brief.",
        "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}],
        "text": {"format": {"type": "text"}},
        "max_output_tokens": 4,
    },
    "/v1/messages": {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "stop_sequences": ["\n\n"],
        "max_tokens": 4,
    },
}
ROUTES["/v1/messages/count_tokens"] = ROUTES["/v1/messages"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
REPLY_LENGTHS = ("max_tokens", "max_output_tokens", "max_completion_tokens")


def places(value, path=()):
    """Every place in a JSON value: the paths to its members."""
    yield path
    members = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, member in members:
        yield from places(member, (*path, key))


@st.composite
def mutated(draw, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        if not (spots := [p for p in places(body) if p]):
            break
        *parent, last = draw(st.sampled_from(spots))
        holder = body
        for key in parent:
            holder = holder[key]
        change = draw(st.sampled_from(["replace", "drop", "add"]))
        if change == "replace":
            holder[last] = draw(JSON_VALUES)
        elif change == "drop" and isinstance(holder, dict):
            del holder[last]
        elif isinstance(holder, dict):
            holder[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    for name in REPLY_LENGTHS:  # the fuzz looks for failures, not long replies
        if isinstance(body.get(name), int) and body[name] > 4:
            body[name] = 4
    return body


def bodies(route: str):
    valid = ROUTES.get(route, OK_CHAT)
    return (
        mutated(valid)
        | st.builds(lambda b: {**b, "stream": True}, mutated(valid))
        | st.binary(max_size=64)
        | JSON_VALUES
        | st.integers(BODY_BYTES - 64, BODY_BYTES + 4096).map(lambda n: {**valid, "pad": "x" * n})
    )


@settings(
    max_examples=300,  # new bodies each run (about 20 s): a failure prints the body that failed
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_fuzz_every_route_gets_no_server_error(server, data):
    route = data.draw(st.sampled_from([*ROUTES, "/v1/models", "/health"]))
    body = data.draw(bodies(route))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    if route in ("/v1/models", "/health"):
        reply = httpx.request("GET", server.url + route, content=content, headers=JSON, timeout=120)
    else:
        reply = post(server, route, content, timeout=120)
    assert reply.status_code < 500, reply.text
    assert reply.status_code in (200, 400, 404, 413), reply.text  # 404: a model by another name


def test_the_server_serves_after_the_fuzz(server):
    serving(server)
