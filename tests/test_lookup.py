"""Drafts that cost no model forward: context lookup and the history index, the
scheduler that picks a source (or none) per round, and greedy losslessness with
them (sampling with lookup drafts: test_sampling.py)."""

import json

import numpy as np
import pytest
from mlx_lm import load
from tiny_models import build_random_pair

from omnidraft_mlx.decode.drafter import DrafterSource
from omnidraft_mlx.decode.drafts import Context, Draft, DraftSource
from omnidraft_mlx.decode.lookup import ContextLookup, HistoryIndex, escaped_views, match_class
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.policy import FixedPolicy, PolicyConfig
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.vocab.align import common_prefix

# The reply repeats what the prompt shows: lookups have something to find.
REPEAT = "def add_7(x):\n    return x + 7\n\ndef add_8(x):\n    return x + 8\n\ndef add_7(x):\n"


def test_context_lookup_proposes_what_followed_the_longest_match():
    lookup = ContextLookup(max_ngram=3, max_len=4)
    ctx = Context(prompt=[1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3])
    draft = lookup.propose(ctx, limit=10)
    # "1 2 3" occurred at the start, followed by 9 9 2 3; the shorter "2 3" later, followed by 4 5.
    assert draft.tokens == (9, 9, 2, 3) and draft.source == "context:3"
    ctx.committed += [9, 9, 7]  # "9 7" is new; "7" never seen: nothing to propose
    assert lookup.propose(ctx, 10) is None
    ctx.committed += [1]  # "7 1" unseen, "1" seen last at position 9 (then 2 3 9 9 7)
    assert lookup.propose(ctx, 3).tokens == (2, 3, 9) and lookup.propose(ctx, 3).source == "context:1"


def test_context_lookup_follows_the_occurrence_that_matches_furthest_back():
    # "3 4" occurs twice before the tail "1 2 3 4": the latest is followed by 20 21, the first
    # continues the copy under way (its match runs back over "1 2").
    lookup = ContextLookup(max_ngram=2, max_len=4)
    ctx = Context(prompt=[1, 2, 3, 4, 10, 11, 9, 3, 4, 20, 21, 1, 2, 3, 4])
    draft = lookup.propose(ctx, limit=10)
    assert draft.tokens == (10, 11, 9, 3) and draft.source == "context:4"
    # A long match is a class of its own: a copy under way holds far more often than a stray match.
    copy = list(range(100, 120))
    ctx = Context(prompt=copy + [7] + copy[:17])
    assert ContextLookup(max_len=4).propose(ctx, 10).source == "context:16"
    assert [match_class(m) for m in (1, 4, 5, 15, 16, 40)] == [1, 4, 8, 8, 16, 16]


def test_history_index_counts_merges_saves_and_stays_bounded(tmp_path):
    index = HistoryIndex(order=2, capacity=50)
    index.add([5, 6, 7, 8])
    index.add([5, 6, 7, 9])
    index.add([5, 6, 7, 9])
    tokens, order = index.continuation([5, 6], limit=4)
    assert tokens == [7, 9] and order == 2  # 9 followed "6 7" twice, 8 once; nothing follows 9
    index.save(tmp_path / "h.json")
    index.mark_saved()  # as the profile does once its manifest names the file
    other = HistoryIndex.load(tmp_path / "h.json")
    index.add([1, 2, 3])  # learned after the save
    other.add([5, 6, 7, 8])
    other.add([5, 6, 7, 8])
    other.save(tmp_path / "h.json")  # another process saved meanwhile
    index.merge(HistoryIndex.load(tmp_path / "h.json"))
    assert index.next[(6, 7)] == {8: 3, 9: 2} and index.next[(1, 2)] == {3: 1}
    for start in range(0, 400, 4):
        index.add(list(range(start, start + 6)))
        assert len(index) <= index.capacity
    assert json.loads((tmp_path / "h.json").read_text())["order"] == 2


def decode(pair, prompt, history=None, scheduler=None, **cfg):
    msgs = user_messages(prompt)
    dp, tp = encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)
    stats = SpecStats()
    out = [
        t
        for new, _ in speculative_generate(
            pair, dp, tp, SpecConfig(**{"max_tokens": 40, **cfg}), stats, history=history, scheduler=scheduler
        )
        for t in new
    ]
    return out, stats


