"""How far sampled speculative decoding is from the target's own distribution.

The target's distribution over its next few tokens is enumerated exactly;
speculative samples are compared with it by a chi-square test and by total
variation distance. `exact` mode (direct mappings only, TLI-style) must be
indistinguishable; `omnidraft` mode (n-gram merges with the paper's Eq. 2
correction) is only approximately lossless, and this measures by how much.
Runs on the tiny test models (built on the fly), where the exact
distribution is cheap to enumerate:

    ./run.sh python -m omnidraft_mlx.bench.sampling_bias --out bench/results/sampling_bias.json

On a real pair the distribution over sequences is out of reach, but each
emitted token can still be checked against the target's own distribution at
its position (one target forward over prompt + reply). `--bench DIR` does this
for the replies of a sampled `omnidraft bench` run, plain decoding's included
as the control: per task and method, the count of target tokens outside the
vocabulary intersection (the ones only n-gram merges propose, so where the
omnidraft mode's approximate correction acts) and the sum of log-probabilities,
each against its expectation under the target's sampling. Lossless sampling
leaves both differences at noise (|z| < 2 in 19 of 20 runs); a bias shifts them.
The checks assume independent draws: bench samples prompt i with seed + i (on
a run with one seed for all prompts, whose replies share their random draws,
plain decoding itself read z = -2.1 and -3.2 on the log-probability check).

    ./run.sh python -m omnidraft_mlx.bench.sampling_bias --bench bench/results/sampled-0.7/DRAFT__TARGET
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_together, target_probs
from omnidraft_mlx.decode.widths import verify_costs
from omnidraft_mlx.profile.atomic import atomic_write_text
from omnidraft_mlx.prompts import encode_prompt, user_messages


def exact_sequence_probs(model, prompt_ids, eos, length, temp, top_p, min_prob=1e-7) -> dict:
    """P(sequence) of the target's own sampling, by enumerating its branches."""
    probs: dict = {}

    def expand(prefix, prob):
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            seq = tuple(t for t in prefix if t not in eos)
            probs[seq] = probs.get(seq, 0.0) + prob
            return
        logits = model(mx.array(prompt_ids + list(prefix))[None])[0, -1:]
        p = target_probs(logits, temp, top_p)[0]
        for t in np.nonzero(p * prob > min_prob)[0]:
            expand(prefix + (int(t),), prob * float(p[t]))

    expand((), 1.0)
    return probs


def sample_sequences(
    pair,
    prompt,
    mode,
    n,
    length,
    temp,
    top_p,
    k=3,
    sources="drafter",
    scheduler=None,
    tree=True,
    beside: str | None = None,
) -> tuple[Counter, SpecStats]:
    """n sampled continuations of prompt, drafted by `sources` (every round, no guard), with the
    drafter's branches or without; `scheduler`: makes each one's Scheduler (None: the default);
    `beside`: a prompt whose own sampled reply shares each one's target forwards (two requests
    in a batch, as `omnidraft serve` decodes them)."""

    def ids(text):
        msgs = user_messages(text)
        return encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)

    verify_costs(pair.target)  # as open_pair does: the scheduler keeps a branch by what its width costs
    counts, stats = Counter(), SpecStats()
    for seed in range(n):
        cfg = SpecConfig(
            k=k,
            temp=temp,
            top_p=top_p,
            max_tokens=length,
            sampling=mode,
            seed=seed,
            sources=sources,
            guard=False,
            tree=tree,
        )
        decodings = [Decoding(pair, *ids(prompt), cfg, stats, scheduler=scheduler and scheduler())]
        if beside:
            decodings.append(
                Decoding(pair, *ids(beside), replace(cfg, seed=n + seed, max_tokens=length + 2), SpecStats())
            )
        sequence = []
        for taken in decode_together(decodings):
            sequence += taken.get(0, ([], []))[0]
        for d in decodings:
            d.close()
        counts[tuple(sequence)] += 1
    return counts, stats


def fit(counts: Counter, expected: dict) -> tuple[float, int]:
    """Chi-square p-value (pooling sequences expected fewer than 5 times) and the category count."""
    n = sum(counts.values())
    big = [s for s, p in expected.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    want = [expected[s] * n for s in big] + [n * (1 - sum(expected[s] for s in big))]
    return float(chisquare(observed, want).pvalue), len(big)


def total_variation(counts: Counter, expected: dict) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(s, 0) / n - expected.get(s, 0.0)) for s in set(counts) | set(expected))


