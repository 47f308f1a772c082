"""The offline policy replay: its cost fit and its rounds, worked by hand."""

import numpy as np
import pytest

from omnidraft_mlx.bench.policy_replay import Reply, RoundCost, fit_costs, main, replay
from omnidraft_mlx.decode.policy import FixedPolicy, OraclePolicy, PolicyConfig


def test_fit_costs_recovers_the_per_round_costs():
    truth = RoundCost(step_s=0.2, resync_s=0.03, forward_s=0.02, verify_s=0.25, token_s=0.01)
    records = [{"kind": "plain", "policy": "fixed", "k": None, "generate_s": 2.0, "tokens": 10, "rounds": 10}]
    for k, rounds in ((1, 40), (2, 30), (4, 20)):
        records.append(
            {
                "kind": "ours",
                "policy": "fixed",
                "k": k,
                "rounds": rounds,
                "draft_forwards": rounds * (k - 1),
                "draft_s": rounds * (truth.resync_s + truth.forward_s * (k - 1)),
                "proposed": rounds * k,
                "verify_s": rounds * (truth.verify_s + truth.token_s * k),
            }
        )
    fitted = fit_costs(records)
    assert np.allclose(list(vars(fitted).values()), list(vars(truth).values()))
    with pytest.raises(SystemExit, match="two fixed draft lengths"):
        fit_costs([r for r in records if r["k"] in (None, 2)])


def test_replay_plays_rounds_as_decoding_does():
    # The drafter is right at positions 0, 1, 3; wrong at 2 and 4.
    reply = Reply(
        "chat",
        target_tokens=5,
        drafted=np.arange(5),
        kept=np.array([True, True, False, True, False]),
        features=np.zeros((5, 4), np.float32),
    )
    cost = RoundCost(step_s=1.0, resync_s=0.3, forward_s=0.2, verify_s=1.0, token_s=0.1)
    # k2: [0, 1] both kept, the target adds position 2; then [3, 4], 3 kept, the target's token ends it.
    assert replay(reply, FixedPolicy(PolicyConfig(k=2)), cost) == pytest.approx((2 * 1.7, 2, 4))
    # Oracle: drafts 0, 1 and the wrong 2 (3 tokens, 2.0 s); then the 2 positions left (1.7 s).
    oracle = OraclePolicy(PolicyConfig(name="oracle", max_k=8))
    assert replay(reply, oracle, cost, oracle=True) == pytest.approx((2.0 + 1.7, 2, 5))


def test_bad_input_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="no bench.json in"):
        main([str(tmp_path)])
