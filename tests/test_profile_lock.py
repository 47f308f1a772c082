"""One profile, several writers: real processes saving the same profile at once
keep every contribution (n-grams, head labels, updates); a save in flight keeps
its files; a lock held elsewhere is waited for a while, then a clear error; Ctrl-C
never leaves learned state half-updated."""

import inspect
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mlx_lm import load

from omnidraft_mlx.decode.head import LearnedHead
from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.distill import DistillConfig, setup_trainable
from omnidraft_mlx.profile.adapter import trainable_weights
from omnidraft_mlx.profile.store import LOCK, MANIFEST, Profile, load_head, load_profile, profile_files
from omnidraft_mlx.vocab.ngram import NGramCache

WRITER = Path(__file__).with_name("profile_writer.py")


def writer(tiny_dirs, path, tag, saves, go, *held):
    """A writer process (tests/profile_writer.py), returned once it has loaded the profile."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WRITER),
            str(tiny_dirs["draft"]),
            str(tiny_dirs["target"]),
            str(path),
            str(tag),
            str(saves),
            str(go),
            *map(str, held),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "loaded\n", proc.communicate()[1]
    return proc


def finish(proc) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return err


def check_loads(tiny_dirs, path):
    """The profile loads, its adapter is one writer's whole, and it holds no file it does not name."""
    model, _ = load(str(tiny_dirs["draft"]))
    profile = load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), model, trainable=True, path=path)
    values = {float(v.min()) for v in trainable_weights(model).values()} | {
        float(v.max()) for v in trainable_weights(model).values()
    }
    assert len(values) == 1 and values <= {1.0, 2.0, 3.0}
    assert sorted(p.name for p in path.iterdir()) == sorted(profile_files(path) + [LOCK])
    policy = LearnedPolicy(PolicyConfig(name="learned"))
    load_head(policy, path)
    return profile, {round(float(f[0])) for f in policy.head.features}


def test_two_processes_saving_at_once_keep_both_contributions(tmp_path, tiny_dirs):
    path, go, saves = tmp_path / "prof", tmp_path / "go", 5
    procs = [writer(tiny_dirs, path, tag, saves, go) for tag in (1, 2)]
    go.touch()
    errs = [finish(p) for p in procs]
    profile, head_rows = check_loads(tiny_dirs, path)
    assert profile.updates == 2 * saves  # both writers' updates counted
    assert set(profile.ngrams.entries) == {(1000 * tag + i, 7) for tag in (1, 2) for i in range(saves)}
    assert head_rows == {100 * tag + i for tag in (1, 2) for i in range(saves)}
    assert sorted(r["writer"] for r in profile.manifest["history"]) == [1] * saves + [2] * saves
    assert [r["update"] for r in profile.manifest["history"]] == list(range(1, 2 * saves + 1))
    assert profile.position("c") == saves  # both read the corpus from the start: where to resume
    # Both loaded the empty profile before either saved: the one that saved second was told.
    notes = [line for err in errs for line in err.splitlines() if "another process saved" in line]
    assert notes and "is now the newest" in notes[0]


def test_a_save_in_flight_keeps_its_files(tmp_path, tiny_dirs):
    path, go, held, release = tmp_path / "prof", tmp_path / "go", tmp_path / "held", tmp_path / "release"
    go.touch()
    finish(writer(tiny_dirs, path, 1, 1, go))
    second = writer(tiny_dirs, path, 3, 1, tmp_path / "go-second")  # loads the same profile as first
    first = writer(tiny_dirs, path, 2, 1, go, held, release)  # stops with its files written, lock held
    while not held.exists():
        assert first.poll() is None, first.stderr.read()
        time.sleep(0.05)
    fresh = sorted(set(p.name for p in path.iterdir()) - set(profile_files(path)) - {LOCK})
    assert any(f.startswith("adapter-") for f in fresh) and any(f.startswith("ngrams-") for f in fresh)
    (tmp_path / "go-second").touch()  # saves meanwhile: must wait, then build on the first
    time.sleep(3)
    assert second.poll() is None and all((path / f).exists() for f in fresh)
    release.touch()
    finish(first)
    assert "another process saved 1 drafter update" in finish(second)
    profile, head_rows = check_loads(tiny_dirs, path)
    assert profile.updates == 3 and head_rows == {100, 200, 300}
    assert set(profile.ngrams.entries) == {(1000, 7), (2000, 7), (3000, 7)}
    assert profile.manifest["history"][-1]["writer"] == 3  # the waiting writer saved last


def test_generate_style_save_keeps_the_adapter_and_merges_parts(tmp_path, tiny_dirs):
    """A process saving no update (generate, chat without learning) leaves another's adapter and
    merges its n-grams and lookup counts into what another process saved since it loaded."""
    draft, target, path = str(tiny_dirs["draft"]), str(tiny_dirs["target"]), tmp_path / "prof"
    reader = load_profile(draft, target, path=path)  # nothing saved yet
    reader.ngrams.add((5, 6), 1)
    model, _ = load(draft)
    setup_trainable(model, DistillConfig(lora_rank=4))
    trainer = load_profile(draft, target, path=path)
    trainer.ngrams.add((5, 6), 1)
    trainer.ngrams.add((8, 9), 2)
    trainer.ngrams.record_use((5, 6))
    trainer.save(model, distill=DistillConfig(lora_rank=4).__dict__)
    reader.ngrams.record_use((5, 6))
    reader.save()
    saved = json.loads((path / MANIFEST).read_text())
    assert saved["updates"] == 1 and saved["files"]["adapter"] == trainer.manifest["files"]["adapter"]
    merged = load_profile(draft, target, path=path).ngrams
    assert merged.entries == {(5, 6): 1, (8, 9): 2} and merged.uses[(5, 6)] == 2


