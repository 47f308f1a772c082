"""`omnidraft generate` with the target split over two ranks (`mlx.launch -n 2 --backend ring`,
over loopback; decode/ranks.py): the pair's greedy output equals plain decoding of the same
split target and plain decoding in one process, tensor parallel (a tiny llama) and as a
pipeline (a tiny qwen3_next: recurrent layers on both stages); rank 0 alone prints. `omnidraft chat`
on two ranks answers as in one process and Ctrl-C ends every rank; `omnidraft doctor` shows the group."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import mlx.core as mx
import pexpect
from architectures import build, config
from mlx.utils import tree_flatten
from test_chat import endless_target
from test_distributed import LAUNCH, OMNIDRAFT, free_ports
from tiny_models import corpus, train_tokenizer, write_model

PROMPT = "def add_3(x):"


def on_ranks(ranks: int, cmd: list[str]) -> list[str]:
    """The command on `ranks` ranks of `mlx.launch --backend ring` over loopback (itself on one)."""
    if ranks == 1:
        return cmd
    return [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--", *cmd]


def run(home, ranks: int, *args, timeout: float, input: str | None = None) -> subprocess.CompletedProcess:
    """`omnidraft ARGS` on `ranks` ranks, models and profiles under `home`. Past the timeout the ranks
    are killed with the launcher (its process group), so that none left waiting holds a core."""
    cmd, env = on_ranks(ranks, [OMNIDRAFT, *args]), {**os.environ, "OMNIDRAFT_HOME": str(home)}
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(cmd, env=env, start_new_session=True, **pipes) as proc:
        try:
            out, err = proc.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def generate(home, ranks: int, *args) -> subprocess.CompletedProcess:
    """`omnidraft generate` on the prompt (greedy, no chat template, no profile), on `ranks` ranks."""
    return run(home, ranks, "generate", PROMPT, "--raw", "--no-profile", "--max-tokens", "40", *args, timeout=120)


def replies(home, draft, target, *args) -> dict[str, subprocess.CompletedProcess]:
    """The pair's reply on two ranks, and the target's plain reply on two ranks and on one."""
    runs = {
        "pair, 2 ranks": generate(home, 2, "--draft", str(draft), "--target", str(target), *args),
        "plain, 2 ranks": generate(home, 2, "--model", str(target), *args),
        "plain, 1 rank": generate(home, 1, "--model", str(target)),
    }
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run.stderr}"
    return runs


def acceptance(run: subprocess.CompletedProcess) -> float:
    return float(re.search(r"acceptance ([\d.]+)", run.stderr)[1])


def test_tensor_split_target_decodes_as_one_process(tmp_path, tiny_dirs):
    runs = replies(tmp_path, tiny_dirs["draft"], tiny_dirs["target"], "--shard", "tensor")
    want = runs["plain, 1 rank"].stdout
    assert len(want) > 40
    # Rank 1 prints nothing: the reply comes once, and one statistics line.
    assert {name: run.stdout for name, run in runs.items()} == dict.fromkeys(runs, want)
    assert runs["pair, 2 ranks"].stderr.count("acceptance") == 1
    assert 0 < acceptance(runs["pair, 2 ranks"]) < 1  # drafts kept and drafts rolled back


def test_sampled_replies_on_two_ranks_are_the_one_process_replies(tmp_path, tiny_dirs):
    # The drafter alone, a fixed draft length, no guard: the drafts do not depend on measured timings, so
    # with the same seed the lead draws what one process draws (the followers' caches feed its logits).
    target, sampled = ["--target", str(tiny_dirs["target"])], ["--temp", "0.8", "--seed", "3"]
    fixed = ["--draft", str(tiny_dirs["draft"]), *target, "--source", "drafter", "--policy", "fixed", "--no-guard"]
    for args in ([*fixed, *sampled], ["--model", target[1], *sampled]):
        runs = [generate(tmp_path, ranks, *args) for ranks in (2, 1)]
        assert all(run.returncode == 0 for run in runs), runs[0].stderr
        assert len(runs[1].stdout) > 40 and runs[0].stdout == runs[1].stdout
        assert "--model" in args or 0 < acceptance(runs[0]) < 1


def write_family(out, tokenizer_dir, family: str, layers: int, noise: float = 0.0):
    """A tiny random model of an mlx-lm family (tests/architectures.py's sizes) with the tiny
    target's tokenizer, saved as a model directory; noise: its weights perturbed (a drafter)."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    settings = dict(num_hidden_layers=layers, vocab_size=tiny["vocab_size"], eos_token_id=tiny["eos_token_id"])
    model = build(family, noise=noise, **settings)
    (out / "config.json").write_text(json.dumps(dict(config(family), **settings)))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def test_pipeline_split_hybrid_target_decodes_as_one_process(tmp_path, tiny_dirs):
    # Four layers, linear attention and full attention alternating: each stage holds both kinds.
    target = write_family(tmp_path / "target", tiny_dirs["target"], "qwen3_next", layers=4)
    draft = write_family(tmp_path / "draft", tiny_dirs["target"], "qwen3_next", layers=4, noise=0.01)
    runs = replies(tmp_path, draft, target, "--shard", "pipeline", "--no-guard")  # always drafting
    want = runs["plain, 1 rank"].stdout
    assert {name: run.stdout for name, run in runs.items()} == dict.fromkeys(runs, want)
    assert 0 < acceptance(runs["pair, 2 ranks"]) < 1  # recurrent states rolled back past rejected drafts


def test_a_family_without_sharding_is_refused_in_one_line(tmp_path):
    gemma = write_model(tmp_path / "gemma", train_tokenizer(corpus("target"), 600), 64, 3, seed=0, window=8)
    run = generate(tmp_path, 2, "--model", str(gemma))
    # Each rank says it in one line (the one that exits first makes mlx.launch stop the other).
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert lines and set(lines) == {
        "error: mlx-lm cannot split a gemma3_text model over 2 ranks (no tensor or pipeline sharding for the "
        "family): run it in one process, without mlx.launch"
    }


def doctor_rows(home, ranks: int) -> list[list[str]]:
    run_ = run(home, ranks, "doctor", timeout=300)
    assert run_.returncode == 0, run_.stderr
    return [re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in run_.stdout.splitlines()]


def test_doctor_shows_the_group(tmp_path):
    launched = doctor_rows(tmp_path, 2)
    assert [row[0] for row in launched].count("platform") == 1  # rank 0 alone prints
    group = {name: value for name, value in launched if name in ("group", "backend", "MLX_HOSTFILE")}
    assert group.pop("MLX_HOSTFILE").startswith("/")  # the hosts file mlx.launch wrote
    assert group == {"group": "rank 0 of 2 (mlx.launch)", "backend": "ring"}
    alone = dict(row for row in doctor_rows(tmp_path, 1) if len(row) == 2)
    assert alone["group"].startswith("a single process (to split a target over ranks: mlx.launch")
    assert "backend" not in alone and "MLX_HOSTFILE" not in alone


def chat_replies(home, ranks: int, tiny_dirs, lines: list[str], max_tokens: int = 24) -> list[str]:
    """What `omnidraft chat` on `ranks` ranks prints after each line piped in (greedy): a reply and its
    notes, without the statistics line (timings), or what a command says."""
    pair = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"]), "--max-tokens", str(max_tokens)]
    # --no-adapt: no drafter update between replies in one process either (off across ranks).
    chat = run(home, ranks, "chat", *pair, "--no-adapt", input="\n".join([*lines, "/quit", ""]), timeout=300)
    assert chat.returncode == 0, chat.stderr
    return [re.sub(r"\n\d+ tokens, .*\n$", "", turn) for turn in chat.stdout.split("you> ")[1:-1]]


def test_chat_on_two_ranks_answers_as_one_process(tmp_path, tiny_dirs):
    lines = ["def add_3(x):", "print(add_"]
    alone = chat_replies(tmp_path / "alone", 1, tiny_dirs, lines)
    assert len(alone) == 2 and all(len(reply) > 24 for reply in alone)
    # The second reply's prompt holds the first exchange; rank 1 prints nothing (two replies, not four).
    assert chat_replies(tmp_path / "ranks", 2, tiny_dirs, lines) == alone


def test_chat_on_two_ranks_reuses_the_same_prompt_cache_on_both(tmp_path, tiny_dirs):
    # Rank 0 alone keeps the drafter's caches beside the target's: after 33 conversations its prompt
    # cache (64 sequences) has let the first one go, rank 1's has not. Back to the first, both ranks
    # must still prefill the same tokens.
    saved = tmp_path / "first.json"
    lines = ["def add_0(x):", f"/save {saved}", "/reset"]
    lines += [line for i in range(1, 33) for line in (f"def add_{i}(x):", "/reset")]
    lines += [f"/load {saved}", "print(add_"]
    alone = chat_replies(tmp_path / "alone", 1, tiny_dirs, lines, max_tokens=4)
    assert len(alone) == len(lines) and alone[-1] != alone[0]
    assert chat_replies(tmp_path / "ranks", 2, tiny_dirs, lines, max_tokens=4) == alone


def test_ctrl_c_ends_a_chat_on_every_rank_with_its_profile_saved(tmp_path, tiny_dirs):
    # A terminal's Ctrl-C reaches mlx.launch and both ranks; the reply would otherwise run on for minutes.
    dirs = endless_target(tiny_dirs, tmp_path)
    pair = ["--draft", str(dirs["draft"]), "--target", str(dirs["target"])]
    launch, *args = on_ranks(2, [OMNIDRAFT, "chat", *pair, "--max-tokens", "100000", "--policy", "fixed"])
    env = dict(os.environ, OMNIDRAFT_HOME=str(tmp_path / "home"), TERM="xterm")
    chat = pexpect.spawn(launch, ["--verbose", *args], env=env, encoding="utf-8", timeout=120)
    chat.expect_exact("you> ")
    chat.sendline("def add_3(x):")
    chat.expect("return")  # streaming has begun
    chat.sendintr()
    chat.expect(pexpect.EOF)
    for rank in (0, 1):  # mlx.launch --verbose: each exited 0
        assert f"Node with rank {rank} completed" in chat.before
    shown = run(tmp_path / "home", 1, "profile", "show", *pair, timeout=60)
    assert shown.returncode == 0 and "last saved" in shown.stdout, shown.stderr  # saved after the stopped reply


def test_bench_on_two_ranks_times_the_split_target_against_itself(tmp_path, tiny_dirs):
    # bench/sharded.py: `omnidraft bench` in one process, then on two ranks started as mlx.launch starts them.
    # Plain decoding leaves a step computed ahead (mlx-lm's generate_step) whose collectives, unwaited
    # for, ran beside the next decode's on one rank and not the other: the ranks then read each
    # other's buffers as shares (decode/plain.py).
    pair = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    args = ["--task", "complete,chat", "--prompts", "2", "--max-tokens", "16", "--k", "3", "--no-profile"]
    driver = [sys.executable, "-m", "omnidraft_mlx.bench.sharded", "--out", str(tmp_path / "out"), "--", *pair, *args]
    done = subprocess.run(
        driver, capture_output=True, text=True, timeout=300, env={**os.environ, "OMNIDRAFT_HOME": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    alone, split = (
        json.loads((tmp_path / "out" / run / "bench.json").read_text()) for run in ("one-process", "tensor")
    )

    def outputs(result, method):
        return {r["prompt_id"]: r["output"] for r in result["records"] if r["method"] == method}

    assert all(r["equal_to_plain"] for r in split["records"] if r["method"] != "plain")
    assert outputs(split, "ours-k3") == outputs(split, "plain") == outputs(alone, "plain")
    layers = json.loads((tiny_dirs["target"] / "config.json").read_text())["num_hidden_layers"]
    cost = split["round_cost"]
    assert (cost["ranks"], cost["shard"], cost["collectives"]) == (2, "tensor", {"AllReduce": 2 * layers})
    assert alone["round_cost"]["collectives"] == {} and alone["round_cost"]["ranks"] == 1
    assert all(r["share_s"] > 0 for r in split["records"] if r["kind"] == "ours")
    assert all(r["share_s"] == 0 for r in alone["records"])
    summary = json.loads((tmp_path / "out" / "sharded.json").read_text())["summary"]
    assert set(summary) == {"complete", "chat"}
    assert summary["chat"]["ours-k3"]["2 ranks, tensor"]["tokens_per_round"] > 1
