"""How far trees of the drafter's top choices could take a pair: a ceiling, offline.

One teacher-forced drafter forward over each reply a bench recorded (its plain
method's outputs) gives, at every position, the rank among the drafter's
choices of the token the reply goes on with. A draft shape is then played over
those ranks with an oracle's luck, every round drafting its full depth:

- `chain`: the drafter's first choice at each depth (width 1);
- `branches`: the chain plus BRANCHES next-best one-token leaves at each depth
  (the trees `--tree` builds, every branch kept);
- `top-W`: the drafter's W best tokens at every node (W**1 + ... + W**depth nodes).

A round holds tokens while their ranks stay inside the shape, then the target
adds its own. Rounds are priced with what this machine measures now: the
target's forward over the shape's node count (widths.measure), one drafter
forward per depth (batched branches as cheap as one row: a ceiling), and the
bench's plain step. Counting is in the drafter's tokens over the reply's text
and reported per target token, so cross-vocabulary pairs are approximate.

    ./run.sh python -m omnidraft_mlx.bench.tree_ceiling BENCH_DIR [--max-depth 8] [--max-nodes 64]

writes BENCH_DIR/ceiling.json and prints the best depth of each shape per task
beside the bench's own summary rows (its measured chain and tree).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from omnidraft_mlx.bench.report import speedup
from omnidraft_mlx.decode.drafter import BRANCHES


@dataclass(frozen=True)
class Shape:
    name: str
    width: int  # ranks below this hold at every depth
    leaf_width: int  # ranks below this hold as a final one-token leaf
    depth: int

    @property
    def nodes(self) -> int:
        if self.leaf_width > self.width:  # a chain with leaves at every depth
            return self.depth * self.leaf_width
        return sum(self.width**d for d in range(1, self.depth + 1))


def shapes(max_depth: int, max_nodes: int) -> list[Shape]:
    every = [Shape("chain", 1, 1, d) for d in range(1, max_depth + 1)]
    every += [Shape("branches", 1, 1 + BRANCHES, d) for d in range(1, max_depth + 1)]
    every += [Shape(f"top-{w}", w, w, d) for w in (2, 3) for d in range(1, max_depth + 1)]
    return [s for s in every if s.nodes <= max_nodes]


def rounds_to_cover(ranks: np.ndarray, shape: Shape) -> int:
    """Target forwards the shape needs to cover a reply whose next tokens have these drafter ranks."""
    start, rounds, n = 0, 0, len(ranks)
    while start < n:
        held = 0
        while held < shape.depth and start + held < n and ranks[start + held] < shape.width:
            held += 1
        if held < shape.depth and start + held < n and ranks[start + held] < shape.leaf_width:
            held += 1  # a leaf holds; the target's own token follows it
        start, rounds = start + held + 1, rounds + 1
    return rounds


def reply_ranks(pair, messages: list[dict], target_ids: list[int]) -> np.ndarray:
    """The drafter's rank of each next token of the reply (0: its first choice), in its tokenization."""
    from omnidraft_mlx.learn.adapt import drafter_on_reply
    from omnidraft_mlx.prompts import encode_prompt
    from omnidraft_mlx.vocab.align import as_draft_tokens

    prompt = encode_prompt(pair.draft_tok, messages)
    reply = as_draft_tokens(target_ids, pair.vmap, pair.draft_tok)
    _, logits, _, _ = drafter_on_reply(pair, prompt + reply, len(prompt))
    truth = mx.array(reply)[:, None]
    return np.array((logits > mx.take_along_axis(logits, truth, axis=-1)).sum(axis=-1))


