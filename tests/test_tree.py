"""Token trees on tiny random models of each family (qwen2, llama, gemma3_text with a
sliding window shorter than the prompt): one forward over a tree gives every node the
logits a token-by-token decode of its own path gives, and the caches compacted to
the accepted path continue exactly as if only that path had been fed. Batched
(batch.py): rows of different lengths, trees and chains in one forward, each row
as its own forward. A tree is a value, and a target that verifies chains only
(recurrent layers) verifies the cut tree its round accepts along."""

import dataclasses

import architectures
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text, lfm2, llama, qwen2
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from omnidraft_mlx.decode.batch import forward_rounds, forward_trees
from omnidraft_mlx.decode.kvcache import KVSlot, keep_path, make_cache, prefill
from omnidraft_mlx.decode.layouts import PositionsRoPE, fit_tree, forward_tree, tree_forward
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.decode.widths import MOST
from omnidraft_mlx.pair import make_pair

VOCAB, WINDOW = 97, 8
BASE = dict(
    hidden_size=128,
    num_hidden_layers=3,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILIES = {
    "qwen2": (qwen2, {}),
    "llama": (llama, {}),
    "gemma3_text": (
        gemma3_text,
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, sliding_window_pattern=3),
    ),
}
PREFIX = np.random.default_rng(0).integers(0, VOCAB, 21).tolist()  # longer than the window
# Main chain 5 -> 6 -> 7 -> 8, branches off the root, off node 0 and off a branch.
TREE = TokenTree.of([5, 6, 7, 8], [[9, 10, 11], [5, 12], [5, 6, 13, 14], [9, 15]])


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    arch, extra = FAMILIES[request.param]
    mx.random.seed(1)
    m = arch.Model(arch.ModelArgs.from_dict({**BASE, **extra, "model_type": request.param}))
    mx.eval(m.parameters())
    return m


def stepwise(model, ids: list[int]) -> mx.array:
    """Logits after each of ids, fed one at a time into a fresh cache."""
    cache = make_cache(model)
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in ids])


def test_tree_structure_merges_shared_prefixes():
    assert TREE.tokens[:4] == (5, 6, 7, 8) and TREE.chain == 4
    assert len(TREE.tokens) == 4 + 3 + 1 + 2 + 1  # [5, ...] and [5, 6, ...] merged into the chain
    assert TREE.children(-1) == [0, 4]
    assert TREE.on_chain([0, 1, 9]) == 2 and TREE.on_chain([4, 5]) == 0
    assert TREE.new_nodes([9, 10, 16, 17]) == 2 and TREE.new_nodes([5, 6]) == 0
    depth, anc = TREE.rows()
    assert depth.tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 2, 3, 4, 2]
    assert anc[10].nonzero()[0].tolist() == [0, 1, 2, 9, 10]  # row 10: node 9, [5, 6, 13, 14]'s last


def test_a_tree_is_a_value():
    chain = TokenTree.of([5, 6, 7, 8])
    grown = chain.add([9, 10])
    assert chain == TokenTree.of([5, 6, 7, 8]) and grown.tokens == (5, 6, 7, 8, 9, 10)
    assert grown.parents == (-1, 0, 1, 2, -1, 4) and grown.add([5, 6]) is grown
    assert TREE.main_chain() == chain and len(TREE.tokens) == 11  # the cut is a new tree
    with pytest.raises(dataclasses.FrozenInstanceError):
        TREE.tokens = ()


def test_one_forward_gives_each_node_its_own_path_logits(model):
    cache = make_cache(model)
    prefill(model, cache, PREFIX)
    root = 3
    out = tree_forward(model, cache, root, TREE)
    assert out.shape[0] == len(TREE.tokens) + 1
    assert cache[0].offset == len(PREFIX) + len(TREE.tokens) + 1
    full = stepwise(model, PREFIX + [root])
    assert mx.allclose(out[0], full[-1], atol=1e-4).item()
    for node in range(len(TREE.tokens)):
        ids = PREFIX + [root] + [TREE.tokens[i] for i in TREE.path(node)]
        assert mx.allclose(out[node + 1], stepwise(model, ids)[-1], atol=1e-4).item(), node
    # The model is left as it was: a later chain forward is the plain one.
    assert "make_mask" not in vars(cache[0])


@pytest.mark.parametrize("node", [3, 6, 10, 7])
def test_cache_compacted_to_the_accepted_path_continues_exactly(model, node):
    cache = make_cache(model)
    prefill(model, cache, PREFIX)
    start = cache[0].offset + 1  # the root, then the tree's nodes
    tree_forward(model, cache, 3, TREE)
    path = TREE.path(node)
    keep_path(cache, start, path)
    for c in cache:
        c.trim(c.offset - start - len(path))
    ids = PREFIX + [3] + [TREE.tokens[i] for i in path]
    after = model(mx.array([[40, 41]]), cache=cache)[0]
    assert mx.allclose(after, stepwise(model, ids + [40, 41])[-2:], atol=1e-4).item()


