"""`omnidraft adapt` on 1 and 2 ranks (mx.distributed): prompts per minute, and held-out
acceptance after a fixed number of prompts.

    ./run.sh python -m omnidraft_mlx.bench.distributed_adapt --ranks 1,2 --prompts 16

Each world size starts with no profile, in its own OMNIDRAFT_HOME under the output folder
(the user's models and downloads linked in), and runs `omnidraft adapt --mode target --task T
--max-prompts N`, under `mlx.launch -n R --backend ring` for R > 1. Held-out acceptance
before and after is adapt's own --eval; prompts per minute is rank 0's last progress line
(the adaptation loop alone: model loading and evaluation not counted). Results go to
bench/results/distributed-adapt/. Ranks on one machine share its cores with each
other and with mlx.launch, whose loop over the ranks' pipes (mlx 0.32) keeps one
core busy while they run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "distributed-adapt"
ACCEPTANCE = re.compile(
    r"held-out\s+acceptance\s+([\d.]+)\s+->\s+([\d.]+),\s+tokens/target\s+forward\s+([\d.]+)\s+->\s+([\d.]+)"
)
PROGRESS = re.compile(r"^(\d+)/\d+ prompts .*\| ([\d.]+) prompts/min", re.M)


def fresh_home(path: Path) -> Path:
    """An OMNIDRAFT_HOME without a profile that sees the user's models and downloads."""
    from omnidraft_mlx.paths import model_home

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name in ("models", "downloads"):
        (path / name).symlink_to(model_home() / name)
    return path


def local(text: str) -> str:
    """Text without this machine's paths: the environment's scripts and the checkout."""
    return text.replace(str(Path(sys.executable).parent) + "/", "").replace(str(Path.cwd()) + "/", "")


def command(args, ranks: int) -> list[str]:
    adapt = [
        sys.executable,
        "-m",
        "omnidraft_mlx.cli.main",
        "adapt",
        "--task",
        args.task,
        "--mode",
        "target",
        "--draft",
        args.draft,
        "--target",
        args.target,
        "--max-prompts",
        str(args.prompts),
        "--interval",
        str(args.interval),
        "--eval",
        str(args.eval),
        "--eval-tokens",
        str(args.eval_tokens),
    ]
    if ranks == 1:
        return adapt
    launch = str(Path(sys.executable).parent / "mlx.launch")
    return [launch, "-n", str(ranks), "--backend", "ring", "--", *adapt]


def run(args, ranks: int) -> dict:
    home = fresh_home(args.out / "homes" / f"ranks-{ranks}")
    cmd = command(args, ranks)
    start = time.monotonic()
    out = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "OMNIDRAFT_HOME": str(home), "COLUMNS": "200"}
    )
    wall = time.monotonic() - start
    acc, progress = ACCEPTANCE.search(out.stdout), PROGRESS.findall(out.stderr)
    if out.returncode or not acc or not progress:
        sys.exit(f"ranks={ranks}: adapt failed (exit {out.returncode})\n{out.stderr[-3000:]}")
    prompts, per_minute = progress[-1]
    return {
        "ranks": ranks,
        "command": local(shlex.join(cmd)),
        "prompts": int(prompts),
        "prompts_per_min": float(per_minute),
        "acceptance_before": float(acc[1]),
        "acceptance_after": float(acc[2]),
        "tokens_per_forward_before": float(acc[3]),
        "tokens_per_forward_after": float(acc[4]),
        "wall_s": round(wall, 1),
        "progress": out.stderr.count("prompts/min"),
        "stdout": local(out.stdout),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="world sizes, comma separated")
    p.add_argument("--prompts", type=int, default=16, help="prompts of the adaptation split per run")
    p.add_argument("--task", default="complete")
    p.add_argument("--draft", default="smollm2-135m")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--eval", type=int, default=8, help="held-out prompts")
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    import mlx.core as mx

    runs = [run(args, int(r)) for r in args.ranks.split(",")]
    result = {
        "argv": shlex.join(["python", "-m", "omnidraft_mlx.bench.distributed_adapt", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__},
        "note": "ranks on one machine share its cores",
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(args.out / "homes", ignore_errors=True)  # profiles of the runs: not results
    for r in runs:
        print(
            f"{r['ranks']} rank(s): {r['prompts']} prompts at {r['prompts_per_min']:.1f} prompts/min; held-out "
            f"acceptance {r['acceptance_before']:.3f} -> {r['acceptance_after']:.3f} ({r['wall_s']:.0f}s in all)"
        )


if __name__ == "__main__":
    main()
