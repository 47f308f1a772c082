"""The cost of verifying each draft length, measured (widths.py, fit.VerifyCost), and
drafts padded with looked-up tokens to a length that verifies no slower: greedy
output stays the target's own (sampling with padding: test_sampling.py)."""

import json

import pytest
from test_lookup import REPEAT, decode

from omnidraft_mlx.decode import widths
from omnidraft_mlx.decode.fit import VerifyCost
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.widths import MOST, costs_path, interpolate, saved_costs, verify_costs
from omnidraft_mlx.loading import open_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages


def test_cheapest_length_is_a_longer_one_measured_no_slower():
    cost = VerifyCost(decay=0.95)
    for n, seconds in [(0, 0.5), (1, 0.65), (3, 0.95), (8, 1.2), (15, 0.94), (16, 1.1)]:
        cost.add(n, seconds)
    assert cost.seconds(15) == 0.94 and cost.seconds(1) == 0.65
    assert cost.cheapest_length(3, most=16) == 15  # 15 tokens verify faster than 3
    assert cost.cheapest_length(3, most=12) == 3  # ... unless the reply has no room for them
    assert cost.cheapest_length(0, most=16) == 0 and cost.cheapest_length(1, most=16) == 1
    assert cost.cheapest_length(5, most=16) == 5  # never measured: the linear fit's 0.84 s, below 0.94
    cost.add(15, 2.0)  # the machine changed: 15 now costs (0.95 * 0.94 + 2.0) / 1.95
    assert cost.cheapest_length(3, most=16) == 3


def test_costs_measured_once_per_model_shape_and_kept(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    (tm, _), (dm, _) = tiny["target"], tiny["draft"]
    assert saved_costs(tm) is None
    seconds = verify_costs(tm)
    assert sorted(seconds) == list(range(MOST + 1)) and all(s > 0 for s in seconds.values())
    saved = json.loads(costs_path().read_text())
    assert saved_costs(tm) == verify_costs(tm) == seconds  # read back, not measured again
    assert json.loads(costs_path().read_text()) == saved
    verify_costs(dm)  # another shape: its own entry
    assert len(json.loads(costs_path().read_text())) == 2


def test_lengths_not_measured_lie_on_the_line_between_their_neighbours():
    curve = interpolate({0: 1.0, 1: 1.1, 4: 0.8, 16: 2.0})
    assert sorted(curve) == list(range(MOST + 1))
    assert curve[0] == 1.0 and curve[4] == 0.8 and curve[16] == 2.0  # measured: kept (a dip too)
    assert curve[2] == pytest.approx(1.0) and curve[10] == pytest.approx(1.4)
    assert all(0.8 <= curve[n] <= 1.1 for n in range(1, 5))  # no bump that was not measured


def test_the_pair_opens_with_its_costs_measured_and_no_reply_measures(tiny_dirs, tmp_path, monkeypatch):
    """open_pair measures (once per machine); a reply's prefill then only reads the curve: with
    measuring made to fail, replies still decode, seeded from what open_pair saved."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    opened = open_pair(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), profile=False)
    seconds = saved_costs(opened.pair.target)
    assert seconds is not None and sorted(seconds) == list(range(MOST + 1))

    def no_measuring(*_):
        raise AssertionError("measured inside a reply")

    monkeypatch.setattr(widths, "measure", no_measuring)
    again = open_pair(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), profile=False)  # kept: not measured
    scheduler = Scheduler()
    out, stats = decode(again.pair, "def add_", scheduler=scheduler, max_tokens=8)
    assert len(out) == 8 and scheduler.measured
    seeded = {n: total for n, (weight, total) in scheduler.costs.by_length.items() if weight == 1.0}
    assert len(seeded) > MOST // 2 and seeded == {n: seconds[n] for n in seeded}  # lengths not verified since
    assert stats.prefill_s < 1.0


def padding_scheduler() -> Scheduler:
    """A scheduler told, firmly, that longer drafts verify faster: every draft is padded where a
    lookup has tokens."""
    scheduler = Scheduler()
    scheduler.costs.seed({n: 1.0 - 0.01 * n for n in range(17)}, rounds=1e6)
    scheduler.measured = True
    return scheduler


def test_padded_drafts_decode_the_target_greedy_output(cross, tiny):
    tm, tt = tiny["target"]
    for prompt in [REPEAT, "print(add_3(9))  # four\n"]:
        plain = list(
            plain_generate(tm, tt, encode_prompt(tt, user_messages(prompt), True), PlainStats(), max_tokens=40)
        )
        for sources in ["drafter,context", "context"]:
            out, stats = decode(cross, prompt, scheduler=padding_scheduler(), sources=sources, guard=True, k=2)
            assert out == plain
            assert 0 < stats.pad_held < stats.padded  # padding held, and was rejected