def test_quantized_caches_compact_too(model):
    if any(getattr(c, "window", None) for c in make_cache(model)):
        pytest.skip("sliding-window layers keep full-precision caches")
    cache = make_cache(model)
    prefill(model, cache, PREFIX)
    cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
    assert isinstance(cache[0], QuantizedKVCache)
    start = cache[0].offset + 1
    tree_forward(model, cache, 3, TREE)
    path = TREE.path(6)
    keep_path(cache, start, path)
    for c in cache:
        c.trim(c.offset - start - len(path))
    reference = make_cache(model)
    prefill(model, reference, PREFIX)
    reference = [c.to_quantized(group_size=32, bits=8) for c in reference]
    expected = model(mx.array([[3, 9, 10, 11, 40]]), cache=reference)[0][-1]
    after = model(mx.array([[40]]), cache=cache)[0][-1]
    assert mx.allclose(after, expected, atol=1e-3).item()


# Rows of a batch: prefixes of different lengths (past the window and within it), a tree,
# a chain and a plain step (no draft).
ROWS = [(PREFIX, TREE), (PREFIX[:13], TokenTree.of([5, 6])), (PREFIX[:5], TokenTree.of([]))]


def slots_for(model, rows) -> list[KVSlot]:
    slots = [KVSlot.fresh(model) for _ in rows]
    for slot, (prefix, _) in zip(slots, rows):
        slot.extend(model, prefix)
    return slots


def test_a_batched_forward_gives_each_row_its_own_forward(model):
    solo, batched = slots_for(model, ROWS), slots_for(model, ROWS)
    alone = [forward_tree(model, slot, 3, tree) for slot, (_, tree) in zip(solo, ROWS)]
    together = forward_trees(model, batched, [3] * len(ROWS), [tree for _, tree in ROWS])
    for a, b, (_, tree) in zip(alone, together, ROWS):
        assert b.shape == (len(tree.tokens) + 1, VOCAB)
        assert mx.allclose(a, b, atol=1e-4).item()
    # Each row's cache kept its own nodes: compacted to a path, it continues as the solo one.
    for a, b, (_, tree), node in zip(solo, batched, ROWS, (6, 1, None)):
        assert a.tokens == b.tokens
        path = tree.path(node) if node is not None else []
        for slot in (a, b):
            slot.keep_path(tree, path)
        after = [model(mx.array([[40, 41]]), cache=slot.cache)[0] for slot in (a, b)]
        assert mx.allclose(*after, atol=1e-4).item()
    assert not isinstance(model.model.layers[0].self_attn.rope, PositionsRoPE)  # the model is left as it was


def test_an_exception_leaves_the_caches_as_they_were(model):
    cache = make_cache(model)
    prefill(model, cache, PREFIX)
    before = [c.offset for c in cache]
    slots = slots_for(model, ROWS)
    row_lengths = [len(slot.tokens) for slot in slots]

    class Failing:  # the last layer fails after the others wrote their caches
        def __init__(self, layer):
            self.layer = layer

        def __getattr__(self, name):
            return getattr(self.layer, name)

        def __call__(self, *args, **kwargs):
            raise MemoryError("out of memory")

    layers = model.model.layers
    last = layers[-1]
    layers[-1] = Failing(last)
    try:
        with pytest.raises(MemoryError):
            tree_forward(model, cache, 3, TREE)
        with pytest.raises(MemoryError):
            forward_trees(model, slots, [3] * len(ROWS), [tree for _, tree in ROWS])
    finally:
        layers[-1] = last
    assert [c.offset for c in cache] == before
    assert "make_mask" not in vars(cache[0])
    assert [[c.offset for c in slot.cache] for slot in slots] == [[n] * len(cache) for n in row_lengths]
    assert [len(slot.tokens) for slot in slots] == row_lengths


def test_a_tree_cut_for_a_recurrent_target_is_the_tree_accepted(tiny):
    """A target with recurrent layers verifies drafts as chains (a branch's state would depend on
    its path): the round's tree is cut before its forward, and that cut tree is the one take()
    accepts along and compacts the cache to (the drafted tree's branch nodes have no logits and
    would misplace the kept tokens). Branches are kept every round they are offered (every draft
    length costs the same here); greedy output equals plain decoding."""
    tok = tiny["target"][1]
    mx.random.seed(2)
    target = lfm2.Model(lfm2.ModelArgs.from_dict(dict(architectures.config("lfm2"), vocab_size=len(tok.vocab))))
    mx.eval(target.parameters())
    pair = make_pair(tiny["same"][0], tok, target, tok)
    cfg = SpecConfig(k=3, max_tokens=16, tree=True, sources=("drafter",), guard=False)
    prompt = tok.encode("def add_7(x):\n    return x + 7\n\nprint(add_")
    scheduler = Scheduler()
    scheduler.costs.seed(dict.fromkeys(range(1, MOST + 1), 1.0), rounds=100)
    decoding, out, cut = Decoding(pair, prompt, prompt, cfg, SpecStats(), scheduler=scheduler), [], 0
    while not decoding.done:
        tree = decoding.plan()
        drafted = decoding.round.draft.tree()
        assert tree == fit_tree(target, decoding.target.cache, drafted) == drafted.main_chain()
        cut += not drafted.is_chain
        if not drafted.is_chain:  # the drafted tree is not one this target verifies
            with pytest.raises(ValueError, match="main chain"):
                forward_trees(target, [decoding.target], [decoding.y], [drafted])
        ((logits, seconds),) = forward_rounds([decoding], [tree])
        out += decoding.take(logits, seconds)[0]
    decoding.close()
    plain = generate_step(mx.array(prompt), target, max_tokens=len(out), prompt_cache=make_prompt_cache(target))
    assert cut > 0 and out == [int(t) for t, _ in plain]
