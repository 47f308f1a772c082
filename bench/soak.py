"""A soak test of `omnidraft serve` as people run it: learning on, many clients, a long run, then
SIGTERM and a restart.

    python -m omnidraft_mlx.bench.soak --minutes 30 --out bench/results/serve-soak

The server runs with `serve`'s defaults (drafter updates and profile saves between requests) and
an API key, in a scratch OMNIDRAFT_HOME (a new machine: it measures its verification
costs as it loads; the user's profile is not touched). --clients clients, each with the official
`openai` SDK, send requests one after another, a pause between two (exponential, mean --think
seconds: the server falls idle now and then, as in use, and learns then), drawn from KINDS:
greedy chat (whole and streamed, some with a long system prompt), tool calls, completions,
sampled chat, streams the client drops after a few chunks, and bad requests (a malformed body,
a prompt longer than the context, a wrong model name, a wrong API key), until --minutes have
passed and the requests under way have ended. The server's resident memory (and its prompt
cache's size, which fills up to --cache-bytes) is read every 5 s.
Then: its /health figures (the longest pause between two rounds, the longest wait of a request on
learning, drafter updates), SIGTERM (exit status and seconds), a restart on the same home (seconds
until it serves, the n-grams it loaded), and each greedy request sent alone to the restarted
server: every reply of the soak must equal its request's reply decoded alone.
Writes soak.json and soak.png (memory, and every request's seconds, over the run) under --out;
exits non-zero when a check fails (`checks` in soak.json says which).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omnidraft_mlx.bench.load_test import ServerProcess
from omnidraft_mlx.bench.report import print_checks
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.profile.atomic import atomic_write_text

KINDS = {  # kind: its weight in every client's mix
    "chat": 5,
    "chat-stream": 6,
    "long-stream": 1,
    "tools": 2,
    "completion": 2,
    "sampled": 1,
    "dropped": 2,
    "malformed": 1,
    "oversized": 1,
    "wrong-model": 1,
    "wrong-key": 1,
}
BAD = {"malformed", "oversized", "wrong-model", "wrong-key"}
HANG_S = 300.0  # a valid request unanswered this long is a hang
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]
TOOL_PROMPTS = ["What is the weather in Paris right now?", "Use the add tool: what is 17 + 25?", "Weather in Oslo?"]
STUBS = [
    "def fibonacci(n):\n",
    "def is_prime(n):\n    ",
    "class Stack:\n    def __init__(self):\n",
    "# Read a CSV file and print the sum of its second column\nimport csv\n",
]


@dataclass
class Record:
    client: int
    kind: str
    key: str | None  # greedy requests: what their reply must equal (the same request alone)
    start_s: float  # from the start of the soak
    seconds: float = 0.0
    status: str = ""  # "ok", "dropped", an HTTP status, "hang", or the exception's name
    first_token_s: float | None = None
    longest_gap_s: float | None = None  # streamed: the longest wait between two chunks
    output: str | None = None


class Prompts:
    """What the requests ask, by key."""

    def __init__(self, chat: int, long_examples: int):
        from omnidraft_mlx.tasks import load_task

        tasks = load_task("chat", "heldout") + load_task("chat", "adapt")
        self.chat = [p.text for p in tasks[:chat]]
        self.system = "Answer as these examples ask to be answered:\n" + "\n".join(
            p.text for p in tasks[chat : chat + long_examples]
        )

    def messages(self, kind: str, i: int) -> list[dict]:
        if kind == "tools":
            return [{"role": "user", "content": TOOL_PROMPTS[i % len(TOOL_PROMPTS)]}]
        user = [{"role": "user", "content": self.chat[i % len(self.chat)]}]
        return [{"role": "system", "content": self.system}, *user] if kind == "long-stream" else user

    def count(self, kind: str) -> int:
        return {"tools": len(TOOL_PROMPTS), "completion": len(STUBS), "long-stream": 3}.get(kind, len(self.chat))


def send(client, kind: str, i: int, prompts: Prompts, model: str, max_tokens: int, rec: Record, url: str) -> None:
    """One request of `kind`; what came back into rec (status "ok" or "dropped" when it went as it should)."""
    import httpx

    if kind == "malformed":
        r = httpx.post(
            url + "/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"},
            timeout=HANG_S,
        )
        rec.status = str(r.status_code)
        return
    if kind == "completion":
        out = client.completions.create(model=model, prompt=STUBS[i % len(STUBS)], max_tokens=max_tokens, temperature=0)
        rec.output, rec.status = out.choices[0].text, "ok"
        return
    messages = prompts.messages(kind, i)
    if kind == "oversized":
        messages = [{"role": "user", "content": "Summarize this: " + " ".join(prompts.chat) * 100}]
    args = dict(model="no-such-model" if kind == "wrong-model" else model, messages=messages, max_tokens=max_tokens)
    if kind == "sampled":
        args.update(temperature=0.8, top_p=0.95)
    else:
        args.update(temperature=0)
    if kind == "tools":
        out = client.chat.completions.create(**args, tools=TOOLS)
        message = out.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        rec.output, rec.status = json.dumps({"content": message.content, "calls": calls}), "ok"
        return
    if kind not in ("chat-stream", "long-stream", "dropped"):
        out = client.chat.completions.create(**args)
        rec.output, rec.status = out.choices[0].message.content, "ok"
        return
    start, last, text, chunks = time.perf_counter(), None, "", 0
    with client.chat.completions.create(**args, stream=True) as stream:
        for chunk in stream:
            now = time.perf_counter()
            if last is not None:
                rec.longest_gap_s = max(rec.longest_gap_s or 0.0, now - last)
            last, chunks = now, chunks + 1
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                rec.first_token_s = rec.first_token_s or now - start
                text += piece
            if kind == "dropped" and chunks == 3:
                rec.status = "dropped"
                return
    rec.output, rec.status = text, "ok"


def run_client(
    c: int, url: str, key: str, model: str, prompts: Prompts, args, t0: float, stop: threading.Event, records: list
) -> None:
    """One client's requests until `stop`, a pause between two, each into `records` as it ends."""
    import openai

    rng = np.random.default_rng(c)
    kinds, weights = list(KINDS), np.array(list(KINDS.values()), float)
    good = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=HANG_S)
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong-" + key, max_retries=0, timeout=HANG_S)
    while not stop.wait(rng.exponential(args.think)):
        kind = kinds[rng.choice(len(kinds), p=weights / weights.sum())]
        i = int(rng.integers(prompts.count(kind)))
        family = {"chat-stream": "chat", "dropped": None, "sampled": None}.get(kind, kind)
        greedy = kind not in BAD and family is not None
        rec = Record(c, kind, f"{family}:{i}" if greedy else None, time.perf_counter() - t0)
        try:
            send(wrong if kind == "wrong-key" else good, kind, i, prompts, model, args.max_tokens, rec, url)
        except openai.APIStatusError as e:
            rec.status = str(e.status_code)
        except openai.APITimeoutError:
            rec.status = "hang"
        except Exception as e:  # recorded: a lost reply is a result
            rec.status = type(e).__name__
        rec.seconds = time.perf_counter() - t0 - rec.start_s
        records.append(rec)


