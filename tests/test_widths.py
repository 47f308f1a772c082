"""The cost of verifying each draft length, measured (widths.py, fit.VerifyCost), and
drafts padded with looked-up tokens to a length that verifies no slower: greedy
output stays the target's own (sampling with padding: test_sampling.py)."""

import json

from test_lookup import REPEAT, decode

from omnidraft_mlx.decode.fit import VerifyCost
from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.widths import costs_path, verify_costs
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
    (tm, tt), (dm, _) = tiny["target"], tiny["draft"]
    ids = encode_prompt(tt, user_messages("def add_"), True)
    slot = KVSlot.fresh(tm)
    slot.extend(tm, ids[:-1])
    seconds = verify_costs(tm, slot)
    assert sorted(seconds) == list(range(17)) and all(s > 0 for s in seconds.values())
    assert slot.cache[0].offset == len(ids) - 1  # the cache holds the prompt again
    saved = json.loads(costs_path().read_text())
    assert verify_costs(tm, slot) == seconds  # read back, not measured again
    assert json.loads(costs_path().read_text()) == saved
    verify_costs(dm, KVSlot.fresh(dm))  # another shape: its own entry
    assert len(json.loads(costs_path().read_text())) == 2
    out = list(plain_generate(tm, tt, ids[len(slot.tokens) :], PlainStats(), max_tokens=12, prompt_cache=slot.cache))
    assert out == list(plain_generate(tm, tt, ids, PlainStats(), max_tokens=12))


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
