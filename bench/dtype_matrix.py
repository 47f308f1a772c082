"""The drafter x target dtype matrix on a real pair: one `omnidraft bench` per
combination, then acceptance and tokens per target forward side by side.

    ./run.sh python -m omnidraft_mlx.bench.dtype_matrix --dtypes float32,float16,q4

Each model is pulled in each dtype first (`omnidraft models pull NAME --dtype D`).
Acceptance and tokens per target forward measure how far rounding and
quantization move the two models apart; they do not depend on the machine.
Speedups do: MLX's CPU backend runs float16 and quantized matmuls slowly, so
speedups off float32 here are no guide to a Mac. A combination whose bench.json
exists is not run again (the matrix resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from omnidraft_mlx.models.catalog import local_name
from omnidraft_mlx.models.convert import default_dtype
from omnidraft_mlx.profile.atomic import atomic_write_text

OUT = Path(__file__).parent / "results" / "dtypes"


def bench_command(args, draft: str, target: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "omnidraft_mlx.cli.main",
        "bench",
        "--draft",
        draft,
        "--target",
        target,
        "--task",
        args.task,
        "--prompts",
        str(args.prompts),
        "--max-tokens",
        str(args.max_tokens),
        "--k",
        str(args.k),
        "--no-mlx-lm",
        "--no-profile",
        "--out",
        os.path.relpath(out),
    ]


def cell(bench: dict, draft_dtype: str, target_dtype: str) -> dict:
    """The speculative method's row of one bench, all its tasks pooled."""
    rows = [r for r in bench["summary"] if r["method"] != "plain"]
    row = next(r for r in rows if r["task"] == "all") if len(rows) > 1 else rows[0]
    return {
        "draft_dtype": draft_dtype,
        "target_dtype": target_dtype,
        "method": row["method"],
        "prompts": row["prompts"],
        "acceptance": row["acceptance"],
        "tokens_per_forward": row["tokens_per_forward"],
        "speedup_median": row["speedup_median"],
        "speedup_min": row["speedup_min"],
        "speedup_max": row["speedup_max"],
        "all_equal_to_plain": row["all_equal_to_plain"],
    }


def table(cells: list[dict]) -> str:
    lines = [
        "| drafter | target | acceptance | tokens / target forward | equal to plain | speedup here (median, range) |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        mark = "" if c["draft_dtype"] == c["target_dtype"] == "float32" else " *"
        lines.append(
            f"| {c['draft_dtype']} | {c['target_dtype']} | {c['acceptance']:.3f} | "
            f"{c['tokens_per_forward']:.2f} | {'yes' if c['all_equal_to_plain'] else '**no**'} | "
            f"{c['speedup_median']:.2f}x ({c['speedup_min']:.2f}-{c['speedup_max']:.2f}){mark} |"
        )
    return "\n".join(lines) + "\n\n\\* not representative of a Mac: this CPU runs that dtype's matmuls slowly.\n"


def plot(cells: list[dict], dtypes: list[str], path: Path) -> None:
    import numpy as np

    from omnidraft_mlx.bench.plots import plt, save_figure

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, title in zip(axes, ("acceptance", "tokens_per_forward"), ("acceptance", "tokens per target forward")):
        grid = np.full((len(dtypes), len(dtypes)), np.nan)
        for c in cells:
            grid[dtypes.index(c["draft_dtype"]), dtypes.index(c["target_dtype"])] = c[key]
        ax.imshow(grid, cmap="viridis")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", color="white")
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_yticks(range(len(dtypes)), dtypes)
        ax.set_xlabel("target dtype")
        ax.set_ylabel("drafter dtype")
        ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="smollm2-135m", help="catalog name")
    p.add_argument("--target", default="qwen2.5-coder-0.5b", help="catalog name")
    p.add_argument("--dtypes", default="float32,float16,q4")
    p.add_argument("--task", default="code")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    dtypes, default = [d.strip() for d in args.dtypes.split(",")], default_dtype()
    cells, commands = [], []
    for target_dtype in dtypes:
        for draft_dtype in dtypes:
            draft, target = local_name(args.draft, draft_dtype, default), local_name(args.target, target_dtype, default)
            out = args.out / f"{draft}__{target}"
            cmd = bench_command(args, draft, target, out)
            commands.append(shlex.join(["omnidraft", *cmd[3:]]))
            if not (out / "bench.json").exists():
                print(f"bench {draft} -> {target}", flush=True)
                subprocess.run(cmd, check=True)
            cells.append(cell(json.loads((out / "bench.json").read_text()), draft_dtype, target_dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "argv": shlex.join(["python", "-m", "omnidraft_mlx.bench.dtype_matrix", *sys.argv[1:]]),
        "draft": args.draft,
        "target": args.target,
        "bench_commands": commands,
        "cells": cells,
    }
    atomic_write_text(args.out / "matrix.json", json.dumps(result, indent=1))
    atomic_write_text(args.out / "matrix.md", table(cells))
    plot(cells, dtypes, args.out / "matrix.png")
    print(table(cells))


if __name__ == "__main__":
    main()
