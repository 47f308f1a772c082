"""A bounded load test of `omnidraft serve`: concurrent streaming clients over real HTTP.

    python -m omnidraft_mlx.bench.load_test --out bench/results/serve-load

For each --batch value in turn (default 8, then 1: requests decoded together,
then one at a time, the same clients and prompts), starts the server in its own
process on a free port of 127.0.0.1 (with --no-profile: the run neither reads
nor changes the pair's profile; otherwise as a user runs it, and --batch), then
--clients clients, each sending --requests streaming greedy chat requests one
after another (the chat task's prompts, in order, each client its own; the first
--long-clients send long prompts instead, about --long-tokens each, every one its
own: a mix in which short prompts must not wait behind long prefills), with
the official `openai` client. A request's latency includes any wait in the
queue. After the servers have stopped (so that nothing shares the CPU), the
target decodes every prompt plainly in this process. Checks: every reply
complete (a finish reason, usage, `data: [DONE]`) and equal to plain greedy
decoding. Reports, per batch size, latency percentiles (time to first token,
whole request), throughput (completion tokens and requests per second of wall
time) and the drafter's acceptance, and the first run's throughput and median
first-token time against the last's, to load_test.json under --out; exits
non-zero when a reply was lost or differs. Before the first run's clients
start, one request with a long system prompt is sent twice: the second's
prompt comes from the server's prompt cache, and its time to first token is
reported next to the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.profile.atomic import atomic_write_text


class ServerProcess:
    """`omnidraft serve` in a child process on a free local port; ready once /health answers (asked
    with `key`, or the --api-key among its args). launch: a launcher's command to start it under
    (`mlx.launch ... --`), which runs the installed `omnidraft` script, as a user does."""

    def __init__(
        self,
        draft: str,
        target: str,
        log: Path,
        *args: str,
        env: dict | None = None,
        start_s: float = 600,
        key: str | None = None,
        launch: tuple[str, ...] = (),
    ):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        key = key or (args[args.index("--api-key") + 1] if "--api-key" in args else None)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        omnidraft = (
            [*launch, str(Path(sys.executable).parent / "omnidraft")]
            if launch
            else [sys.executable, "-m", "omnidraft_mlx.cli.main"]
        )
        argv = [
            *omnidraft,
            "serve",
            "--draft",
            draft,
            "--target",
            target,
            "--port",
            str(self.port),
            *args,
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start in {start_s:.0f}s:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.5)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", headers=self.headers, timeout=30).json()

    def stop(self) -> int:
        """SIGTERM, which stops it as Ctrl-C does (the server saves what it learned and exits), and
        reaches it where Ctrl-C would not (a shell starts background jobs with SIGINT ignored); its
        exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:  # stuck: its threads' stacks into the log, then killed
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        return self.proc.wait()


@dataclass
class Request:
    client: int
    prompt_id: str
    messages: list[dict]
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    usage: dict | None = None
    error: str | None = None
    start_s: float = 0.0  # from the start of the run
    first_token_s: float | None = None  # after start_s
    total_s: float | None = None


def run_client(url: str, model: str, requests: list[Request], max_tokens: int, t0: float) -> None:
    """One client: its requests one after another, each streamed."""
    from openai import OpenAI

    with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        for r in requests:
            r.start_s = time.perf_counter() - t0
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=r.messages,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.usage is not None:
                        r.usage = chunk.usage.model_dump()
                    if not chunk.choices:
                        continue
                    piece = chunk.choices[0].delta.content or ""
                    if piece and r.first_token_s is None:
                        r.first_token_s = time.perf_counter() - t0 - r.start_s
                    r.text += piece
                    r.finish_reason = chunk.choices[0].finish_reason or r.finish_reason
                r.done = True  # the client's stream returns only after data: [DONE]
            except Exception as e:  # recorded: a lost reply is a result
                r.error = f"{type(e).__name__}: {e}"
            r.total_s = time.perf_counter() - t0 - r.start_s


