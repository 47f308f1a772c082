"""`omnidraft bench` end to end on the tiny models: files, records, consistency.

No timing assertions: the numbers are the benchmark's job, these tests check
that the machinery measures the right things and that greedy outputs agree.
"""

import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.profile.store import profile_dir
from omnidraft_mlx.tasks import ADAPT_SIZE, TASKS, load_task
from omnidraft_mlx.vocab.ngram import NGramCache


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty OMNIDRAFT_HOME that still finds the task data already downloaded."""
    from omnidraft_mlx.models.pull import downloads_dir

    real = downloads_dir()
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    if real.is_dir():
        (tmp_path / "home").mkdir()
        os.symlink(real, tmp_path / "home" / "downloads")
    return tmp_path / "home"


def invoke(*args: str):
    from omnidraft_mlx.cli.bench_cmd import bench

    app = typer.Typer()
    app.command()(bench)
    return CliRunner().invoke(app, list(args))


def test_tasks_have_fixed_disjoint_splits():
    for task in TASKS:
        adapt, heldout = load_task(task, "adapt"), load_task(task, "heldout")
        assert len(adapt) == ADAPT_SIZE[task] and heldout
        assert not {p.id for p in adapt} & {p.id for p in heldout}
        assert all(p.task == task and p.text.strip() for p in adapt + heldout)
        assert [p.id for p in heldout] == [p.id for p in load_task(task, "heldout")]
    assert [len(load_task(t, "heldout")) for t in ("math", "complete", "write", "chat")] == [319, 64, 20, 20]
    assert load_task("complete", "heldout")[0].text.startswith("Complete this Python function:\n```python\n")
    assert not any("```" in p.text or "def " in p.text for p in load_task("write", "heldout"))  # nothing to copy
    code, math = load_task("complete", "adapt")[0], load_task("math", "adapt")[0]
    stub = code.text.split("```python\n", 1)[1].rstrip("`")
    assert code.reference.startswith("```python\n" + stub) and len(code.reference) > len(stub) + 20
    assert "<<" not in math.reference and re.search(r"\nThe answer is [\d,.-]+\.$", math.reference)
    assert all(p.reference is None for p in load_task("chat", "adapt") + load_task("write", "adapt"))
    with pytest.raises(OmniDraftError, match="unknown --task 'poetry'"):
        load_task("poetry", "adapt")
    with pytest.raises(OmniDraftError, match="'code' is now 'complete'"):
        load_task("code", "adapt")
    with pytest.raises(OmniDraftError, match="unknown split"):
        load_task("complete", "test")


def check_records(result: dict, methods: list[str]) -> None:
    records, cfg = result["records"], result["config"]
    assert [m["name"] for m in cfg["methods"]] == methods
    assert len(records) == len(cfg["prompt_ids"]) * len(methods)
    for prompt_id in cfg["prompt_ids"]:
        group = {r["method"]: r for r in records if r["prompt_id"] == prompt_id}
        assert set(group) == set(methods)
        # Every method ran once, in a rotation of the fixed order.
        assert sorted(r["order"] for r in group.values()) == list(range(len(methods)))
        plain = group["plain"]
        assert plain["speedup"] == pytest.approx(1.0) and plain["tokens"] == len(plain["output"]) > 0
        for r in group.values():
            assert r["equal_to_plain"] and r["mismatch"] is None, (r["method"], r["mismatch"])
            assert r["output"] == plain["output"]
            assert r["prompt_tokens"] == plain["prompt_tokens"]
            assert r["ttft_s"] > 0 and r["generate_s"] > 0 and r["tokens_per_s"] > 0
            # The target processed the prompt once; each method's first token counts that prefill
            # (but in the agent task ours prefills on its own prompt cache, as the server does).
            served = r["task"] == "agent" and r["kind"] == "ours"
            assert r["prompt_s"] == (0 if served else plain["prompt_s"]) and plain["prompt_s"] > 0
            assert r["ttft_s"] > r["prompt_s"]
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
            if r["kind"] == "plain":
                continue
            assert 0 <= r["accepted"] <= r["proposed"]
            # A guarded method may decode a prompt plainly throughout (the guard times rounds).
            assert (0 <= r["acceptance"] <= 1) if r["proposed"] else r["acceptance"] is None
            # Each target forward emits its accepted tokens plus one of its own.
            if r.get("policy", "fixed") == "fixed":
                assert 1 <= r["tokens_per_forward"] <= r["k"] + 1
            if r["kind"] == "ours":
                assert r["draft_s"] + r["verify_s"] <= r["generate_s"] + 1e-6 and r["other_s"] >= 0
    summary = {(s["task"], s["method"]): s for s in result["summary"]}
    for task in {r["task"] for r in records} | {"all"}:
        for method in methods:
            assert summary[task, method]["all_equal_to_plain"]


def test_bench_cross_vocab_end_to_end(tiny_dirs, home, tmp_path):
    draft, target = str(tiny_dirs["draft"]), str(tiny_dirs["target"])
    # A saved profile is read, used and left as it was.
    saved = NGramCache()
    saved.add((1, 2), 3)
    saved.save(profile_dir(draft, target) / "ngrams.json")
    before = (profile_dir(draft, target) / "ngrams.json").read_bytes()

    out = tmp_path / "out"
    r = invoke(
        "--draft",
        draft,
        "--target",
        target,
        "--task",
        ",".join(TASKS),
        "--k",
        "2,3",
        "--translation",
        "text,tokens",
        "--tree",
        "on,off",
        "--prompts",
        "2",
        "--max-tokens",
        "12",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    for name in ("bench.json", "summary.md", "speedup.png", "k_sweep.png", "time_split.png"):
        assert (out / name).stat().st_size > 0
    result = json.loads((out / "bench.json").read_text())
    check_records(
        result,
        [
            "plain",
            "ours-k2-tree",
            "ours-k2",
            "ours-k2-tokens-tree",
            "ours-k2-tokens",
            "ours-k3-tree",
            "ours-k3",
            "ours-k3-tokens-tree",
            "ours-k3-tokens",
        ],
    )
    assert len(result["config"]["prompt_ids"]) == 2 * len(TASKS)
    assert [load_task(t, "heldout")[0].id for t in TASKS] == result["config"]["prompt_ids"][: len(TASKS)]
    assert result["config"]["ngram_cache_at_start"] == 1
    assert result["config"]["profile"]["ngrams"] == 1 and not result["config"]["profile"]["adapter"]
    assert (profile_dir(draft, target) / "ngrams.json").read_bytes() == before
    # One pair for the run: its n-gram cache only grows, prompt after prompt.
    ours = [r for r in result["records"] if r["kind"] == "ours"]
    sizes = [
        r["ngram_cache_size"]
        for r in sorted(ours, key=lambda r: (result["config"]["prompt_ids"].index(r["prompt_id"]), r["order"]))
    ]
    assert sizes == sorted(sizes) and sizes[0] >= 1
    env = result["environment"]
    assert env["blas"] and env["mlx"] and env["mlx_lm"] and env["models"]["target"]["name"] == target
    assert re.search(r"\| ours-k2-tokens +\|", (out / "summary.md").read_text())
    # The tree methods verified trees and the chains did not; both equal plain (check_records).
    by_method = {m: [r for r in result["records"] if r["method"] == m] for m in ("ours-k2-tree", "ours-k2")}
    assert sum(r["branched"] for r in by_method["ours-k2-tree"]) > 0
    assert sum(r["branched"] for r in by_method["ours-k2"]) == 0


def test_bench_compares_sources_on_use_cases_and_user_prompts(tiny_dirs, home, tmp_path):
    """drafter / lookup / fused families, guard on and off, the edit and multiturn tasks and
    a prompts file, all greedy-equal to plain; lookups find the code the edit prompts show."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "def add_3(x):"},
                    {"role": "assistant", "content": "    return x + 3"},
                    {"role": "user", "content": "Again, please."},
                ]
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    r = invoke(
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--task",
        "edit,multiturn",
        "--prompts-file",
        str(prompts),
        "--source",
        "drafter,lookup,fused",
        "--guard",
        "on,off",
        "--k",
        "3",
        "--prompts",
        "2",
        "--max-tokens",
        "16",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    check_records(result, ["plain", "ours-k3", "lookup", "lookup-noguard", "fused-k3", "fused-k3-noguard"])
    ids = result["config"]["prompt_ids"]
    assert len(ids) == 5 and ids[0].startswith("edit/HumanEval/") and ids[1].endswith("/2") and ids[2] == "file/1"
    multiturn = next(r for r in result["records"] if r["task"] == "multiturn" and r["method"] == "plain")
    assert multiturn["prompt_tokens"] > 60  # the earlier turn and its reply are part of the prompt
    lookups = [r for r in result["records"] if r["method"] == "lookup-noguard" and r["task"] == "edit"]
    assert sum(r["by_source"].get("context", [0, 0, 0])[2] for r in lookups) > 0


def test_bench_sampled_runs_compare_by_distribution(tiny_dirs, home, tmp_path):
    out = tmp_path / "out"
    r = invoke(
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--task",
        "complete",
        "--source",
        "drafter,fused",
        "--k",
        "3",
        "--temp",
        "0.7",
        "--seed",
        "3",
        "--prompts",
        "2",
        "--sampling",
        "exact,omnidraft",
        "--max-tokens",
        "12",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    assert {r["method"] for r in result["records"]} == {
        "plain",
        "ours-k3",
        "ours-k3-omnidraft",
        "fused-k3",
        "fused-k3-omnidraft",
    }
    modes = {m["name"]: m["sampling"] for m in result["config"]["methods"]}
    assert modes["ours-k3"] == "exact" and modes["fused-k3-omnidraft"] == "omnidraft"
    assert all(r["equal_to_plain"] is None and r["mismatch"] is None for r in result["records"])
    assert "n/a" in (out / "summary.md").read_text()


def test_bench_compares_draft_length_policies(tiny_dirs, home, tmp_path):
    out = tmp_path / "out"
    r = invoke(
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--task",
        "complete",
        "--k",
        "3",
        "--policy",
        "confidence,heuristic,learned,oracle",
        "--gamma",
        "0.2,auto,0.8",
        "--prompts",
        "2",
        "--max-tokens",
        "24",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    check_records(
        result,
        [
            "plain",
            "ours-k3",
            "ours-confidence",
            "ours-heuristic",
            "ours-learned-g0.2",
            "ours-learned-gauto",
            "ours-learned-g0.8",
            "ours-oracle",
        ],
    )
    assert (out / "gamma.png").stat().st_size > 0
    drafted = {}
    for rec in result["records"]:
        if rec["kind"] == "ours":
            drafted[rec["method"]] = drafted.get(rec["method"], 0) + rec["drafted"] / rec["rounds"]
    assert len(set(drafted.values())) > 1  # the policies do draft differently


def test_bench_same_vocab_runs_mlx_lm_beside_ours(tiny_dirs, home, tmp_path):
    out = tmp_path / "out"
    r = invoke(
        "--draft",
        str(tiny_dirs["same"]),
        "--target",
        str(tiny_dirs["target"]),
        "--task",
        "complete",
        "--k",
        "2,3",
        "--translation",
        "text,tokens",
        "--quick",
        "--no-profile",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["profile"] is None  # --no-profile
    # Same vocabulary: no translation variants, and mlx-lm's speculative decoding beside ours.
    check_records(result, ["plain", "ours-k2", "ours-k3", "mlxlm-k2", "mlxlm-k3"])
    assert result["config"]["max_tokens"] == 32 and len(result["config"]["prompt_ids"]) == 1
    assert result["config"]["prompt_ids"][0] == min(load_task("complete", "heldout"), key=lambda p: len(p.text)).id
    mlxlm = [r for r in result["records"] if r["kind"] == "mlxlm"]
    assert all(r["draft_s"] is None and r["accepted"] > 0 for r in mlxlm)


def test_mismatch_reports_position_and_logit_gap(tiny):
    from omnidraft_mlx.bench.run import first_mismatch
    from omnidraft_mlx.pair import make_pair

    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    prompt = list(tt.encode("def add_1(x):\n"))
    reference = [5, 6, 7, 8]
    assert first_mismatch(pair, prompt, reference, list(reference)) is None
    m = first_mismatch(pair, prompt, reference, [5, 6, 9, 8])
    assert (m["position"], m["plain_token"], m["method_token"]) == (2, 7, 9) and m["top2_logit_gap"] >= 0
    m = first_mismatch(pair, prompt, reference, reference[:3])
    assert (m["position"], m["method_token"]) == (3, None)


def test_speedup_is_the_median_of_per_prompt_ratios():
    from omnidraft_mlx.bench.report import record_speedup, speedup

    # Ratios 1, 3, 1: pooled tokens/s would give 1.5, their mean 1.67.
    assert speedup([(10, 10), (15, 5), (5, 5)]) == {"median": 1.0, "min": 1.0, "max": 3.0, "prompts": 3}
    assert speedup([(10, 10), (30, 10), (8, 4), (5, 0)])["median"] == 2.0  # no plain rate: left out
    assert speedup([(1, None)]) is None
    plain = [{"prompt_id": "a", "tokens_per_s": 4.0}, {"prompt_id": "b", "tokens_per_s": 10.0}]
    ours = [{"prompt_id": "b", "tokens_per_s": 12.0}, {"prompt_id": "a", "tokens_per_s": 8.0}]
    assert record_speedup(ours, plain) == {"median": 1.6, "min": 1.2, "max": 2.0, "prompts": 2}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "poetry"], "unknown --task"),
        (["--k", "0"], "at least 1"),
        (["--k", "three"], "comma-separated integers"),
        (["--policy", "learned", "--gamma", "half"], "--gamma takes a probability between 0 and 1 or 'auto'"),
        (["--translation", "bytes"], "unknown --translation"),
        (["--temp", "0.7", "--sampling", "fast"], "unknown --sampling 'fast'"),
        (["--sampling", "omnidraft"], "--sampling compares sampled decoding: add --temp"),
        (["--forward-cost", ","], "needs model names"),
    ],
)
def test_bad_input_is_one_clear_error(tiny_dirs, args, message):
    r = invoke("--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"]), *args)
    assert isinstance(r.exception, OmniDraftError) and message in str(r.exception)