def alone(url: str, key: str, model: str, prompts: Prompts, keys: set[str], max_tokens: int) -> dict[str, str]:
    """Each greedy request's reply, sent alone."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=HANG_S)
    out = {}
    for k in sorted(keys):
        family, i = k.split(":")
        rec = Record(0, family, k, 0.0)
        send(client, family, int(i), prompts, model, max_tokens, rec, url)
        out[k] = rec.output
    return out


def sample_memory(server: ServerProcess, t0: float, stop: threading.Event, into: list) -> None:
    """(seconds, resident MiB, the prompt cache's MiB from /health) of the server every 5 s."""
    import httpx

    while not stop.wait(5.0):
        try:
            rss = next(
                line
                for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
            cached = server.health()["prompt_cache_bytes"]
        except (OSError, StopIteration, httpx.HTTPError):
            return
        into.append((time.perf_counter() - t0, int(rss.split()[1]) / 1024, cached / 2**20))


def growth(samples: list, column: int, after_s: float = 300.0) -> float | None:
    """The most a memory column rose over its first sample after `after_s`, as a fraction of it."""
    values = [row[column] for row in samples if row[0] >= after_s]
    return max(values) / values[0] - 1 if values else None


def plot(result: dict, records: list[Record], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from omnidraft_mlx.bench.plots import save_figure

    fig, (mem, lat) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    rows = np.array(result["memory_mib"] or [[0.0, 0.0, 0.0]])
    mem.plot(rows[:, 0] / 60, rows[:, 1], label="resident")
    mem.plot(rows[:, 0] / 60, rows[:, 1] - rows[:, 2], label="resident less the prompt cache")
    mem.set_ylabel("server MiB")
    mem.legend(fontsize=7)
    for kind in KINDS:
        rows = [r for r in records if r.kind == kind]
        if rows:
            lat.scatter([r.start_s / 60 for r in rows], [r.seconds for r in rows], s=6, label=kind)
    lat.set_yscale("log")
    lat.set_ylabel("request seconds")
    lat.set_xlabel("minutes into the soak")
    lat.legend(fontsize=6, ncol=4)
    mem.set_title(f"omnidraft serve soak: {result['config']['target']}, {result['config']['clients']} clients")
    save_figure(fig, path)


def checks(result: dict, records: list[Record], reference: dict[str, str]) -> dict[str, bool]:
    valid = [r for r in records if r.kind not in BAD]
    health = result["health"]
    return {
        "no 5xx": not any(r.status.startswith("5") for r in records),
        "no hangs or lost valid requests": all(r.status in ("ok", "dropped") for r in valid),
        "greedy replies equal the request alone": all(
            r.output == reference.get(r.key) for r in valid if r.key and r.status == "ok"
        ),
        "bad requests answered 4xx": all(r.status.startswith("4") for r in records if r.kind in BAD),
        # The prompt cache fills up to --cache-bytes as new prompts come: what else the server holds must not grow.
        "memory less the prompt cache, after 5 min, grew at most 10%": (
            result["memory_growth"]["less_prompt_cache"] or 0
        )
        <= 0.10,
        "longest pause between rounds < 2 s": health["longest_round_pause_s"] < 2.0,
        "longest wait on learning < 2 s": health["longest_learning_wait_s"] < 2.0,
        "drafter updated during the soak": (health["drafter_updates"] or 0) > result["drafter_updates_at_start"],
        "SIGTERM: exit 0 within 10 s": result["sigterm"]["exit_status"] == 0 and result["sigterm"]["seconds"] <= 10,
        "restart loads the saved n-grams": result["restart"]["ngrams"] >= health["ngrams"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--think", type=float, default=20.0, help="mean seconds a client waits between its requests")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat-prompts", type=int, default=12, help="distinct greedy chat prompts")
    ap.add_argument("--long-examples", type=int, default=50, help="chat prompts in the long system prompt")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve-soak"))
    args = ap.parse_args(argv)
    if min(args.minutes, args.clients, args.think, args.max_tokens, args.chat_prompts) <= 0:
        raise SystemExit("--minutes, --clients, --think, --max-tokens and --chat-prompts must be positive")

    from omnidraft_mlx.bench.run import environment_base
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="omnidraft-soak-"))  # a new machine's: the user's profile untouched
    draft, target = Path(args.draft).name, Path(args.target).name  # named, never a path of this machine:
    (home / "models").mkdir()
    for name, model in ((draft, args.draft), (target, args.target)):  # its models as if pulled there
        (home / "models" / name).symlink_to(CATALOG_RESOLVER.path(model))
    key = "soak-key"
    prompts = Prompts(args.chat_prompts, args.long_examples)
    env = {"OMNIDRAFT_HOME": str(home)}

    server = ServerProcess(draft, target, args.out / "server.log", "--api-key", key, env=env)
    try:
        updates_at_start = server.health()["drafter_updates"] or 0
        t0, stop, memory = time.perf_counter(), threading.Event(), []
        results: list[list[Record]] = [[] for _ in range(args.clients)]
        threads = [
            threading.Thread(target=run_client, args=(c, server.url, key, target, prompts, args, t0, stop, results[c]))
            for c in range(args.clients)
        ]
        sampler = threading.Thread(target=sample_memory, args=(server, t0, stop, memory))
        for t in [*threads, sampler]:
            t.start()
        last = -1
        while time.perf_counter() - t0 < args.minutes * 60:
            time.sleep(5)
            if (minute := int((time.perf_counter() - t0) // 60)) != last:
                last = minute
                print(f"soak: {minute} min, {sum(len(r) for r in results)} requests ended", file=sys.stderr)
        stop.set()
        for t in [*threads, sampler]:
            t.join()
        soak_s = time.perf_counter() - t0
        health = server.health()
    finally:
        start = time.perf_counter()
        status = server.stop()
        exit_s = time.perf_counter() - start
    records = [r for rows in results for r in rows]

    start = time.perf_counter()
    again = ServerProcess(draft, target, args.out / "server-restart.log", "--api-key", key, env=env)
    try:
        ready_s = time.perf_counter() - start
        loaded = again.health()
        keys = {r.key for r in records if r.key and r.status == "ok"}
        reference = alone(again.url, key, target, prompts, keys, args.max_tokens)
    finally:
        restart_status = again.stop()
        shutil.rmtree(home, ignore_errors=True)

    streamed = [r for r in records if r.longest_gap_s is not None]
    result = {
        "command": " ".join(["python -m omnidraft_mlx.bench.soak", *(argv if argv is not None else sys.argv[1:])]),
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "kinds": KINDS},
        "environment": environment_base(),
        "soak_s": soak_s,
        "requests": len(records),
        "by_kind": {k: sum(r.kind == k for r in records) for k in KINDS},
        "statuses": {s: sum(r.status == s for r in records) for s in sorted({r.status for r in records})},
        "drafter_updates_at_start": updates_at_start,
        "health": health,
        "longest_stream_gap_s": max((r.longest_gap_s for r in streamed), default=None),
        "memory_mib": memory,  # (seconds, resident, prompt cache)
        "memory_growth": {
            "resident": growth(memory, 1),
            "less_prompt_cache": growth([(t, rss - cached) for t, rss, cached in memory], 1),
        },
        "sigterm": {"exit_status": status, "seconds": exit_s},
        "restart": {
            "ready_s": ready_s,
            "ngrams": loaded["ngrams"],
            "drafter_updates": loaded["drafter_updates"],
            "exit_status": restart_status,
        },
        "distinct_greedy_requests": len(reference),
    }
    result["checks"] = checks(result, records, reference)
    result["records"] = [
        {**asdict(r), "equal_alone": r.output == reference.get(r.key) if r.key else None} for r in records
    ]
    atomic_write_text(args.out / "soak.json", json.dumps(result, indent=1))
    plot(result, records, args.out / "soak.png")
    print_checks(
        result["checks"],
        f"{len(records)} requests in {soak_s / 60:.1f} min ({result['statuses']}); longest pause between rounds "
        f"{health['longest_round_pause_s']:.2f}s, on learning {health['longest_learning_wait_s']:.2f}s; "
        f"SIGTERM exit {status} in {exit_s:.1f}s; restart served in {ready_s:.1f}s; memory after 5 min "
        f"+{100 * (result['memory_growth']['resident'] or 0):.0f}% "
        f"(+{100 * (result['memory_growth']['less_prompt_cache'] or 0):.0f}% less the prompt cache)",
        args.out / "soak.json",
        "soak",
    )


if __name__ == "__main__":
    main()
