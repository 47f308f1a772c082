"""The agent task of `omnidraft bench`: its test harness, its episodes, and the run end to end on
the tiny models (greedy steps equal to plain, per-step and per-episode speedups consistent)."""

import json

import numpy as np
import pytest
from test_bench import check_records, home, invoke  # noqa: F401 (home: a fixture)

from omnidraft_mlx.bench.agent import AGENT_STEPS, PASSED, CheckResult, Workspace, answered, problems, run_tests
from omnidraft_mlx.bench.report import episode_of
from omnidraft_mlx.tasks import humaneval

LOOP = "def spin(x):\n    while True:\n        pass\n"


def reference(problem) -> str:
    row = humaneval()[problem.id]
    return row["prompt"] + row["canonical_solution"]


def test_harness_runs_the_problems_own_tests():
    problem = problems(1)[0]
    assert problem.check(reference(problem)) == CheckResult(True, PASSED)
    broken = problem.check(problem.code)
    assert not broken.passed and "AssertionError" in broken.output
    spun = run_tests(LOOP, "def check(f):\n    f(1)\n", "spin", timeout_s=1.0)
    assert not spun.passed and "timed out" in spun.output


def test_every_episode_starts_from_a_file_that_fails():
    for problem in problems(4):
        assert problem.code != reference(problem) and not problem.check(problem.code).passed


def test_a_reply_is_applied_and_tested(tiny):
    """A write_file call (bare JSON, as Qwen2.5-Coder writes it) or a code block replaces the file; the
    tests' output comes back as a tool message; once they pass, the next step asks for a change."""
    tokenizer, problem = tiny["target"][1], problems(1)[0]
    space = Workspace(problem)
    call = json.dumps({"name": "write_file", "arguments": {"path": problem.path, "content": reference(problem)}})
    messages = answered(space, tokenizer, call, 1)
    assert messages[0]["tool_calls"][0]["function"]["arguments"]["content"] == reference(problem)
    assert space.code == reference(problem) and [m["role"] for m in messages] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "user",
    ]
    assert messages[3]["content"] == PASSED and "The tests pass." in messages[4]["content"]

    space = Workspace(problem)
    messages = answered(space, tokenizer, f"Fixed:\n```python\n{problem.code}```", 2)
    assert [m["role"] for m in messages] == ["assistant", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "run_tests"
    assert messages[2]["content"].startswith("FAILED")


def test_served_steps_keep_the_prompt_cache_and_learn_history(cross):
    """Our methods decode agent steps as the server does: each step reuses the cache of the last
    (its prompt and reply) and the history index learns every reply; plain gets the same tokens."""
    from omnidraft_mlx.bench.agent import agent_prompts
    from omnidraft_mlx.bench.run import DecodeSettings, Method, Serving, run_one
    from omnidraft_mlx.decode.drafts import SOURCES
    from omnidraft_mlx.decode.scheduler import Scheduler

    steps, run = agent_prompts(1, cross, 8), DecodeSettings(8)
    fused, serving, scheduler = Method("fused-k3", "ours", 3, sources=SOURCES), Serving.start(None), Scheduler()
    learned, before = [], 0  # history n-grams after each step; the last step's prompt tokens
    for step in steps:
        mine = run_one(cross, fused, step, run, scheduler=scheduler, serving=serving)
        assert mine["output"] == run_one(cross, Method("plain", "plain"), step, run)["output"]
        learned.append(len(serving.history))
        # The last step's prompt, but for a token or two where the next message joins it.
        assert before - 3 <= mine["cached_tokens"] < mine["prompt_tokens"] and (before or not mine["cached_tokens"])
        before = mine["prompt_tokens"]
    assert 0 < learned[0] < learned[1] < learned[2]


def test_bench_agent_end_to_end(tiny_dirs, home, tmp_path):
    out = tmp_path / "out"
    r = invoke(
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--task",
        "agent",
        "--source",
        "drafter,fused",
        "--k",
        "3",
        "--prompts",
        "2",
        "--max-tokens",
        "12",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    check_records(result, ["plain", "ours-k3", "fused-k3"])
    records = result["records"]
    assert len(result["config"]["prompt_ids"]) == 2 * AGENT_STEPS
    _check_steps_build_on_each_other(records)
    _check_episodes(result)
    assert "| agent |" in (out / "summary.md").read_text()


def _check_steps_build_on_each_other(records):
    """Each step's prompt holds the last one's; our methods' prompt cache (kept across steps) holds it."""
    plain = [r for r in records if r["method"] == "plain"]
    for earlier, later in zip(plain, plain[1:]):
        if episode_of(earlier["prompt_id"]) == episode_of(later["prompt_id"]):
            assert later["prompt_tokens"] > earlier["prompt_tokens"] + earlier["tokens"]
            for r in records:
                if r["prompt_id"] == later["prompt_id"] and r["kind"] == "ours":
                    assert r["cached_tokens"] >= earlier["prompt_tokens"] - 3 and r["prompt_s"] == 0
    assert all(r["equal_to_plain"] for r in records if r["kind"] == "ours")


def _check_episodes(result):
    """Per episode: the steps' speedups are the records', the episode's is plain's summed time over
    the method's (same tokens); the summary's median is over those episodes."""
    episodes, records = result["episodes"], result["records"]
    assert len(episodes) == 2 * 3 and all(e["steps"] == AGENT_STEPS for e in episodes)
    for e in episodes:
        mine = [r for r in records if r["method"] == e["method"] and episode_of(r["prompt_id"]) == e["episode"]]
        plain = [r for r in records if r["method"] == "plain" and episode_of(r["prompt_id"]) == e["episode"]]
        assert e["step_speedups"] == [r["speedup"] for r in mine] and e["all_equal_to_plain"]
        assert e["tokens"] == sum(r["tokens"] for r in plain)
        expected = sum(r["generate_s"] for r in plain) / sum(r["generate_s"] for r in mine)
        assert e["speedup"] == pytest.approx(expected)
    row = next(s for s in result["summary"] if s["task"] == "agent" and s["method"] == "fused-k3")
    fused = [e["speedup"] for e in episodes if e["method"] == "fused-k3"]
    assert row["episodes"] == 2 and row["episode_speedup_median"] == pytest.approx(float(np.median(fused)))
