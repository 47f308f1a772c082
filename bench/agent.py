"""The agent task: multi-step tool conversations that fix held-out HumanEval code.

An episode is one held-out problem. The agent is asked to make the tests of a
file pass; its scripted first call reads the file (the reference solution with
one injected bug, or the bare stub where no small change breaks a test); then
each measured step is the target's reply: a write_file call with the whole file,
or the whole file in a code block. The harness applies it, runs the problem's
own tests on it in a subprocess with a timeout (as HumanEval's harness does)
and returns their output as a tool message; once they pass, the next step asks
for a change (usecases.EDITS). The target's greedy replies decide the
conversation (decoded here, untimed, by the lossless speculative loop), so
every method decodes the same steps.
Prompts render with the tools through the target's chat template, as the
server renders them; run.py decodes our methods' steps on a prompt cache and a
history index kept across steps, as the server keeps them across requests.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omnidraft_mlx.bench.usecases import EDITS, greedy_reply
from omnidraft_mlx.serve.text import splitter
from omnidraft_mlx.serve.tools import auto_plan
from omnidraft_mlx.tasks import Prompt, humaneval, load_task

AGENT_STEPS = 3  # measured replies per episode
TEST_TIMEOUT_S = 3.0  # HumanEval's harness allows 3 s per problem
OUTPUT_CHARS = 1200  # the end of a failing run's output, as the tool returns it
SYSTEM = "You are a coding agent. Use the tools to read, write and test files. Always write whole files."
TASK = "The tests of `{path}` fail. Fix the file so that they pass."
PASSED = "All tests passed."
# Small changes that break a reference solution, tried in order: the first that fails a test is the bug.
BUGS = (
    (" <= ", " < "),
    (" < ", " <= "),
    (" >= ", " > "),
    (" > ", " >= "),
    (" == ", " != "),
    (" != ", " == "),
    ("+ 1", "- 1"),
    ("- 1", "+ 1"),
    (" and ", " or "),
    (" or ", " and "),
    ("True", "False"),
    ("False", "True"),
    ("[0]", "[1]"),
    ("[1:]", "[2:]"),
    (" + ", " - "),
    (" - ", " + "),
    (" * ", " + "),
    (" % ", " // "),
    ("reverse=True", "reverse=False"),
    ("sorted(", "list("),
    ("0", "1"),
)


def _tool(name: str, description: str, **params: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = (
    _tool("read_file", "Read a file.", path="the file's path"),
    _tool("write_file", "Write a whole file, replacing it.", path="the file's path", content="the whole new file"),
    _tool("run_tests", "Run the tests of a file; returns their output.", path="the file's path"),
)


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    output: str  # what the run_tests tool returns


def run_tests(code: str, test: str, entry_point: str, timeout_s: float = TEST_TIMEOUT_S) -> CheckResult:
    """A HumanEval problem's own tests (`test` + check(entry_point)) on `code`, in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "solution.py"
        path.write_text(f"{code}\n\n{test}\n\ncheck({entry_point})\n", "utf-8")
        try:
            run = subprocess.run(
                [sys.executable, "-I", path.name], cwd=tmp, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return CheckResult(False, f"FAILED: the tests timed out after {timeout_s:g} s")
    if run.returncode == 0:
        return CheckResult(True, PASSED)
    return CheckResult(False, "FAILED\n" + (run.stdout + run.stderr).replace(tmp, ".")[-OUTPUT_CHARS:])


@dataclass(frozen=True)
class Problem:
    id: str  # HumanEval's task id
    path: str  # the file's name in the conversation
    code: str  # the broken file the agent starts from
    test: str
    entry_point: str

    def check(self, code: str) -> CheckResult:
        return run_tests(code, self.test, self.entry_point)


def broken_file(row: dict) -> str:
    """The reference solution with the first small change (BUGS) that fails its tests; else the stub."""
    for old, new in BUGS:
        if old in row["canonical_solution"]:
            code = (row["prompt"] + row["canonical_solution"].replace(old, new, 1)).lstrip("\n")
            if not run_tests(code, row["test"], row["entry_point"]).passed:
                return code
    return row["prompt"].lstrip("\n") + "    pass\n"


def problems(n: int) -> list[Problem]:
    """n held-out HumanEval problems, each with a broken file to fix."""
    rows = [humaneval()[p.id] for p in load_task("complete", "heldout")[:n]]
    return [Problem(r["task_id"], f"{r['entry_point']}.py", broken_file(r), r["test"], r["entry_point"]) for r in rows]


@dataclass(frozen=True)
class AgentStep(Prompt):
    """One measured step: the whole conversation so far (it ends with a tool result or a request)."""

    def messages(self) -> list[dict]:
        return list(self.context)


def call(name: str, arguments: dict) -> dict:
    """An assistant message making one tool call (arguments as objects, as chat templates take them)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def opening(problem: Problem) -> list[dict]:
    """The conversation up to step 1: the task, the agent's read_file call and the file."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK.format(path=problem.path)},
        call("read_file", {"path": problem.path}),
        {"role": "tool", "content": problem.code},
    ]


