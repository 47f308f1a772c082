"""Draft-length policies on the tiny cross-vocabulary pair: every policy stays
lossless, and each one actually changes how far the drafter goes."""

import numpy as np
import pytest
from tiny_models import TEXT

from omnidraft_mlx.decode.drafter import drafted_and_kept
from omnidraft_mlx.decode.head import replay_depths, replay_recent
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.policy import PolicyConfig, make_policy
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.learn.adapt import head_labels
from omnidraft_mlx.learn.distill import make_example
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages

PROMPTS = [TEXT[i : i + 60] for i in range(0, 1800, 150)]


def run(pair, policy, prompts, max_tokens=40):
    total, outs = SpecStats(), []
    for prompt in prompts:
        msgs = user_messages(prompt)
        dp, tp = encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)
        stats = SpecStats()
        cfg = SpecConfig(k=policy.cfg.k, max_tokens=max_tokens, sources="drafter", guard=False)
        outs.append([t for new, _ in speculative_generate(pair, dp, tp, cfg, stats, policy) for t in new])
        for f in ("rounds", "drafted", "accepted", "proposed", "emitted"):
            setattr(total, f, getattr(total, f) + getattr(stats, f))
    return outs, total


@pytest.mark.parametrize("name", ["confidence", "heuristic", "learned"])
def test_policies_stay_lossless(cross, tiny, name):
    tm, tt = tiny["target"]
    policy = make_policy(PolicyConfig(name=name, k=3, warmup=64))
    outs, _ = run(cross, policy, PROMPTS[:6])
    for prompt, out in zip(PROMPTS, outs):
        ids = encode_prompt(tt, user_messages(prompt), True)
        assert out == list(plain_generate(tm, tt, ids, PlainStats(), max_tokens=40))


def test_confidence_policy_drafts_less_than_fixed(cross):
    _, fixed = run(cross, make_policy(PolicyConfig(name="fixed", k=6)), PROMPTS[:4])
    _, confident = run(cross, make_policy(PolicyConfig(name="confidence", k=6, max_k=6, p_min=0.9)), PROMPTS[:4])
    assert confident.drafted / confident.rounds < fixed.drafted / fixed.rounds


def test_heuristic_policy_adapts_length():
    policy = make_policy(PolicyConfig(name="heuristic", k=4, max_k=8))
    policy.observe([], [True, True, True, True])
    assert policy.max_len == 6
    policy.observe([], [True, False])
    assert policy.max_len == 5


def test_gamma_auto_follows_measured_costs():
    """gamma = 1 - (s per drafter forward + s to verify a draft token) * (tokens per s):
    a cheap drafter drafts further; the verification term is the slope of verify time
    over draft length, zero until the lengths vary."""
    cheap, dear, fixed = (make_policy(PolicyConfig(name="learned", gamma=g)) for g in (None, None, 0.4))
    assert cheap.gamma == dear.gamma == 0.5  # before anything is measured: the start value
    for _ in range(6):
        cheap.time_round(draft_s=0.03, forwards=3, verify_s=0.2, drafted=3, round_s=0.23, tokens=3)  # 13 tok/s
        dear.time_round(draft_s=0.3, forwards=3, verify_s=0.2, drafted=3, round_s=0.5, tokens=3)  # 6 tok/s
        fixed.time_round(draft_s=0.3, forwards=3, verify_s=0.2, drafted=3, round_s=0.5, tokens=3)
    assert cheap.gamma == pytest.approx(1 - 0.01 * 3 / 0.23)  # 10 ms per forward, lengths all 3
    assert dear.gamma == pytest.approx(1 - 0.1 * 3 / 0.5)  # 100 ms per forward
    assert fixed.gamma == 0.4
    # Verification taking 0.2 s + 20 ms per draft token, over rounds of 1 to 5 tokens.
    varied = make_policy(PolicyConfig(name="learned"))
    for i in range(20):
        n = 1 + i % 5
        varied.time_round(
            draft_s=0.01 * n, forwards=n, verify_s=0.2 + 0.02 * n, drafted=n, round_s=0.23 + 0.03 * n, tokens=n
        )
    w = 0.9 ** np.arange(20)[::-1]  # the decaying weights of the rounds
    ns = 1 + np.arange(20) % 5
    tokens_per_s = (w * ns).sum() / (w * (0.23 + 0.03 * ns)).sum()
    assert varied.gamma == pytest.approx(1 - (0.01 + 0.02) * tokens_per_s)


