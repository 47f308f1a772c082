"""Sampling is lossless in `exact` mode: a goodness-of-fit test of whole
generated sequences against the target's own distribution, computed exactly
by enumeration on tiny models with different tokenizers. The same test must
catch a deliberately biased variant, or it proves nothing."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

import omnidraft_mlx.speculative as spec
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.speculative import SpecConfig, SpecStats, speculative_generate, target_probs

PROMPT = "def add_"  # ~50 likely continuations: numbers, then "(x"
LENGTH, TEMP, TOP_P, SAMPLES = 3, 1.0, 0.95, 1500


def exact_sequence_probs(model, prompt_ids, eos, length, min_prob=1e-7):
    """P(sequence) of the target's own sampling, by enumerating its branches."""
    probs = {}

    def expand(prefix, prob):
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            seq = tuple(t for t in prefix if t not in eos)
            probs[seq] = probs.get(seq, 0.0) + prob
            return
        logits = model(mx.array(prompt_ids + list(prefix))[None])[0, -1:]
        p = target_probs(logits, TEMP, TOP_P)[0]
        for t in np.nonzero(p * prob > min_prob)[0]:
            expand(prefix + (int(t),), prob * float(p[t]))

    expand((), 1.0)
    return probs


def sample_sequences(pair, mode, n=SAMPLES):
    msgs = user_messages(PROMPT)
    dp, tp = encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)
    counts, stats = Counter(), SpecStats()
    for seed in range(n):
        cfg = SpecConfig(k=3, temp=TEMP, top_p=TOP_P, max_tokens=LENGTH, sampling=mode, seed=seed)
        counts[tuple(t for new, _ in speculative_generate(pair, dp, tp, cfg, stats) for t in new)] += 1
    return counts, stats


def fit(counts, expected_probs):
    """Chi-square p-value, pooling sequences expected fewer than 5 times."""
    n = sum(counts.values())
    big = [s for s, p in expected_probs.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    expected = [expected_probs[s] * n for s in big] + [n * (1 - sum(expected_probs[s] for s in big))]
    return chisquare(observed, expected).pvalue, len(big)


@pytest.fixture(scope="module")
def setup(tiny):
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    tp = encode_prompt(tt, user_messages(PROMPT), True)
    eos = set(tt.eos_token_ids) | {pair.vmap.target_eos}
    return pair, exact_sequence_probs(tm, tp, eos, LENGTH)


def test_exact_mode_matches_target_distribution(setup):
    pair, expected = setup
    counts, stats = sample_sequences(pair, "exact")
    pvalue, categories = fit(counts, expected)
    assert categories >= 5  # a test with a handful of outcomes would prove little
    assert 0 < stats.accepted < stats.proposed  # both branches of the rule were exercised
    assert pvalue > 1e-3, f"exact sampling deviates from the target (p={pvalue:.2g})"


def test_biased_variant_is_caught(setup, monkeypatch):
    """Sampling from p instead of the residual after a rejection: the classic bug."""
    pair, expected = setup
    monkeypatch.setattr(spec, "residual", lambda p, q: p)
    counts, _ = sample_sequences(pair, "exact")
    pvalue, _ = fit(counts, expected)
    assert pvalue < 1e-3, f"the test failed to detect a biased sampler (p={pvalue:.2g})"
