"""Replies decoded together (batch.py, as `omnidraft serve` does with concurrent requests)
on the tiny cross-vocabulary pair: each reply equals the same reply decoded alone,
greedy and sampled, whatever else is in the batch, and a reply that leaves the batch
early leaves the others unchanged."""

import pytest

from omnidraft_mlx.decode.batch import batchable
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_together, speculative_generate
from omnidraft_mlx.prompts import encode_prompt, user_messages

PROMPTS = [
    "def add_7(x):\n    return x + 7\n\nprint(add_7(21))  # two\n\ndef add_1",
    "print(add_3(9))  # four\n",
    "x",
    "def add_",
]


def settings(temp: float, seed: int, k: int = 3, max_tokens: int = 40) -> SpecConfig:
    # A fixed draft each round (no timing-dependent choices): a sampled reply then depends
    # only on its seed and the target's logits.
    return SpecConfig(k=k, temp=temp, seed=seed, max_tokens=max_tokens, sources=("drafter",), guard=False)


def prompts(pair, text):
    msgs = user_messages(text)
    return encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)


def alone(pair, text, cfg, stats: SpecStats | None = None) -> list[int]:
    return [t for new, _ in speculative_generate(pair, *prompts(pair, text), cfg, stats or SpecStats()) for t in new]


def together(pair, texts, cfgs, leave_after: dict | None = None, stats: list | None = None) -> list[list[int]]:
    """Each prompt's reply, all decoded in shared target forwards by one scheduler; leave_after[i] =
    rounds after which reply i leaves the batch (a client that went away)."""
    scheduler, stats = Scheduler(), stats or [SpecStats() for _ in texts]
    decodings = [
        Decoding(pair, *prompts(pair, text), cfg, s, scheduler=scheduler) for text, cfg, s in zip(texts, cfgs, stats)
    ]
    assert batchable([d.target for d in decodings])  # one forward for all, not one each
    batch, replies = list(decodings), {id(d): [] for d in decodings}
    for rounds, taken in enumerate(decode_together(batch), 1):
        for i, (new, _) in taken.items():
            replies[id(batch[i])] += new
        for i, after in (leave_after or {}).items():
            if rounds == after:
                batch.remove(decodings[i])
    for d in decodings:
        d.close()
    return [replies[id(d)] for d in decodings]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_replies_decoded_together_equal_their_solo_decodes(cross, temp):
    cfgs = [settings(temp, seed, k, n) for seed, k, n in zip((1, 2, 3, 4), (3, 1, 4, 2), (40, 25, 33, 12))]
    expected = [alone(cross, text, cfg) for text, cfg in zip(PROMPTS, cfgs)]
    assert together(cross, PROMPTS, cfgs) == expected
    assert len({len(r) for r in expected}) > 1  # replies of different lengths: rows leave the batch at different rounds


def test_a_reply_that_leaves_early_leaves_the_others_unchanged(cross):
    cfgs = [settings(0.0, 0)] * 3
    expected = [alone(cross, text, cfg) for text, cfg in zip(PROMPTS, cfgs)]
    replies = together(cross, PROMPTS[:3], cfgs, leave_after={0: 2})
    assert replies[1:] == expected[1:3]
    assert replies[0] == expected[0][: len(replies[0])] and len(replies[0]) < len(expected[0])


def test_one_scheduler_serves_replies_interleaved_round_by_round(cross):
    """A round's state travels with the round and a reply's with the reply, so one scheduler serves
    replies interleaved round by round (each proposed, then each settled): each makes what it makes
    alone (one fixed draft a round: the same rounds too; every source under the guard: the same text)."""
    for cfgs in ([settings(1.0, seed) for seed in (5, 6)], [SpecConfig(max_tokens=40)] * 2):
        solo, mixed = [SpecStats() for _ in cfgs], [SpecStats() for _ in cfgs]
        expected = [alone(cross, text, cfg, s) for text, cfg, s in zip(PROMPTS[:2], cfgs, solo)]
        assert together(cross, PROMPTS[:2], cfgs, stats=mixed) == expected
        if cfgs[0].sources == ("drafter",):
            assert [s.by_source for s in mixed] == [s.by_source for s in solo]