def test_forward_cost_mode(tiny_dirs, tmp_path):
    r = invoke("--forward-cost", f"{tiny_dirs['draft']},{tiny_dirs['target']}", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "forward_cost.json").read_text())
    assert list(result["models"]) == [str(tiny_dirs["draft"]), str(tiny_dirs["target"])]
    for m in result["models"].values():
        assert set(m["forward_ms"]) == {"1", "4", "8"} and all(v > 0 for v in m["forward_ms"].values())
        assert m["decode_tokens"] > 1 and m["decode_tokens_per_s"] > 0
        assert 0 < m["graph_build_ms"] < 1.5 * m["forward_ms"]["1"]  # building is part of a forward
    assert result["environment"]["blas"]


def test_first_run_times_a_new_machine_against_plain_and_warm(tiny_dirs, tmp_path):
    """The first-run bench on the tiny pair: each prompt decoded plainly, on a new machine and warm,
    the same text from all three; its checks judged (timings on tiny models say nothing)."""
    from omnidraft_mlx.bench.first_run import README_PROMPT, RUNS, main

    argv = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    try:
        main([*argv, "--prompts", "2", "--readme-runs", "1", "--out", str(tmp_path)])
    except SystemExit:
        pass
    result = json.loads((tmp_path / "first_run.json").read_text())
    assert [r["prompt"] == README_PROMPT for r in result["prompts"]] == [True, False]
    assert result["same_text"] and result["checks"]["every output equal to plain decoding"]
    for row in result["prompts"]:
        assert row["plain"]["text"].strip() and all(0 < row[run]["first_byte_s"] < row[run]["total_s"] for run in RUNS)
    assert result["config"]["readme_runs"] == 1 and (tmp_path / "first_run.png").stat().st_size > 0


