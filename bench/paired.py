"""Two bench runs of the same prompts, compared prompt by prompt: per task, the geometric mean of
each prompt's speedup in run A over its speedup in run B, with a bootstrap 95 % interval.

A task's median speedup moves between two runs of the same code on this machine by more than most
changes do (plain decoding's own time varies 10-20 % a prompt; a near-tie between the drafter and
plain steps goes either way), so a change is judged on the pairs: an interval holding 1 is no
measurable difference.

    ./run.sh python -m omnidraft_mlx.bench.paired A/bench.json B/bench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from omnidraft_mlx.bench.report import ALL

BOOTSTRAP = 2000


def speedups(path: Path) -> dict[tuple[str, str], float]:
    """(task, prompt id) -> the speedup of its speculative method over plain decoding."""
    records = json.loads(Path(path).read_text())["records"]
    return {(r["task"], r["prompt_id"]): r["speedup"] for r in records if r["method"] != "plain"}


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
    ap.add_argument("a", type=Path, help="bench.json of the run compared")
    ap.add_argument("b", type=Path, help="bench.json of the run it is compared with")
    args = ap.parse_args(argv)
    print("| task | prompts | speedup A / B (geometric mean) | 95 % interval | prompts' range |")
    print("|---|---|---|---|---|")
    for r in paired(speedups(args.a), speedups(args.b)):
        print(
            f"| {r['task']} | {r['prompts']} | {r['ratio']:.3f} | {r['low']:.3f}-{r['high']:.3f} "
            f"| {r['min']:.2f}-{r['max']:.2f} |"
        )


if __name__ == "__main__":
    main()
