"""What a draft-length policy could gain on a bench run's own replies, offline.

Replays greedy speculative decoding over the target replies a bench recorded
(its plain method's outputs). One teacher-forced drafter forward per reply
gives, at each position, the token the drafter would draft there and whether
the reply goes on with it (as `adapt.head_labels` does); rounds are then
played with each policy asked exactly what `speculative_generate` asks it
(`wants_more`, `observe`, `time_round`), and priced with the per-round costs
fitted from the same bench's fixed-k records. Any gamma, the oracle and the
fixed lengths come out side by side in a minute, without decoding; the
bench's measured speedups stand beside the replayed ones, to show how far to
trust the replay. The learned policy starts from the profile's head and
learns as it goes, as in the bench; `--in-sample` adds heads fitted on each
task's replies themselves, which bounds what any head on the same features
could gain there.

On math and chat the replay landed within 4 % of the measured speedups (both
then computed by total time; both are now report.speedup's median per reply). On code
it overrates short drafts (k1 on Qwen 0.5B: 1.27x replayed, 1.16x measured):
there half the rejections at k1 are of a drafted token whose text is right but
ends inside a longer target token (`)` against the target's `):\n`), which the
replay, counting in the drafter's tokens, takes as kept.

    ./run.sh python -m omnidraft_mlx.bench.policy_replay BENCH_DIR [--gamma 0.3,0.5,0.7,auto] [--in-sample]

writes BENCH_DIR/replay.json and replay.png.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from omnidraft_mlx.bench.report import record_speedup, speedup
from omnidraft_mlx.decode.head import FEATURES, replay_depths, replay_recent
from omnidraft_mlx.decode.policy import DraftPolicy, FixedPolicy, LearnedPolicy, OraclePolicy, PolicyConfig, parse_gamma
from omnidraft_mlx.errors import OmniDraftError


@dataclass
class RoundCost:
    """Seconds of one round, fitted on a bench's fixed-k records (least squares over k)."""

    step_s: float  # a plain target step
    resync_s: float  # the drafter's re-sync forward, which drafts the first token
    forward_s: float  # each further drafter forward
    verify_s: float  # the target's verification forward, before its draft tokens
    token_s: float  # verifying one more draft token

    def drafting_s(self, drafted: int) -> float:
        return self.resync_s + self.forward_s * (drafted - 1)

    def verifying_s(self, drafted: int) -> float:
        return self.verify_s + self.token_s * drafted


def fit_costs(records: list[dict]) -> RoundCost:
    plain = [r for r in records if r["kind"] == "plain"]
    fixed = [r for r in records if r["kind"] == "ours" and r["policy"] == "fixed" and r["rounds"]]
    if len({r["k"] for r in fixed}) < 2:
        raise SystemExit("the bench must have run at least two fixed draft lengths (--k) to price a draft token")
    per_round = np.array([[r["draft_forwards"], r["draft_s"], r["proposed"], r["verify_s"]] for r in fixed])
    per_round /= np.array([r["rounds"] for r in fixed])[:, None]
    forward_s, resync_s = np.polyfit(per_round[:, 0], per_round[:, 1], 1)
    token_s, verify_s = np.polyfit(per_round[:, 2], per_round[:, 3], 1)
    step_s = sum(r["generate_s"] for r in plain) / sum(r["tokens"] for r in plain)
    return RoundCost(step_s, resync_s, forward_s, verify_s, token_s)


@dataclass
class Reply:
    task: str
    target_tokens: int
    drafted: np.ndarray  # the drafter's greedy token at each position of the reply (its tokenization)
    kept: np.ndarray  # does the reply go on with it
    features: np.ndarray  # the head's features there, depth 0 and recent acceptance 1 (set per round)


def teacher_forced(pair, policy: LearnedPolicy, prompt: str, target_ids: list[int], task: str) -> Reply:
    from omnidraft_mlx.learn.adapt import drafter_on_reply
    from omnidraft_mlx.prompts import encode_prompt, user_messages

    prompt_ids = encode_prompt(pair.draft_tok, user_messages(prompt))
    reply = list(pair.draft_tok.encode(pair.target_tok.decode(target_ids), add_special_tokens=False))
    hidden, logits, drafted, kept = drafter_on_reply(pair, prompt_ids + reply, len(prompt_ids))
    features = policy.features_of(hidden, logits, drafted, mx.zeros(len(reply)), mx.ones(len(reply)))
    return Reply(task, len(target_ids), np.array(drafted), kept, np.array(features))


