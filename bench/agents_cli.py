"""The real coding agents on `omnidraft serve`: Codex CLI (the Responses API) and Claude Code (the
Messages API) run small coding tasks through the server.

    python -m omnidraft_mlx.bench.agents_cli --target qwen2.5-coder-1.5b --out bench/results/agents-cli

Starts the server (with an API key, so both agents send theirs; --no-profile unless --profile),
and in front of it a recording proxy that passes every request through unchanged and notes its
status, the usage figures of its reply (tokens, cached prompt tokens, the drafter's figures, time
to first token) and the tool calls in it. Then, for each agent and each task, a fresh scratch git
repository (with the task's starting files), the agent's one-shot command in it (`codex exec`
with a local provider: base_url, wire_api "responses", env_key; `claude -p` with
ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY and the target as every model it asks for), and the
task's check (run the file, compare its output). Codex gets a trimmed tool set (no web search,
sub-agents, goals, apps, plugins, images) and its context window as the pair's, Claude Code the
tools Bash, Read, Write, Edit: their prompts must fit the shorter context of the two models
(SmolLM2's 8,192 tokens in the default pairs). After the server has stopped (nothing else on the
CPU), the target alone decodes every answered turn again, the same prompt (rendered as the
server renders it) for its first --plain-tokens tokens, for each turn's speedup (tokens per second
over plain decoding's), and prefills each agent's first prompt whole: plain decoding's time to first
token on every turn, against the server's (its prompt cache holds the agent's long system prompt
after the first turn).
Writes agents_cli.json and README.md under --out: per task the prompt, the tool calls (commands),
the files written, whether the check passed (the model's skill, reported as it is), the agent's
exit status and the tail of its output; per agent every request's status (any 4xx/5xx is a
protocol error), the pooled speedup and time to first token on first and later turns.
Needs `codex` and `claude` on PATH (npm install -g @openai/codex @anthropic-ai/claude-code) or
given by --codex / --claude.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from omnidraft_mlx.bench.load_test import ServerProcess
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.profile.atomic import atomic_write_text


@dataclass
class Task:
    name: str
    prompt: str
    check: list[str]  # run in the repository; solved when it exits 0 and prints `expect`
    expect: str
    files: dict[str, str] = field(default_factory=dict)  # the repository's starting files


TASKS = [
    Task(
        "hello",
        "Create hello.py that prints exactly `hello, world`. Then run it.",
        ["python3", "hello.py"],
        "hello, world",
    ),
    Task(
        "count",
        "Create count.py that prints the numbers 1 to 5, one per line. Then run it.",
        ["python3", "count.py"],
        "1\n2\n3\n4\n5",
    ),
    Task(
        "reverse",
        "Create rev.py with a function reverse(s) that returns the string s reversed, "
        "and make the file print reverse('abc'). Then run it.",
        ["python3", "rev.py"],
        "cba",
    ),
    Task(
        "greet",
        "Edit greet.py so that it prints `hi, agent` instead of `hi`. Then run it.",
        ["python3", "greet.py"],
        "hi, agent",
        {"greet.py": 'print("hi")\n'},
    ),
    Task(
        "fix",
        "double(x) in calc.py should return twice x, but it does not. Fix it, then run calc.py.",
        ["python3", "calc.py"],
        "8",
        {"calc.py": "def double(x):\n    return x * 3\n\n\nprint(double(4))\n"},
    ),
    Task(
        "add",
        "Create mathx.py with a function add(a, b) that returns a + b, and make the file print add(2, 3). Then run it.",
        ["python3", "mathx.py"],
        "5",
    ),
]
CLAUDE_TOOLS = "Bash,Read,Write,Edit"
CODEX_CONFIG = """model = {target}
model_provider = "omnidraft"
web_search = "disabled"
model_context_window = {context}

[features]
multi_agent = false
goals = false
apps = false
plugins = false
image_generation = false
view_image = false
skill_search = false

[model_providers.omnidraft]
name = "omnidraft"
base_url = "{url}/v1"
env_key = "OMNIDRAFT_API_KEY"
wire_api = "responses"
stream_idle_timeout_ms = 3600000
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]


