"""Prompt-cache reuse across replies on the tiny cross-vocabulary pair: lossless, and it does reuse."""

import os

from tiny_models import TEXT

from omnidraft_mlx.chat import ChatConfig, ChatSession
from omnidraft_mlx.decode.drafter import CONTEXT_KEEP, CONTEXT_STEP, draft_context
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.promptcache import CacheUse, PromptCache
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, decode_alone, speculative_generate
from omnidraft_mlx.prompts import encode_prompt

CFG = SpecConfig(k=3, max_tokens=24)
TURNS = ["def add_3(x):", "print(add_", "def add_7(x):\n    return", "print(add_7(21))  # three"]


def encode(pair, messages):
    return encode_prompt(pair.draft_tok, messages), encode_prompt(pair.target_tok, messages)


def cached_reply(cache, pair, messages, use=None) -> list[int]:
    d, t = encode(pair, messages)
    return [i for new, _ in cache.generate(pair, d, t, CFG, SpecStats(), use=use) for i in new]


def fresh_reply(pair, messages) -> list[int]:
    d, t = encode(pair, messages)
    return [i for new, _ in speculative_generate(pair, d, t, CFG, SpecStats()) for i in new]


def greedy(pair, messages) -> list[int]:
    return list(
        plain_generate(pair.target, pair.target_tok, encode(pair, messages)[1], PlainStats(), max_tokens=CFG.max_tokens)
    )


def test_multi_turn_reuse_equals_fresh_prefill(cross):
    cache, messages, before = PromptCache(), [], None
    for turn, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        use = CacheUse()
        reply = cached_reply(cache, cross, messages, use)
        assert reply == fresh_reply(cross, messages) == greedy(cross, messages)
        if turn:
            # The whole previous prompt came from the cache, in each model's own tokens (and
            # of the reply whatever the template re-encodes the same way).
            assert use.target_tokens >= len(before[1]) and use.draft_tokens >= len(before[0])
        else:
            assert use == CacheUse(0, 0)
        before = encode(cross, messages)
        messages.append({"role": "assistant", "content": cross.target_tok.decode(reply)})
    assert 0 < cache.nbytes <= cache.max_bytes


def test_same_prompt_again_reuses_all_but_the_last_token(cross):
    cache, messages = PromptCache(), [{"role": "user", "content": TURNS[0]}]
    first = cached_reply(cache, cross, messages)
    use = CacheUse()
    assert cached_reply(cache, cross, messages, use) == first
    d, t = encode(cross, messages)
    assert use == CacheUse(len(d) - 1, len(t) - 1)


def test_a_reply_stopped_early_leaves_a_cache_that_stays_lossless(cross):
    cache, messages = PromptCache(), [{"role": "user", "content": TURNS[2]}]
    d, t = encode(cross, messages)
    rounds = cache.generate(cross, d, t, CFG, SpecStats())
    partial = next(rounds)[0]
    rounds.close()  # the consumer stops between rounds (a client that went away)
    use = CacheUse()
    again = cached_reply(cache, cross, messages, use)
    assert again[: len(partial)] == partial and again == greedy(cross, messages)
    assert use.target_tokens == len(t) - 1


def test_conversations_do_not_evict_each_other_and_the_budget_holds(cross):
    a = [{"role": "user", "content": TURNS[0]}]
    b = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": TURNS[1]}]
    cache = PromptCache()
    cached_reply(cache, cross, a)
    cached_reply(cache, cross, b)
    for messages in (a, b):
        use = CacheUse()
        cached_reply(cache, cross, messages, use)
        assert use.target_tokens == len(encode(cross, messages)[1]) - 1

    # A budget that holds one conversation's caches: the older one is evicted first.
    one = cache.nbytes // 2
    small = PromptCache(max_bytes=one)
    cached_reply(small, cross, a)
    cached_reply(small, cross, b)
    assert small.nbytes <= one
    use_a, use_b = CacheUse(), CacheUse()
    cached_reply(small, cross, b, use_b)
    cached_reply(small, cross, a, use_a)
    shared = len(os.path.commonprefix([encode(cross, a)[1], encode(cross, b)[1]]))  # the template's start
    assert use_b.target_tokens == len(encode(cross, b)[1]) - 1 and use_a.target_tokens == shared


