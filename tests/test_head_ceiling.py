"""The offline head ceiling: its examples, runs and rounds worked by hand, and a head that learns."""

import mlx.core as mx
import numpy as np
import pytest
from architectures import BASE, VOCAB, build

from omnidraft_mlx.bench.head_ceiling import (
    HEADS,
    MAX_CHAIN,
    Recording,
    chain_examples,
    head_chains,
    kept_runs,
    next_token_table,
    record,
    rounds,
    train_head,
)


def one_reply(tokens, labels) -> Recording:
    tokens, labels = np.array(tokens, np.int32), np.array(labels, np.int32)
    return Recording(
        ["t"],
        np.zeros((len(tokens), 4), np.float16),
        tokens,
        labels,
        np.array([0, len(tokens)]),
        np.array([0, len(labels)]),
    )


def test_a_chain_is_known_only_while_the_reply_is_the_targets_own():
    # The target would write 5, 6, 7, 8 after tokens ... ; the reply (a reference) wrote 5, 9, 7.
    rec = one_reply([5, 9, 7], [5, 6, 7, 8])
    fed, wanted, known = chain_examples(rec, 3)
    # From position 0: fed 5 (the reply's), wanted the target's 6; then fed 9, which the target would not
    # have written: what it writes after 9 is unknown, and so is everything after.
    assert fed[0].tolist() == [5, 9, 7] and wanted[0].tolist() == [6, 7, 8]
    assert known[0].tolist() == [True, False, False]
    # From position 2: fed 7 (wanted 8), then the reply ends.
    assert known[2].tolist() == [True, False, False]
    # Position 1 starts on the reference's 9 (any fed first token is fine), wants 7; then fed 7 (the target's
    # own), wants 8.
    assert known[1].tolist() == [True, True, False] and wanted[1, :2].tolist() == [7, 8]


def test_runs_and_rounds_replay_greedy_speculation():
    labels = np.array([1, 2, 3, 4, 5, 6])  # the reply is the target's own: token j is labels[j]
    guesses = np.zeros((5, MAX_CHAIN), np.int64)
    guesses[0, :3] = [2, 3, 9]  # from 0: 2 and 3 kept, 9 is not 4
    guesses[3, :2] = [5, 6]  # from 3: both kept, then the reply ends
    runs = kept_runs(guesses, labels)
    assert runs.tolist() == [2, 0, 0, 2, 0]
    assert rounds(runs, k=3) == 2  # round at 0 writes 3 tokens, round at 3 writes 3: 5 positions covered
    assert rounds(runs, k=1) == 3  # 0 -> 2, 2 -> 3, 3 -> 5
    assert rounds(np.zeros(4, int), k=5) == 4


def test_the_table_keeps_the_most_frequent_next_token():
    rec = one_reply([3, 4, 3, 4, 3], [0, 7, 1, 7, 1, 8])
    table = next_token_table(rec, vocab=10)
    assert table[3] == 7 and table[4] == 1 and table[5] == 5  # 3 -> 7 twice, 8 once; 5 never seen


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_a_head_learns_a_tiny_targets_next_tokens(kind):
    target = build("llama")
    rng = np.random.default_rng(0)
    conversations = [("t", rng.integers(0, VOCAB, 4).tolist(), rng.integers(0, VOCAB, 24).tolist()) for _ in range(24)]
    rec = record(target, conversations)
    assert len(rec.tokens) == 24 * 24 and len(rec.labels) == 24 * 25
    embed = target.model.embed_tokens
    draft_ids = np.arange(VOCAB)
    head = HEADS[kind](BASE["hidden_size"], target.lm_head.weight.astype(mx.float32))

    def agreement():
        hits = [kept_runs(head_chains(head, embed, h, t, draft_ids), lab) >= 1 for h, t, lab in rec.of_all()]
        return float(np.mean(np.concatenate(hits)))

    before = agreement()
    losses = train_head(head, embed, rec, draft_ids, steps=150)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])
    assert agreement() > before + 0.2