def reply_figures(path: str, text: str) -> dict:
    """From a reply's body (JSON or server-sent events): its usage and tool calls."""
    try:
        events = sse_events(text) if text.lstrip().startswith(("event:", "data:", ":")) else [json.loads(text)]
    except ValueError:
        return {}
    usage, calls = None, []
    for e in events:
        kind = e.get("type")
        if kind in ("response.completed", "response.incomplete") or e.get("object") == "response":
            response = e.get("response", e)
            u = response.get("usage") or {}
            usage = {
                "prompt_tokens": u.get("input_tokens"),
                "cached_tokens": (u.get("input_tokens_details") or {}).get("cached_tokens"),
                "completion_tokens": u.get("output_tokens"),
                "speculative": u.get("speculative"),
            }
            calls = [
                {"name": o["name"], "arguments": o["arguments"]}
                for o in response.get("output", [])
                if o.get("type") == "function_call"
            ]
        elif kind == "message" or kind == "message_delta":
            u = e.get("usage") or {}
            usage = {
                "prompt_tokens": (u.get("input_tokens") or 0) + (u.get("cache_read_input_tokens") or 0),
                "cached_tokens": u.get("cache_read_input_tokens"),
                "completion_tokens": u.get("output_tokens"),
                "speculative": u.get("speculative"),
            }
            if kind == "message":
                calls = [
                    {"name": b["name"], "arguments": json.dumps(b["input"])}
                    for b in e.get("content", [])
                    if b.get("type") == "tool_use"
                ]
        elif kind == "content_block_start" and e["content_block"].get("type") == "tool_use":
            calls.append({"name": e["content_block"]["name"], "arguments": ""})
        elif kind == "content_block_delta" and e["delta"].get("type") == "input_json_delta" and calls:
            calls[-1]["arguments"] += e["delta"]["partial_json"]
    return {"usage": usage, "tool_calls": calls} if usage else {}


class Recorder:
    """A proxy in front of the server (uvicorn in a thread): passes each request through, byte for
    byte and streamed, and records it under the current label."""

    def __init__(self, upstream: str):
        import httpx
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.upstream, self.label, self.turns = upstream, {}, []
        client = httpx.AsyncClient(timeout=None)

        async def relay(request):
            body, start = await request.body(), time.perf_counter()
            headers = [(k, v) for k, v in request.headers.items() if k not in ("host", "content-length")]
            url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
            sent = client.build_request(request.method, url, headers=headers, content=body)
            reply = await client.send(sent, stream=True)
            label = dict(self.label)

            async def chunks():
                got, first = [], None
                try:
                    async for chunk in reply.aiter_raw():
                        first = first if first is not None else time.perf_counter() - start
                        got.append(chunk)
                        yield chunk
                finally:
                    await reply.aclose()
                    self.note(label, request, body, reply.status_code, start, first, b"".join(got))

            kept = {k: v for k, v in reply.headers.items() if k.lower() in ("content-type", "cache-control")}
            return StreamingResponse(chunks(), status_code=reply.status_code, headers=kept)

        methods = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]
        app = Starlette(routes=[Route("/{path:path}", relay, methods=methods)])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def note(self, label, request, body: bytes, status: int, start: float, first, reply: bytes) -> None:
        text = reply.decode("utf-8", "replace")
        turn = {
            **label,
            "method": request.method,
            "path": request.url.path,
            "status": status,
            "wall_s": round(time.perf_counter() - start, 3),
            "first_byte_s": round(first, 3) if first is not None else None,
            **reply_figures(request.url.path, text),
        }
        if status >= 400:
            turn["error"] = text[:500]
        turn["_body"] = body  # for the plain replay; not written out
        self.turns.append(turn)
        usage = turn.get("usage") or {}
        print(
            f"  {label.get('agent')} {label.get('task')}: {request.method} {request.url.path} {status} "
            f"{turn['wall_s']:.1f} s, prompt {usage.get('prompt_tokens')} (cached {usage.get('cached_tokens')}), "
            f"reply {usage.get('completion_tokens')}, calls {[c['name'] for c in turn.get('tool_calls', [])]}",
            flush=True,
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def scratch_repo(root: Path, task: Task) -> Path:
    repo = root / task.name
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    for name, text in task.files.items():
        (repo / name).write_text(text)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], cwd=repo, check=True)
    return repo


def written(repo: Path) -> dict[str, str]:
    """The files the agent created or changed (their text, up to 2,000 characters each)."""
    out = subprocess.run(["git", "status", "--porcelain", "-uall"], cwd=repo, capture_output=True, text=True).stdout
    files = {}
    for line in out.splitlines():
        path = repo / line[3:]
        if path.is_file():
            files[line[3:]] = path.read_text(errors="replace")[:2000]
    return files


