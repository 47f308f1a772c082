"""`omnidraft adapt` on mx.distributed: real ranks started by `mlx.launch --backend ring`
over loopback, on the tiny pair, against the same command in one process."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from omnidraft_mlx.learn.distributed import shard
from omnidraft_mlx.profile.store import load_profile

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
OMNIDRAFT = str(Path(sys.executable).parent / "omnidraft")
PROMPTS = [f"def add_{i}(x):\n    return x + {i}\n\nprint(add_{i}(" for i in range(40, 72)]


def test_shard_is_disjoint_and_covers_each_batch():
    for size in (1, 2, 3):
        parts = [shard(5, 16, 3, rank, size) for rank in range(size)]
        assert all(len(p) == 4 for p in parts)  # as many gradient batches on every rank
        for b in range(4):
            members = sorted(i for p in parts for i in p[b])
            assert members == list(range(5 + 3 * b, min(5 + 3 * b + 3, 16)))


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports (the ring backend listens on one per rank)."""
    for base in np.random.default_rng().integers(20000, 60000, 50):
        socks = []
        try:
            for p in range(int(base), int(base) + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return int(base)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def adapt_cmd(corpus, tiny_dirs, ranks: int, *extra) -> list[str]:
    # The installed console script, as a user launches it (`mlx.launch ... -- omnidraft adapt`): mlx 0.31's
    # launcher runs any existing file it is given under python, so the interpreter itself cannot be the command.
    cmd = [
        OMNIDRAFT,
        "adapt",
        str(corpus),
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--batch",
        "3",
        "--steps",
        "2",
        "--max-tokens",
        "12",
        "--eval",
        "0",
        "--rank",
        "4",
        "--lr",
        "1e-3",
        *extra,
    ]
    if ranks == 1:
        return cmd
    return [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--", *cmd]


def run_adapt(home, corpus, tiny_dirs, ranks, *extra):
    out = subprocess.run(
        adapt_cmd(corpus, tiny_dirs, ranks, *extra),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMNIDRAFT_HOME": str(home)},
    )
    assert out.returncode == 0, out.stderr
    return out


def profile_path(home) -> Path:
    (path,) = Path(home, "profiles").iterdir()
    return path


def saved(home) -> dict:
    """The profile's manifest and the arrays and n-grams of the files it names."""
    path = profile_path(home)
    manifest = json.loads((path / "manifest.json").read_text())
    files = manifest["files"]
    with np.load(path / files["accept_head"]) as head:
        head = {k: head[k] for k in head.files if k.startswith("head.") or k in ("features", "labels")}
    return {
        "manifest": manifest,
        "head": head,
        "ngrams": json.loads((path / files["ngrams"]).read_text()),
        "history": json.loads((path / files["history"]).read_text()),
        **{k: {n: np.array(v) for n, v in mx.load(str(path / files[k])).items()} for k in ("adapter", "optimizer")},
    }


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    return path


def test_an_update_on_two_ranks_equals_one_on_one_rank(tmp_path, tiny_dirs, corpus):
    # Both runs continue one profile (its random adapter and head already made) for one update of 8 prompts;
    # --batch 3 cuts them 3 + 3 + 2, so the ranks' shares of a batch differ in size.
    args = ("--interval", "8", "--max-prompts", "8")
    run_adapt(tmp_path / "start", corpus, tiny_dirs, 1, *args)
    for name in ("one", "two"):
        shutil.copytree(tmp_path / "start", tmp_path / name)
    one = run_adapt(tmp_path / "one", corpus, tiny_dirs, 1, *args)
    two = run_adapt(tmp_path / "two", corpus, tiny_dirs, 2, *args)
    start, a, b = saved(tmp_path / "start"), saved(tmp_path / "one"), saved(tmp_path / "two")
    for s in (a, b):
        assert s["manifest"]["updates"] == 2 and s["manifest"]["history"][-1]["position"] == 16
        assert s["manifest"]["history"][-1]["examples"] == 8
    assert not any(np.allclose(start["adapter"][k], a["adapter"][k]) for k in a["adapter"])  # the update moved it
    for part in ("adapter", "optimizer", "head"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            np.testing.assert_allclose(a[part][k], b[part][k], rtol=1e-4, atol=1e-5, err_msg=f"{part} {k}")
    assert a["ngrams"] == b["ngrams"] and a["ngrams"]["entries"]  # the merged cache is the one-rank cache
    assert a["history"] == b["history"] != start["history"]  # so is the index of earlier replies
    assert np.isclose(a["manifest"]["history"][-1]["loss"], b["manifest"]["history"][-1]["loss"], rtol=1e-5)
    # Progress appears once, from rank 0, as a plain line per update (stderr is not a terminal).
    lines = [line for line in two.stderr.splitlines() if "prompts/min" in line]
    assert len(lines) == 1 and lines[0].startswith("8/8 prompts (position 16/32)") and "2 ranks" in lines[0], two.stderr
    assert one.stdout.count("profile:") == two.stdout.count("profile:") == 1


def rank_pids(launcher: int) -> dict[int, int]:
    """The adapt processes mlx.launch started, by rank."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
        except (OSError, ValueError):
            continue
        if "MLX_RANK" in env:
            pids[int(env["MLX_RANK"])] = int(proc.name)
    return pids


def adapt_past_an_update(home, corpus, tiny_dirs, *args, stdout=subprocess.PIPE) -> subprocess.Popen:
    """Adapt on two ranks under mlx.launch, returned once it reports its first update saved."""
    launcher = subprocess.Popen(
        adapt_cmd(corpus, tiny_dirs, 2, *args),
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        # A rank stuck in a collective on a killed one ends 5 s after the launcher's SIGTERM, not 60 s.
        env={**os.environ, "OMNIDRAFT_HOME": str(home), "OMNIDRAFT_STUCK_S": "5"},
    )
    for line in launcher.stderr:
        if "prompts/min" in line:
            return launcher
    pytest.fail(f"no update reported (exit {launcher.wait()})")


def kill_rank_after_an_update(home, corpus, tiny_dirs, rank: int) -> None:
    """Two ranks; once an update is saved, kill -9 `rank`: the launcher sends the other one SIGTERM, and it
    ends, saying why, even when it waits in a collective on the killed rank (which may last for ever)."""
    launcher = adapt_past_an_update(home, corpus, tiny_dirs, "--interval", "4", stdout=subprocess.DEVNULL)
    try:
        os.kill(rank_pids(launcher.pid)[rank], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)  # the launcher's own exit status is 0 whatever the ranks did
    finally:
        launcher.kill()
    assert f"Node with rank {rank} exited with code -9" in stderr, stderr
    assert "Traceback" not in stderr and ("another rank" in stderr or "in one call" in stderr), stderr


def check_profile(home, tiny_dirs) -> int:
    """The profile loads (adapter included) and is the state after its last update: returns its position."""
    path = profile_path(home)
    profile = load_profile(
        str(tiny_dirs["draft"]), str(tiny_dirs["target"]), load(str(tiny_dirs["draft"]))[0], trainable=True, path=path
    )
    history = profile.manifest["history"]
    position = profile.position(next(iter(profile.manifest["corpus"])))
    assert len(history) == profile.updates and history[-1]["position"] == position == 4 * profile.updates
    return position


def test_a_killed_rank_leaves_the_last_update_and_the_run_resumes(tmp_path, tiny_dirs, corpus):
    home = tmp_path / "home"
    kill_rank_after_an_update(home, corpus, tiny_dirs, rank=1)
    first = check_profile(home, tiny_dirs)
    kill_rank_after_an_update(home, corpus, tiny_dirs, rank=0)  # resumed on 2 ranks; the writer killed
    second = check_profile(home, tiny_dirs)
    assert 4 <= first < second < len(PROMPTS)
    run_adapt(home, corpus, tiny_dirs, 1, "--interval", "4")  # resumed on 1 rank, to the end
    assert check_profile(home, tiny_dirs) == len(PROMPTS)
    # Every update took the next 4 prompts: none repeated, none skipped, whatever the number of ranks.
    history = json.loads((profile_path(home) / "manifest.json").read_text())["history"]
    assert [h["position"] for h in history] == list(range(4, len(PROMPTS) + 1, 4))
    assert all(h["examples"] == 4 for h in history)


def test_modes_other_than_target_are_refused_on_several_ranks(tmp_path, tiny_dirs):
    doc = tmp_path / "doc.txt"
    doc.write_text("def add_1(x):\n    return x + 1\n")
    out = subprocess.run(
        adapt_cmd(doc, tiny_dirs, 2),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMNIDRAFT_HOME": str(tmp_path)},
    )
    # Each rank says it in one line (the one that exits first makes mlx.launch stop the other).
    assert (
        "error: under mlx.launch adapt runs in the target mode (a JSONL corpus or --task), not teacher-forced"
        in " ".join(out.stderr.split())
    ), out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "profiles").exists()


def test_a_signal_to_either_rank_stops_both_after_the_same_update_saved(tmp_path, tiny_dirs, corpus):
    # Ctrl-C in a terminal reaches every rank; a stop asked of one rank alone (here rank 1's SIGTERM) stops them all.
    launcher = adapt_past_an_update(tmp_path, corpus, tiny_dirs, "--interval", "2", "--minutes", "0")
    try:
        os.kill(rank_pids(launcher.pid)[1], signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert "exited with code" not in stderr and "was killed" not in stderr, stderr  # both ranks exited 0
    assert "rank 1: SIGTERM: stopping on request once the update under way is saved" in stderr
    assert stdout.count("stopped on request: learned from") == 1 and "on 2 ranks" in stdout, stdout
    history = json.loads((profile_path(tmp_path) / "manifest.json").read_text())["history"]
    position = history[-1]["position"]
    assert [h["position"] for h in history] == list(range(2, position + 1, 2)) and position < len(PROMPTS)
    assert f"to go on from item {position + 1} of {len(PROMPTS)} (under the same mlx.launch" in stdout