DEPTH, RECENT = (FEATURES.index(name) - len(FEATURES) for name in ("depth", "recent_acceptance"))


def replay(reply: Reply, policy: DraftPolicy, cost: RoundCost, oracle: bool = False) -> tuple[float, int, int]:
    """Decode `reply` under `policy` (or the oracle: draft while the drafter is right):
    (seconds, rounds, draft tokens proposed)."""
    policy.begin_reply()
    start, seconds, rounds, proposed, n = 0, 0.0, 0, 0, len(reply.kept)
    while start < n:
        policy.begin_round()
        limit = min(policy.max_len, n - start)
        feats = []
        for i in range(limit):
            f = None
            if policy.needs_features:
                f = reply.features[start + i].copy()
                f[DEPTH], f[RECENT] = i, policy.recent
                f = mx.array(f)
            feats.append(f)
            more = reply.kept[start + i] if oracle else policy.wants_more(None, int(reply.drafted[start + i]), f)
            if i == limit - 1 or not more:
                break
        drafted = len(feats)
        right = int(np.cumprod(reply.kept[start : start + drafted]).sum())
        policy.observe(feats, [j < right for j in range(drafted)])
        draft_s, verify_s = cost.drafting_s(drafted), cost.verifying_s(drafted)
        round_s = draft_s + verify_s
        policy.time_round(
            draft_s=draft_s, forwards=drafted, verify_s=verify_s, drafted=drafted, round_s=round_s, tokens=right + 1
        )
        seconds, rounds, proposed, start = seconds + round_s, rounds + 1, proposed + drafted, start + right + 1
    return seconds, rounds, proposed


def fit_head(policy: LearnedPolicy, replies: list[Reply], steps: int = 1500) -> None:
    """Fit the policy's head on the replayed labels of `replies` (as `adapt.head_labels` labels a reply)."""
    features, kept = [], []
    for r in replies:
        depths = replay_depths(r.kept, policy.cfg.max_k)
        f = r.features.copy()
        f[:, DEPTH], f[:, RECENT] = depths, replay_recent(r.kept, depths, policy.cfg.recent_decay)
        features.append(f[depths >= 0])
        kept.append(r.kept[depths >= 0])
    policy.head.learn(np.concatenate(features), np.concatenate(kept), steps=steps)