@pytest.mark.parametrize(
    "sources,guard",
    [
        ("context", False),
        ("context,history", True),
        ("drafter,context,history", False),
        ("drafter,context,history", True),
    ],
)
def test_greedy_with_lookups_equals_target_greedy(cross, tiny, sources, guard):
    tm, tt = tiny["target"]
    history = HistoryIndex()
    for prompt in [REPEAT, "print(add_3(9))  # four\n", "x"]:
        ids = encode_prompt(tt, user_messages(prompt), True)
        plain = list(plain_generate(tm, tt, ids, PlainStats(), max_tokens=40))
        for _ in range(2):  # the second time, the history holds the first reply
            out, stats = decode(cross, prompt, history, sources=sources, guard=guard)
            assert out == plain
    assert stats.rounds > 0


def test_lookup_drafts_are_accepted_where_the_reply_repeats(cross):
    _, stats = decode(cross, REPEAT, sources="context", guard=False)
    rounds, proposed, accepted = stats.by_source["context"]
    assert accepted >= 4 and stats.tokens_per_forward > 1.3


@pytest.mark.parametrize("vocab", ["cross", "same"])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_the_drafter_reads_a_guess_ahead_and_drafts_what_it_would_alone(cross, tiny, vocab, temp):
    """Given a lookup's guess, the drafter drafts what it drafts token by token (under
    sampling: from the same random draws), in one forward for the stretch the guess has right."""
    pair = cross if vocab == "cross" else make_pair(*tiny["same"], *tiny["target"])
    msgs = user_messages(REPEAT)
    dp, tp = encode_prompt(pair.draft_tok, msgs, True), encode_prompt(pair.target_tok, msgs, True)
    cfg = SpecConfig(k=6, temp=temp, sources="drafter", guard=False)

    def draft(guess):
        source, ctx = (
            DrafterSource(pair, dp, cfg, FixedPolicy(PolicyConfig(k=6))),
            Context(tp, rng=np.random.default_rng(1)),
        )
        source.start(ctx)
        d = source.propose(ctx, 6, guess)
        return d.tokens, d.forwards

    alone, forwards = draft([])
    assert len(alone) >= 4 and forwards >= 3
    read, read_forwards = draft(alone)
    assert read == alone and read_forwards < forwards
    if vocab == "same":
        assert read_forwards == 1
    wrong = alone[:2] + (alone[2] + 1,) + alone[3:]  # right up to its third token
    assert draft(wrong) == (alone, forwards - 1)  # the guess read once, then token by token


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory):
    """Untrained models with peaked, unrelated distributions: the drafter is always wrong."""
    draft, target = build_random_pair(tmp_path_factory.mktemp("rand"))
    (dm, dt), (tm, tt) = load(str(draft)), load(str(target))
    return make_pair(dm, dt, tm, tt)


