"""The offline tree ceiling: its shapes and rounds, worked by hand."""

import numpy as np
import pytest

from omnidraft_mlx.bench.tree_ceiling import Shape, drafter_forward_s, main, rounds_to_cover, shapes
from omnidraft_mlx.decode.drafter import BRANCHES


def test_shapes_count_their_nodes():
    assert Shape("chain", 1, 1, 5).nodes == 5
    assert Shape("branches", 1, 1 + BRANCHES, 3).nodes == 3 * (1 + BRANCHES)
    assert Shape("top-2", 2, 2, 3).nodes == 2 + 4 + 8
    assert all(s.nodes <= 20 for s in shapes(max_depth=8, max_nodes=20))
    assert {s.name for s in shapes(8, 20)} == {"chain", "branches", "top-2", "top-3"}


def test_rounds_hold_while_ranks_stay_inside_the_shape():
    # The drafter's first choice at 0, 1, 3, 4; its second at 2; its fifth at 5; then first choices.
    ranks = np.array([0, 0, 1, 0, 0, 4, 0, 0])
    # chain, depth 4: [0, 1] hold, the target adds 2; [3, 4] hold, the target adds 5; [6, 7] hold: 3 rounds.
    assert rounds_to_cover(ranks, Shape("chain", 1, 1, 4)) == 3
    # a one-token leaf at 2 holds (rank 1 < 4), the target adds 3; [4] holds, 5 is outside the leaves, the
    # target adds it; [6, 7]: 3 rounds, as the chain needed.
    assert rounds_to_cover(ranks, Shape("branches", 1, 1 + BRANCHES, 4)) == 3
    # top-2, depth 4: [0..3] hold, the target adds 4; [5] is rank 4: the target adds it; [6, 7]: 3 rounds.
    assert rounds_to_cover(ranks, Shape("top-2", 2, 2, 4)) == 3
    # top-2, depth 8: [0..4] hold, the target adds 5; [6, 7]: 2 rounds.
    assert rounds_to_cover(ranks, Shape("top-2", 2, 2, 8)) == 2
    # every round is one token where nothing holds
    assert rounds_to_cover(np.full(5, 9), Shape("top-3", 3, 3, 2)) == 5


def test_bad_input_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="no bench.json in"):
        main([str(tmp_path)])


def test_a_bench_without_drafted_rounds_is_a_one_line_error():
    plain = {"kind": "plain", "draft_forwards": None, "draft_s": 0.0}
    with pytest.raises(SystemExit, match="no rounds drafted"):
        drafter_forward_s([plain])
    assert drafter_forward_s([plain, {"kind": "ours", "draft_forwards": 4, "draft_s": 0.2}]) == pytest.approx(0.05)
