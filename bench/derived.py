"""A derived (shallow) drafter against the full one it came from, in one run.

1. Cost: a single-token forward with 200 cached tokens for the full drafter cut
   to several depths (the weights do not change the cost), the derived model,
   the full drafter and both targets, in interleaved rounds (median).
2. Decoding: plain target decoding and speculative decoding with the full and
   with the derived drafter, interleaved prompt by prompt in a rotating order on
   held-out code and math prompts; greedy, so every output must equal plain.

    ./run.sh python -m omnidraft_mlx.bench.derived \\
        --derived smollm2-135m-6l --out bench/results/derived
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from omnidraft_mlx.bench.report import prompt_speedup, record_speedup
from omnidraft_mlx.bench.run import (
    BenchConfig,
    DecodeSettings,
    Method,
    environment_base,
    rotated,
    run_one,
    select_prompts,
)
from omnidraft_mlx.decode.kvcache import make_cache, prefill
from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.timing import forward_seconds

CACHED = 200


def step_ms(model, repeats: int = 7) -> float:
    """Median ms of a single-token forward with CACHED tokens in the KV cache."""
    cache = make_cache(model)
    prefill(model, cache, [(17 * i) % 1000 + 100 for i in range(CACHED)])
    times = forward_seconds(model, mx.array([[42]]), cache, repeats + 1)
    return 1000 * float(np.median(times[1:]))  # the first is a warm-up


def measure_costs(full, models: dict, depths: list[int], rounds: int, progress=None) -> dict:
    """ms per token: `full` cut to each depth, then each of `models`; median over rounds."""
    layers = list(full.model.layers)
    times: dict[str, list[float]] = {}
    task = progress.add_task("cost", total=rounds * (len(depths) + len(models))) if progress else None
    for _ in range(rounds):
        for n in depths:
            full.model.layers = layers[:n]
            times.setdefault(f"drafter cut to {n} layers", []).append(step_ms(full))
            if progress:
                progress.advance(task)
        full.model.layers = layers
        for name, model in models.items():
            times.setdefault(name, []).append(step_ms(model))
            if progress:
                progress.advance(task)
    return {name: round(float(np.median(v)), 2) for name, v in times.items()}


def decode_all(pairs: dict, methods: list[tuple[str, Method]], prompts, max_tokens: int, progress=None) -> list:
    """Every (pair, method) on every prompt, rotating the order prompt by prompt."""
    from omnidraft_mlx.tasks import Prompt

    warm = Prompt("warmup", "chat", "Say hello.")
    for label, method in methods:  # first calls allocate; keep them out of the numbers
        run_one(pairs[label], method, warm, DecodeSettings(4))
    task = progress.add_task("decode", total=len(prompts) * len(methods)) if progress else None
    records = []
    for i, prompt in enumerate(prompts):
        done = {}
        for label, method in rotated(methods, i):
            if progress:
                progress.update(task, description=f"{prompt.id} {label}")
            record = run_one(pairs[label], method, prompt, DecodeSettings(max_tokens))
            done[label] = {**record, "method": label}
            if progress:
                progress.advance(task)
        plain = done["plain"]
        for label, _ in methods:
            record = done[label]
            record["speedup"] = prompt_speedup(record["tokens_per_s"], plain["tokens_per_s"])
            record["equal_to_plain"] = record["output"] == plain["output"]
            records.append(record)
    return records


def summarize(records: list) -> dict:
    """Per method, per task and over all prompts ("all"): tokens/s (pooled), speedup
    (report.speedup: median per-prompt ratio, min, max), acceptance, tokens per target forward."""
    out = {}
    tasks = [*dict.fromkeys(r["task"] for r in records), "all"]
    plain = [r for r in records if r["method"] == "plain"]
    for label in dict.fromkeys(r["method"] for r in records):
        for task in tasks:
            rs = [r for r in records if r["method"] == label and task in ("all", r["task"])]
            tokens, seconds = sum(r["tokens"] for r in rs), sum(r["generate_s"] for r in rs)
            proposed = sum(r["proposed"] or 0 for r in rs)
            sp = record_speedup(rs, plain)
            out.setdefault(label, {})[task] = {
                "prompts": len(rs),
                "tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 3),
                "acceptance": round(sum(r["accepted"] or 0 for r in rs) / proposed, 3) if proposed else None,
                "tokens_per_forward": round(tokens / sum(r["rounds"] for r in rs), 3),
                "draft_s": round(sum(r["draft_s"] or 0 for r in rs), 2),
                "verify_s": round(sum(r["verify_s"] or 0 for r in rs), 2),
                "all_equal_to_plain": all(r["equal_to_plain"] for r in rs),
                "speedup": sp and round(sp["median"], 3),
                "speedup_range": sp and [round(sp["min"], 3), round(sp["max"], 3)],
            }
    return out


def plot(result: dict, path: Path) -> None:
    from omnidraft_mlx.bench.plots import plt, save_figure

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    cost = result["cost_ms"]
    names = list(cost)
    ax = axes[0]
    ax.barh(
        [Path(n).name for n in names],
        [cost[n] for n in names],
        color=["tab:orange" if n == result["derived"] else "tab:blue" for n in names],
    )
    big = result["targets"][-1]
    ax.axvline(cost[big] / 10, color="red", ls="--", label=f"1/10 of {Path(big).name}")
    ax.set_xlabel("ms per single-token forward (200 cached)")
    ax.legend(fontsize=7)
    ax.set_title("cost per token", fontsize=9)

    ax = axes[1]
    sel = result["derived_info"]["selection_loss"]
    depths = sorted(int(d) for d in sel)
    ax.plot(depths, [sel[str(d)] for d in depths], marker=".", label="greedy drop (no training)")
    info = result["derived_info"]
    n = len(info["kept_layers"])
    ax.scatter([n], [info["heldout_before"]["loss"]], color="tab:red", zorder=3, label="before distillation*")
    ax.scatter([n], [info["heldout_after"]["loss"]], color="tab:orange", zorder=3, label="after distillation*")
    ax.axhline(info["heldout_after"]["teacher_loss"], color="gray", ls=":", label="full drafter")
    ax.set_xlabel("layers kept")
    ax.set_ylabel("held-out next-token loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("quality by depth (*: evaluation text, longer windows)", fontsize=9)

    ax = axes[2]
    summary = result["summary"]
    labels = [m for m in summary if m != "plain"]
    tasks = list(summary["plain"])
    width = 0.8 / len(labels)
    for j, m in enumerate(labels):
        x = np.arange(len(tasks)) + (j - (len(labels) - 1) / 2) * width
        ax.bar(x, [summary[m][t]["speedup"] for t in tasks], width, label=m)
        for xi, t in zip(x, tasks):
            ax.text(xi, 0.02, f"{summary[m][t]['acceptance']:.2f}", ha="center", fontsize=6, rotation=90)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(np.arange(len(tasks)), tasks, fontsize=8)
    ax.set_ylabel("speedup over plain (numbers: acceptance)")
    ax.legend(fontsize=7)
    ax.set_title(f"target {Path(result['target']).name}, {len(result['prompt_ids'])} prompts, greedy", fontsize=9)
    save_figure(fig, path)


def main() -> None:
    from rich.console import Console

    from omnidraft_mlx.blas import ensure_fast_blas
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER, _progress, resolve_model
    from omnidraft_mlx.pair import make_pair
    from omnidraft_mlx.paths import INFO_FILE
    from omnidraft_mlx.profile.store import load_profile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--derived", required=True, help="the derived drafter (a local model name)")
    parser.add_argument("--full", default="smollm2-135m")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--big-target", default="qwen2.5-coder-1.5b", help="only timed, for the cost ratio")
    parser.add_argument("--depths", default="4,6,8")
    parser.add_argument("--k", default="4", help="draft lengths for the derived drafter")
    parser.add_argument("--full-k", default="4", help="draft lengths for the full drafter")
    parser.add_argument("--tasks", default="complete,math,chat")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per task")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cost-rounds", type=int, default=3)
    parser.add_argument(
        "--adapted",
        action="store_true",
        help="also decode with each drafter's profile for --target (`omnidraft adapt` first)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/derived"))
    args = parser.parse_args()
    ensure_fast_blas()

    info = json.loads((Path(resolve_model(args.derived)) / INFO_FILE).read_text())
    full, full_tok = load_model(args.full, CATALOG_RESOLVER)
    derived, derived_tok = load_model(args.derived, CATALOG_RESOLVER)
    target, target_tok = load_model(args.target, CATALOG_RESOLVER)
    big = target if args.big_target == args.target else load_model(args.big_target, CATALOG_RESOLVER)[0]
    with _progress(True) as bar:
        cost = measure_costs(
            full,
            {args.derived: derived, args.full: full, args.target: target, args.big_target: big},
            [int(d) for d in args.depths.split(",")],
            args.cost_rounds,
            bar,
        )
        del big
        pairs = {"plain": make_pair(full, full_tok, target, target_tok)}
        prompts = select_prompts(
            BenchConfig(draft=args.derived, target=args.target, tasks=args.tasks.split(","), prompts=args.prompts),
            pairs["plain"],
        )
        methods = [("plain", Method("plain", "plain"))]
        drafters = [
            ("full", pairs["plain"], args.full_k),
            ("derived", make_pair(derived, derived_tok, target, target_tok), args.k),
        ]
        if args.adapted:  # each drafter again, as its profile for the target left it (adapter, n-gram cache)
            for name, model_name, ks in (("full", args.full, args.full_k), ("derived", args.derived, args.k)):
                model, tok = load_model(model_name, CATALOG_RESOLVER)
                profile = load_profile(model_name, args.target, model, resolver=CATALOG_RESOLVER)
                drafters.append((f"{name}-adapted", make_pair(model, tok, target, target_tok, profile.ngrams), ks))
        for name, pair, ks in drafters:
            for k in [int(k) for k in ks.split(",")]:
                pairs[f"{name}-k{k}"] = pair
                methods.append((f"{name}-k{k}", Method(f"ours-k{k}", "ours", k, "text")))
        records = decode_all(pairs, methods, prompts, args.max_tokens, bar)
    big_step = cost[args.big_target]
    result = {
        "derived": args.derived,
        "full": args.full,
        "target": args.target,
        "targets": [args.target, args.big_target],
        "cost_ms": cost,
        "cost_ratio": {
            name: {t: round(cost[t] / ms, 2) for t in (args.target, args.big_target)}
            for name, ms in cost.items()
            if name not in (args.target, args.big_target)
        },
        "goal_met": cost[args.derived] <= big_step / 10,
        "derived_info": info,
        "prompt_ids": [p.id for p in prompts],
        "max_tokens": args.max_tokens,
        "summary": summarize(records),
        "records": [{k: v for k, v in r.items() if k != "output"} for r in records],
        "environment": environment_base(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "derived.json", json.dumps(result, indent=2))
    plot(result, args.out / "derived.png")
    Console().print_json(json.dumps({"cost_ms": cost, "summary": result["summary"]}))


if __name__ == "__main__":
    main()