def checked(repo: Path, task: Task) -> dict:
    try:
        run = subprocess.run(task.check, cwd=repo, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return {"solved": False, "output": "timed out"}
    output = (run.stdout + run.stderr).strip()
    return {"solved": run.returncode == 0 and run.stdout.strip() == task.expect, "output": output[-500:]}


def agent_command(agent: str, exe: str, task: Task, target: str, repo: Path) -> list[str]:
    if agent == "codex":
        return [exe, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--color", "never", task.prompt]
    return [
        exe,
        "-p",
        task.prompt,
        "--model",
        target,
        "--tools",
        CLAUDE_TOOLS,
        "--allowedTools",
        CLAUDE_TOOLS,
        "--max-turns",
        "10",
    ]


def agent_env(agent: str, home: Path, proxy: str, key: str, target: str, context: int) -> dict:
    env = {**os.environ, "NO_COLOR": "1"}
    if agent == "codex":
        codex_home = home / "codex-home"
        codex_home.mkdir(parents=True, exist_ok=True)
        config = CODEX_CONFIG.format(target=json.dumps(target), context=context, url=proxy)
        (codex_home / "config.toml").write_text(config)
        return {**env, "CODEX_HOME": str(codex_home), "OMNIDRAFT_API_KEY": key}
    (home / "claude-config").mkdir(parents=True, exist_ok=True)
    models = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")
    models += ("ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL")
    return {
        **env,
        **dict.fromkeys(models, target),
        "ANTHROPIC_BASE_URL": proxy,
        "ANTHROPIC_API_KEY": key,
        "CLAUDE_CONFIG_DIR": str(home / "claude-config"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",  # its 5 minutes: a long prompt may prefill longer
    }


def run_task(agent: str, exe: str, task: Task, args, recorder: Recorder, work: Path, key: str) -> dict:
    repo = scratch_repo(work / agent, task)
    env = agent_env(agent, work / f"{agent}-home", recorder.url, key, args.target, args.context)
    recorder.label = {"agent": agent, "task": task.name}
    start = time.perf_counter()
    # Its own process group: npm's wrapper starts the agent's binary, which must go at a timeout too.
    proc = subprocess.Popen(
        agent_command(agent, exe, task, args.target, repo),
        cwd=repo,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=args.task_timeout_s)
        exit_code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        exit_code = "timeout"
    wall = time.perf_counter() - start
    time.sleep(0.5)  # the proxy notes the last reply once its stream closes
    turns = [t for t in recorder.turns if t.get("agent") == agent and t.get("task") == task.name]
    return {
        "task": task.name,
        "prompt": task.prompt,
        "command": agent_command(agent, Path(exe).name, task, args.target, repo),
        "exit_code": exit_code,
        "wall_s": round(wall, 1),
        "tool_calls": [c for t in turns for c in t.get("tool_calls", [])],
        "written": written(repo),
        **checked(repo, task),
        "requests": len(turns),
        "protocol_errors": [{k: t.get(k) for k in ("path", "status", "error")} for t in turns if t["status"] >= 400],
        "output_tail": output[-1500:],
    }


def prompt_ids(turn: dict, tok) -> list[int] | None:
    """The target's prompt of a recorded request, rendered as the server renders it (None: not a turn)."""
    from omnidraft_mlx.serve import messages, responses
    from omnidraft_mlx.serve.config import Limits
    from omnidraft_mlx.serve.schema import chat_messages
    from omnidraft_mlx.serve.tools import encode, plan_tools

    body = json.loads(turn["_body"])
    if turn["path"] == "/v1/responses":
        req = responses.ResponsesRequest.model_validate(body)
        if req.previous_response_id:
            return None  # its conversation lived in the server
        chat = responses.chat_request(req, responses.input_messages(req.input), Limits())
    elif turn["path"] == "/v1/messages":
        chat = messages.chat_request(messages.MessagesRequest.model_validate(body), Limits())
    else:
        return None
    pair = SimpleNamespace(draft_tok=tok, target_tok=tok)
    return encode(pair, chat_messages(chat), False, plan_tools(chat, tok))[1]


def replay_plain(target: str, turns: list[dict], most_tokens: int) -> None:
    """Each answered turn decoded again by the target alone (mlx-lm's generate_step), its first
    `most_tokens` tokens at most: turn["plain"], whose tokens/s is the turn's baseline (plain
    decoding's rate does not depend on what it writes; replaying whole turns of the 1.5B would take
    as long as the agents did again). Each agent's first turn is prefilled whole: plain decoding's
    time to first token, which every later turn pays as well (it keeps no prompt cache). Later turns
    reuse the KV cache of the prompt before, so the replay does not prefill the agent's long system
    prompt again."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from omnidraft_mlx.decode.plain import PlainStats, plain_generate
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    model, tok = load_model(target, CATALOG_RESOLVER)
    cache, held, agent = None, [], None  # the KV cache of the turn before, and the tokens it holds
    for turn in turns:
        usage = turn.get("usage") or {}
        if turn["status"] != 200 or not usage.get("speculative") or (usage.get("completion_tokens") or 0) < 2:
            continue
        ids = prompt_ids(turn, tok)
        if ids is None:
            continue
        if turn["agent"] != agent:
            cache, held, agent = make_prompt_cache(model), [], turn["agent"]
        common = 0
        while common < min(len(held), len(ids) - 1) and held[common] == ids[common]:
            common += 1
        trim_prompt_cache(cache, cache[0].offset - common)
        stats = PlainStats()
        out = list(
            plain_generate(
                model,
                tok,
                ids[common:],
                stats,
                max_tokens=min(most_tokens, usage["completion_tokens"]),
                prompt_cache=cache,
            )
        )
        held = (ids + out)[: cache[0].offset]
        turn["plain"] = {
            "prompt_tokens": len(ids),
            "cached_tokens": common,
            "completion_tokens": stats.emitted,
            "prefill_s": round(stats.prefill_s, 3),
            "tokens_per_s": round(stats.tokens_per_s, 2),
        }


def summary(turns: list[dict]) -> dict:
    """Over one agent's answered turns: the pooled speedup of decoding (tokens over decode time,
    against plain decoding's) and the time to first token on each task's first and later turns."""
    answered = [t for t in turns if (t.get("usage") or {}).get("speculative")]
    timed = [t for t in answered if t.get("plain") and t["usage"]["speculative"]["tokens_per_s"] > 0]
    tokens = sum(t["usage"]["completion_tokens"] for t in timed)
    spec_s = sum(t["usage"]["completion_tokens"] / t["usage"]["speculative"]["tokens_per_s"] for t in timed)
    plain_s = sum(  # each turn's tokens at plain decoding's rate for that turn
        t["usage"]["completion_tokens"] / t["plain"]["tokens_per_s"] for t in timed if t["plain"]["tokens_per_s"]
    )
    firsts, laters, seen = [], [], set()
    for t in answered:
        key = t.get("task")
        (laters if key in seen else firsts).append(t)
        seen.add(key)

    def prefilled_whole(group):
        return [t["plain"]["prefill_s"] for t in group if t.get("plain") and not t["plain"]["cached_tokens"]]

    def ttft(group):
        values = [t["usage"]["speculative"]["time_to_first_token_s"] for t in group]
        return {
            "turns": len(group),
            "median_s": round(statistics.median(values), 3) if values else None,
            "range_s": [round(min(values), 1), round(max(values), 1)] if values else None,
            "median_cached_tokens": statistics.median([t["usage"]["cached_tokens"] or 0 for t in group])
            if group
            else None,
            "median_prompt_tokens": statistics.median([t["usage"]["prompt_tokens"] or 0 for t in group])
            if group
            else None,
            "median_plain_prefill_s": round(statistics.median(whole), 3) if (whole := prefilled_whole(group)) else None,
        }

    speculative = [t["usage"]["speculative"] for t in answered]
    return {
        "requests": len(turns),
        "statuses": {str(s): sum(t["status"] == s for t in turns) for s in sorted({t["status"] for t in turns})},
        "protocol_errors": sum(t["status"] >= 400 for t in turns),
        "answered_turns": len(answered),
        "speedup": round(plain_s / spec_s, 3) if spec_s and plain_s else None,
        "speedup_turns": len(timed),
        "plain_prefill_s": round(statistics.median(whole), 3) if (whole := prefilled_whole(answered)) else None,
        "completion_tokens": tokens,
        "acceptance": round(
            sum(s["accepted"] for s in speculative) / max(sum(s["proposed"] for s in speculative), 1), 4
        ),
        "time_to_first_token": {"first_turn": ttft(firsts), "later_turns": ttft(laters)},
    }


def readme(result: dict) -> str:
    lines = [
        "# Codex CLI and Claude Code on `omnidraft serve`",
        "",
        f"Target `{result['target']}`, drafter `{result['draft']}`; "
        f"{result['tasks']} tasks per agent, each in a fresh scratch git repository.",
        "",
        "```bash",
        result["command"],
        "```",
        "",
        "| agent | solved | requests | 4xx/5xx | speedup (pooled, vs plain) | TTFT, each task's first turn "
        "| TTFT, later turns |",
        "|---|---|---|---|---|---|---|",
    ]

    def ttft(turns: dict) -> str:
        if not turns["turns"]:
            return "none"
        low, high = turns["range_s"]
        return (
            f"{low}-{high} s, median {turns['median_s']} s ({turns['median_cached_tokens']:.0f} of "
            f"{turns['median_prompt_tokens']:.0f} prompt tokens cached)"
        )

    for agent, run in result["agents"].items():
        s, t = run["summary"], run["summary"]["time_to_first_token"]
        solved = sum(task["solved"] for task in run["tasks"])
        lines.append(
            f"| {agent} ({run['version']}) | {solved} / {len(run['tasks'])} | {s['requests']} | "
            f"{s['protocol_errors']} | {s['speedup']}x over {s['speedup_turns']} turns | "
            f"{ttft(t['first_turn'])}; plain decoding prefills the whole prompt, "
            f"{s['plain_prefill_s']} s | {ttft(t['later_turns'])}; plain decoding prefills it all again |"
        )
    lines += ["", "## Tasks", ""]
    for agent, run in result["agents"].items():
        for task in run["tasks"]:
            calls = "; ".join(f"{c['name']}({c['arguments'][:120]})" for c in task["tool_calls"][:6]) or "none"
            lines.append(
                f"- **{agent} / {task['task']}**: {'solved' if task['solved'] else 'not solved'}, exit "
                f"{task['exit_code']}, {task['requests']} requests, wrote {sorted(task['written']) or 'nothing'}; "
                f"calls: {calls}"
            )
    return "\n".join(lines) + "\n"


def version(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--agents", default="codex,claude")
    p.add_argument("--tasks", type=int, default=len(TASKS), help=f"the first N of the {len(TASKS)} tasks")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="the server's reply length when none is asked (Codex: a cut reply is an error)",
    )
    p.add_argument("--context", type=int, default=8192, help="the context window Codex is told")
    p.add_argument("--task-timeout-s", type=float, default=900)
    p.add_argument("--profile", action="store_true", help="serve with the pair's profile (default: --no-profile)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain replay (no speedups)")
    p.add_argument("--plain-tokens", type=int, default=64, help="replayed plainly per turn, for its rate")
    p.add_argument("--codex", default=shutil.which("codex"))
    p.add_argument("--claude", default=shutil.which("claude"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    for agent in agents:
        if agent not in ("codex", "claude"):
            raise OmniDraftError(f"--agents: codex and/or claude, not '{agent}'")
        if not getattr(args, agent):
            raise OmniDraftError(
                f"{agent} not found: npm install -g @openai/codex @anthropic-ai/claude-code, or --{agent}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    # The scratch repositories and the agents' homes, absolute: the agents run inside the repositories.
    work = args.out.resolve() / "work"
    key = secrets.token_hex(8)
    serve_args = ["--api-key", key, "--max-tokens", str(args.max_tokens)] + ([] if args.profile else ["--no-profile"])
    server = ServerProcess(args.draft, args.target, args.out / "server.log", *serve_args)
    recorder = Recorder(server.url)
    runs = {}
    try:
        for agent in agents:
            exe = getattr(args, agent)
            tasks = []
            for task in TASKS[: args.tasks]:
                tasks.append(run_task(agent, exe, task, args, recorder, work, key))
                print(
                    f"{agent} {task.name}: solved={tasks[-1]['solved']} requests={tasks[-1]['requests']} "
                    f"errors={len(tasks[-1]['protocol_errors'])} exit={tasks[-1]['exit_code']}",
                    flush=True,
                )
                if not tasks[-1]["requests"]:  # it never reached the server: say why, as it said
                    print(tasks[-1]["output_tail"], flush=True)
            runs[agent] = {"version": version(exe), "tasks": tasks}
    finally:
        recorder.stop()
        code = server.stop()
    if not args.no_plain:
        replay_plain(args.target, recorder.turns, args.plain_tokens)
    for agent, run in runs.items():
        run["turns"] = [{k: v for k, v in t.items() if k != "_body"} for t in recorder.turns if t.get("agent") == agent]
        run["summary"] = summary(run["turns"])
    command = "./run.sh python -m omnidraft_mlx.bench.agents_cli " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "draft": args.draft,
        "target": args.target,
        "tasks": min(args.tasks, len(TASKS)),
        "command": command,
        "server_exit": code,
        "agents": runs,
    }
    # The agents' tool calls name files by absolute path: the record says them from the checkout's root.
    root = str(Path.cwd().resolve()) + os.sep
    atomic_write_text(args.out / "agents_cli.json", json.dumps(result, indent=1).replace(root, ""))
    atomic_write_text(args.out / "README.md", readme(result).replace(root, ""))
    print(readme(result))


if __name__ == "__main__":
    main()