def test_gamma_auto_is_measured_while_decoding(cross):
    policy = make_policy(PolicyConfig(name="learned", k=4, warmup=32))
    run(cross, policy, PROMPTS[:3])
    assert policy.cost.rounds > 4 and 0.0 <= policy.gamma <= 1.0 and policy.gamma != policy.cfg.start_gamma


def test_learned_head_learns_acceptance(cross):
    """After online training the head ranks accepted tokens above rejected ones."""
    policy = make_policy(PolicyConfig(name="learned", k=6, warmup=10**9))  # collect, never stop early
    run(cross, policy, PROMPTS)
    x, y = np.stack(policy.head.features), np.array(policy.head.labels)
    assert 0.2 < y.mean() < 0.95 and policy.head.net is not None
    policy.head.train(steps=200)
    import mlx.core as mx

    scores = np.array(policy.head.net(mx.array(x)))
    pos, neg = scores[y > 0.5], scores[y < 0.5]
    auc = (pos[:, None] > neg[None, :]).mean()
    assert auc > 0.75, f"head AUC {auc:.2f}"
    # Plain BCE keeps P(accept) calibrated: the stopping rule multiplies these probabilities.
    assert abs(float(mx.sigmoid(mx.array(scores)).mean()) - y.mean()) < 0.1


def test_saved_head_on_other_features_is_not_reused(cross, tmp_path):
    with_hidden = make_policy(PolicyConfig(name="learned", k=4, hidden=True))
    run(cross, with_hidden, PROMPTS[:2])
    assert with_hidden.head.features[0].shape[0] > 3
    with_hidden.head.save(tmp_path / "head.npz")
    fresh = make_policy(PolicyConfig(name="learned", k=4))
    fresh.head.load(tmp_path / "head.npz")
    assert fresh.head.net is None and not fresh.head.labels
    # A head saved before its features were named (an older profile's, without the recent acceptance).
    cheap = make_policy(PolicyConfig(name="learned", k=4))
    run(cross, cheap, PROMPTS[:2])
    cheap.head.save(tmp_path / "cheap.npz")
    with np.load(tmp_path / "cheap.npz") as data:
        older = {k: data[k] for k in data.files if k != "feature_names"}
    older["features"] = older["features"][:, :3]
    np.savez(tmp_path / "older.npz", **older)
    for name, restarts in (("cheap.npz", False), ("older.npz", True)):
        loaded = make_policy(PolicyConfig(name="learned", k=4))
        loaded.head.load(tmp_path / name)
        assert (loaded.head.net is None) == restarts


def test_labels_follow_the_text(cross):
    vmap = cross.vmap
    enc_d = lambda s: list(cross.draft_tok.encode(s, add_special_tokens=False))  # noqa: E731
    enc_t = lambda s: list(cross.target_tok.encode(s, add_special_tokens=False))  # noqa: E731
    drafted = enc_d("return x + 1")
    assert drafted_and_kept(vmap, drafted, enc_t("return x + 1\n")) == [True] * len(drafted)
    labels = drafted_and_kept(vmap, drafted, enc_t("return y"))
    assert labels[0] is True and labels[-1] is False


def test_learned_policy_saves_and_resumes(cross, tmp_path):
    policy = make_policy(PolicyConfig(name="learned", k=4, warmup=50))
    run(cross, policy, PROMPTS[:4])
    policy.head.save(tmp_path / "head.npz")
    resumed = make_policy(PolicyConfig(name="learned", k=4, warmup=50))
    resumed.head.load(tmp_path / "head.npz")
    assert resumed.ready and resumed.head.labels == policy.head.labels and resumed.head.rounds == policy.head.rounds
    import mlx.core as mx

    x = mx.array(np.stack(policy.head.features[:8]))
    assert np.allclose(np.array(resumed.head.net(x)), np.array(policy.head.net(x)), atol=1e-5)


