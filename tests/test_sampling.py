"""Sampling is lossless in `exact` mode: a goodness-of-fit test of whole
generated sequences against the target's own distribution, computed exactly
by enumeration on tiny models with different tokenizers, for drafts from the
model drafter (q' from its distribution), as a chain and as a token tree (its
next-best tokens as point-mass branches), decoded beside another request in
shared target forwards (batch.py), and from context lookup (a point mass).
The same test must catch a deliberately biased variant, or it proves nothing."""

import numpy as np
import pytest
from test_recurrent import build
from test_widths import padding_scheduler

import omnidraft_mlx.decode.speculative as spec
from omnidraft_mlx.bench.sampling_bias import exact_sequence_probs, fit, position_checks, sample_sequences
from omnidraft_mlx.pair import make_pair, vocab_size
from omnidraft_mlx.prompts import encode_prompt, user_messages

LENGTH, TEMP, TOP_P, SAMPLES = 3, 1.0, 0.95, 1500
CASES = {
    "drafter": ("def add_", "drafter"),  # ~50 likely continuations: numbers, then "(x"
    "tree": ("def add_", "drafter"),  # the same, with the drafter's branches
    "batched": ("def add_", "drafter"),  # the same, each beside another request's reply in one forward
    # "add_" was followed by "1(x)" before: lookups propose it, the target often disagrees.
    "lookup": ("def add_1(x):\n    return x + 1\n\ndef add_", "context"),
    # The drafter's one token padded with the context's continuation of it (a point mass): the
    # tiny target writes "5(x" now and then, and "6(x", "53(", "52("... ("1" is followed by "0"
    # there, so a "1(x" seen before never held after a drafted "1").
    "padded": ("def add_5(x):\n    return x + 5\n\ndef add_", "drafter,context"),
    # A hybrid target (gated delta layers beside attention) and a noisy copy of it drafting: the
    # recurrent states roll back to each accepted length (test_recurrent.py).
    "hybrid": ("def add_", "drafter"),
}


@pytest.fixture(scope="module", params=list(CASES))
def setup(request, tiny):
    prompt, sources = CASES[request.param]
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    if request.param == "hybrid":
        tm, dm, dt = build("qwen3_next"), build("qwen3_next", noise=0.1), tt
        for m in (tm, dm):
            m.lm_head.weight = m.lm_head.weight * 12.0  # peaked: a few likely continuations
    pair = make_pair(dm, dt, tm, tt)
    tp = encode_prompt(tt, user_messages(prompt), True)
    eos = set(tt.eos_token_ids) | {pair.vmap.target_eos}

    padded, tree = request.param == "padded", request.param == "tree"
    beside = "print(add_" if request.param == "batched" else None

    def sample():
        return sample_sequences(
            pair,
            prompt,
            "exact",
            SAMPLES,
            LENGTH,
            TEMP,
            TOP_P,
            k=1 if padded else 3,
            sources=sources,
            # Told that wider verifies faster, the tree keeps its branches whatever this machine measured
            # (under mlx 0.31 the measured curve kept a branch in an eighth of the rounds).
            scheduler=padding_scheduler if padded or tree else None,
            tree=tree,
            beside=beside,
        )

    return sample, exact_sequence_probs(tm, tp, eos, LENGTH, TEMP, TOP_P), request.param


def test_exact_mode_matches_target_distribution(setup):
    sample, expected, case = setup
    counts, stats = sample()
    pvalue, categories = fit(counts, expected)
    assert categories >= 5  # a test with a handful of outcomes would prove little
    assert 0 < stats.accepted < stats.proposed  # both branches of the rule were exercised
    if case == "padded":  # and on the padding: held (accepted with p(t)) and rejected
        assert 0 < stats.pad_held < stats.padded
    if case == "tree":  # trees were verified, and branches held where the chain's token was rejected
        assert stats.branched > stats.rounds // 2 and 0 < stats.branch_held
    else:
        assert stats.branched == 0
    assert pvalue > 1e-3, f"exact sampling deviates from the target (p={pvalue:.2g})"


def test_biased_variant_is_caught(setup, monkeypatch):
    """Sampling from p instead of the residual after a rejection: the classic bug."""
    sample, expected, _ = setup
    monkeypatch.setattr(spec, "residual", lambda p, q: p)
    counts, _ = sample()
    pvalue, _ = fit(counts, expected)
    assert pvalue < 1e-3, f"the test failed to detect a biased sampler (p={pvalue:.2g})"


def test_position_checks_score_each_token_where_the_target_sampled_it(tiny):
    """The check `sampling_bias --bench` runs on real pairs: its per-token log-probabilities
    add up to the sequence probabilities enumerated exactly, ended replies included."""
    (tm, tt) = tiny["target"]
    tp = encode_prompt(tt, user_messages("def add_"), True)
    eos = sorted(set(tt.eos_token_ids))
    expected = exact_sequence_probs(tm, tp, set(eos), LENGTH, TEMP, TOP_P)
    everything = np.ones(vocab_size(tm))
    everything[eos] = 0.0
    for reply in sorted(expected, key=expected.get, reverse=True)[:5]:
        checks = position_checks(tm, tp, list(reply), len(reply) < LENGTH, TEMP, TOP_P, eos, everything)
        assert np.isclose(checks[:, 2].sum(), np.log(expected[reply]), atol=1e-3)
        # Every token is "in the category" here: expected counts are 1 - P(end).
        assert checks[: len(reply), 0].sum() == len(reply)
        assert np.all((checks[:, 1] > 0) & (checks[:, 1] <= 1 + 1e-6))
        assert np.all(checks[:, 4] >= -1e-9)  # variances
