"""Sampling is lossless in `exact` mode: a goodness-of-fit test of whole
generated sequences against the target's own distribution, computed exactly
by enumeration on tiny models with different tokenizers. The same test must
catch a deliberately biased variant, or it proves nothing."""

import pytest

import omnidraft_mlx.speculative as spec
from omnidraft_mlx.bench.sampling_bias import exact_sequence_probs, fit, sample_sequences
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages

PROMPT = "def add_"  # ~50 likely continuations: numbers, then "(x"
LENGTH, TEMP, TOP_P, SAMPLES = 3, 1.0, 0.95, 1500


def sample(pair, mode):
    return sample_sequences(pair, PROMPT, mode, SAMPLES, LENGTH, TEMP, TOP_P)


@pytest.fixture(scope="module")
def setup(tiny):
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    tp = encode_prompt(tt, user_messages(PROMPT), True)
    eos = set(tt.eos_token_ids) | {pair.vmap.target_eos}
    return pair, exact_sequence_probs(tm, tp, eos, LENGTH, TEMP, TOP_P)


def test_exact_mode_matches_target_distribution(setup):
    pair, expected = setup
    counts, stats = sample(pair, "exact")
    pvalue, categories = fit(counts, expected)
    assert categories >= 5  # a test with a handful of outcomes would prove little
    assert 0 < stats.accepted < stats.proposed  # both branches of the rule were exercised
    assert pvalue > 1e-3, f"exact sampling deviates from the target (p={pvalue:.2g})"


def test_biased_variant_is_caught(setup, monkeypatch):
    """Sampling from p instead of the residual after a rejection: the classic bug."""
    pair, expected = setup
    monkeypatch.setattr(spec, "residual", lambda p, q: p)
    counts, _ = sample(pair, "exact")
    pvalue, _ = fit(counts, expected)
    assert pvalue < 1e-3, f"the test failed to detect a biased sampler (p={pvalue:.2g})"
