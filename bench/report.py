"""Per task and method summaries of bench records, as a table and as JSON rows; per episode
speedups of the agent task (an episode's steps summed)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.timing import prompt_speedup, speedup

ALL = "all"
AGENT = "agent"  # the task whose prompts are steps of episodes (bench/agent.py)


def _total(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records]
    return None if any(v is None for v in values) else float(sum(values))


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def record_speedup(records: list[dict], plain: list[dict]) -> dict | None:
    """speedup() of bench records against the plain records of the same prompts (by prompt_id)."""
    plain_rate = {r["prompt_id"]: r["tokens_per_s"] for r in plain}
    return speedup((r["tokens_per_s"], plain_rate.get(r["prompt_id"])) for r in records)


def episode_of(prompt_id: str) -> str:
    """The episode an agent step belongs to ("agent/HumanEval/12/2" -> "agent/HumanEval/12")."""
    return prompt_id.rsplit("/", 1)[0]


def _episode_rate(steps: list[dict]) -> float | None:
    """An episode's tokens/s: its steps' tokens over their summed generate_s."""
    seconds = sum(r["generate_s"] for r in steps)
    return sum(r["tokens"] for r in steps) / seconds if seconds else None


def episodes(records: list[dict]) -> list[dict]:
    """One row per agent episode and method: each step's speedup, and the whole episode's
    against plain on the same steps (greedy, same tokens: plain's summed time over the method's)."""
    steps: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r["task"] == AGENT:
            steps.setdefault((episode_of(r["prompt_id"]), r["method"]), []).append(r)
    rows = []
    for (episode, method), group in steps.items():
        rate, plain_rate = _episode_rate(group), _episode_rate(steps.get((episode, "plain"), []))
        equal = [r["equal_to_plain"] for r in group]
        rows.append(
            {
                "episode": episode,
                "method": method,
                "steps": len(group),
                "tokens": sum(r["tokens"] for r in group),
                "generate_s": sum(r["generate_s"] for r in group),
                "tokens_per_s": rate,
                "plain_tokens_per_s": plain_rate,
                "step_speedups": [r["speedup"] for r in group],
                "speedup": prompt_speedup(rate, plain_rate),
                "all_equal_to_plain": None if None in equal else all(equal),
            }
        )
    return rows


def episode_speedup(rows: list[dict], method: str) -> dict | None:
    """speedup() over whole episodes (rows of episodes()) of one method; "prompts" counts episodes."""
    return speedup((e["tokens_per_s"], e["plain_tokens_per_s"]) for e in rows if e["method"] == method)


def _rounds_by_source(records: list[dict]) -> dict | None:
    """Rounds per draft source (and plain rounds), summed over records."""
    total: dict[str, int] = {}
    for r in records:
        for source, (rounds, _, _) in (r.get("by_source") or {}).items():
            total[source] = total.get(source, 0) + rounds
    return total or None


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, method), plus task "all"; speedup as speedup() gives it."""
    tasks = list(dict.fromkeys(r["task"] for r in records)) + [ALL]
    methods = list(dict.fromkeys(r["method"] for r in records))
    per_episode, rows = episodes(records), []
    for task in tasks:
        for method in methods:
            group = [r for r in records if r["method"] == method and task in (ALL, r["task"])]
            if not group:
                continue
            plain = [r for r in records if r["method"] == "plain" and task in (ALL, r["task"])]
            sp = record_speedup(group, plain) or {}
            speedups = [r["speedup"] for r in group if r["speedup"] is not None]
            tokens, gen = _total(group, "tokens"), _total(group, "generate_s")
            ep = episode_speedup(per_episode, method) if task in (ALL, AGENT) else None
            rows.append(
                {
                    "task": task,
                    "method": method,
                    "prompts": len(group),
                    "ttft_s": float(np.median([r["ttft_s"] for r in group])),
                    "tokens_per_s": float(np.median([r["tokens_per_s"] for r in group])),
                    "speedup_median": sp.get("median"),
                    "speedup_min": sp.get("min"),
                    "speedup_max": sp.get("max"),
                    "speedup_iqr": [float(q) for q in np.percentile(speedups, [25, 75])] if speedups else None,
                    # The agent task's whole episodes (steps summed); None without any.
                    "episodes": ep and ep["prompts"],
                    "episode_speedup_median": ep and ep["median"],
                    "episode_speedup_min": ep and ep["min"],
                    "episode_speedup_max": ep and ep["max"],
                    # Pooled over the group's tokens, not averaged over prompts.
                    "acceptance": _ratio(_total(group, "accepted"), _total(group, "proposed")),
                    "tokens_per_forward": _ratio(tokens, _total(group, "rounds")),
                    # Token trees: nodes verified per target forward, and the accepted tokens branches held.
                    "nodes_per_round": _ratio(_total(group, "proposed"), _total(group, "rounds")),
                    "branch_held": _total(group, "branch_held"),
                    "draft_ms_per_token": _ratio(_total(group, "draft_s"), tokens / 1000 if tokens else None),
                    "verify_ms_per_token": _ratio(_total(group, "verify_s"), tokens / 1000 if tokens else None),
                    "other_ms_per_token": _ratio(_total(group, "other_s"), tokens / 1000 if tokens else None),
                    "generate_ms_per_token": _ratio(gen, tokens / 1000 if tokens else None),
                    "ngram_hits": _total(group, "ngram_hits"),
                    # None: sampled, compared by distribution
                    "all_equal_to_plain": None
                    if any(r["equal_to_plain"] is None for r in group)
                    else all(r["equal_to_plain"] for r in group),
                    "rounds_by_source": _rounds_by_source(group),
                    "mismatches": [{"prompt_id": r["prompt_id"], **r["mismatch"]} for r in group if r["mismatch"]],
                }
            )
    return rows


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _shares(rounds: dict | None) -> str:
    if not rounds:
        return "-"
    total = sum(rounds.values())
    return " ".join(f"{name} {100 * n / total:.0f}" for name, n in sorted(rounds.items(), key=lambda kv: -kv[1]))


