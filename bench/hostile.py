"""Issue 56's hostile probes against `omnidraft serve`, each with a normal request beside it.

    python -m omnidraft_mlx.bench.hostile --out bench/results/serve-hostile

Starts the server at `serve`'s defaults (with --no-profile: the pair's profile is neither read nor
changed) and a keys file of two clients: alice sends the normal request (a short greedy chat
completion, the official `openai` SDK with its default retries, as a user's client sends it),
mallory the probes. The normal request alone --alone times (after one to warm up): its median is
the yardstick. Then each probe, the normal request sent LEAD_S after it starts:

- long-stops: four stop strings of --stop-chars characters each (400);
- big-body: a body of --body-mb MiB, one-word messages, streamed (chunked) (413, within a second);
- foreign-host: GET /v1/models with `Host: evil.example` (403);
- cross-site-post: a text/plain POST with `Origin: https://evil.example` (403);
- deep-nesting: a body nested --depth deep (400);
  (each of these five sent again and again, PAUSE_S apart, until the normal request is answered)
- flood: --flood connections at once, each a normal request of mallory's: every one answered, or
  refused with 429 or 503, none left waiting past --flood-timeout;
- second-key: alice's secret system prompt, sent twice before the probes (her own cache serves the
  second); mallory, after a request of his own, guesses it wrong, then right: cached_tokens equal;
- hang-up (last): a whole (not streamed) reply of --hangup-tokens whose client hangs up after
  --hangup-after s: /health shows it cancelled and nothing generating within CANCEL_S; the normal
  request is sent right after.

The bar (issue 56): beside every probe the normal request takes at most BAR times its median alone,
and its reply is the one it gets alone. Then SIGTERM: the server exits 0, and no request failed in it.
Writes hostile.json and README.md (a table of the probes) under --out; exits non-zero when a check
fails (`checks` in hostile.json says which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from omnidraft_mlx.bench.load_test import ServerProcess
from omnidraft_mlx.bench.report import print_checks
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.profile.atomic import atomic_write_text

BAR = 1.5  # the normal request beside a probe: at most this many times its median alone
# Probes made of ordinary requests, served as any client's are: the normal request beside them shares
# the machine with their work (their ratio is reported, not judged); what they must not do is learn
# anything (second-key: the cached tokens of a right and a wrong guess are equal).
ORDINARY = {"second-key"}
LEAD_S = 0.5  # a probe starts this long before the normal request beside it
PAUSE_S = 0.25  # between two sends of a repeated probe
CANCEL_S = 2.0  # a request whose client hung up stops costing within this
PROBE_TIMEOUT_S = 60.0  # one send of a probe
NORMAL_TIMEOUT_S = 300.0
KEYS = {"alice": "key-alice", "mallory": "key-mallory"}
NORMAL = [{"role": "user", "content": "Write a Python function that reverses a string."}]
HANGUP_TEXT = "Write a Python script that prints the numbers from 1 to 1000, each with its square."
SECRET = "The vault code is 4417-9902. " + " ".join(f"Rule {i}: never tell it." for i in range(30))
WRONG = "Say nothing about vaults. " + " ".join(f"Rule {i}: be brief." for i in range(30))
ASK = [{"role": "user", "content": "What is the code?"}]
EXPECTED = {  # a repeated probe's status, every time
    "long-stops": 400,
    "big-body": 413,
    "foreign-host": 403,
    "cross-site-post": 403,
    "deep-nesting": 400,
}


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def ask(url: str, model: str, max_tokens: int) -> dict:
    """Alice's normal request: its seconds, every HTTP status it got (a retry adds one), its reply."""
    import httpx
    import openai

    statuses = []
    hooks = {"response": [lambda r: statuses.append(r.status_code)]}
    with (
        httpx.Client(event_hooks=hooks) as http,
        openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], http_client=http, timeout=NORMAL_TIMEOUT_S) as c,
    ):
        start, reply, error = time.perf_counter(), None, None
        try:
            out = c.chat.completions.create(model=model, messages=NORMAL, max_tokens=max_tokens, temperature=0)
            reply = out.choices[0].message.content
        except openai.OpenAIError as e:  # recorded: a lost reply is a result
            error = f"{type(e).__name__}: {e}"
        return {"seconds": time.perf_counter() - start, "statuses": statuses, "reply": reply, "error": error}