def repeated_prompt(url: str, model: str, prompts: list, examples: int, max_tokens: int) -> dict:
    """One request with a long system prompt (chat prompts as examples), sent twice."""
    system = "Answer as these examples ask to be answered:\n" + "\n".join(p.text for p in prompts[:examples])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompts[0].text}]
    warm = Request(0, "warm-up", prompts[-1].messages())  # so that neither pays the server's first-request costs
    first, again = Request(0, "repeated", messages), Request(0, "repeated", messages)
    for r in (warm, first, again):
        run_client(url, model, [r], max_tokens, time.perf_counter())
        if r.error or not r.usage:
            return {"error": r.error or "no usage"}
    return {
        "prompt_tokens": first.usage["prompt_tokens"],
        "cached_tokens": [
            first.usage["prompt_tokens_details"]["cached_tokens"],
            again.usage["prompt_tokens_details"]["cached_tokens"],
        ],
        "first_token_s": [first.first_token_s, again.first_token_s],
        "first_token_ratio": again.first_token_s / first.first_token_s
        if first.first_token_s and again.first_token_s
        else None,
        "same_reply": first.text == again.text,
    }


def long_messages(prompts: list, j: int, tokens: int) -> list[dict]:
    """The j-th long request: about `tokens` tokens (4 characters each) of chat prompts from the j-th on as
    examples in its system prompt, a prompt of its own (the prompt cache holds none of it), then a question."""
    examples, i = [], j
    while sum(len(e) for e in examples) < 4 * tokens:
        examples.append(prompts[i % len(prompts)].text)
        i += 1
    system = "Answer as these examples ask to be answered:\n" + "\n".join(examples)
    return [{"role": "system", "content": system}, {"role": "user", "content": prompts[j % len(prompts)].text}]


def plain_replies(target: str, requests: list[Request], max_tokens: int) -> dict[str, str]:
    """The target's own greedy reply to each prompt (mlx-lm's generate_step)."""
    from omnidraft_mlx.decode.plain import PlainStats, plain_generate
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.prompts import encode_prompt

    model, tok = load_model(target, CATALOG_RESOLVER)
    out = {}
    for r in requests:
        if r.prompt_id not in out:
            ids = plain_generate(model, tok, encode_prompt(tok, r.messages), PlainStats(), max_tokens=max_tokens)
            out[r.prompt_id] = tok.decode(list(ids))
    return out


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    p = np.percentile(values, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "max": float(max(values)), "n": len(values)}