def measured(records: list[dict], task: str, method: str) -> float | None:
    """The bench's speedup of `method` on `task` (report.speedup's median)."""

    def of(name):
        return [r for r in records if r["task"] == task and r["method"] == name]

    sp = record_speedup(of(method), of("plain"))
    return sp and sp["median"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir", type=Path)
    ap.add_argument("--gamma", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8,auto")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument(
        "--in-sample",
        action="store_true",
        help="also replay heads fitted on each task's replies themselves: the most any head on its "
        "features could gain there",
    )
    args = ap.parse_args(argv)
    if not (args.bench_dir / "bench.json").is_file():
        raise SystemExit(f"no bench.json in {args.bench_dir}: give the --out folder of an `omnidraft bench` run")
    result = json.loads((args.bench_dir / "bench.json").read_text())
    records, cfg = result["records"], result["config"]
    if not cfg["use_profile"]:
        raise SystemExit("that bench ran without the pair's profile (--no-profile): the replay needs its head")
    try:
        gammas = [parse_gamma(text) for text in args.gamma.split(",")]
    except OmniDraftError as e:
        raise SystemExit(str(e)) from None
    cost = fit_costs(records)
    mx.random.seed(0)  # heads start from the same weights on every run

    from omnidraft_mlx.bench.run import BenchConfig, load_pair
    from omnidraft_mlx.paths import model_home
    from omnidraft_mlx.profile.store import load_head
    from omnidraft_mlx.tasks import load_task

    pair, profile, _ = load_pair(BenchConfig(draft=cfg["draft"], target=cfg["target"], tasks=cfg["tasks"]))
    texts = {p.id: p.text for task in cfg["tasks"] for p in load_task(task, "heldout")}
    feature_policy = LearnedPolicy(PolicyConfig(name="learned", max_k=args.max_k))
    replies = [
        teacher_forced(pair, feature_policy, texts[r["prompt_id"]], r["output"], r["task"])
        for r in records
        if r["kind"] == "plain"
    ]

    def learned(gamma, fit_on=None):
        policy = LearnedPolicy(PolicyConfig(name="learned", max_k=args.max_k, gamma=gamma))
        if fit_on is None:
            load_head(policy, model_home() / profile["path"])
        else:
            fit_head(policy, fit_on)
        return policy

    rows = []
    for task in cfg["tasks"]:
        task_replies = [r for r in replies if r.task == task]
        methods = {f"ours-k{k}": lambda k=k: FixedPolicy(PolicyConfig(k=k)) for k in range(1, args.max_k + 1)}
        for gamma in gammas:
            suffix = "" if gamma is None else f"-g{gamma:g}"
            methods[f"ours-learned{suffix}"] = lambda g=gamma: learned(g)
            if args.in_sample:
                methods[f"ours-insample{suffix}"] = lambda g=gamma, fit=task_replies: learned(g, fit_on=fit)
        methods["ours-oracle"] = lambda: OraclePolicy(PolicyConfig(name="oracle", max_k=args.max_k))
        for name, make in methods.items():
            policy = make()
            runs = [replay(r, policy, cost, oracle=name == "ours-oracle") for r in task_replies]
            seconds, rounds, proposed = (sum(x) for x in zip(*runs))
            replayed = speedup((r.target_tokens / s, 1 / cost.step_s) for r, (s, _, _) in zip(task_replies, runs))
            rows.append(
                {
                    "task": task,
                    "method": name,
                    "speedup": replayed["median"],
                    "measured": measured(records, task, name),
                    "draft_per_round": proposed / rounds,
                }
            )
    report = {"bench": str(args.bench_dir), "cost": vars(cost), "max_k": args.max_k, "rows": rows}
    (args.bench_dir / "replay.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    plot(report, args.bench_dir / "replay.png")


def best_fixed(report: dict, task: str) -> tuple[float, str]:
    """The best fixed length's replayed speedup on `task`, and its name."""
    return max(
        (r["speedup"], r["method"])
        for r in report["rows"]
        if r["task"] == task and r["method"].startswith("ours-k") and r["method"][6:].isdigit()
    )


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"replayed on {report['bench']} (speedup over plain: median per reply)")
    for col in ("task", "method", "replayed", "vs best fixed", "measured", "draft/round"):
        table.add_column(col)
    for row in report["rows"]:
        best, _ = best_fixed(report, row["task"])
        table.add_row(
            row["task"],
            row["method"],
            f"{row['speedup']:.2f}x",
            f"{row['speedup'] / best - 1:+.1%}",
            f"{row['measured']:.2f}x" if row["measured"] else "",
            f"{row['draft_per_round']:.2f}",
        )
    Console(width=120).print(table)


def plot(report: dict, path: Path) -> None:
    """Replayed speedup against gamma per task, with the best fixed length and the oracle."""
    from omnidraft_mlx.bench.plots import plt, save_figure

    tasks = list(dict.fromkeys(r["task"] for r in report["rows"]))
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, task in enumerate(tasks):
        rows = {r["method"]: r["speedup"] for r in report["rows"] if r["task"] == task}
        best = best_fixed(report, task)
        for head, style in (("learned", "-"), ("insample", "-.")):
            swept = sorted((float(m.rsplit("-g", 1)[1]), v) for m, v in rows.items() if f"-{head}-g" in m)
            if swept:
                ax.plot(*zip(*swept), marker="o", ls=style, color=f"C{i}", label=f"{task}: {head}")
        ax.axhline(best[0], color=f"C{i}", ls=":", lw=1, label=f"{task}: best fixed ({best[1]})")
        ax.axhline(rows["ours-oracle"], color=f"C{i}", ls="--", lw=1, label=f"{task}: oracle")
    ax.set_xlabel("gamma (stop drafting when P(a rejection) > gamma)")
    ax.set_ylabel("replayed speedup over plain")
    ax.set_title(f"policy replay: {report['bench']}", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    save_figure(fig, path)


if __name__ == "__main__":
    main()
