"""Speculation on hybrid targets (recurrent layers: gated delta, Mamba-2, short convolutions)
is exact: the state after a rollback equals a forward over only the accepted tokens, and
greedy output equals mlx-lm's plain decoding, with drafts the target often rejects."""

import importlib
import itertools
import re
import sys
from importlib.metadata import version
from pathlib import Path

import architectures
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from packaging.requirements import Requirement

from omnidraft_mlx.decode import recurrent
from omnidraft_mlx.decode.batch import batch_forward
from omnidraft_mlx.decode.kvcache import KVSlot
from omnidraft_mlx.decode.layouts import batch_layout, forward_tree
from omnidraft_mlx.decode.promptcache import CacheUse, PromptCache
from omnidraft_mlx.decode.recurrent import StepsCache, layers
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_together, speculative_generate
from omnidraft_mlx.decode.tree import TokenTree
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import make_pair

V = 600  # the tiny target tokenizer's vocabulary
VOCAB = min(V, architectures.VOCAB)  # token ids every model here takes
# Tiny configurations, real layer kinds: attention beside recurrent layers where the family mixes them.
CONFIGS = {
    "qwen3_next": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-5,
        vocab_size=V,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=512,
        head_dim=16,
        full_attention_interval=2,
    ),
    "qwen3_5": dict(
        text_config=dict(
            model_type="qwen3_5_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-5,
            vocab_size=V,
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            max_position_embeddings=512,
            head_dim=16,
            full_attention_interval=2,
            tie_word_embeddings=False,
        )
    ),
    "lfm2": dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        full_attn_idxs=[1, 3],
        rope_theta=10000.0,
    ),
    "mamba2": dict(
        num_heads=8,
        head_dim=16,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=2,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
        time_step_limit=(0.0, float("inf")),
        time_step_rank=8,
    ),
    "nemotron_h": dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern="M*M-",
        head_dim=16,
        num_hidden_layers=4,
    ),
    "granitemoehybrid": dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        embedding_multiplier=1.0,
        attention_multiplier=0.25,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=2,
        mamba_conv_bias=True,
        shared_intermediate_size=128,
        num_local_experts=0,
        num_experts_per_tok=0,
        position_embedding_type="rope",
    ),
    "falcon_h1": dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
}


def build(family: str, seed: int = 0, noise: float = 0.0):
    """A random-weight model of the family; noise > 0: the seed-0 weights scaled by 1 + Gaussian noise (a drafter)."""
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(dict(CONFIGS[family], model_type=family)))
    if noise:
        from mlx.utils import tree_map

        model.update(tree_map(lambda w: w * (1 + noise * mx.random.normal(w.shape)), model.parameters()))
    model.eval()
    return model


# The other recurrence kinds, built by the architecture matrix's tiny settings: Mamba-1 (mamba, jamba's
# mixer), RG-LRU, RWKV-7, gated delta with three convolutions (olmo_hybrid), Mamba-2 (plamo2).
OTHER_KINDS = ["mamba", "jamba", "recurrent_gemma", "rwkv7", "olmo_hybrid", "plamo2"]


def any_build(family: str):
    return build(family) if family in CONFIGS else architectures.build(family)


def recurrent_states(cache: list) -> list:
    return [v for c in cache for s in layers(c) if isinstance(s, StepsCache) for v in s.cache]


@pytest.mark.parametrize("family", architectures.installed([*CONFIGS, *OTHER_KINDS]))
def test_state_after_rollback_equals_forward_over_accepted(family):
    model = any_build(family)
    ids = np.random.default_rng(0).integers(0, VOCAB, 40).tolist()
    slot = KVSlot.fresh(model)
    slot.extend(model, ids[:5])
    for accepted in (3, 0, 6, 1):  # of 6 draft tokens: rollbacks into the verify forward, to either end of it
        n = len(slot.tokens)
        forward_tree(model, slot, ids[n], TokenTree.of(ids[n + 1 : n + 7]))
        slot.rewind(n + 1 + accepted)
        ref = KVSlot.fresh(model)
        ref.extend(model, ids[: n + 1 + accepted])
        assert slot.tokens == ref.tokens
        states, expected = recurrent_states(slot.cache), recurrent_states(ref.cache)
        assert states and len(states) == len(expected)
        for x, y in zip(states, expected):
            assert mx.allclose(x, y, atol=1e-5).item()
    nxt = mx.array([[ids[len(slot.tokens)]]])
    assert mx.allclose(model(nxt, cache=slot.cache), model(nxt, cache=ref.cache), atol=1e-4).item()


