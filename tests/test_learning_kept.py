"""Learning is never lost (learn/online.py, profile/store.py): a save that fails keeps what was
learned and is tried again; a failed drafter update does not stop the next; under constant load
the server still saves, so a kill -9 loses at most the last interval; a lock held by a stopped
process does not hang the exit."""

import logging
import threading
import time

import numpy as np
import pytest
from mlx_lm import load
from openai import OpenAI
from test_profile_lock import hold_lock
from test_server import start

from omnidraft_mlx import failpoints
from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
from omnidraft_mlx.decode.promptcache import PromptCache
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn import online
from omnidraft_mlx.learn.online import Learning, make_learner
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.profile.store import MANIFEST, Profile, load_head, load_profile, profile_dir
from omnidraft_mlx.prompts import encode_prompt


def arm(monkeypatch, spec: str) -> None:
    monkeypatch.setattr(failpoints, "_armed", failpoints._parse(spec))


def test_a_manifest_that_cannot_be_written_loses_nothing_after_another_process_saves(tmp_path, monkeypatch):
    path, model = tmp_path / "prof", "tiny"
    mine = Profile(path, model, model)
    head = mine.attach_policy(LearnedPolicy(PolicyConfig(name="learned"))).head
    learning = Learning(None, mine, None, PromptCache())
    mine.ngrams.add((5, 6), 7)
    head.learn(np.full((3, 4), 1.0, np.float32), [1, 0, 1], steps=0)
    learning.observe([1], [1], [])
    arm(monkeypatch, "manifest@1")  # the first manifest write fails, as on a full disk
    assert not learning.save()
    assert learning.dirty and mine.ngrams.changed and head.changed  # nothing counted as saved
    assert not (path / MANIFEST).exists()
    theirs = Profile(path, model, model)  # another process saves meanwhile
    their_head = theirs.attach_policy(LearnedPolicy(PolicyConfig(name="learned"))).head
    theirs.ngrams.add((8, 9), 10)
    their_head.learn(np.full((2, 4), 2.0, np.float32), [1, 1], steps=0)
    theirs.save()
    assert not learning.save()  # the backoff runs
    learning.retry_at = time.monotonic()  # ... and ends
    assert learning.save() and not learning.dirty
    assert load_profile(model, model, path=path).ngrams.entries == {(5, 6): 7, (8, 9): 10}
    saved = LearnedPolicy(PolicyConfig(name="learned"))
    load_head(saved, path)
    assert sorted(round(float(f[0])) for f in saved.head.features) == [1, 1, 1, 2, 2]


