"""Greedy speculative decoding equals the target's own greedy decoding on real
models: two cross-vocabulary pairs (three tokenizer families) and one
same-vocabulary pair. Where batched verification and one-token decoding differ
in the last float32 bits, the divergence must sit on a near-tie of the target's
top-2 logits, shown by the gap; anything else fails."""

import gc

import mlx.core as mx
import pytest

from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.loading import load_model
from omnidraft_mlx.models.pull import CATALOG_RESOLVER
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Describe a quiet morning by the sea in three sentences.",
    "Traduis en français : « The café on the corner serves crème brûlée. » Puis écris 東京 en rōmaji.",
]
TIE_GAP = 0.05  # logits; fp32 batched-vs-single differences are ~1e-4..1e-2

_models = {}


@pytest.fixture(scope="module", autouse=True)
def free_models():
    """The loaded models (the 1.5B alone is 7 GB in float32) are let go when this module ends, with
    MLX's buffer cache: the server tests after it start their own, and a 24 GB machine holds not both."""
    yield
    _models.clear()
    gc.collect()
    mx.clear_cache()


def model(name):
    if name not in _models:
        _models[name] = load_model(name, CATALOG_RESOLVER)  # catalog names, pulled on first use
    return _models[name]


def top2_gap(target, prompt_ids, prefix):
    logits = target(mx.array(prompt_ids + prefix)[None])[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


def check_pair(draft_name, target_name, prompts, max_tokens, k, sources="drafter", guard=False):
    (dm, dt), (tm, tt) = model(draft_name), model(target_name)
    pair = make_pair(dm, dt, tm, tt)
    accepted = proposed = 0
    for prompt in prompts:
        msgs = user_messages(prompt)
        tp, dp = encode_prompt(tt, msgs), encode_prompt(dt, msgs)
        ref = list(plain_generate(tm, tt, tp, PlainStats(), max_tokens=max_tokens))
        stats = SpecStats()
        cfg = SpecConfig(k=k, max_tokens=max_tokens, sources=sources, guard=guard)
        out = [t for new, _ in speculative_generate(pair, dp, tp, cfg, stats) for t in new]
        if out != ref:
            i = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
            gap = top2_gap(tm, tp, ref[:i])
            assert gap < TIE_GAP, f"{draft_name}->{target_name}: diverged at token {i}, top-2 gap {gap:.4f}"
            print(f"near-tie at token {i} (top-2 logit gap {gap:.4f}): {prompt[:40]!r}")
        accepted += stats.accepted
        proposed += stats.proposed
    return accepted / proposed, pair


EDIT = (
    "Here is a Python function:\n```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total / len(xs)\n```\nAdd type hints and show the whole updated code."
)


def test_default_sources_and_guard_on_the_default_pair():
    """The product's default: drafter, context and history lookups, the guard."""
    acceptance, _ = check_pair(
        "smollm2-135m", "qwen2.5-coder-0.5b", [EDIT, PROMPTS[2]], 48, k=4, sources="drafter,context,history", guard=True
    )
    assert 0 < acceptance < 1  # drafts were kept and rejected: both paths of verification ran


def test_smollm2_drafts_for_qwen():
    acceptance, pair = check_pair("smollm2-135m", "qwen2.5-coder-0.5b", PROMPTS, 40, k=4)
    assert 30_000 < pair.vmap.size < 49_152
    assert acceptance > 0.2


def test_gemma_drafts_for_qwen():
    acceptance, pair = check_pair("gemma-3-270m", "qwen2.5-coder-0.5b", PROMPTS, 40, k=3)
    assert pair.vmap.size > 50_000
    assert acceptance > 0.1


def test_qwen_same_vocab_pair():
    acceptance, pair = check_pair("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", PROMPTS[:3], 24, k=4)
    assert pair.vmap.same_vocab
    assert acceptance > 0.5
