"""Sliding-window models (Gemma 3) stay lossless past their window.

mlx-lm keeps a sliding-window layer in a RotatingKVCache that cannot be trimmed
once it has wrapped; make_cache keeps those layers whole and lets the mask
enforce the window. Tiny Gemma 3 models with a 24-token window, prompts and
replies several windows long, as target and as drafter."""

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
    trim_prompt_cache,
)
from tiny_models import TEXT, build_windowed_models

from omnidraft_mlx.decode.kvcache import WindowedKVCache, make_cache, prefill, trim_cache
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import make_pair

WINDOW = 24
PROMPTS = [TEXT[:260], TEXT[600:700] + "\ndef add_"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    dirs = build_windowed_models(tmp_path_factory.mktemp("gemma"), WINDOW)
    return {name: load(str(path)) for name, path in dirs.items()}


class Unwindowed(KVCache):
    def make_mask(self, N, window_size=None, return_array=False):
        return create_attention_mask(N, self.offset, return_array, None)


def decode_logits(model, cache, ids):
    """Logits of each position, fed one token at a time."""
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in ids])


def test_windowed_cache_matches_rotating_and_trims_exactly(gemma):
    model, tok = gemma["target"]
    ids = tok.encode(PROMPTS[0])[: 3 * WINDOW]
    cache = make_cache(model)
    assert not any(isinstance(c, RotatingKVCache) for c in cache)
    assert any(isinstance(c, WindowedKVCache) for c in cache)
    ours = decode_logits(model, cache, ids)
    rotating = decode_logits(model, make_prompt_cache(model), ids)
    assert mx.allclose(ours, rotating, atol=1e-4).item()
    # A cache whose mask ignores the window is told apart: the window matters here.
    unwindowed = decode_logits(model, [Unwindowed() for _ in model.layers], ids)
    assert not mx.allclose(unwindowed[WINDOW + 1 :], rotating[WINDOW + 1 :], atol=1e-2).item()

    # Past the window, roll back 5 and feed other tokens: as if they had been there all along.
    trim_cache(cache, 5)
    other = ids[:5]
    again = decode_logits(model, cache, other)
    fresh = make_cache(model)
    prefill(model, fresh, ids[:-5])
    assert mx.allclose(again, decode_logits(model, fresh, other), atol=1e-4).item()


def test_untrimmable_caches_fail_loudly(gemma):
    model, tok = gemma["target"]
    rotating = make_prompt_cache(model)
    prefill(model, rotating, tok.encode(PROMPTS[0])[: 2 * WINDOW])
    assert trim_prompt_cache(rotating, 3) == 0  # mlx-lm's trim silently trims nothing: the bug
    with pytest.raises(OmniDraftError, match="RotatingKVCache layers cannot roll back"):
        trim_cache(rotating, 3)
    with pytest.raises(OmniDraftError, match="ArraysCache"):
        trim_cache([ArraysCache(2)], 1)


def run_both(pair, prompt, k, max_tokens=64):
    dp = pair.draft_tok.encode(prompt)
    tp = pair.target_tok.encode(prompt)
    stats = SpecStats()
    cfg = SpecConfig(k=k, max_tokens=max_tokens)
    out = [t for new, _ in speculative_generate(pair, dp, tp, cfg, stats) for t in new]
    plain = list(plain_generate(pair.target, pair.target_tok, tp, PlainStats(), max_tokens=max_tokens))
    assert len(tp) + len(out) > 3 * WINDOW  # well past the window
    return out, plain, stats


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_greedy_lossless_past_the_window(gemma, tiny, role, k):
    if role == "target":
        (dm, dt), (tm, tt) = tiny["draft"], gemma["target"]
    else:
        (dm, dt), (tm, tt) = gemma["draft"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    rejected = 0
    for prompt in PROMPTS:
        out, plain, stats = run_both(pair, prompt, k)
        assert out == plain
        rejected += stats.proposed - stats.accepted
    assert rejected > 0  # rollbacks past the window were exercised


def long_prompt() -> str:
    """A Python module pasted with a question: well over Gemma-3-270M's 512-token window."""
    import textwrap

    source = open(textwrap.__file__).read()[:2600]
    return f"{source}\n\n# Question: what does the function dedent above do? Answer:\n"


@pytest.mark.real
@pytest.mark.parametrize("draft, target", [("smollm2-135m", "gemma-3-270m"), ("gemma-3-270m", "qwen2.5-coder-0.5b")])
def test_real_gemma_lossless_past_its_window(draft, target):
    from test_lossless_real import check_pair, model

    prompt_ids = model("gemma-3-270m")[1].encode(long_prompt())
    assert len(prompt_ids) > 560  # prompt + reply > 600 target and drafter tokens
    acceptance, _ = check_pair(draft, target, [long_prompt()], max_tokens=80, k=4)
    assert 0 < acceptance < 1  # drafts accepted and rejected (rolled back) past the window
