"""`omnidraft bench`: plain, our speculative and mlx-lm's speculative decoding, side by side."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from omnidraft_mlx.cli import options
from omnidraft_mlx.errors import OmniDraftError

QUICK_PROMPTS, QUICK_TOKENS = 1, 32


def _integers(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise OmniDraftError(f"{what} takes comma-separated integers, e.g. 3,4,5 (got '{text}')")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _on_off(text: str, flag: str) -> bool:
    if text not in ("on", "off"):
        raise OmniDraftError(f"{flag} takes on, off or on,off (got '{text}')")
    return text == "on"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name.rstrip("/")).name)


class _LogLines:
    """Progress as one plain stderr line per finished run (a log file gets no bar)."""

    def __init__(self):
        self.tasks: list[list] = []  # per task: what it is doing, its total, how many are done
        self.start = 0.0

    def __enter__(self):
        import time

        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description: str, total: int = 0) -> int:
        self.tasks.append([description, total, 0])
        return len(self.tasks) - 1

    def update(self, task: int, description: str = "") -> None:
        self.tasks[task][0] = description or self.tasks[task][0]

    def advance(self, task: int, n: int = 1) -> None:
        import sys
        import time

        what, total, done = self.tasks[task]
        self.tasks[task][2] = done = done + n
        print(
            f"bench {done}/{total}: {what} done ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True
        )


def _progress():
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from omnidraft_mlx.cli.main import err_console

    if not sys.stderr.isatty():
        return _LogLines()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    )


def bench(
    draft: str = options.DRAFT,
    target: str = options.TARGET,
    task: str | None = typer.Option(
        None,
        "--task",
        help=(
            "complete, write, math, chat, edit, multiturn, agent, comma-separated, or all (every task but agent; the "
            "default, unless --prompts-file is given)."
        ),
    ),
    source: str = typer.Option(
        "drafter",
        "--source",
        help=(
            "Method families, comma-separated: drafter (the model drafter alone), lookup (context and history lookups"
            " alone), fused (both, picked per round)."
        ),
    ),
    guard: str = typer.Option("on", "--guard", help="lookup and fused methods: on, off (suffix -noguard) or on,off."),
    tree: str = typer.Option(
        "off", "--tree", help="drafter and fused methods: token trees on (suffix -tree), off (chains) or on,off."
    ),
    prompts_file: Path | None = typer.Option(
        None,
        "--prompts-file",
        help='Also your own prompts: JSONL, {"prompt": ...} or {"messages": [...]} per line (task "file").',
    ),
    temp: float = typer.Option(
        0.0,
        "--temp",
        help=(
            "Sampling temperature for every method, plain included (0 = greedy; outputs then compared by "
            "distribution, not identity)."
        ),
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampled runs (prompt i: seed + i)."),
    sampling: str = typer.Option(
        "exact",
        "--sampling",
        help=(
            "Sampled runs: exact (lossless), omnidraft (+ n-gram merges, approximately lossless) or exact,omnidraft "
            "(suffix -omnidraft)."
        ),
    ),
    fixed: bool = typer.Option(
        True, "--fixed/--no-fixed", help="With --policy: also the fixed-length methods (one per --k)."
    ),
    k: str = typer.Option("3,4,5", "--k", "-k", help="Draft lengths to compare, comma-separated."),
    translation: str = typer.Option("text", "--translation", help="Draft translation(s): text, tokens or text,tokens."),
    policy: str = typer.Option(
        "",
        "--policy",
        help=(
            "Adaptive draft-length policies to add: confidence,heuristic,learned; oracle (knows the reply: the bound "
            "for any policy)."
        ),
    ),
    gamma: str = typer.Option(
        "auto",
        "--gamma",
        help=(
            "The learned policy's stopping threshold(s), comma-separated (one method each); auto: from measured costs."
        ),
    ),
    prompts: int | None = typer.Option(
        None, "--prompts", help="Held-out prompts per task, episodes for agent (default 6; --quick: 1)."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", help="Tokens per generation (default 96; --quick: 32)."
    ),
    quick: bool = typer.Option(False, "--quick", help="A few short prompts: a check in minutes, not a measurement."),
    no_profile: bool = typer.Option(
        False, "--no-profile", help="Ignore the pair's profile (adapter, n-gram cache): start from the bare drafter."
    ),
    time_limit: float | None = typer.Option(
        None, "--time-limit", help="Minutes after which no new prompt starts (the report keeps whole prompts)."
    ),
    no_mlx_lm: bool = typer.Option(False, "--no-mlx-lm", help="Leave out mlx-lm's speculative decoding."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output directory (default omnidraft-bench/DRAFT__TARGET)."
    ),
    forward_cost: str | None = typer.Option(
        None, "--forward-cost", help="Instead: plain decode speed and forward cost of these models (comma-separated)."
    ),
    shard: str = options.SHARD,
) -> None:
    """Measure speed and acceptance of the decoders on the same prompts in one run.

    Writes bench.json (every record and the environment), summary.md and PNG plots;
    the profile of the pair is read but never written. Under `mlx.launch` the target is
    split over the ranks (--shard), which run the bench in step; rank 0 writes the results.
    """
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.collectives import world

    lead = world().rank() == 0
    if lead:
        warn_if_slow_blas(err_console)
    if forward_cost is not None:
        return _forward_cost(forward_cost, out or Path("omnidraft-bench"))

    from omnidraft_mlx.bench.report import write_results
    from omnidraft_mlx.bench.run import BenchConfig, run_bench
    from omnidraft_mlx.decode.policy import parse_gamma

    cfg = BenchConfig(
        draft=draft,
        target=target,
        tasks=_tasks(task, prompts_file),
        sources=_names(source),
        guards=[_on_off(g, "--guard") for g in _names(guard)],
        trees=[_on_off(t, "--tree") for t in _names(tree)],
        temp=temp,
        seed=seed,
        prompts_file=str(prompts_file) if prompts_file else None,
        fixed=fixed,
        ks=_integers(k, "--k"),
        translations=_names(translation),
        samplings=_names(sampling),
        prompts=prompts or (QUICK_PROMPTS if quick else 6),
        max_tokens=max_tokens or (QUICK_TOKENS if quick else 96),
        shortest=quick,
        use_profile=not no_profile,
        mlx_lm=not no_mlx_lm,
        time_limit_s=None if time_limit is None else 60 * time_limit,
        policies=[p.strip() for p in policy.split(",") if p.strip()],
        gammas=[parse_gamma(g) for g in gamma.split(",")],
        shard=shard,
    )
    out = out or Path("omnidraft-bench") / f"{_slug(draft)}__{_slug(target)}"
    if not lead:
        run_bench(cfg)
        return
    with _progress() as progress:
        result = run_bench(cfg, progress)
    files = write_results(result, out, console)
    console.print("wrote " + ", ".join(str(p) for p in files.values()))


def _tasks(task: str | None, prompts_file: Path | None) -> list[str]:
    """The --task list: every benchmark task by default, none by default beside --prompts-file."""
    from omnidraft_mlx.bench.run import ALL_TASKS

    return list(ALL_TASKS) if (task or ("" if prompts_file else "all")) == "all" else _names(task or "")


def _forward_cost(models: str, out: Path) -> None:
    """`bench --forward-cost`: each model's plain decode speed and forward cost, into out/forward_cost.json."""
    from omnidraft_mlx.bench.forward_cost import run_forward_cost
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.profile.atomic import atomic_write_text

    names = _names(models)
    if not names:
        raise OmniDraftError("--forward-cost needs model names, e.g. smollm2-135m,qwen2.5-coder-0.5b")
    with _progress() as progress:
        result = run_forward_cost(names, progress)
    path = out / "forward_cost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1))
    for name, m in result["models"].items():
        ms = " / ".join(f"{v:.0f}" for v in m["forward_ms"].values())
        console.print(
            f"{name}: decode {m['decode_tokens_per_s']:.1f} tok/s, forward over "
            f"{'/'.join(m['forward_ms'])} tokens: {ms} ms ({m['cached_tokens']} cached), "
            f"of which building the one-token graph {m['graph_build_ms']:.1f} ms"
        )
    console.print(f"wrote {path}")