def test_a_namespace_reuses_only_what_it_stored(cross):
    """The server keeps each API key's prompts in a namespace of its own: a request under another
    namespace reuses none of them (so its cached_tokens tell nothing of them), one under its own all."""
    cache, messages = PromptCache(), [{"role": "user", "content": TURNS[0]}]
    d, t = encode(cross, messages)
    decoding = cache.start(cross, d, t, CFG, SpecStats(), slots=cache.take(cross, d, t, namespace="a"))
    reply = [i for new, _ in decode_alone(decoding) for i in new]
    cache.finish(decoding, namespace="a")
    assert reply == greedy(cross, messages)
    for namespace, reused in (("b", CacheUse(0, 0)), ("", CacheUse(0, 0)), ("a", CacheUse(len(d) - 1, len(t) - 1))):
        use = CacheUse()
        cache.take(cross, d, t, use, namespace)
        assert use == reused, namespace


def test_a_drafter_update_retires_only_the_drafter_caches(cross):
    cache, messages = PromptCache(), [{"role": "user", "content": TURNS[0]}]
    cached_reply(cache, cross, messages)
    cache.drafter_changed()
    use = CacheUse()
    assert cached_reply(cache, cross, messages, use) == greedy(cross, messages)
    assert use.draft_tokens == 0 and use.target_tokens > 0


def test_the_drafter_reads_the_end_of_a_prompt_from_a_start_that_moves_a_step_at_a_time():
    ids = list(range(40))
    starts = []
    for n in range(len(ids) + 1):
        window = draft_context(ids[:n], keep=5, step=8)
        assert ids[:n][n - len(window) :] == window and draft_context(window, keep=5, step=8) == window
        assert len(window) == n if n < 5 + 8 else 5 <= len(window) < 5 + 8
        starts.append(n - len(window))
    assert sorted(set(starts)) == [0, 8, 16, 24, 32] and starts == sorted(starts)


def test_a_long_conversation_stays_lossless_and_its_next_turn_finds_the_drafters_cache(cross):
    messages = [{"role": "user", "content": TEXT * 2 + "def add_60(x):"}]
    draft_ids = encode(cross, messages)[0]
    assert len(draft_ids) > CONTEXT_KEEP + CONTEXT_STEP  # the drafter reads only the window
    cache = PromptCache()
    reply = cached_reply(cache, cross, messages)
    assert reply == greedy(cross, messages)
    messages += [{"role": "assistant", "content": cross.target_tok.decode(reply)}, {"role": "user", "content": "ok"}]
    window = draft_context(encode(cross, messages)[0])
    assert window[: len(draft_context(draft_ids))] == draft_context(draft_ids)  # the same start
    use = CacheUse()
    assert cached_reply(cache, cross, messages, use) == greedy(cross, messages)
    assert len(draft_context(draft_ids)) - 1 <= use.draft_tokens < len(draft_ids)  # its window, not the whole
    assert use.target_tokens >= len(encode(cross, messages[:1])[1]) - 1


def test_a_chat_turn_prefills_only_what_is_new(cross):
    """Six turns: each prefills the last reply and the new message, never the history before them."""
    session, before = ChatSession(cross, ChatConfig(spec=SpecConfig(k=3, max_tokens=16), adapt=False)), 0
    for turn in range(6):
        reply = session.start(TURNS[turn % len(TURNS)])
        text = "".join(piece for piece, _ in session.stream(reply))
        session.finish(reply)
        assert reply.ttft_s is not None and text == reply.text
        assert reply.cached.target_tokens >= before
        before = len(reply.target_ids)
    assert len(session.conv.sent()) == 12
