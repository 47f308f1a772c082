"""The architecture matrix: every mlx-lm family that builds as a causal LM (tests/architectures.py),
as a tiny random-weight target and as a drafter. Greedy speculative output equals mlx-lm's plain
decoding (generate_step) in chain, tree, batched and cross-vocabulary modes, and with the family
drafting for a llama target. Families whose layouts take no trees or batched rows fall back
(decode/layouts.py) and must still be exact. docs/architectures.md lists the results."""

import functools

import mlx.core as mx
import pytest
from architectures import FAMILIES, REFUSED, build, installed
from mlx_lm import load
from mlx_lm.generate import generate_step
from tiny_models import corpus, train_tokenizer, write_model

from omnidraft_mlx.anatomy import anatomy
from omnidraft_mlx.decode import layouts
from omnidraft_mlx.decode.layouts import batch_layout, takes_trees
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import Decoding, SpecConfig, SpecStats, decode_together, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages

pytestmark = pytest.mark.matrix
PROMPTS = ["def add_7(x):\n    return x + 7\n", "print(add_3(9))  # four\n", "x"]
TOKENS = 24


def families() -> list:
    """Every family built here but the refused ones (test_a_refused_family_says_so_in_one_line)."""
    return installed(f for f in FAMILIES if f not in REFUSED)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Random llamas (target: the target tokenizer; draft: another vocabulary), loaded as a user would."""
    root = tmp_path_factory.mktemp("llamas")
    target = write_model(root / "target", train_tokenizer(corpus("target"), 320), 48, 2, seed=11, logit_scale=4.0)
    draft = write_model(root / "draft", train_tokenizer(corpus("draft"), 300), 48, 2, seed=12, logit_scale=4.0)
    return {"target": load(str(target)), "draft": load(str(draft))}


@functools.lru_cache(maxsize=4)
def models(family: str):
    """(target, drafter: the target's weights plus noise) of the family."""
    return build(family), build(family, noise=0.05)


def settings(tree: bool = False) -> SpecConfig:
    return SpecConfig(k=4, max_tokens=TOKENS, sources=("drafter",), guard=False, tree=tree)


def prompts(pair, text):
    msgs = user_messages(text)
    return encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)


def plain(pair, text) -> list[int]:
    """mlx-lm's own greedy decoding of the target, up to its end-of-turn (not kept) or TOKENS."""
    out = []
    for token, _ in generate_step(mx.array(prompts(pair, text)[1]), pair.target, max_tokens=TOKENS):
        if int(token) in pair.target_tok.eos_token_ids:
            break
        out.append(int(token))
    return out


def alone(pair, text, cfg) -> list[int]:
    return [t for new, _ in speculative_generate(pair, *prompts(pair, text), cfg, SpecStats()) for t in new]


def together(pair, texts, cfg) -> list[list[int]]:
    scheduler = Scheduler()
    decodings = [Decoding(pair, *prompts(pair, t), cfg, SpecStats(), scheduler=scheduler) for t in texts]
    replies = [[] for _ in texts]
    for taken in decode_together(decodings):
        for i, (new, _) in taken.items():
            replies[i] += new
    for d in decodings:
        d.close()
    return replies


def same_vocab(family, llamas):
    (target, drafter), tok = models(family), llamas["target"][1]
    return make_pair(drafter, tok, target, tok)


@pytest.mark.parametrize("family", families())
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_chain_and_tree_equal_plain_decoding(family, tree, llamas):
    pair = same_vocab(family, llamas)
    for text in PROMPTS[:2]:
        assert alone(pair, text, settings(tree)) == plain(pair, text)


@pytest.mark.parametrize("family", families())
def test_batched_rows_equal_plain_decoding(family, llamas):
    pair = same_vocab(family, llamas)
    assert together(pair, PROMPTS, settings(tree=True)) == [plain(pair, text) for text in PROMPTS]


@pytest.mark.parametrize("family", families())
def test_cross_vocabulary_target_equals_plain_decoding(family, llamas):
    target, (drafter, draft_tok) = models(family)[0], llamas["draft"]
    pair = make_pair(drafter, draft_tok, target, llamas["target"][1])
    for text in PROMPTS[:2]:
        assert alone(pair, text, settings()) == plain(pair, text)


@pytest.mark.parametrize("family", families())
def test_family_as_drafter_keeps_the_target_exact(family, llamas):
    (target, target_tok), draft_tok = llamas["target"], llamas["draft"][1]
    pair = make_pair(models(family)[1], draft_tok, target, target_tok)
    for text in PROMPTS[:2]:
        assert alone(pair, text, settings(tree=True)) == plain(pair, text)


@pytest.mark.parametrize("family", installed(REFUSED))
def test_a_refused_family_says_so_in_one_line(family, llamas):
    with pytest.raises(OmniDraftError) as refused:
        alone(same_vocab(family, llamas), PROMPTS[0], settings())
    assert "\n" not in str(refused.value) and "plain decoding" in str(refused.value)


def test_layouts_found_for_known_families():
    """gemma2 groups queries 5-D (its batch mask follows), gpt2 looks its positions up in a table
    (rewired): both take trees and batched rows; nanochat ropes by hand: chains and one at a time."""
    assert takes_trees(models("gemma2")[0]) and batch_layout(models("gemma2")[0]) == "5d"
    assert takes_trees(models("gpt2")[0]) and batch_layout(models("gpt2")[0]) == "4d"
    assert not takes_trees(models("nanochat")[0]) and batch_layout(models("nanochat")[0]) is None


def test_a_fallback_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(layouts, "_said", set())
    with caplog.at_level("WARNING", logger="omnidraft.layouts"):
        for seed in (3, 4):
            model = build("nanochat", seed=seed)
            takes_trees(model), takes_trees(model)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("nanochat: draft trees are verified as chains")


def test_anatomy_finds_wrapped_and_renamed_parts():
    assert anatomy(models("qwen3_5")[0]).lm is models("qwen3_5")[0].language_model
    assert anatomy(models("mistral3")[0]).lm is models("mistral3")[0].language_model
    assert anatomy(models("gpt_bigcode")[0]).backbone == "transformer"
    assert anatomy(models("mamba2")[0]).backbone == "backbone"


def test_a_model_without_a_token_embedding_is_refused_in_one_line():
    import mlx.nn as nn

    with pytest.raises(OmniDraftError, match="no token embedding"):
        anatomy(nn.Linear(4, 4))