def main(out: str, samples: int = 3000, length: int = 3, temp: float = 1.0, top_p: float = 0.95) -> dict:
    from mlx_lm import load

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import TEXT, build_tiny_models, corpus, train_tokenizer, write_model

    from omnidraft_mlx.pair import make_pair

    root = Path(tempfile.mkdtemp())
    dirs = build_tiny_models(root)  # the test suite's tiny trained pair
    # A drafter with a near-byte-level vocabulary, so that many target tokens
    # are spelled by several draft tokens and the n-gram cache matters.
    fine = write_model(
        root / "fine-draft", train_tokenizer(corpus("draft"), 290), 48, 2, seed=5, train_text=TEXT, train_steps=300
    )
    (dm, dt), (tm, tt) = load(str(fine)), load(str(dirs["target"]))
    pair = make_pair(dm, dt, tm, tt)
    # Fill the n-gram cache as use would: verified text teaches the merges.
    pair.learn_ngrams(list(tt.encode(TEXT, add_special_tokens=False)))
    result = {
        "samples": samples,
        "length": length,
        "temp": temp,
        "top_p": top_p,
        "ngram_cache": len(pair.ngrams),
        "prompts": {},
    }
    eos = set(tt.eos_token_ids) | {pair.vmap.target_eos}
    for prompt in ["def add_", "print(add_", "    return x + "]:
        expected = exact_sequence_probs(tm, encode_prompt(tt, user_messages(prompt), True), eos, length, temp, top_p)
        rows = {}
        for mode in ["exact", "omnidraft"]:
            counts, stats = sample_sequences(pair, prompt, mode, samples, length, temp, top_p)
            pvalue, categories = fit(counts, expected)
            rows[mode] = {
                "chi2_pvalue": pvalue,
                "categories": categories,
                "total_variation": total_variation(counts, expected),
                "acceptance": stats.acceptance,
                "ngram_hits": stats.ngram_hits,
            }
            print(prompt, mode, rows[mode])
        result["prompts"][prompt] = rows
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def position_checks(
    target,
    prompt_ids: list[int],
    reply: list[int],
    ended: bool,
    temp: float,
    top_p: float,
    eos: list[int],
    category: np.ndarray,
) -> np.ndarray:
    """Per emitted token (and the end of the reply, if it ended): [category observed, its
    probability, log p(token), its mean and variance] under the target's own sampling, all
    end-of-sequence tokens counted as one outcome (a reply records no end token)."""
    logits = target(mx.array(prompt_ids + reply)[None])[0, len(prompt_ids) - 1 :]
    p = target_probs(logits, temp, top_p)[: len(reply) + ended].astype(np.float64)
    outcomes = np.column_stack([p, p[:, eos].sum(axis=1)])  # the end: the last outcome
    outcomes[:, eos] = 0.0
    logs = np.log(outcomes, out=np.zeros_like(outcomes), where=outcomes > 0)
    mean = (outcomes * logs).sum(axis=1)
    emitted = reply + ([outcomes.shape[1] - 1] if ended else [])
    category = np.append(category, 0.0)
    return np.column_stack(
        [
            category[emitted],
            outcomes @ category,
            logs[np.arange(len(emitted)), emitted],
            mean,
            (outcomes * logs**2).sum(axis=1) - mean**2,
        ]
    )


def check_bench(bench_dir: str) -> dict:
    """Every reply of a sampled bench run checked token by token against the target (see the top)."""
    from omnidraft_mlx.bench.run import BenchConfig, load_pair, select_prompts
    from omnidraft_mlx.pair import vocab_size

    result = json.loads((Path(bench_dir) / "bench.json").read_text())
    cfg = result["config"]
    if not cfg["temp"]:
        raise SystemExit(f"{bench_dir} is a greedy run: bias is measured on sampled runs (--temp > 0)")
    keys = ("draft", "target", "tasks", "prompts", "max_tokens", "shortest", "prompts_file")
    bench = BenchConfig(**{k: cfg[k] for k in keys}, use_profile=False, mlx_lm=False)
    pair, _, _ = load_pair(bench)
    prompts = {p.id: p for p in select_prompts(bench, pair)}
    eos = sorted(set(pair.target_tok.eos_token_ids) | {pair.vmap.target_eos})
    direct = pair.vmap.draft_to_target[pair.vmap.draft_to_target >= 0]
    category = np.ones(vocab_size(pair.target))
    category[direct] = 0.0
    category[eos] = 0.0
    top_p = 1.0  # bench samples without nucleus truncation
    groups: dict[tuple[str, str], list[np.ndarray]] = {}
    for i, r in enumerate(result["records"]):
        ids = encode_prompt(pair.target_tok, prompts[r["prompt_id"]].messages())
        ended = len(r["output"]) < cfg["max_tokens"]
        groups.setdefault((r["task"], r["method"]), []).append(
            position_checks(pair.target, ids, r["output"], ended, cfg["temp"], top_p, eos, category)
        )
        print(f"checked {i + 1}/{len(result['records'])}: {r['prompt_id']} {r['method']}", flush=True)
    rows = []
    for (task, method), checks in groups.items():
        c = np.concatenate(checks)
        n = len(c)
        cat_sd = float(np.sqrt((c[:, 1] * (1 - c[:, 1])).sum()))
        lp_sd = float(np.sqrt(c[:, 4].sum()))
        rows.append(
            {
                "task": task,
                "method": method,
                "positions": n,
                "outside_intersection_observed": int(c[:, 0].sum()),
                "outside_intersection_expected": float(c[:, 1].sum()),
                "outside_intersection_z": float((c[:, 0] - c[:, 1]).sum() / cat_sd) if cat_sd else 0.0,
                "outside_intersection_bias": float((c[:, 0] - c[:, 1]).sum() / n),
                "outside_intersection_bias_sd": cat_sd / n,
                "logp_bias": float((c[:, 2] - c[:, 3]).sum() / n),
                "logp_bias_sd": lp_sd / n,
                "logp_z": float((c[:, 2] - c[:, 3]).sum() / lp_sd) if lp_sd else 0.0,
            }
        )
    out = {"bench": Path(bench_dir).name, "temp": cfg["temp"], "top_p": top_p, "rows": rows}
    atomic_write_text(Path(bench_dir) / "bias.json", json.dumps(out, indent=1))
    for row in rows:
        print(
            f"{row['task']:6} {row['method']:22} n={row['positions']:4}  outside the intersection "
            f"{row['outside_intersection_observed']} vs {row['outside_intersection_expected']:.1f} "
            f"(z {row['outside_intersection_z']:+.2f})  log p per token {row['logp_bias']:+.3f} "
            f"+- {row['logp_bias_sd']:.3f} (z {row['logp_z']:+.2f})"
        )
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/sampling_bias.json")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--bench", help="check the replies of this sampled bench run instead (writes DIR/bias.json)")
    args = parser.parse_args()
    check_bench(args.bench) if args.bench else main(args.out, args.samples)
