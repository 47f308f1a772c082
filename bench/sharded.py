"""`omnidraft bench` with the target split over ranks, beside the same bench in one process.

    ./run.sh python -m omnidraft_mlx.bench.sharded --ranks 2 --shard tensor --out bench/results/sharded \\
        -- --target qwen2.5-coder-1.5b --task write,complete --prompts 10 --max-tokens 64

The arguments after `--` go to every `omnidraft bench`. The split run times plain decoding of the
split target against speculative decoding of the same split target; the one-process run gives the
ratio on one machine. The ranks are started as `mlx.launch -n N --backend ring` starts them on one
machine (MLX_RANK, and MLX_HOSTFILE naming loopback ports), without the launcher's loop over their
pipes: in mlx 0.32 that loop keeps a core busy (select on the ranks' stdin, always writable), and
on 2 cores it would take a rank's. Each rank gets one BLAS thread, so one core a rank; the
one-process run uses them all. Writes each run's bench output under OUT/<run>/, and OUT/sharded.json
and OUT/summary.md: per task and method, the speedup in each run, and per round the time spent
in communication (the round's shares, measured; the forward's collectives, counted in its graph and
priced at one collective's time alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from omnidraft_mlx.profile.atomic import atomic_write_text

OUT = Path(__file__).parent / "results" / "sharded"


def loopback_hosts(ranks: int) -> str:
    """A ring hosts file's content for `ranks` ranks on this machine, each on a free port."""
    ports = []
    for _ in range(ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return json.dumps([[f"127.0.0.1:{port}"] for port in ports])


def run_ranks(cmd: list[str], ranks: int, log: Path) -> None:
    """`cmd` on `ranks` ranks of the ring backend over loopback, rank 0's output into `log`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hosts:
        hosts.write(loopback_hosts(ranks))
    env = {**os.environ, "MLX_HOSTFILE": hosts.name, "OPENBLAS_NUM_THREADS": "1"}
    with open(log, "w") as out:
        procs = [
            subprocess.Popen(
                cmd,
                env={**env, "MLX_RANK": str(rank)},
                stdin=subprocess.DEVNULL,
                stdout=out if rank == 0 else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if rank == 0 else subprocess.DEVNULL,
            )
            for rank in range(ranks)
        ]
        codes = [p.wait() for p in procs]
    os.unlink(hosts.name)
    if any(codes):
        sys.exit(f"ranks exited {codes}: see {log}")


def per_round(result: dict, method: str, task: str) -> dict:
    """A method's figures on a task: speedup (median, range), tokens per round trip, and per round its
    milliseconds, those in its shares and those its forward's collectives cost alone."""
    records = [r for r in result["records"] if r["method"] == method and r["task"] == task]
    rounds = sum(r["rounds"] for r in records)
    speedups = [r["speedup"] for r in records]
    cost = result["round_cost"]
    held = sum(cost["collectives"].values())
    # A round verifies ~tokens-per-round positions; a collective's cost changes little with the width.
    width = min(cost["widths"], key=lambda w: abs(int(w) - sum(r["tokens"] for r in records) / rounds))
    collective_ms = cost["widths"][width].get("collective_ms", 0.0)
    return {
        "prompts": len(records),
        "speedup": float(np.median(speedups)),
        "speedup_range": [min(speedups), max(speedups)],
        "tokens_per_round": sum(r["tokens"] for r in records) / rounds,
        "round_ms": 1000 * sum(r["generate_s"] for r in records) / rounds,
        "share_ms": 1000 * sum(r["share_s"] for r in records) / rounds,
        "collectives_ms": held * collective_ms,
    }


def summarize(runs: dict[str, dict]) -> dict:
    """Per task, per method, per run: per_round's figures."""
    first = next(iter(runs.values()))
    tasks = sorted({r["task"] for r in first["records"]}, key=[r["task"] for r in first["records"]].index)
    methods = [m["name"] for m in first["config"]["methods"]]
    return {
        task: {method: {name: per_round(result, method, task) for name, result in runs.items()} for method in methods}
        for task in tasks
    }


def table(summary: dict, runs: dict[str, dict]) -> str:
    names = list(runs)
    head = ["task", "method"] + [f"{n}: {what}" for n in names for what in ("speedup", "tok/round", "ms/round")]
    head += [f"{n}: comm ms/round (shares + collectives)" for n in names if runs[n]["round_cost"]["ranks"] > 1]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, methods in summary.items():
        for method, by_run in methods.items():
            cells = [task, method]
            for n in names:
                f = by_run[n]
                lo, hi = f["speedup_range"]
                cells += [
                    f"{f['speedup']:.2f}x ({lo:.2f}-{hi:.2f})",
                    f"{f['tokens_per_round']:.2f}",
                    f"{f['round_ms']:.0f}",
                ]
            for n in names:
                if runs[n]["round_cost"]["ranks"] > 1:
                    f = by_run[n]
                    cells.append(
                        f"{f['share_ms'] + f['collectives_ms']:.1f} ({f['share_ms']:.1f} + {f['collectives_ms']:.1f})"
                    )
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--shard", default="tensor", help="tensor, pipeline or both comma-separated (a run each)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of every `omnidraft bench`")
    args = p.parse_args()
    given = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    omnidraft = [sys.executable, "-m", "omnidraft_mlx.cli.main", "bench", *given]
    from omnidraft_mlx.bench.report import round_line

    args.out.mkdir(parents=True, exist_ok=True)
    commands = {"one process": omnidraft + ["--out", str(args.out / "one-process")]}
    for shard in args.shard.split(","):
        commands[f"{args.ranks} ranks, {shard}"] = omnidraft + ["--shard", shard, "--out", str(args.out / shard)]
    runs = {}
    for name, cmd in commands.items():
        folder = Path(cmd[-1])
        folder.mkdir(parents=True, exist_ok=True)
        print(f"{name}: {shlex.join(cmd[1:])}", flush=True)
        if name == "one process":
            with open(folder / "log.txt", "w") as log:
                if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                    sys.exit(f"{name}: bench failed, see {folder / 'log.txt'}")
        else:
            run_ranks(cmd, args.ranks, folder / "log.txt")
        runs[name] = json.loads((folder / "bench.json").read_text())
        print(round_line(runs[name]["round_cost"]), flush=True)
    summary = summarize(runs)
    argv = shlex.join(["python", "-m", "omnidraft_mlx.bench.sharded", *sys.argv[1:]])
    atomic_write_text(args.out / "sharded.json", json.dumps({"argv": argv, "summary": summary}, indent=1))
    text = table(summary, runs)
    lines = [f"- {name}: {round_line(result['round_cost'])}" for name, result in runs.items()]
    atomic_write_text(args.out / "summary.md", f"`{argv}`\n\n{text}\n" + "\n".join(lines) + "\n")
    print(text)


if __name__ == "__main__":
    main()