def test_paired_compares_two_runs_prompt_by_prompt(tmp_path, capsys):
    """bench/paired.py: a run against itself is 1 everywhere; against a run whose write prompts were
    twice as fast, write is 0.5 and the whole in between, each prompt's pair kept apart."""
    from omnidraft_mlx.bench.paired import main, paired, speedups

    def run(name: str, write_speedup: float) -> Path:
        records = [
            {"task": task, "prompt_id": f"{task}/{i}", "method": method, "speedup": speedup}
            for task, fused in (("write", write_speedup), ("math", 1.0))
            for i in range(10)
            for method, speedup in (("plain", 1.0), ("fused-learned", fused * (1 + i / 10)))
        ]
        (tmp_path / name).write_text(json.dumps({"records": records}))
        return tmp_path / name

    a, b = run("a.json", 1.2), run("b.json", 2.4)
    same = paired(speedups(a), speedups(a))
    assert [(r["task"], r["prompts"]) for r in same] == [("math", 10), ("write", 10), ("all", 20)]
    assert all(r["ratio"] == r["low"] == r["high"] == pytest.approx(1.0) for r in same)
    rows = {r["task"]: r for r in paired(speedups(a), speedups(b))}
    assert rows["write"]["ratio"] == rows["write"]["min"] == rows["write"]["max"] == pytest.approx(0.5)
    assert rows["all"]["ratio"] == pytest.approx(0.5**0.5) and rows["all"]["low"] < 0.65 < 0.77 < rows["all"]["high"]
    main([str(a), "--against", str(b)])
    assert "| write | 10 | 0.500 | 0.500-0.500 | 0.50-0.50 |" in capsys.readouterr().out
    main([str(a), str(b), "--against", str(b), str(b)])  # two runs of each: 20 pairs, half of them 1
    assert "| write | 20 | 0.707 |" in capsys.readouterr().out