def drafter_forward_s(records: list[dict]) -> float:
    """Seconds of one drafter forward, from the bench's drafted rounds."""
    ours = [r for r in records if r["kind"] == "ours" and r["draft_forwards"]]
    if not ours:
        raise SystemExit(
            "that bench has no rounds drafted by our drafter to price its forward: "
            "give a bench run with --source drafter or fused"
        )
    return sum(r["draft_s"] for r in ours) / sum(r["draft_forwards"] for r in ours)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir", type=Path)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--max-nodes", type=int, default=64)
    args = ap.parse_args(argv)
    if not (args.bench_dir / "bench.json").is_file():
        raise SystemExit(f"no bench.json in {args.bench_dir}: give the --out folder of an `omnidraft bench` run")
    result = json.loads((args.bench_dir / "bench.json").read_text())
    records, cfg = result["records"], result["config"]

    from omnidraft_mlx.bench.run import BenchConfig, load_pair
    from omnidraft_mlx.decode.kvcache import KVSlot
    from omnidraft_mlx.decode.widths import measure
    from omnidraft_mlx.prompts import encode_prompt
    from omnidraft_mlx.tasks import load_task

    pair, _, _ = load_pair(
        BenchConfig(draft=cfg["draft"], target=cfg["target"], tasks=cfg["tasks"], use_profile=cfg["use_profile"])
    )
    prompts = {p.id: p for task in cfg["tasks"] for p in load_task(task, "heldout")}
    plain = [r for r in records if r["kind"] == "plain"]
    ranks = {r["prompt_id"]: reply_ranks(pair, prompts[r["prompt_id"]].messages(), r["output"]) for r in plain}

    every = shapes(args.max_depth, args.max_nodes)
    slot = KVSlot.fresh(pair.target)
    mx.eval(slot.extend(pair.target, encode_prompt(pair.target_tok, prompts[plain[0]["prompt_id"]].messages())))
    verify_s = measure(pair.target, slot, sorted({s.nodes for s in every}))
    forward_s = drafter_forward_s(records)

    rows = []
    for task in cfg["tasks"]:
        replies = [r for r in plain if r["task"] == task]
        for shape in every:
            rounds = [rounds_to_cover(ranks[r["prompt_id"]], shape) for r in replies]
            round_s = shape.depth * forward_s + verify_s[shape.nodes]
            rates = [(r["tokens"] / (n * round_s), r["tokens_per_s"]) for r, n in zip(replies, rounds)]
            rows.append(
                {
                    "task": task,
                    "shape": shape.name,
                    "depth": shape.depth,
                    "nodes": shape.nodes,
                    "tokens_per_forward": sum(r["tokens"] for r in replies) / sum(rounds),
                    "speedup": speedup(rates)["median"],
                    "verify_s": verify_s[shape.nodes],
                }
            )
    measured = [
        {
            "task": row["task"],
            "method": row["method"],
            "speedup": row["speedup_median"],
            "tokens_per_forward": row["tokens_per_forward"],
        }
        for row in result["summary"]
        if row["task"] in cfg["tasks"] and row["method"] != "plain"
    ]
    every_rank = np.concatenate(list(ranks.values()))
    hit = {f"top-{k}": float(np.mean(every_rank < k)) for k in (1, 2, 3, 4)}
    report = {
        "bench": str(args.bench_dir),
        "drafter_forward_s": forward_s,
        "rank_hit_rate": hit,
        "rows": rows,
        "measured": measured,
    }
    (args.bench_dir / "ceiling.json").write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    console.print(
        "the reply's next token among the drafter's first k choices: "
        + ", ".join(f"{k} {v:.2f}" for k, v in report["rank_hit_rate"].items())
    )
    table = Table(title=f"tree ceilings on {report['bench']} (best depth per shape; speedup: median per reply)")
    for col in ("task", "shape", "depth", "nodes", "tokens/forward", "ceiling speedup", "measured speedup"):
        table.add_column(col)
    for task in dict.fromkeys(r["task"] for r in report["rows"]):
        for name in dict.fromkeys(r["shape"] for r in report["rows"]):
            best = max(
                (r for r in report["rows"] if r["task"] == task and r["shape"] == name), key=lambda r: r["speedup"]
            )
            table.add_row(
                task,
                name,
                str(best["depth"]),
                str(best["nodes"]),
                f"{best['tokens_per_forward']:.2f}",
                f"{best['speedup']:.2f}x",
                "",
            )
        for m in (m for m in report["measured"] if m["task"] == task):
            table.add_row(task, m["method"], "", "", f"{m['tokens_per_forward']:.2f}", "", f"{m['speedup']:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
