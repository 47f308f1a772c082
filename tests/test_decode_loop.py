"""The speculative engine on tiny trained models: lossless greedy decoding,
vocabulary mapping, n-gram cache, bad input."""

import numpy as np
import pytest

from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.vocab.ngram import NGramCache
from omnidraft_mlx.vocab.translate import complete_utf8, translate_tokens

PROMPTS = [
    "def add_7(x):\n    return x + 7\n\nprint(add_7(21))  # two\n\ndef add_1",
    "print(add_3(9))  # four\n",
    "Ünïcödé naïve 日本語 🙂 def add_",
    "x",
]


def run_spec(pair, prompt, raw=True, **cfg):
    msgs = user_messages(prompt)
    dp, tp = encode_prompt(pair.draft_tok, msgs, raw), encode_prompt(pair.target_tok, msgs, raw)
    stats = SpecStats()
    cfg = {"sources": "drafter", "guard": False, **cfg}  # the drafter's path (lookups: test_lookup.py)
    out = [t for new, _ in speculative_generate(pair, dp, tp, SpecConfig(**cfg), stats) for t in new]
    return out, stats


def run_plain(model, tok, prompt, raw=True, max_tokens=48):
    ids = encode_prompt(tok, user_messages(prompt), raw)
    return list(plain_generate(model, tok, ids, PlainStats(), max_tokens=max_tokens))


def test_vocab_map_is_byte_exact(cross):
    vmap = cross.vmap
    draft_ids, target_ids = vmap.mapped_pairs()
    assert 0 < vmap.size < len(vmap.draft_bytes)  # a partial overlap, as in real pairs
    for d, t in zip(draft_ids, target_ids):
        if d not in vmap.draft_eos:
            assert vmap.draft_bytes[d] == vmap.target_bytes[t]
    eos = cross.draft_tok.convert_tokens_to_ids("<|im_end|>")
    assert vmap.draft_to_target[eos] == cross.target_tok.convert_tokens_to_ids("<|im_end|>")
    # Other special tokens never map by text, even where both tokenizers spell them alike.
    start = cross.draft_tok.convert_tokens_to_ids("<|im_start|>")
    assert vmap.draft_to_target[start] == -1


@pytest.mark.parametrize("translation", ["text", "tokens"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_greedy(cross, tiny, translation, k):
    tm, tt = tiny["target"]
    accepted = 0
    for prompt in PROMPTS:
        out, stats = run_spec(cross, prompt, k=k, max_tokens=48, translation=translation)
        assert out == run_plain(tm, tt, prompt)
        accepted += stats.accepted
    assert accepted > 0  # the drafter did contribute


def test_greedy_chat_template(cross, tiny):
    tm, tt = tiny["target"]
    prompt = "def add_5(x):"
    out, stats = run_spec(cross, prompt, raw=False, k=4, max_tokens=32)
    assert out == run_plain(tm, tt, prompt, raw=False, max_tokens=32)


def test_same_vocab_identity_pair(tiny):
    (dm, dt), (tm, tt) = tiny["same"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    assert pair.vmap.same_vocab and pair.vmap.size == len(pair.vmap.draft_to_target)
    for prompt in PROMPTS[:2]:
        out, stats = run_spec(pair, prompt, k=4, max_tokens=48)
        assert out == run_plain(tm, tt, prompt)
        assert stats.acceptance > 0.3
    assert len(pair.ngrams) == 0  # nothing to translate, nothing to learn


def test_ngram_cache_learns_and_is_used(tiny):
    (dm, dt), (tm, tt) = tiny["draft"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    out, stats = run_spec(pair, PROMPTS[0], k=5, max_tokens=48, translation="tokens")
    assert len(pair.ngrams) > 0
    for gram, target_id in pair.ngrams.entries.items():
        spelled = b"".join(pair.vmap.draft_bytes[d] for d in gram)
        assert spelled == pair.vmap.target_bytes[target_id]
    # A second pass over the same prompt proposes merged tokens from the cache.
    out2, stats2 = run_spec(pair, PROMPTS[0], k=5, max_tokens=48, translation="tokens")
    assert out2 == out and stats2.ngram_hits > 0


def test_translate_tokens_longest_ngram_first(cross):
    vmap, cache = cross.vmap, NGramCache()
    a, b, c = [int(i) for i in np.nonzero(vmap.draft_to_target >= 0)[0][300:303]]
    cache.add((a, b), 7)
    cache.add((a, b, c), 9)
    tr = translate_tokens([a, b, c, a], vmap, cache)
    assert tr.target_ids == [9, vmap.draft_to_target[a]] and tr.spans == [(0, 3), (3, 4)]
    tr = translate_tokens([a, b], vmap, cache)
    assert tr.target_ids == [7]
    assert cache.is_open_prefix([a], 0) and not cache.is_open_prefix([c], 0)


def test_ngram_cache_lfu_and_save_load(tmp_path):
    cache = NGramCache(capacity=2)
    cache.add((1, 2), 10)
    cache.add((3, 4), 11)
    cache.record_use((1, 2))
    cache.add((5, 6, 7), 12)  # evicts the never-used (3, 4)
    assert set(cache.entries) == {(1, 2), (5, 6, 7)}
    cache.save(tmp_path / "ngrams.json")
    loaded = NGramCache.load(tmp_path / "ngrams.json")
    assert loaded.entries == cache.entries and loaded.uses == cache.uses
    assert loaded.match([5, 6, 7, 1], 0) == (5, 6, 7)


def test_complete_utf8():
    text = "a日🙂".encode()
    assert complete_utf8(text) == text
    assert complete_utf8(text[:-1]) == "a日".encode()
    assert complete_utf8(text[:-3]) == "a日".encode()
    assert complete_utf8(text[:2]) == b"a"


def test_bad_input(cross):
    with pytest.raises(OmniDraftError, match="at least 1"):
        run_spec(cross, "x", k=0)
    with pytest.raises(OmniDraftError, match="empty prompt"):
        run_spec(cross, "", k=2)