def serve_clients(args, batch: int, prompts: list, repeat: bool) -> dict:
    """One server (--batch batch) and the clients' requests: what happened, before comparing."""
    total = args.clients * args.requests
    requests = [
        Request(i % args.clients, p.id, p.messages())
        for i, p in enumerate(prompts[j % len(prompts)] for j in range(total))
    ]
    for j, r in enumerate(r for r in requests if r.client < args.long_clients):  # a mix: long prompts beside short
        r.prompt_id, r.messages = f"long/{j}", long_messages(prompts, j, args.long_tokens)
    server = ServerProcess(
        args.draft, args.target, args.out / f"server-batch{batch}.log", "--no-profile", "--batch", str(batch)
    )
    try:
        repeated = (
            repeated_prompt(server.url, args.target, prompts, args.repeat_examples, args.max_tokens) if repeat else None
        )
        t0 = time.perf_counter()
        threads = [
            threading.Thread(
                target=run_client,
                args=(server.url, args.target, [r for r in requests if r.client == c], args.max_tokens, t0),
            )
            for c in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall_s = time.perf_counter() - t0
        health = server.health()
    finally:
        status = server.stop()
    return {
        "batch": batch,
        "requests": requests,
        "wall_s": wall_s,
        "server_health": health,
        "server_exit_status": status,
        "repeated": repeated,
    }


def summary(run: dict, plain: dict[str, str]) -> dict:
    """A run's replies checked against plain decoding; its throughput, latency and drafting."""
    requests, wall_s = run["requests"], run["wall_s"]
    complete = [r for r in requests if r.done and r.finish_reason and r.usage and not r.error]
    tokens = sum(r.usage["completion_tokens"] for r in complete)
    spec = [r.usage["speculative"] for r in complete]
    proposed, accepted = sum(s["proposed"] for s in spec), sum(s["accepted"] for s in spec)
    forwards = sum(s["rounds"] for s in spec)
    return {
        "batch": run["batch"],
        "requests": len(requests),
        "complete": len(complete),
        "equal_to_plain": sum(r.text == plain[r.prompt_id] for r in complete),
        "server_exit_status": run["server_exit_status"],
        "server_health": run["server_health"],
        "wall_s": wall_s,
        "throughput": {
            "completion_tokens_per_s": tokens / wall_s,
            "requests_per_s": len(complete) / wall_s,
            "completion_tokens": tokens,
        },
        "latency_s": {
            "first_token": percentiles([r.first_token_s for r in complete if r.first_token_s is not None]),
            "request": percentiles([r.total_s for r in complete]),
        },
        "speculative": {
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_target_forward": tokens / forwards if forwards else None,
            "cached_prompt_tokens": sum(r.usage["prompt_tokens_details"]["cached_tokens"] for r in complete),
        },
        "records": [{**asdict(r), "equal_to_plain": r.text == plain[r.prompt_id]} for r in requests],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-clients", type=int, default=0, help="clients whose every prompt is long (--long-tokens)")
    ap.add_argument("--long-tokens", type=int, default=1500, help="a long prompt's length, about")
    ap.add_argument("--batch", default="8,1", help="the server's --batch per run, in order (1: one at a time)")
    ap.add_argument(
        "--repeat-examples",
        type=int,
        default=50,
        help="chat prompts in the repeated request's system prompt (its length)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve-load"))
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise SystemExit(f"--batch: '{args.batch}' is not a comma-separated list of numbers, e.g. 8,1") from None
    if min(args.clients, args.requests, args.max_tokens, *batches) < 1:
        raise SystemExit("--clients, --requests, --max-tokens and --batch must be at least 1")

    from omnidraft_mlx.bench.run import environment_base
    from omnidraft_mlx.tasks import load_task

    prompts = load_task("chat", "heldout") + load_task("chat", "adapt")
    args.out.mkdir(parents=True, exist_ok=True)
    served = [serve_clients(args, batch, prompts, repeat=not i) for i, batch in enumerate(batches)]
    plain = plain_replies(args.target, served[0]["requests"], args.max_tokens)
    runs = [summary(run, plain) for run in served]
    first, last = runs[0], runs[-1]
    result = {
        "command": " ".join(["python -m omnidraft_mlx.bench.load_test", *(argv if argv is not None else sys.argv[1:])]),
        "config": {
            "draft": args.draft,
            "target": args.target,
            "clients": args.clients,
            "repeat_examples": args.repeat_examples,
            "batches": batches,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "long_clients": args.long_clients,
            "long_tokens": args.long_tokens,
            "greedy": True,
            "server_args": ["--no-profile", "--batch B"],
        },
        "environment": environment_base(),
        "runs": runs,
        "first_over_last": {
            "completion_tokens_per_s": first["throughput"]["completion_tokens_per_s"]
            / max(last["throughput"]["completion_tokens_per_s"], 1e-9),
            "first_token_p50": (first["latency_s"]["first_token"] or {}).get("p50", 0)
            / max((last["latency_s"]["first_token"] or {}).get("p50", 0), 1e-9),
        },
        "repeated_prompt": served[0]["repeated"],
    }
    atomic_write_text(args.out / "load_test.json", json.dumps(result, indent=1))
    for run in runs:
        lat, tput = run["latency_s"], run["throughput"]
        print(
            f"--batch {run['batch']}: {run['complete']}/{run['requests']} replies complete, {run['equal_to_plain']} "
            f"equal to plain greedy decoding; {tput['completion_tokens_per_s']:.1f} tokens/s, "
            f"{tput['requests_per_s']:.2f} requests/s over {run['wall_s']:.1f}s"
            + (
                f"; first token p50 {lat['first_token']['p50']:.2f}s p90 {lat['first_token']['p90']:.2f}s; "
                f"request p50 {lat['request']['p50']:.2f}s p90 {lat['request']['p90']:.2f}s"
                if run["complete"]
                else ""
            )
        )
    repeated = result["repeated_prompt"]
    print(
        f"--batch {first['batch']} against {last['batch']}: "
        f"{result['first_over_last']['completion_tokens_per_s']:.2f}x the tokens/s, first token p50 "
        f"{result['first_over_last']['first_token_p50']:.2f}x as late; "
        f"a repeated {repeated.get('prompt_tokens')}-token "
        f"prompt: first token {repeated.get('first_token_ratio') or 0:.2f}x as late -> {args.out / 'load_test.json'}"
    )
    bad = [run for run in runs if run["equal_to_plain"] < run["requests"] or run["server_exit_status"] != 0]
    if bad:
        raise SystemExit(
            "; ".join(
                f"--batch {run['batch']}: {run['requests'] - run['complete']} replies lost or "
                f"incomplete, {run['complete'] - run['equal_to_plain']} differ from plain decoding, "
                f"server exit status {run['server_exit_status']}"
                for run in bad
            )
            + f": see {args.out / 'load_test.json'}"
        )


if __name__ == "__main__":
    main()