def test_ngram_merge_counts_only_what_was_learned_since_the_last_save(tmp_path):
    mine = NGramCache()
    mine.add((1, 2), 3)
    mine.record_use((1, 2))
    mine.save(tmp_path / "a.json")
    mine.mark_saved()  # as the profile does once its manifest names the file
    theirs = NGramCache.load(tmp_path / "a.json")  # the same base, then each learns on
    theirs.add((4, 5), 6)
    theirs.record_use((1, 2))
    mine.add((7, 8), 9)
    mine.record_use((1, 2))
    mine.merge(theirs)
    assert mine.entries == {(1, 2): 3, (4, 5): 6, (7, 8): 9}
    assert mine.uses == {(1, 2): 3, (4, 5): 0, (7, 8): 0}  # the base's use once, then one each
    assert mine.match([7, 8, 1], 0) == (7, 8) and mine.match([4, 5], 0) == (4, 5)


def interrupt_at(func, text: str):
    """A trace function that sends this process SIGINT (Ctrl-C) when `func` reaches
    its line containing `text`; install it with sys.settrace."""
    lines, first = inspect.getsourcelines(func)
    target = first + next(i for i, line in enumerate(lines) if text in line)
    code, sent = func.__code__, []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    return tracer


def interrupted(func, text: str, call) -> bool:
    """Run call() with Ctrl-C landing at `text` in `func`; whether KeyboardInterrupt came."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    sys.settrace(interrupt_at(func, text))
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_ctrl_c_inside_ngram_and_policy_updates_waits_for_them():
    cache = NGramCache()
    assert interrupted(NGramCache._insert, "bucket.append", lambda: cache.add((1, 2, 3), 4))
    assert cache.entries == {(1, 2, 3): 4} and cache.uses == {(1, 2, 3): 0}
    assert cache.by_first[1] == [(1, 2, 3)] and cache.fresh == {(1, 2, 3)}
    assert interrupted(NGramCache.record_use, "self.used[gram]", lambda: cache.record_use((1, 2, 3)))
    assert cache.uses[(1, 2, 3)] == cache.used[(1, 2, 3)] == 1

    head = LearnedHead(buffer=8192, hidden=False)
    rows = np.ones((3, 4), np.float32)
    assert interrupted(LearnedHead.learn, "self.labels +=", lambda: head.learn(rows, [1, 0, 1], steps=0))
    assert len(head.features) == len(head.labels) == head.unsaved == 3


def test_ctrl_c_during_a_save_lets_it_finish(tmp_path, tiny_dirs):
    draft, target, path = str(tiny_dirs["draft"]), str(tiny_dirs["target"]), tmp_path / "prof"
    model, _ = load(draft)
    setup_trainable(model, DistillConfig(lora_rank=4))
    profile = Profile(path, draft, target)
    profile.ngrams.add((1, 2), 3)
    assert interrupted(
        Profile._save_locked,
        "atomic_write_text(self.path / MANIFEST",
        lambda: profile.save(model, distill=DistillConfig(lora_rank=4).__dict__),
    )
    loaded = load_profile(draft, target, load(draft)[0], path=path)
    assert loaded.updates == 1 and (1, 2) in loaded.ngrams.entries
    assert sorted(p.name for p in path.iterdir()) == sorted(profile_files(path) + [LOCK])


def test_the_interrupt_checks_can_fail(monkeypatch):
    """Without the deferral a Ctrl-C at that line does leave the cache torn (the test above can fail)."""
    import contextlib

    import omnidraft_mlx.vocab.ngram as ngram

    monkeypatch.setattr(ngram, "deferred_interrupt", contextlib.nullcontext)
    cache = NGramCache()
    assert interrupted(NGramCache._insert, "bucket.append", lambda: cache.add((1, 2, 3), 4))
    assert (1, 2, 3) in cache.entries and cache.by_first[1] == []


def hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the profile's lock, then stopped (SIGSTOP), as a stopped `omnidraft adapt`
    in the middle of a save would; returned once it holds it (kill() ends it)."""
    path.mkdir(parents=True, exist_ok=True)
    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path / LOCK)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    proc.send_signal(signal.SIGSTOP)
    return proc


def test_a_lock_held_elsewhere_is_waited_for_a_while_then_a_clear_error_and_nothing_lost(tmp_path, tiny_dirs):
    draft, target, path = str(tiny_dirs["draft"]), str(tiny_dirs["target"]), tmp_path / "prof"
    profile = Profile(path, draft, target)
    profile.ngrams.add((1, 2), 3)
    holder = hold_lock(path)
    try:
        start = time.monotonic()
        with pytest.raises(OmniDraftError, match="another process held the profile's lock .* for over 0.5s"):
            profile.save(wait_s=0.5)
        assert 0.5 <= time.monotonic() - start < 3
        assert profile.ngrams.changed  # kept for the next save
    finally:
        holder.kill()
        holder.wait()
    profile.save(wait_s=0.5)
    assert load_profile(draft, target, path=path).ngrams.entries == {(1, 2): 3}