def test_oracle_drafts_exactly_as_far_as_the_reply_agrees(cross, tiny):
    """The bench's oracle (shown the target's greedy reply) stays lossless, drafts
    past k where the drafter is right, and pays no forward after a token whose
    text leaves the reply: a round ends at its first "stop", and verification
    keeps no token the oracle stopped at."""
    tm, tt = tiny["target"]
    oracle = make_policy(PolicyConfig(name="oracle", k=3, max_k=8))
    rounds, decisions = [], []
    begin, wants_more, observe = oracle.begin_round, oracle.wants_more, oracle.observe
    oracle.begin_round = lambda: (decisions.clear(), begin())
    oracle.wants_more = lambda *a, **kw: decisions.append(wants_more(*a, **kw)) or decisions[-1]
    oracle.observe = lambda feats, kept: (rounds.append((list(decisions), kept)), observe(feats, kept))
    for prompt in PROMPTS[:4]:
        msgs = user_messages(prompt)
        reply = list(plain_generate(tm, tt, encode_prompt(tt, msgs, True), PlainStats(), max_tokens=40))
        oracle.start(reply, cross.vmap)
        out = []
        cfg = SpecConfig(k=3, max_tokens=40, sources="drafter", guard=False)
        for new, _ in speculative_generate(
            cross, encode_prompt(cross.draft_tok, msgs, True), encode_prompt(tt, msgs, True), cfg, SpecStats(), oracle
        ):
            out += new
            oracle.advance(new)
        assert out == reply
    for said, kept in rounds:  # a round's last token is asked about only when it ends by a stop
        stopped = said[-1:] == [False]
        assert all(said[:-1]) and len(kept) == len(said) + (not stopped)  # a forward after each "go on" only
        assert not (stopped and kept[-1])  # the token it stopped at was not kept
    assert max(len(kept) for _, kept in rounds) > 3  # it drafts past k where the drafter is right


def test_replay_depths_follow_greedy_rounds():
    # rounds of up to 3: kept, kept, rejected | kept x3, then the target's bonus token | rejected | kept
    kept = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1], bool)
    assert replay_depths(kept, 3).tolist() == [0, 1, 2, 0, 1, 2, -1, 0, 0]


def test_replay_recent_is_the_mean_of_earlier_rounds():
    # rounds of up to 3 as above; decay 0.5: each label halves the distance to it
    kept = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1], bool)
    depths = replay_depths(kept, 3)
    after_round1 = ((1 * 0.5 + 0.5) * 0.5 + 0.5) * 0.5  # 1.0, then labels 1, 1, 0
    after_round2 = ((after_round1 * 0.5 + 0.5) * 0.5 + 0.5) * 0.5 + 0.5  # then 1, 1, 1; the bonus carries none
    after_round3 = after_round2 * 0.5  # then 0
    expected = [1.0] * 3 + [after_round1] * 4 + [after_round2, after_round3]
    np.testing.assert_allclose(replay_recent(kept, depths, 0.5), expected)


def test_head_labels_replay_what_decoding_gives_the_head(tiny):
    """Batch mode's teacher-forced replay of a reply gives the acceptance head the
    same labels and features that speculative decoding of it gives, round by round
    (a same-vocabulary pair, where a kept token is the reply's own token; chains: a
    branch that holds ends its round further on than a chain's would)."""
    (dm, dt), (tm, tt) = tiny["same"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    live = make_policy(PolicyConfig(name="learned", k=4, max_k=4, warmup=10**9))  # always 4 a round
    replayed = make_policy(PolicyConfig(name="learned", max_k=4))
    compared = []
    for prompt in PROMPTS[:4]:
        msgs = user_messages(prompt)
        dp, tp = encode_prompt(dt, msgs, True), encode_prompt(tt, msgs, True)
        before = len(live.head.labels)
        reply = [
            t
            for new, _ in speculative_generate(
                pair,
                dp,
                tp,
                SpecConfig(k=4, max_tokens=40, sources="drafter", guard=False, tree=False),
                SpecStats(),
                live,
            )
            for t in new
        ]
        features, kept = head_labels(pair, make_example(pair, dp, tp, reply), replayed)
        n = min(len(kept), len(live.head.labels) - before) - 4  # the last round may be cut short by max_tokens
        assert kept[:n].tolist() == [bool(x) for x in live.head.labels[before : before + n]]
        np.testing.assert_allclose(features[:n], np.stack(live.head.features[before : before + n]), atol=2e-3)
        compared += kept[:n].tolist()
    assert len(compared) > 60 and 0 < np.mean(compared) < 1
    assert len(set(np.stack(live.head.features)[:, -1].tolist())) > 5  # the recent acceptance moved, and matched
