"""Two bench runs of the same prompts, compared prompt by prompt: per task, the geometric mean of
each prompt's speedup in run A over its speedup in run B, with a bootstrap 95 % interval.

A task's median speedup moves between two runs of the same code on this machine by more than most
changes do (plain decoding's own time varies 10-20 % a prompt; a near-tie between the drafter and
plain steps goes either way), so a change is judged on the pairs: an interval holding 1 is no
measurable difference.

    ./run.sh python -m omnidraft_mlx.bench.paired A/bench.json --against B/bench.json

Several runs of each (A1 A2 --against B1 B2) pool their pairs: A1's prompts with B1's, A2's with B2's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from omnidraft_mlx.bench.report import ALL

BOOTSTRAP = 2000


def speedups(*paths: Path) -> dict[tuple[str, str], float]:
    """(task, prompt id) -> the speedup of its speculative method over plain decoding; several runs'
    prompts are told apart by the run's place in `paths`."""
    out = {}
    for run, path in enumerate(paths):
        records = json.loads(Path(path).read_text())["records"]
        tag = f"#{run}" if len(paths) > 1 else ""
        out.update({(r["task"], r["prompt_id"] + tag): r["speedup"] for r in records if r["method"] != "plain"})
    return out


def paired(a: dict, b: dict, seed: int = 0) -> list[dict]:
    """Per task (and all together): prompts both runs decoded, the geometric mean of a/b, its bootstrap
    95 % interval, the smallest and largest prompt's ratio."""
    rng, rows = np.random.default_rng(seed), []
    shared = sorted(set(a) & set(b))
    for task in [*sorted({t for t, _ in shared}), ALL]:
        logs = np.log([a[k] / b[k] for k in shared if task in (ALL, k[0])])
        means = np.exp(rng.choice(logs, (BOOTSTRAP, len(logs))).mean(axis=1))
        rows.append(
            {
                "task": task,
                "prompts": len(logs),
                "ratio": float(np.exp(logs.mean())),
                "low": float(np.quantile(means, 0.025)),
                "high": float(np.quantile(means, 0.975)),
                "min": float(np.exp(logs.min())),
                "max": float(np.exp(logs.max())),
            }
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, nargs="+", help="bench.json of the run (or runs) compared")
    ap.add_argument("--against", type=Path, nargs="+", required=True, help="bench.json of the runs compared with")
    args = ap.parse_args(argv)
    if len(args.a) != len(args.against):
        ap.error(f"{len(args.a)} runs against {len(args.against)}: give as many of each (run i pairs with run i)")
    print("| task | prompts | speedup A / B (geometric mean) | 95 % interval | prompts' range |")
    print("|---|---|---|---|---|")
    for r in paired(speedups(*args.a), speedups(*args.against)):
        print(
            f"| {r['task']} | {r['prompts']} | {r['ratio']:.3f} | {r['low']:.3f}-{r['high']:.3f} "
            f"| {r['min']:.2f}-{r['max']:.2f} |"
        )


if __name__ == "__main__":
    main()
