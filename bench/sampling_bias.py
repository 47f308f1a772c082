"""How far sampled speculative decoding is from the target's own distribution.

The target's distribution over its next few tokens is enumerated exactly;
speculative samples are compared with it by a chi-square test and by total
variation distance. `exact` mode (direct mappings only, TLI-style) must be
indistinguishable; `omnidraft` mode (n-gram merges with the paper's Eq. 2
correction) is only approximately lossless, and this measures by how much.
Runs on the tiny test models (built on the fly), where the exact
distribution is cheap to enumerate:

    ./run.sh python -m omnidraft_mlx.bench.sampling_bias --out bench/results/sampling_bias.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.speculative import SpecConfig, SpecStats, speculative_generate, target_probs


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


def sample_sequences(pair, prompt, mode, n, length, temp, top_p, k=3, sources="drafter") -> tuple[Counter, SpecStats]:
    """n sampled continuations of prompt, drafted by `sources` (every round, no guard)."""
    msgs = user_messages(prompt)
    dp, tp = encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)
    counts, stats = Counter(), SpecStats()
    for seed in range(n):
        cfg = SpecConfig(k=k, temp=temp, top_p=top_p, max_tokens=length, sampling=mode, seed=seed,
                         sources=sources, guard=False)
        counts[tuple(t for new, _ in speculative_generate(pair, dp, tp, cfg, stats) for t in new)] += 1
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
    fine = write_model(root / "fine-draft", train_tokenizer(corpus("draft"), 290), 48, 2, seed=5,
                       train_text=TEXT, train_steps=300)
    (dm, dt), (tm, tt) = load(str(fine)), load(str(dirs["target"]))
    pair = make_pair(dm, dt, tm, tt)
    # Fill the n-gram cache as use would: verified text teaches the merges.
    pair.learn_ngrams(list(tt.encode(TEXT, add_special_tokens=False)))
    result = {"samples": samples, "length": length, "temp": temp, "top_p": top_p,
              "ngram_cache": len(pair.ngrams), "prompts": {}}
    eos = set(tt.eos_token_ids) | {pair.vmap.target_eos}
    for prompt in ["def add_", "print(add_", "    return x + "]:
        expected = exact_sequence_probs(tm, encode_prompt(tt, user_messages(prompt), True), eos, length, temp, top_p)
        rows = {}
        for mode in ["exact", "omnidraft"]:
            counts, stats = sample_sequences(pair, prompt, mode, samples, length, temp, top_p)
            pvalue, categories = fit(counts, expected)
            rows[mode] = {"chi2_pvalue": pvalue, "categories": categories,
                          "total_variation": total_variation(counts, expected),
                          "acceptance": stats.acceptance, "ngram_hits": stats.ngram_hits}
            print(prompt, mode, rows[mode])
        result["prompts"][prompt] = rows
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/sampling_bias.json")
    parser.add_argument("--samples", type=int, default=3000)
    main(parser.parse_args().out, parser.parse_args().samples)