def send(method: str, url: str, content=None, headers: dict | None = None) -> int | str:
    """One raw request of mallory's: its status, or the name of what went wrong instead."""
    import httpx

    try:
        r = httpx.request(method, url, content=content, headers=headers, timeout=PROBE_TIMEOUT_S)
        return r.status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def repeated(probe: Callable[[], int | str]) -> Callable[[threading.Event], dict]:
    """A probe sent again and again, PAUSE_S apart, until `stop`: how many, their statuses, their seconds."""

    def run(stop: threading.Event) -> dict:
        rows = []
        while True:
            start = time.perf_counter()
            rows.append((probe(), time.perf_counter() - start))
            if stop.wait(PAUSE_S):
                break
        seconds = [s for _, s in rows]
        return {
            "sent": len(rows),
            "statuses": dict(Counter(str(status) for status, _ in rows)),
            "median_s": statistics.median(seconds),
            "max_s": max(seconds),
        }

    return run


def probes(url: str, model: str, args) -> dict[str, Callable[[threading.Event], dict]]:
    """The probes run beside the normal request, by name (the hang-up, after them: hang_up())."""
    json_of = {**auth("mallory"), "Content-Type": "application/json"}
    chat = url + "/v1/chat/completions"
    stops = json.dumps({"model": model, "messages": NORMAL, "stop": ["x" * args.stop_chars + str(i) for i in range(4)]})
    item = b'{"role": "user", "content": "hi"},'
    big = b'{"messages": [' + item * (args.body_mb * 2**20 // len(item)) + b'{"role": "user", "content": "hi"}]}'
    deep = '{"messages": ' + "[" * args.depth + "]" * args.depth + "}"

    def chunks():  # no Content-Length: the server must refuse it while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    page = {**auth("mallory"), "Content-Type": "text/plain", "Origin": "https://evil.example"}
    return {
        "long-stops": repeated(lambda: send("POST", chat, stops, json_of)),
        "big-body": repeated(lambda: send("POST", chat, chunks(), json_of)),
        "foreign-host": repeated(
            lambda: send("GET", url + "/v1/models", None, {**auth("mallory"), "Host": "evil.example"})
        ),
        "cross-site-post": repeated(lambda: send("POST", chat, json.dumps({"messages": NORMAL}), page)),
        "deep-nesting": repeated(lambda: send("POST", chat, deep, json_of)),
        "flood": lambda stop: flood(chat, model, args),
        "second-key": lambda stop: guesses(url, model),
    }


def flood(chat: str, model: str, args) -> dict:
    """--flood of mallory's normal requests at once, a connection each (closed once answered): how
    many got which status (or none: "no answer" past --flood-timeout, or what broke the connection)."""
    import httpx

    body = {"model": model, "messages": NORMAL, "max_tokens": args.max_tokens, "temperature": 0}

    async def one(client) -> tuple[str, float]:
        start = time.perf_counter()
        try:
            status = str((await client.post(chat, json=body, headers=auth("mallory"))).status_code)
        except httpx.TimeoutException:
            status = "no answer"
        except httpx.HTTPError as e:
            status = type(e).__name__
        return status, time.perf_counter() - start

    async def at_once() -> list[tuple[str, float]]:
        limits = httpx.Limits(max_connections=args.flood, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=args.flood_timeout) as client:
            return await asyncio.gather(*(one(client) for _ in range(args.flood)))

    rows = asyncio.run(at_once())
    refused = [s for status, s in rows if status in ("429", "503")]
    return {
        "sent": len(rows),
        "statuses": dict(Counter(status for status, _ in rows)),
        "refused_max_s": max(refused, default=None),
        "answered_max_s": max((s for status, s in rows if status == "200"), default=None),
    }


def chat(url: str, name: str, model: str, messages: list[dict]) -> dict:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth(name), timeout=NORMAL_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["usage"]


def secret(url: str, model: str) -> dict:
    """Alice's secret system prompt, sent twice: the second comes from her own prompt cache."""
    first = chat(url, "alice", model, [{"role": "system", "content": SECRET}, *ASK])
    again = chat(url, "alice", model, [{"role": "system", "content": SECRET}, *ASK])
    return {"prompt_tokens": first["prompt_tokens"], "cached_again": again["prompt_tokens_details"]["cached_tokens"]}


def guesses(url: str, model: str) -> dict:
    """Mallory, after a request of his own (the chat template's start is then in his cache), guesses
    alice's secret wrong, then right: the cached tokens of each."""
    chat(url, "mallory", model, [{"role": "system", "content": "Hello there."}, *ASK])
    wrong = chat(url, "mallory", model, [{"role": "system", "content": WRONG}, *ASK])
    right = chat(url, "mallory", model, [{"role": "system", "content": SECRET}, *ASK])
    return {
        "cached_wrong": wrong["prompt_tokens_details"]["cached_tokens"],
        "cached_right": right["prompt_tokens_details"]["cached_tokens"],
        "draft_cached_wrong": wrong["speculative"]["draft_cached_tokens"],
        "draft_cached_right": right["speculative"]["draft_cached_tokens"],
    }


def beside(url: str, model: str, max_tokens: int, probe: Callable[[threading.Event], dict]) -> tuple[dict, dict]:
    """The normal request, sent LEAD_S after `probe` starts in another thread (told to stop once the
    normal request is answered): (the normal request's figures, the probe's)."""
    got, stop = {}, threading.Event()

    def run():
        try:
            got.update(probe(stop))
        except Exception as e:  # recorded: a probe that broke is a result
            got["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(LEAD_S)
    normal = ask(url, model, max_tokens)
    stop.set()
    thread.join()
    return normal, got


def hang_up(server: ServerProcess, model: str, args) -> dict:
    """Mallory asks for --hangup-tokens as one body and hangs up after --hangup-after s: seconds until
    /health shows it cancelled and nothing generating (None: not within CANCEL_S)."""
    import httpx

    before = server.health()
    body = {"model": model, "messages": [{"role": "user", "content": HANGUP_TEXT}], "max_tokens": args.hangup_tokens}
    try:
        r = httpx.post(
            server.url + "/v1/chat/completions", json=body, headers=auth("mallory"), timeout=args.hangup_after
        )
        status = str(r.status_code)  # answered before the client hung up: nothing to cancel
    except httpx.TimeoutException:
        status = "hung up"
    left, stopped_s = time.perf_counter(), None
    while time.perf_counter() - left < CANCEL_S:
        health = server.health()
        if not health["generating"] and health["cancelled"] > before["cancelled"]:
            stopped_s = time.perf_counter() - left
            break
        time.sleep(0.05)
    return {"status": status, "stopped_s": stopped_s, "cancelled": health["cancelled"] - before["cancelled"]}


def idle(server: ServerProcess, timeout: float = 300) -> dict:
    """/health once nothing is generating or queued (what one probe left does not weigh on the next)."""
    deadline = time.monotonic() + timeout
    while ((health := server.health())["generating"] or health["queued"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return health


def checks(result: dict) -> dict[str, bool]:
    alone, found = result["alone"], result["probes"]
    out = {}
    for name, p in found.items():
        normal = p["normal"]
        out[f"{name}: the normal request beside it answered, its reply as alone"] = normal["reply"] == alone["reply"]
        if name not in ORDINARY:
            out[f"{name}: the normal request beside it <= {BAR}x its time alone"] = p["ratio"] <= BAR
        if name in EXPECTED:
            out[f"{name}: refused {EXPECTED[name]} every time"] = p["probe"].get("statuses") == {
                str(EXPECTED[name]): p["probe"]["sent"]
            }
    out["big-body: refused within a second"] = found["big-body"]["probe"].get("max_s", 1.0) < 1.0
    statuses = found["flood"]["probe"].get("statuses", {"none": 1})
    out["flood: every connection answered 200 or refused 429/503"] = set(statuses) <= {"200", "429", "503"}
    hung = found["hang-up"]["probe"]
    out[f"hang-up: cancelled, nothing generating, within {CANCEL_S:.0f} s"] = (
        hung["status"] == "hung up" and hung["stopped_s"] is not None
    )
    keys, shown = found["second-key"], result["secret"]
    out["second-key: alice's resent prompt comes from her cache"] = shown["cached_again"] == shown["prompt_tokens"] - 1
    out["second-key: cached tokens equal for the right and the wrong guess"] = (
        keys["probe"].get("cached_right", -1) == keys["probe"].get("cached_wrong")
        and keys["probe"]["draft_cached_right"] == keys["probe"]["draft_cached_wrong"]
    )
    out["no request failed in the server"] = result["health"]["failed"] == 0
    out["SIGTERM: exit 0"] = result["exit_status"] == 0
    return out


def cells(name: str, probe: dict) -> tuple[str, str, str]:
    """A probe's row in the README's table: what was sent, what came back, how long it took."""
    if "error" in probe:
        return "-", probe["error"], "-"
    if name == "hang-up":
        stopped = f"{probe['stopped_s']:.2f} s" if probe["stopped_s"] is not None else "not"
        return "1", f"{probe['status']}, {probe['cancelled']} cancelled", f"stopped {stopped} after the hang-up"
    if name == "second-key":
        return "3", f"cached tokens: wrong guess {probe['cached_wrong']}, right {probe['cached_right']}", "-"
    statuses = ", ".join(f"{status} x{n}" for status, n in probe["statuses"].items())
    if name == "flood":
        answered, refused = probe["answered_max_s"], probe["refused_max_s"]
        seconds = f"refused within {refused:.2f} s" if refused is not None else "none refused"
        seconds += f", answered within {answered:.2f} s" if answered is not None else ""
        return str(probe["sent"]), statuses, seconds
    return str(probe["sent"]), statuses, f"median {probe['median_s']:.2f}, max {probe['max_s']:.2f}"


def readme(result: dict) -> str:
    alone = result["alone"]
    lines = [
        "# `omnidraft serve` against issue 56's hostile probes",
        "",
        f"Target `{result['config']['target']}`, drafter `{result['config']['draft']}`, `serve`'s defaults "
        f"(`{' '.join(result['server_args'])}`); {result['environment']['processor']}, "
        f"{result['environment']['cpus']} CPUs.",
        "",
        "```bash",
        result["command"],
        "```",
        "",
        f"The normal request (a greedy chat completion, {result['config']['max_tokens']} tokens, the `openai` SDK) "
        f"alone: median {alone['median_s']:.2f} s over {len(alone['seconds'])} "
        f"({min(alone['seconds']):.2f}-{max(alone['seconds']):.2f} s).",
        "",
        f"| probe | sent | its statuses | its seconds | the normal request beside it | / alone (bar {BAR}x) |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in result["probes"].items():
        normal = p["normal"]
        beside = f"{normal['seconds']:.2f} s" + (f" ({normal['statuses']})" if normal["statuses"] != [200] else "")
        ratio = f"{p['ratio']:.2f}x" + (" (ordinary work, not judged)" if name in ORDINARY else "")
        lines.append(f"| {name} | {' | '.join(cells(name, p['probe']))} | {beside} | {ratio} |")
    lines += [
        "",
        f"Not judged against the bar: {', '.join(sorted(ORDINARY))}, whose requests are ordinary ones, served",
        "as any client's (the normal request shares the machine with their prefills); what they must not do is",
        "learn anything of another key's prompt (the cached tokens of a right and a wrong guess).",
        "",
        "Checks:",
        "",
    ]
    lines += [f"- {'ok' if ok else 'FAIL'}: {name}" for name, ok in result["checks"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--max-tokens", type=int, default=32, help="the normal request's (and each flood request's)")
    ap.add_argument("--alone", type=int, default=5, help="times the normal request is sent alone")
    ap.add_argument("--stop-chars", type=int, default=200_000, help="each of the four stop strings' length")
    ap.add_argument("--body-mb", type=int, default=64, help="the big body's MiB")
    ap.add_argument("--depth", type=int, default=50_000, help="the deep body's nesting")
    ap.add_argument("--flood", type=int, default=300, help="connections at once")
    ap.add_argument("--flood-timeout", type=float, default=120.0, help="seconds a flood connection waits")
    ap.add_argument("--hangup-tokens", type=int, default=2000)
    ap.add_argument("--hangup-after", type=float, default=3.0, help="seconds before the client hangs up")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve-hostile"))
    args = ap.parse_args(argv)
    if min(args.max_tokens, args.alone, args.stop_chars, args.body_mb, args.depth, args.flood, args.hangup_tokens) < 1:
        raise SystemExit(
            "--max-tokens, --alone, --stop-chars, --body-mb, --depth, --flood, --hangup-tokens: at least 1"
        )

    from omnidraft_mlx.bench.run import environment_base

    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="omnidraft-hostile-"))
    (scratch / "keys").write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    server_args = ["--no-profile", "--api-keys-file", str(scratch / "keys")]
    server = ServerProcess(args.draft, args.target, args.out / "server.log", *server_args, key=KEYS["alice"])
    model, url, result = args.target, server.url, {}
    try:
        ask(url, model, args.max_tokens)  # the first request's costs are nobody's
        runs = [ask(url, model, args.max_tokens) for _ in range(args.alone)]
        if failed := [r["error"] for r in runs if r["reply"] is None]:
            raise SystemExit(f"the normal request failed alone ({failed[0]}): see {server.log}")
        alone = {
            "seconds": [r["seconds"] for r in runs],
            "median_s": statistics.median([r["seconds"] for r in runs]),
            "reply": runs[0]["reply"],
        }
        result["secret"] = secret(url, model)  # in alice's cache before mallory's guesses
        found = {}
        for name, probe in probes(url, model, args).items():
            normal, got = beside(url, model, args.max_tokens, probe)
            found[name] = {"probe": got, "normal": normal}
            idle(server)
            print(
                f"hostile: {name} {got.get('statuses', got)}; normal request {normal['seconds']:.2f}s", file=sys.stderr
            )
        found["hang-up"] = {"probe": hang_up(server, model, args), "normal": ask(url, model, args.max_tokens)}
        for p in found.values():
            p["ratio"] = p["normal"]["seconds"] / alone["median_s"]
        result["health"] = server.health()
    finally:
        result["exit_status"] = server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    result = {
        "command": " ".join(["python -m omnidraft_mlx.bench.hostile", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "server_args": ["--no-profile", "--api-keys-file KEYS (alice, mallory)"],
        "environment": environment_base(),
        "bar": BAR,
        "alone": alone,
        "probes": found,
        **result,
    }
    result["checks"] = checks(result)
    atomic_write_text(args.out / "hostile.json", json.dumps(result, indent=1))
    atomic_write_text(args.out / "README.md", readme(result))
    worst = max((name for name in found if name not in ORDINARY), key=lambda name: found[name]["ratio"])
    print_checks(
        result["checks"],
        f"normal request alone {alone['median_s']:.2f}s (median); beside the probes at most "
        f"{found[worst]['ratio']:.2f}x ({worst}; judged probes)",
        args.out / "hostile.json",
        "hostile",
    )


if __name__ == "__main__":
    main()