def _split(row: dict) -> str:
    gen = row["generate_ms_per_token"]
    if row["draft_ms_per_token"] is None or not gen:
        return "-"
    parts = (row["draft_ms_per_token"], row["verify_ms_per_token"], row["other_ms_per_token"])
    return " / ".join(f"{100 * p / gen:.0f}" for p in parts)


def table(rows: list[dict], title: str) -> Table:
    """A markdown-styled table (it prints as valid markdown)."""
    t = Table(title=title, box=box.MARKDOWN, title_justify="left")
    for col in (
        "task",
        "method",
        "n",
        "TTFT s",
        "tok/s",
        "speedup (min-max)",
        "accept",
        "tok/fwd",
        "nodes/fwd",
        "held on branches",
        "draft/verify/other %",
        "n-gram hits",
        "= plain",
        "rounds by source %",
        "episode speedup",
    ):
        t.add_column(col, justify="left" if col in ("task", "method") else "right")
    for r in rows:
        t.add_row(
            r["task"],
            r["method"],
            str(r["prompts"]),
            f"{r['ttft_s']:.2f}",
            f"{r['tokens_per_s']:.2f}",
            f"{_fmt(r['speedup_median'], '.2f')}x ({_fmt(r['speedup_min'], '.2f')}-{_fmt(r['speedup_max'], '.2f')})",
            _fmt(r["acceptance"], ".2f"),
            _fmt(r["tokens_per_forward"], ".2f"),
            _fmt(r["nodes_per_round"], ".1f"),
            _fmt(r["branch_held"], ".0f"),
            _split(r),
            _fmt(r["ngram_hits"], ".0f"),
            "n/a"
            if r["all_equal_to_plain"] is None
            else "yes"
            if r["all_equal_to_plain"]
            else f"NO ({len(r['mismatches'])})",
            _shares(r["rounds_by_source"]),
            "-"
            if r["episodes"] is None
            else f"{r['episode_speedup_median']:.2f}x "
            f"({r['episode_speedup_min']:.2f}-{r['episode_speedup_max']:.2f}, {r['episodes']})",
        )
    return t


def pair_name(cfg: dict) -> str:
    return f"{Path(cfg['draft']).name} -> {Path(cfg['target']).name}"


def title_of(result: dict) -> str:
    cfg, env = result["config"], result["environment"]
    decoding = f"temperature {cfg['temp']:g}, seed {cfg['seed']}" if cfg.get("temp") else "greedy"
    return (
        f"{pair_name(cfg)}, {decoding}, {cfg['max_tokens']} tokens, "
        f"{len(cfg['prompt_ids'])} prompts ({env['blas']}, mlx {env['mlx']}, mlx-lm {env['mlx_lm']})"
    )


def round_line(cost: dict) -> str:
    """What a round trip of the target cost in the run (round_cost.py), in one line."""
    widths = cost["widths"]
    forward = "/".join(f"{w['forward_ms']:.1f}" for w in widths.values())
    line = f"target forward over {'/'.join(widths)} tokens: {forward} ms"
    if cost["ranks"] == 1:
        return line + " (one process)"
    held = ", ".join(f"{n} {kind}" for kind, n in cost["collectives"].items())
    alone = "/".join(f"{w['collective_ms']:.2f}" for w in widths.values())
    return f"{line} on {cost['ranks']} ranks ({cost['shard']}): {held} a forward, one alone {alone} ms"


def write_results(result: dict, out: Path, console) -> dict[str, Path]:
    """bench.json, summary.md and the plots under `out`; prints the table."""
    from omnidraft_mlx.bench.plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize(result["records"])
    result["episodes"] = episodes(result["records"])
    files = {"json": out / "bench.json", "table": out / "summary.md"}
    atomic_write_text(files["json"], json.dumps(result, indent=1))
    t = table(result["summary"], title_of(result))
    wide = Console(width=250, file=io.StringIO(), highlight=False)
    wide.print(t)
    text = "\n".join(line.rstrip() for line in wide.file.getvalue().strip().splitlines()) + "\n"
    if result.get("round_cost"):
        text += "\n" + round_line(result["round_cost"]) + "\n"
    atomic_write_text(files["table"], text)
    # A terminal gets the table fitted to it; a pipe or file gets it whole.
    console.print(t) if console.is_terminal else console.out(text, highlight=False)
    files.update(write_plots(result, out))
    return files


def print_checks(checks: dict[str, bool], summary: str, path: Path, what: str) -> None:
    """A bench's checks, one line each, then its summary; exits non-zero when one failed."""
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"{summary} -> {path}")
    if not all(checks.values()):
        raise SystemExit(f"{what} checks failed: see {path}")