@pytest.mark.parametrize("family", architectures.installed([*CONFIGS, *OTHER_KINDS]))
def test_rollback_from_a_fresh_cache(family):
    """A one-token prompt: the first forward is a verify forward on empty states."""
    model = any_build(family)
    ids = np.random.default_rng(2).integers(0, VOCAB, 8).tolist()
    slot, ref = KVSlot.fresh(model), KVSlot.fresh(model)
    tree = TokenTree.of(ids[1:6])
    forward_tree(model, slot, ids[0], tree)
    slot.keep_path(tree, [0, 1])
    ref.extend(model, ids[:3])
    assert slot.tokens == ref.tokens
    for x, y in zip(recurrent_states(slot.cache), recurrent_states(ref.cache)):
        assert mx.allclose(x, y, atol=1e-5).item()


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2", "rwkv7", "jamba"])
def test_mlx_lm_caches_on_the_same_model_leave_a_rollback_alone(family):
    """mlx-lm's own caches running the same model between a verify forward and its rollback (plain
    decoding beside speculation) record nothing into this package's caches."""
    model = any_build(family)
    ids = np.random.default_rng(3).integers(0, VOCAB, 12).tolist()
    slot, ref = KVSlot.fresh(model), KVSlot.fresh(model)
    slot.extend(model, ids[:5])
    forward_tree(model, slot, ids[5], TokenTree.of(ids[6:10]))
    kept = [dict(s.steps[2]) for c in slot.cache for s in layers(c) if isinstance(s, StepsCache)]
    mx.eval(model(mx.array([ids[:3]]), cache=make_prompt_cache(model)))
    assert kept == [s.steps[2] for c in slot.cache for s in layers(c) if isinstance(s, StepsCache)]
    slot.rewind(7)
    ref.extend(model, ids[:7])
    for x, y in zip(recurrent_states(slot.cache), recurrent_states(ref.cache)):
        assert mx.allclose(x, y, atol=1e-5).item()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_kernel_rows_keep_the_same_states(family, monkeypatch):
    """The Metal kernel's way to every state (a batch row per position, later positions masked),
    run here by mlx-lm's ops path: the same states after each rollback."""
    calls = []
    rows = recurrent._gated_delta_rows
    monkeypatch.setattr(recurrent, "_kernel_rows", lambda: True)
    monkeypatch.setattr(recurrent, "_gated_delta_rows", lambda *a: calls.append(1) or rows(*a))
    test_state_after_rollback_equals_forward_over_accepted(family)
    assert calls


