"""The README's first command on a new machine, end to end, against plain decoding and a warm run.

    python -m omnidraft_mlx.bench.first_run --prompts 10 --readme-runs 3 --out bench/results/first-run

For the README's own prompt (--readme-runs times: the bar is on that command) and the write
task's (held out: prompts of its kind), --prompts in all, three processes in turn, each
`omnidraft generate` with its defaults and nothing else on the CPU: the target decoding alone
(`--model TARGET`); the pair on a new machine (a scratch OMNIDRAFT_HOME holding only the
models: no verification costs, weight digests or profile yet, all made during this run); and the
pair again on that home (warm). Each is timed from its
start to its first byte of output (what the user waits for: loading, measuring, prefill) and to
its exit. Writes first_run.json and first_run.png under --out; checks that the README's command
on a new machine is no slower than plain decoding end to end (the median of its runs; every
prompt's ratio is reported beside it) and that every first byte comes within 2x the warm run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.paths import models_dir
from omnidraft_mlx.profile.atomic import atomic_write_text

RUNS = ("plain", "new machine", "warm")
README_PROMPT = "Write a Python function that checks whether a number is prime."  # the README's first command


def timed(argv: list[str], env: dict) -> dict:
    """A process's seconds to its first byte of output and to its exit; its output and summary line."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}
    )
    first = os.read(proc.stdout.fileno(), 1)  # unbuffered: communicate() reads the pipe itself, past any buffer
    first_s = time.perf_counter() - start
    rest, err = proc.communicate()
    total_s = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{err.decode()[-2000:]}")
    summary = [line for line in err.decode().splitlines() if "tok/s" in line]
    return {
        "first_byte_s": first_s,
        "total_s": total_s,
        "text": (first + rest).decode(errors="replace"),
        "summary": summary[-1] if summary else "",
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from omnidraft_mlx.bench.plots import save_figure

    fig, (first, total) = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["prompts"]
    for run in RUNS:
        first.plot(range(len(rows)), [r[run]["first_byte_s"] for r in rows], "o-", label=run)
        total.plot(range(len(rows)), [r[run]["total_s"] for r in rows], "o-", label=run)
    first.set_title("start to first byte (s)")
    total.set_title("start to exit (s)")
    for ax in (first, total):
        ax.set_xlabel("prompt")
        ax.legend()
    fig.suptitle(f"omnidraft generate, {result['config']['draft']} -> {result['config']['target']}")
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=10, help="in all, the README's prompt included")
    ap.add_argument("--readme-runs", type=int, default=3, help="of the README's prompt, each on a new machine")
    ap.add_argument("--out", type=Path, default=Path("bench/results/first-run"))
    args = ap.parse_args(argv)
    if not 1 <= args.readme_runs <= args.prompts:
        raise SystemExit("--readme-runs must be at least 1 and at most --prompts")

    from omnidraft_mlx.bench.report import print_checks
    from omnidraft_mlx.bench.run import environment_base
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.tasks import load_task

    for name in (args.draft, args.target):
        CATALOG_RESOLVER.path(name)  # pulled now, if not yet: the timed runs only find them
    omnidraft = [sys.executable, "-m", "omnidraft_mlx.cli.main", "generate"]
    pair = ["--draft", args.draft, "--target", args.target]
    rows = []
    write = [p.text for p in load_task("write", "heldout")]
    prompts = [README_PROMPT] * args.readme_runs + write[: args.prompts - args.readme_runs]
    for i, prompt in enumerate(prompts):
        home = Path(tempfile.mkdtemp(prefix="omnidraft-new-machine-"))
        (home / "models").symlink_to(models_dir().resolve())  # the models only, as if just pulled
        try:
            row = {"prompt": prompt}
            row["plain"] = timed([*omnidraft, "--model", args.target, prompt], {})
            for run in RUNS[1:]:
                row[run] = timed([*omnidraft, *pair, prompt], {"OMNIDRAFT_HOME": str(home)})
        finally:
            shutil.rmtree(home, ignore_errors=True)
        row["same_text"] = row["plain"]["text"] == row["new machine"]["text"] == row["warm"]["text"]
        row["plain_over_new"] = row["plain"]["total_s"] / row["new machine"]["total_s"]
        row["first_byte_new_over_warm"] = row["new machine"]["first_byte_s"] / row["warm"]["first_byte_s"]
        rows.append(row)
        print(
            f"prompt {i + 1}: plain {row['plain']['total_s']:.1f}s, new machine {row['new machine']['total_s']:.1f}s "
            f"(first byte {row['new machine']['first_byte_s']:.1f}s), warm {row['warm']['total_s']:.1f}s "
            f"(first byte {row['warm']['first_byte_s']:.1f}s)",
            file=sys.stderr,
        )

    def spread(key, rows=rows):
        values = [r[key] for r in rows]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    readme = [r for r in rows if r["prompt"] == README_PROMPT]

    result = {
        "command": " ".join(["python -m omnidraft_mlx.bench.first_run", *(argv if argv is not None else sys.argv[1:])]),
        "config": {
            "draft": args.draft,
            "target": args.target,
            "task": "the README's prompt, then write (heldout)",
            "prompts": len(rows),
            "readme_runs": len(readme),
        },
        "environment": environment_base(),
        "speedup_end_to_end_readme": spread("plain_over_new", readme),
        "speedup_end_to_end_new_machine": spread("plain_over_new"),
        "first_byte_new_over_warm": spread("first_byte_new_over_warm"),
        "same_text": all(r["same_text"] for r in rows),
        "prompts": rows,
    }
    result["checks"] = {
        "the README's command on a new machine at least as fast as plain end to end (median of its runs)": result[
            "speedup_end_to_end_readme"
        ]["median"]
        >= 1.0,
        "new machine's first byte within 2x the warm run's (every prompt)": result["first_byte_new_over_warm"]["max"]
        <= 2.0,
        "every output equal to plain decoding": result["same_text"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "first_run.json", json.dumps(result, indent=1))
    plot(result, args.out / "first_run.png")
    r, s, f = (
        result[k] for k in ("speedup_end_to_end_readme", "speedup_end_to_end_new_machine", "first_byte_new_over_warm")
    )
    print_checks(
        result["checks"],
        f"new machine over plain, end to end: the README's command {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}), "
        f"every prompt {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}); first byte "
        f"{f['median']:.2f}x the warm run's ({f['min']:.2f}-{f['max']:.2f})",
        args.out / "first_run.json",
        "first-run",
    )


if __name__ == "__main__":
    main()
