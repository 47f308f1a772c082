"""Held-out acceptance and speedup before adaptation, with the n-gram cache alone,
and after online adaptation (paper's Algorithm 2) on the adaptation split.

Three phases, each its own process so that the CPU lock is held in short spans:
    python -m omnidraft_mlx.bench.adaptation before          # no adaptation
    python -m omnidraft_mlx.bench.adaptation adapt --minutes 15   # resumable
    python -m omnidraft_mlx.bench.adaptation after           # cache alone, adapted
    python -m omnidraft_mlx.bench.adaptation report          # JSON + PNG
Greedy decoding; every method decodes every held-out prompt (methods rotated per
prompt); the n-gram cache is reset to the condition's cache for every prompt, so
evaluation never learns. The adaptation profile lives apart from the user's
(under OMNIDRAFT_HOME/bench/), the results in bench/results/adaptation/.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

from omnidraft_mlx.bench.report import record_speedup
from omnidraft_mlx.bench.run import DecodeSettings, Method, environment_base, rotated, run_one
from omnidraft_mlx.tasks import load_task

DRAFT, TARGET = "smollm2-135m", "qwen2.5-coder-0.5b"
TASKS = ("math", "complete")
OUT = Path(__file__).parent / "results" / "adaptation"


def profile_path(args) -> Path:
    from omnidraft_mlx.paths import model_home

    return Path(args.profile) if args.profile else model_home() / "bench" / "adaptation-profile"


def heldout(n: int) -> list:
    per_task = [load_task(t, "heldout")[:n] for t in TASKS]
    return [p for group in zip(*per_task) for p in group]


def adapt_stream() -> list:
    """The adaptation split, tasks interleaved while both last, as one stream of conversations
    (each prompt with its reference answer, which only the teacher-forced mode reads)."""
    from omnidraft_mlx.learn.adapt import task_corpus

    return task_corpus(",".join(TASKS), "adapt")


def evaluate(conditions: dict, prompts: list, k: int, max_tokens: int) -> list[dict]:
    """conditions: name -> (pair, n-gram cache to start every prompt from, translation or None for plain)."""
    records = []
    names = list(conditions)
    for i, prompt in enumerate(prompts):
        for name in rotated(names, i):
            pair, cache, translation = conditions[name]
            pair = replace(pair, ngrams=copy.deepcopy(cache), spelled=set())
            method = Method(name, "plain") if translation is None else Method(name, "ours", k, translation)
            rec = run_one(pair, method, prompt, DecodeSettings(max_tokens))
            rec.pop("output")
            records.append(rec)
            print(f"{prompt.id} {name}: acceptance {rec['acceptance']} tok/s {rec['tokens_per_s']:.2f}", flush=True)
    return records


def load(name: str):
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    return load_model(name, CATALOG_RESOLVER)


def phase_before(args) -> None:
    from omnidraft_mlx.pair import make_pair
    from omnidraft_mlx.vocab.ngram import NGramCache

    pair = make_pair(*load(args.draft), *load(args.target))
    empty = NGramCache()
    conds = {"plain": (pair, empty, None), "none-text": (pair, empty, "text"), "none-tokens": (pair, empty, "tokens")}
    _warm(pair)
    _write("before", evaluate(conds, heldout(args.prompts), args.k, args.tokens), args)


def phase_adapt(args) -> None:
    from omnidraft_mlx.decode.policy import PolicyConfig, make_policy
    from omnidraft_mlx.decode.speculative import SpecConfig
    from omnidraft_mlx.learn.adapt import (
        Budget,
        check_mode,
        learn_from_target,
        learn_speculative,
        learn_teacher_forced,
        open_learner,
    )
    from omnidraft_mlx.learn.distill import DistillConfig
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    cfg = DistillConfig(lam=args.lam, lr=args.lr, lora_rank=args.rank, steps=args.steps)
    mode = check_mode(args.mode)  # recorded as given
    # The target mode trains the acceptance head, whatever --policy says (as `omnidraft adapt` does).
    policy = make_policy(PolicyConfig(name=args.policy if mode == "speculative" else "learned", k=args.k))
    learner = open_learner(
        args.draft,
        args.target,
        (*load(args.draft), *load(args.target)),
        cfg,
        args.interval,
        path=profile_path(args),
        note=print,
        policy=policy,
        resolver=CATALOG_RESOLVER,
    )
    learner.corpus = "adaptation-split:" + ",".join(TASKS)
    learner.position = learner.profile.position(learner.corpus)
    log = args.out / "stream.json"
    previous = json.loads(log.read_text())["records"] if log.exists() and learner.position else []
    start = time.monotonic()

    def show(e) -> None:
        if e.update:
            print(f"update {e.update.update}: loss {e.update.loss:.3f} in {e.update.seconds:.1f}s", flush=True)

    if mode == "teacher-forced":  # on the split's reference answers: no generation
        records = []
        learn_teacher_forced(learner, adapt_stream(), Budget(args.minutes), show)
    elif mode == "target":  # the target answers `interval` prompts at once, then an update
        records = learn_from_target(learner, adapt_stream(), args.stream_tokens, Budget(args.minutes), show)
    else:
        spec = SpecConfig(k=args.k, max_tokens=args.stream_tokens)
        records = learn_speculative(learner, adapt_stream(), spec, Budget(args.minutes), show)
    wall = (json.loads(log.read_text())["wall_s"] if previous else 0.0) + time.monotonic() - start
    _save(
        log,
        {
            "records": previous + records,
            "history": learner.profile.manifest.get("history", []),
            "settings": {
                **cfg.__dict__,
                "interval": args.interval,
                "stream_tokens": args.stream_tokens,
                "k": args.k,
                "mode": args.mode,
            },
            "position": learner.position,
            "wall_s": wall,
        },
    )


def phase_after(args) -> None:
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.pair import make_pair
    from omnidraft_mlx.profile.store import load_profile
    from omnidraft_mlx.vocab.ngram import NGramCache

    (dm, dt), (tm, tt), (am, at) = load(args.draft), load(args.target), load(args.draft)
    profile = load_profile(args.draft, args.target, am, path=profile_path(args), resolver=CATALOG_RESOLVER)
    base, adapted = make_pair(dm, dt, tm, tt), make_pair(am, at, tm, tt)
    cache, empty = profile.ngrams, NGramCache()
    conds = {
        "plain": (base, empty, None),
        "cache-tokens": (base, cache, "tokens"),
        "adapted-text": (adapted, cache, "text"),
        "adapted-tokens": (adapted, cache, "tokens"),
    }
    if args.ablation:  # the adapted drafter without the n-gram cache; the same learning without the n-gram NLL
        conds["adapted-nocache-tokens"] = (adapted, empty, "tokens")
        if json.loads((args.out / "stream.json").read_text())["records"]:  # a replay needs the stream's replies
            kl_only = make_pair(*kl_only_drafter(args, make_pair(*load(args.draft), tm, tt)), tm, tt)
            conds |= {"klonly-text": (kl_only, cache, "text"), "klonly-tokens": (kl_only, cache, "tokens")}
    _warm(base)
    _write("after", evaluate(conds, heldout(args.prompts), args.k, args.tokens), args)


def kl_only_drafter(args, pair) -> tuple:
    """The stream run's updates replayed with lambda = 0 from the base drafter.

    Greedy replies are the target's own output whatever the drafter, so replaying
    the logged replies in the logged order gives the same training data and
    updates the stream run had: only the loss differs."""
    from omnidraft_mlx.learn.adapt import OnlineLearner, asked
    from omnidraft_mlx.learn.distill import DistillConfig, setup_trainable

    log = json.loads((args.out / "stream.json").read_text())
    cfg = DistillConfig.from_dict({**log["settings"], "lam": 0.0})
    setup_trainable(pair.draft, cfg)
    learner, samples = OnlineLearner(pair, cfg, log["settings"]["interval"]), adapt_stream()
    for r in log["records"]:
        learner.observe(asked(samples[r["position"] - 1].messages), r["reply"])
        learner.maybe_update()
    learner.update()
    print(f"KL-only replay: {learner.updates} updates on {len(log['records'])} replies", flush=True)
    return pair.draft, pair.draft_tok


def _warm(pair) -> None:
    from omnidraft_mlx.bench.run import WARMUP_PROMPT, WARMUP_TOKENS
    from omnidraft_mlx.tasks import Prompt

    for m in (Method("plain", "plain"), Method("w", "ours", 3, "text")):
        run_one(pair, m, Prompt("warmup", "chat", WARMUP_PROMPT), DecodeSettings(WARMUP_TOKENS))


def _save(path: Path, data: dict) -> None:
    from omnidraft_mlx.profile.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1))


def _write(phase: str, records: list, args) -> None:
    _save(
        args.out / f"{phase}.json",
        {
            "records": records,
            "environment": environment_base(),
            "settings": {"prompts_per_task": args.prompts, "max_tokens": args.tokens, "k": args.k},
        },
    )


def summarize(records: list) -> dict:
    """Per method and task (and 'all'): acceptance (pooled), tokens per forward, speedup
    (report.speedup: median per-prompt ratio, min, max)."""
    out = {}
    for task in (*TASKS, "all"):
        rows = [r for r in records if task == "all" or r["task"] == task]
        for name in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == name]
            plain = {r["prompt_id"]: r for r in rows if r["method"] == "plain"}
            proposed = sum(r["proposed"] or 0 for r in mine)
            sp = record_speedup(mine, list(plain.values()))
            out.setdefault(name, {})[task] = {
                "acceptance": sum(r["accepted"] or 0 for r in mine) / proposed if proposed else None,
                "tokens_per_forward": sum(r["tokens"] for r in mine) / sum(r["rounds"] for r in mine),
                "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["generate_s"] for r in mine),
                "speedup": sp and sp["median"],
                "speedup_range": sp and [sp["min"], sp["max"]],
                "prompts": len(mine),
            }
    return out


def phase_report(args) -> None:
    import numpy as np

    from omnidraft_mlx.bench.plots import plt, save_figure

    before, after = (json.loads((args.out / f"{p}.json").read_text()) for p in ("before", "after"))
    stream_log = json.loads((args.out / "stream.json").read_text())
    results = {"before": summarize(before["records"]), "after": summarize(after["records"])}
    hist = stream_log["history"]
    cost = {
        "updates": len(hist),
        "seconds_per_update": float(np.mean([h["seconds"] for h in hist])) if hist else None,
        "training_tokens_per_s": float(np.mean([h["tokens_per_s"] for h in hist])) if hist else None,
        "peak_memory_gb": max((h["peak_memory_gb"] for h in hist), default=None),
    }
    recs = stream_log["records"]
    summary = {
        "draft": args.draft,
        "target": args.target,
        "greedy": True,
        "heldout": results,
        "learning_cost": cost,
        "adaptation": {
            "prompts_seen": stream_log.get("position", len(recs)),
            "wall_s": stream_log["wall_s"],
            "settings": stream_log["settings"],
            "ngram_cache": recs[-1]["ngrams"] if recs else 0,
        },
        "environment": after["environment"],
    }
    _save(args.out / "adaptation.json", summary)

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    acc = np.array([r["acceptance"] for r in recs if "acceptance" in r])  # target and teacher-forced modes: none
    w = stream_log["settings"]["interval"]
    if len(acc):
        smooth = np.convolve(acc, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(1, len(acc) + 1), acc, ".", alpha=0.3, label="per prompt (on-policy, adapt split)")
        ax.plot(np.arange(w, len(acc) + 1), smooth, "-", label=f"mean of last {w}")
    if len(acc):
        for name, res, style in (
            ("held-out before", results["before"]["none-text"], "--"),
            ("held-out after", results["after"]["adapted-text"], "-."),
        ):
            ax.axhline(
                res["all"]["acceptance"], linestyle=style, color="gray" if "before" in name else "green", label=name
            )
        ax.set_ylabel("acceptance (accepted / proposed target tokens)")
    else:  # the teacher-forced mode decodes nothing while it learns: its loss per update instead
        ax.plot([h["position"] for h in hist], [h["loss"] for h in hist], "o-", label="distillation loss (new batch)")
        ax.set_ylabel("loss (reverse KL + lambda NLL, per position)")
    ax.set_xlabel("prompts seen")
    ax.set_title(f"{Path(args.draft).name} -> {Path(args.target).name}, greedy, text translation")
    ax.legend(fontsize=8)
    bars = [
        ("none\ntext", "before", "none-text"),
        ("none\ntokens", "before", "none-tokens"),
        ("cache\ntokens", "after", "cache-tokens"),
        ("adapted\ntokens", "after", "adapted-tokens"),
        ("adapted\ntext", "after", "adapted-text"),
    ]
    bars += [
        (label, "after", m)
        for label, m in (
            ("adapted\nno cache\ntokens", "adapted-nocache-tokens"),
            ("KL only\ntokens", "klonly-tokens"),
            ("KL only\ntext", "klonly-text"),
        )
        if m in results["after"]
    ]
    for i, task in enumerate(TASKS):
        vals = [results[ph][m][task]["acceptance"] for _, ph, m in bars]
        bx.bar(np.arange(len(bars)) + 0.4 * i, vals, 0.4, label=task)
    bx.set_xticks(np.arange(len(bars)) + 0.2, [b[0] for b in bars], fontsize=8)
    bx.set_ylabel("held-out acceptance")
    bx.legend()
    save_figure(fig, args.out / "acceptance.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "environment"}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["before", "adapt", "after", "report"])
    ap.add_argument("--prompts", type=int, default=5, help="held-out prompts per task")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per held-out generation")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=15.0, help="adaptation budget of this invocation")
    ap.add_argument("--stream-tokens", type=int, default=64, help="reply length while adapting")
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lam", type=float, default=0.2)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--mode",
        choices=["speculative", "target", "teacher-forced", "stream", "batch", "text"],
        default="speculative",
        help="adapt: speculative (Algorithm 2, on-policy), target (the target's replies by batched decoding) "
        "or teacher-forced (on the reference answers); their old names stream, batch, text still work",
    )
    ap.add_argument("--policy", default="learned", help="adapt: draft-length policy while streaming (its head learns)")
    ap.add_argument(
        "--ablation",
        action="store_true",
        help="after: also the adapted drafter without the n-gram cache, and trained with KL only",
    )
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--profile", help="where the adaptation profile lives (default: OMNIDRAFT_HOME/bench/)")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    {"before": phase_before, "adapt": phase_adapt, "after": phase_after, "report": phase_report}[args.phase](args)


if __name__ == "__main__":
    main()