def plain(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [int(t) for t, _ in steps]


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny["target"][1]


PROMPTS = ["def add_1(x):\n    return x + 1\n\nprint(add_", "print(add_3(9))  # four\ndef "]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_speculation_equals_plain_decoding(family, tok, tiny):
    """Drafts from a noisy copy of the target (itself a hybrid: its own cache rolls back too) and
    from context lookups; most are cut short, so the caches roll back every round."""
    target, drafter = build(family), build(family, noise=0.1)
    pair = make_pair(drafter, tok, target, tok)
    cfg = SpecConfig(k=4, max_tokens=24, sources=("drafter", "context"), guard=False)
    stats = SpecStats()  # over both prompts: some drafted tokens held, some rolled back
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        out = [t for new, _ in speculative_generate(pair, ids, ids, cfg, stats) for t in new]
        assert out == plain(target, ids, len(out))
    assert 0 < stats.accepted < stats.proposed


@pytest.mark.parametrize("family", architectures.installed([*CONFIGS, *OTHER_KINDS]))
def test_batched_rows_keep_their_own_states(family):
    """Rows of different lengths in one forward (batch.py): each row's logits and, after a rollback
    into the forward, its states equal those of its own forward."""
    model = any_build(family)
    ids = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    slots, alone = [KVSlot.fresh(model) for _ in range(3)], [KVSlot.fresh(model) for _ in range(3)]
    for i, (slot, ref) in enumerate(zip(slots, alone)):
        slot.extend(model, ids[i : i + 4 + 3 * i])
        ref.extend(model, ids[i : i + 4 + 3 * i])
    trees = [TokenTree.of(ids[20 + i : 20 + i + w]) for i, w in enumerate((5, 1, 3))]
    roots = ids[30:33]
    assert batch_layout(model) is not None
    outs = batch_forward(model, slots, roots, trees, batch_layout(model))
    for slot, ref, root, tree, out, keep in zip(slots, alone, roots, trees, outs, (2, 0, 3)):
        want = forward_tree(model, ref, root, tree)
        assert mx.allclose(out, want, atol=1e-4).item()
        slot.rewind(len(slot.tokens) - len(tree.tokens) + keep)
        ref.rewind(len(ref.tokens) - len(tree.tokens) + keep)
        assert slot.tokens == ref.tokens
        for x, y in zip(recurrent_states(slot.cache), recurrent_states(ref.cache)):
            assert mx.allclose(x, y, atol=1e-5).item()


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_prompt_cache_reuse_on_a_hybrid_equals_plain_decoding(family, tok):
    """Later turns from the prompt cache (its copies hold the current states only): a longer prompt
    reuses the stored sequence; a shorter one cannot (recurrent state does not trim) and starts
    afresh; all exact."""
    target = build(family)
    pair = make_pair(build(family, noise=0.1), tok, target, tok)
    cache, cfg, uses = PromptCache(), SpecConfig(k=3, max_tokens=12, guard=False), []
    first = tok.encode(PROMPTS[0])
    reply = [t for new, _ in cache.generate(pair, first, first, cfg, SpecStats()) for t in new]
    for ids in (first + reply + tok.encode(PROMPTS[1]), first):
        uses.append(CacheUse())
        out = [t for new, _ in cache.generate(pair, ids, ids, cfg, SpecStats(), use=uses[-1]) for t in new]
        assert out == plain(target, ids, len(out))
    assert uses[0].target_tokens > len(first) and cache.nbytes > 0


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "lfm2", "falcon_h1"])
def test_batched_and_tree_requests_equal_plain_decoding(family, tok, tiny):
    """Two replies verified together (each its own states) with tree drafting asked for (hybrids verify chains)."""
    target = build(family)
    pair = make_pair(tiny["same"][0], tok, target, tok)
    cfg = SpecConfig(k=3, max_tokens=16, tree=True, guard=False)
    prompts = [tok.encode(p) for p in PROMPTS]
    stats = [SpecStats() for _ in prompts]
    decodings = [Decoding(pair, p, p, cfg, s) for p, s in zip(prompts, stats)]
    outs = [[] for _ in prompts]
    for taken in decode_together(decodings):
        for i, (new, _) in taken.items():
            outs[i] += new
    for d in decodings:
        d.close()
    for p, out, s in zip(prompts, outs, stats):
        assert out == plain(target, p, len(out))
        assert s.branched == 0 and s.proposed > s.accepted


def mlx_lm_recurrences() -> dict:
    """What recurrent.py wraps or steps, as every loaded mlx-lm module has it: (module, name) -> object."""
    names = [*recurrent.WRAPPERS, "gated_delta_ops", "_gated_delta_step_ops", "_wkv7_step_ops"]
    modules = [(n, m) for n, m in list(sys.modules.items()) if n.startswith("mlx_lm.models.")]
    return {(n, name): getattr(m, name) for n, m in modules for name in names if hasattr(m, name)}


def round_robin(runs: list) -> list[list]:
    """Each generator's items, taken one from each in turn: their forwards interleave in one process."""
    items = [[] for _ in runs]
    for step in itertools.zip_longest(*runs):
        for got, item in zip(items, step):
            if item is not None:
                got.append(item)
    return items