def test_a_file_copied_into_a_tool_calls_json_is_found_in_the_escaped_context(unrelated):
    """An agent writes a file it was shown into a JSON string, newlines escaped (quotes too, or
    left bare): the context's raw text has no such n-grams past a line; its escaped views do."""
    tok = unrelated.target_tok
    code = 'def greet(name):\n    """Say "hi"."""\n    return "hi " + name\n'
    prompt = list(tok.encode(f"Read {code}Now write it.", add_special_tokens=False))
    for written in (json.dumps(code)[1:-1], code.replace("\n", "\\n")):
        call = list(tok.encode('{"content": "' + written, add_special_tokens=False))
        reply, rest = call[: len(call) // 2], call[len(call) // 2 :]  # halfway through writing it
        ctx = Context(prompt=prompt, committed=reply)
        raw = ContextLookup(max_len=len(rest)).propose(ctx, len(rest))
        seen = ContextLookup(max_len=len(rest), views=escaped_views(tok, prompt)).propose(ctx, len(rest))
        # The view proposes the rest of the file (its last token may merge with what follows it).
        assert common_prefix(seen.tokens, rest) >= len(rest) - 1 > common_prefix(raw.tokens if raw else [], rest)
    assert escaped_views(tok, list(tok.encode("no escapes here", add_special_tokens=False))) == []


@pytest.mark.parametrize("guard", [True, False])
def test_guard_decodes_plainly_while_no_source_pays(unrelated, guard):
    out, stats = decode(unrelated, "x", sources="drafter", guard=guard, k=4, max_tokens=60)
    drafter_rounds, proposed, accepted = stats.by_source["drafter"]
    assert accepted == 0 and proposed > 0
    if guard:  # after four drafter rounds and four plain, plain wins; the drafter is probed after
        # 16 and 32 more rounds, five rounds a probe (its catch-up on the plain rounds' text is not rated)
        assert stats.by_source["plain"][0] >= 45 and 8 <= drafter_rounds <= 15
    else:
        assert "plain" not in stats.by_source


class Repeat(DraftSource):
    """A lookup that always finds the same two tokens."""

    name, free = "context", True

    def propose(self, ctx, limit):
        return Draft([1, 2], self.name)


class Lagging(DraftSource):
    """A drafter that must first catch up on the text other sources drafted."""

    name = "drafter"

    def __init__(self):
        self.in_step = False

    def propose(self, ctx, limit, guess=()):
        draft = Draft([3, 4, 5], self.name, catch_up=not self.in_step)
        self.in_step = True
        return draft


@pytest.mark.parametrize("guard", [True, False])
def test_a_drafter_that_caught_up_is_rated_in_step(guard):
    """Lookup rounds make 2 tokens/s, the drafter's usual round 8/s, its catch-up round 0.4/s:
    rated on the catch-up, a probing drafter always loses and is shut out."""
    scheduler, drafter, ctx = Scheduler(), Lagging(), Context([0])
    reply = scheduler.begin_reply([Repeat(), drafter], guard, ctx)
    chosen = []
    for _ in range(200):
        proposed = scheduler.propose(reply, ctx, 8)
        draft = proposed.draft
        drafter.in_step &= draft.source == "drafter"
        tokens, seconds = {"context": (2, 1.0), "plain": (1, 1.0)}.get(
            draft.source, (4, 10.0 if draft.catch_up else 0.5)
        )
        scheduler.settle(
            proposed, tokens - 1, dict(tokens=tokens, round_s=seconds, verify_s=seconds), len(draft.tokens), 0
        )
        chosen.append(draft.source)
    assert chosen[-100:].count("drafter") >= 90  # the others: plain probes of one round


class Uneven(DraftSource):
    """A drafter that pays on average (2.5 tokens per 1.7 s against plain's 1 per 1 s),
    but half its rounds make one token: the spread of a real drafter's rounds."""

    name = "drafter"

    def __init__(self, rng):
        self.rng = rng

    def propose(self, ctx, limit, guess=()):
        return Draft([3, 4, 5], self.name)

    def tokens(self):
        return 1 if self.rng.random() < 0.5 else 4


def test_a_drafter_that_pays_on_average_keeps_its_rounds():
    """Rated on its last few rounds and its probes judged on one round, a streak of unlucky
    rounds put the drafter behind plain and each lost probe doubled its wait: it sat out whole
    replies where it paid (the 1.5B bench: chat, math)."""
    scheduler, ctx = Scheduler(), Context([0])
    drafter = Uneven(np.random.default_rng(0))
    chosen = []
    for _reply in range(40):  # one scheduler across replies, as chat and bench keep one
        reply = scheduler.begin_reply([drafter], True, ctx)
        for _ in range(40):
            proposed = scheduler.propose(reply, ctx, 8)
            draft = proposed.draft
            tokens, seconds = (drafter.tokens(), 1.7) if draft.source == "drafter" else (1, 1.0)
            scheduler.settle(
                proposed, tokens - 1, dict(tokens=tokens, round_s=seconds, verify_s=seconds), len(draft.tokens), 0
            )
            chosen.append(draft.source)
        scheduler.end_reply(reply, ctx)
    late = chosen[len(chosen) // 2 :]
    assert late.count("drafter") >= 0.9 * len(late)


@pytest.mark.parametrize("rate, waits", [(0.95, [16, 16, 16]), (0.7, [16, 32, 64])])
def test_a_probe_lost_within_its_noise_is_tried_again_as_soon(rate, waits):
    """A 4-round probe's rate is noisy: a drafter that lost to plain by less than that (0.95 against
    1 token/s) is probed every 16 rounds, as one that won would be; one well behind (0.7) waits
    twice as long after each lost probe."""
    scheduler, ctx = Scheduler(), Context([0])
    reply = scheduler.begin_reply([Steady(list(range(100)))], True, ctx)
    chosen = []
    for _ in range(200):
        proposed = scheduler.propose(reply, ctx, 8)
        tokens, seconds = (2, 2 / rate) if proposed.draft.source == "drafter" else (1, 1.0)
        timing = dict(tokens=tokens, draft_s=0.0, verify_s=seconds, round_s=seconds)
        scheduler.settle(proposed, tokens - 1, timing, len(proposed.draft.tokens), 0)
        chosen.append(proposed.draft.source)
    starts = [i for i, source in enumerate(chosen) if source == "drafter" and (i == 0 or chosen[i - 1] != "drafter")]
    assert [b - a - 3 for a, b in zip(starts, starts[1:])][:3] == waits  # rounds from a probe's last to the next


class Copy(DraftSource):
    """A lookup that finds the reply's next four tokens, right on the first `right` of them."""

    name, free = "context", True

    def __init__(self, reply, right):
        self.reply, self.right = reply, right

    def propose(self, ctx, limit, guess=()):
        start = len(ctx.committed)
        return Draft(self.reply[start : start + self.right] + [-1] * (4 - self.right), "context:2")


class Steady(DraftSource):
    """A drafter whose three-token drafts hold two tokens; drafting costs 0.3 s a round."""

    name = "drafter"

    def __init__(self, reply):
        self.reply, self.guesses = reply, []

    def propose(self, ctx, limit, guess=()):
        self.guesses.append(list(guess))
        start = len(ctx.committed)
        return Draft(self.reply[start : start + 2] + [-1], self.name)


@pytest.mark.parametrize("right", [0, 1, 4])
def test_lookups_are_judged_by_how_they_held_whether_verified_or_not(right):
    """Each lookup found is scored against what the target then wrote: one that holds nothing
    is never verified (no probes), one that holds pays and wins its rounds; verifying a draft
    costs 1 s + 0.1 s a token (a lookup holding 1 of 4 tokens: 2 tokens in 1.4 s; the drafter
    3 in 1.6 s; plain 1 in 1 s). The drafter gets the lookup's draft as its guess."""
    reply = list(range(100, 100 + 3000))
    scheduler, ctx = Scheduler(), Context([0])
    drafter = Steady(reply)
    sources = scheduler.begin_reply([Copy(reply, right), drafter], True, ctx)
    chosen = []
    while len(ctx.committed) < 2000:
        proposed = scheduler.propose(sources, ctx, 8)
        draft = proposed.draft
        start = len(ctx.committed)
        held = next((i for i, t in enumerate(draft.tokens) if t != reply[start + i]), len(draft.tokens))
        verify_s = 1.0 + 0.1 * len(draft.tokens)
        round_s = verify_s + (0.3 if draft.source == "drafter" else 0.0)
        scheduler.settle(
            proposed, held, dict(tokens=held + 1, round_s=round_s, verify_s=verify_s), len(draft.tokens), 0
        )
        ctx.committed += reply[start : start + held + 1]
        chosen.append(draft.source.split(":")[0])
    late = chosen[len(chosen) // 2 :]
    if right == 0:
        assert chosen.count("context") == 0 and late.count("drafter") >= 0.9 * len(late)
    if right == 1:  # 2 tokens in 1.4 s against the drafter's 3 in 1.6 s
        assert late.count("drafter") >= 0.9 * len(late)
    if right == 4:  # 5 tokens in 1.4 s
        assert late.count("context") >= 0.9 * len(late)
    assert drafter.guesses and all(len(guess) == 4 for guess in drafter.guesses)  # the lookup's draft


def test_the_schedule_log_writes_each_round_and_the_rates_it_was_chosen_among(tmp_path, monkeypatch):
    """OMNIDRAFT_SCHEDULE_LOG: a line a round. A drafter making 3 tokens in 1.5 s (2/s) against
    plain's 1 in 1 s: the drafter is probed first (nothing measured), then plain, which loses to
    the drafter's 2/s and waits 32 rounds, loses again and waits 64."""
    monkeypatch.setenv("OMNIDRAFT_SCHEDULE_LOG", str(tmp_path / "rounds.jsonl"))
    scheduler, ctx = Scheduler(), Context([0])
    reply = scheduler.begin_reply([Steady(list(range(100)))], True, ctx)
    chosen = []
    for _ in range(40):
        proposed = scheduler.propose(reply, ctx, 8)
        tokens, seconds = (3, 1.5) if proposed.draft.source == "drafter" else (1, 1.0)
        timing = dict(tokens=tokens, draft_s=0.0, verify_s=seconds, round_s=seconds)
        scheduler.settle(proposed, tokens - 1, timing, len(proposed.draft.tokens), 0)
        chosen.append(proposed.draft.source)
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rounds] == chosen and [r["round"] for r in rounds] == list(range(1, 41))
    assert rounds[0]["rates"] == {} and rounds[0]["priced_s"] is None and rounds[0]["tokens"] == 3
    plain = [i for i, source in enumerate(chosen) if source == "plain"]
    assert plain == [4, 36]  # the probes: after the drafter's four, then 32 rounds after the first
    assert rounds[4]["rates"] == {"drafter": pytest.approx(2.0)} and rounds[4]["probes"]["plain"]["trial"] == 1
    assert rounds[5]["rates"] == {"drafter": pytest.approx(2.0), "plain": pytest.approx(1.0)}
    assert rounds[5]["rival"] == pytest.approx(1.0) and rounds[5]["priced_s"] == pytest.approx(1.5)
    assert rounds[5]["probes"]["plain"]["wait"] == 32 and rounds[37]["probes"]["plain"]["wait"] == 64
    monkeypatch.delenv("OMNIDRAFT_SCHEDULE_LOG")
    assert Scheduler().log is None