def read_reply(tokenizer, text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) of a reply, split as the server splits it (tool_choice "auto")."""
    split = splitter(auto_plan(list(TOOLS), tokenizer))
    events = split.add(text) + split.finish()
    calls = [c for kind, payload in events if kind == "tool_calls" for c in payload]
    return "".join(p for kind, p in events if kind == "text"), calls


def code_block(text: str) -> str | None:
    """The last ```python block of a reply: a whole file given as text."""
    blocks = re.findall(r"```(?:python|py)?\n(.*?)```", text, re.S)
    return blocks[-1] if blocks else None


class Workspace:
    """The episode's one file, as the agent's tool calls change it."""

    def __init__(self, problem: Problem):
        self.problem, self.code, self.last = problem, problem.code, None

    def tool(self, name: str, args: dict) -> str:
        """A tool call's result."""
        if name == "write_file" and isinstance(args.get("content"), str):
            self.code = args["content"]
            return f"Wrote {len(self.code)} characters to {self.problem.path}."
        if name == "run_tests":
            self.last = self.problem.check(self.code)
            return self.last.output
        return self.code if name == "read_file" else f"Error: bad call of {name}."


def answered(space: Workspace, tokenizer, reply: str, step: int) -> list[dict]:
    """The messages that follow a reply: its calls' results, then the tests' output (run by the
    agent's scripted run_tests call unless the reply ran them), then the next change once they pass."""
    content, calls = read_reply(tokenizer, reply)
    said = {"role": "assistant", "content": content}
    if calls:
        # As call() writes them: no random call ids, so the prompts are the same in every run.
        said["tool_calls"] = [call(c["function"]["name"], _args(c))["tool_calls"][0] for c in calls]
    elif (code := code_block(content)) is not None:
        space.code = code  # a whole file as text: the harness writes it
    messages, space.last = [said], None
    messages += [{"role": "tool", "content": space.tool(c["function"]["name"], _args(c))} for c in calls]
    if space.last is None:
        messages += [
            call("run_tests", {"path": space.problem.path}),
            {"role": "tool", "content": space.tool("run_tests", {})},
        ]
    if space.last.passed:
        change = EDITS[step % len(EDITS)].format(name=space.problem.entry_point)
        messages.append({"role": "user", "content": f"The tests pass. {change} Use write_file."})
    return messages


def _args(openai_call: dict) -> dict:
    args = json.loads(openai_call["function"]["arguments"] or "{}")
    return args if isinstance(args, dict) else {}


def episode(problem: Problem, pair, max_tokens: int, replied=lambda what: None) -> list[AgentStep]:
    """AGENT_STEPS steps on one problem, each conversation built on the target's greedy replies
    (replied(step id) after each)."""
    space, conversation, steps = Workspace(problem), opening(problem), []
    for step in range(1, AGENT_STEPS + 1):
        steps.append(AgentStep(f"agent/{problem.id}/{step}", "agent", "", context=tuple(conversation), tools=TOOLS))
        if step < AGENT_STEPS:
            conversation += answered(space, pair.target_tok, greedy_reply(pair, steps[-1], max_tokens), step)
            replied(steps[-1].id)
    return steps


def agent_prompts(n: int, pair, max_tokens: int, replied=lambda what: None) -> list[Prompt]:
    """The steps of n episodes, episode after episode (n * (AGENT_STEPS - 1) replies built on)."""
    return [step for problem in problems(n) for step in episode(problem, pair, max_tokens, replied)]