def test_pairs_and_plain_mlx_lm_in_one_process_each_their_own(tok, tiny):
    """A hybrid pair, an attention pair and mlx-lm's own generate_step on an unprepared copy of the
    hybrid target, interleaved in one process: each gives its own output (speculation: plain greedy),
    the copy the same before and after, and mlx-lm's modules and the copy's classes stay mlx-lm's."""
    originals = mlx_lm_recurrences()
    assert originals and all(f.__module__.startswith("mlx_lm.models.") for f in originals.values())
    hybrid, copy, n = build("qwen3_next"), build("qwen3_next"), 16
    ids = tok.encode(PROMPTS[0])
    alone = plain(copy, ids, n)
    pairs = [make_pair(build("qwen3_next", noise=0.1), tok, hybrid, tok), make_pair(*tiny["same"], *tiny["target"])]
    cfg = SpecConfig(k=4, max_tokens=n, sources=("drafter", "context"), guard=False)
    stats = [SpecStats() for _ in pairs]
    runs = [speculative_generate(pair, ids, ids, cfg, s) for pair, s in zip(pairs, stats)]
    beside = generate_step(mx.array(ids), copy, max_tokens=n, prompt_cache=make_prompt_cache(copy))
    *spec, beside = round_robin([*runs, beside])
    for pair, steps, s in zip(pairs, spec, stats):
        out = [t for new, _ in steps for t in new]
        assert out == plain(pair.target, ids, len(out)) and s.accepted < s.proposed
    assert [int(t) for t, _ in beside] == alone == plain(copy, ids, n) == plain(hybrid, ids, n)
    assert [type(m) for m in copy.modules()] == [type(m) for m in build("qwen3_next").modules()]
    assert [type(m) for m in hybrid.modules()] != [type(m) for m in copy.modules()]  # prepared: its own only
    now = mlx_lm_recurrences()
    assert all(now[key] is f for key, f in originals.items())
    assert all(f.__module__.startswith("mlx_lm.models.") for f in now.values())


def test_installed_mlx_lm_is_the_pinned_one_with_the_known_recurrences():
    """A new mlx-lm fails here first: pyproject.toml bounds it above, as recurrent.MLX_LM says; the
    installed one is in that range; and all recurrent.py wraps or overrides has the parameters it knows."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = Requirement(re.search(r'^\s*"(mlx-lm\W[^"]*)"', pyproject, re.M)[1])
    assert pin.specifier == Requirement(recurrent.MLX_LM).specifier
    assert any(s.operator == "<" for s in pin.specifier) and version("mlx-lm") in pin.specifier
    for key in recurrent.KNOWN:
        module, *path = key.split(".")
        owner = importlib.import_module(f"mlx_lm.models.{module}")
        for name in path[:-1]:
            owner = getattr(owner, name)
        assert recurrent.known(owner, path[-1]) is getattr(owner, path[-1])


def test_an_mlx_lm_with_other_recurrences_is_refused_in_one_line(monkeypatch):
    """A recurrence whose parameters are not the ones recurrent.py knows (as in another mlx-lm): one
    line naming it and the versions to install, the model left as it was."""
    monkeypatch.setattr(recurrent, "_scopes", {})  # nothing wrapped nor made yet: as in a fresh process
    monkeypatch.setattr(recurrent, "_prepared", {nn.Conv1d: recurrent.StepsConv1d})
    monkeypatch.setitem(recurrent.KNOWN, "ssm.ssm_update", "hidden_states A_log B C D dt dt_bias state")
    model = build("mamba2")
    classes = [type(m) for m in model.modules()]
    with pytest.raises(OmniDraftError, match=r"ssm\.ssm_update is \(hidden_states .* lengths\).*mlx-lm>=0\.32") as e:
        recurrent.prepare(model)
    assert "\n" not in str(e.value) and [type(m) for m in model.modules()] == classes
    with pytest.raises(OmniDraftError, match="MambaBlock.ssm_steps is missing"):
        recurrent.known(importlib.import_module("mlx_lm.models.mamba").MambaBlock, "ssm_steps")