def test_a_failed_save_backs_off_doubling():
    learning = Learning(None, None, None, PromptCache())
    waits = []
    for _ in range(9):
        learning.save_failures += 1
        waits.append(learning._backoff())
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def observe(learning, pair, prompt: str, reply: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    learning.observe(
        encode_prompt(pair.draft_tok, messages),
        encode_prompt(pair.target_tok, messages),
        list(pair.target_tok.encode(reply, add_special_tokens=False)),
    )


def test_failed_drafter_updates_and_saves_do_not_stop_learning(tiny_dirs, tiny, tmp_path, monkeypatch, caplog):
    """One failed adapter save: the next save holds that update, and the next update runs; a failed
    update: tried again at the next due one; only three failures in a row stop drafter learning."""
    draft, target, path = str(tiny_dirs["draft"]), str(tiny_dirs["target"]), tmp_path / "prof"
    profile = Profile(path, draft, target)
    pair = make_pair(*load(draft), *tiny["target"], profile.ngrams)  # its own drafter: made trainable
    learning = Learning(pair, profile, make_learner(pair, profile, 1), PromptCache())
    arm(monkeypatch, "save@1#adapter")  # the first save of a drafter update fails
    observe(learning, pair, "def add_3(x):", "    return x + 3")
    with caplog.at_level(logging.WARNING, "omnidraft.learn"):
        report = learning.update()
    assert report is not None and learning.dirty and learning.learner.unsaved is not None
    assert "failpoint 'save'" in caplog.text and "saved again in 1s" in caplog.text
    assert not (path / MANIFEST).exists()
    learning.retry_at = time.monotonic()  # the backoff over: the next save holds the update
    assert learning.save() and load_profile(draft, target, path=path).updates == 1
    observe(learning, pair, "print(add_", "3(9))")
    assert learning.update().update == 2 and not learning.dirty
    assert load_profile(draft, target, path=path).updates == 2

    arm(monkeypatch, "update@1")  # the next update fails (its first slice)
    observe(learning, pair, "def add_4(x):", "    return x + 4")
    with pytest.raises(OmniDraftError, match="drafter update failed .*tried again after the next 1 replies"):
        learning.update()
    assert learning.learner is not None and not learning.learner.buffer
    observe(learning, pair, "def add_5(x):", "    return x + 5")
    assert learning.update().update == 3

    arm(monkeypatch, "update")  # every update fails from now on
    for n in range(online.MAX_UPDATE_FAILURES):
        observe(learning, pair, "def add_6(x):", "    return x + 6")
        with pytest.raises(OmniDraftError, match="drafter learning stops" if n == 2 else "tried again"):
            learning.update()
    assert learning.learner is None
    observe(learning, pair, "def add_7(x):", "    return x + 7")  # the n-grams and the head still learn and save
    assert learning.update() is None and learning.save()


def loop_requests(srv, model: str, first: int, stop: threading.Event) -> None:
    """A client sending requests one after another until stop (or the server dies)."""
    with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        i = first
        while not stop.is_set():
            try:
                c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"def add_{i}(x):"}], max_tokens=16
                )
            except Exception:  # the kill lands mid-request
                return
            i += 2


def test_under_constant_load_the_server_saves_and_kill_9_loses_at_most_the_last_interval(
    tiny_dirs, tmp_path, monkeypatch
):
    """Two clients keep the server busy (its queue is never empty long enough to be idle), the
    save interval shortened to 2 s: saves happen between rounds, and after a kill -9 the profile
    holds every n-gram learned before the last two saves began."""
    home = tmp_path / "home"
    monkeypatch.setenv("OMNIDRAFT_SAVE_EVERY_S", "2")
    srv = start(tiny_dirs, home, tmp_path / "server.log", "--no-adapt")
    stop = threading.Event()
    clients = [threading.Thread(target=loop_requests, args=(srv, str(tiny_dirs["target"]), i, stop)) for i in range(2)]
    try:
        for c in clients:
            c.start()
        time.sleep(3)
        before = srv.health()
        assert before["generating"] + before["queued"] > 0 and before["ngrams"] > 0
        deadline = time.monotonic() + 120
        while (h := srv.health())["profile_saves"] < before["profile_saves"] + 2:  # one began after `before`
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.1)
        assert h["served"] > before["served"]  # still under load
        srv.proc.kill()
        srv.proc.wait()
    finally:
        stop.set()
        for c in clients:
            c.join(60)
        srv.stop()
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    assert len(load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"])).ngrams) >= before["ngrams"]


def test_shutdown_with_the_profile_lock_held_elsewhere_ends_within_10_s_and_says_what_is_lost(
    tiny_dirs, tmp_path, monkeypatch
):
    home = tmp_path / "home"
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    srv = start(tiny_dirs, home, tmp_path / "server.log", "--no-adapt")
    holder = hold_lock(profile_dir(str(tiny_dirs["draft"]), str(tiny_dirs["target"])))  # a stopped `adapt`
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
            c.chat.completions.create(
                model=str(tiny_dirs["target"]), messages=[{"role": "user", "content": "def add_3(x):"}], max_tokens=16
            )
        sent = time.monotonic()
        srv.proc.terminate()
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - sent < 10
        log = srv.log.read_text()
        assert "another process held the profile's lock" in log and "is lost (not saved)" in log, log
    finally:
        holder.kill()
        holder.wait()
        srv.stop()
