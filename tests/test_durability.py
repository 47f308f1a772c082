"""What keeps learned state whole: signals held while it changes, a model's identity read from
every byte of its weights (computed once per file version), old profiles still loading, and the
failpoints the server tests aim."""

import json
import os
import shutil
import signal

import pytest

from omnidraft_mlx import failpoints
from omnidraft_mlx.decode.lookup import HistoryIndex
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.profile.learned import deferred_interrupt
from omnidraft_mlx.profile.store import Profile, load_profile, model_identity, profile_dir


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_are_held_until_the_block_ends(sig):
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as `omnidraft serve` does
    try:
        reached_end = False
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupt():
                os.kill(os.getpid(), sig)
                reached_end = True  # the signal did not cut the block short
        assert reached_end
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler  # handlers put back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_failpoints_parse_and_aim(monkeypatch):
    monkeypatch.setattr(failpoints, "_armed", failpoints._parse("verify@2,draft#BOOM,save~0.01"))
    failpoints.failpoint("verify")  # the 1st hit passes
    with pytest.raises(failpoints.FailpointError):
        failpoints.failpoint("verify")
    failpoints.failpoint("verify")  # only the 2nd
    failpoints.failpoint("draft", "a quiet request")
    with pytest.raises(failpoints.FailpointError):
        failpoints.failpoint("draft", '[{"content": "BOOM"}]')
    failpoints.failpoint("save")  # a stall, not an error
    failpoints.failpoint("finish")  # not armed
    with pytest.raises(ValueError, match="name\\[@n\\]"):
        failpoints._parse("verify@x")


def model_copy(tiny_dirs, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_dirs["target"], copy)
    return copy


def test_a_fine_tune_of_the_same_shape_is_another_model(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    model = model_copy(tiny_dirs, tmp_path)
    before = model_identity(str(model))
    assert before.startswith("weights:") and model_identity(str(model)) == before
    (weights,) = model.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2  # neither the first nor the last 64 KiB: the old identity missed this
    data[middle] ^= 0xFF
    stat = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime: the cached digest
    assert model_identity(str(model)) == before
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: read again
    assert model_identity(str(model)) != before
    cache = json.loads((tmp_path / "home" / "digests.json").read_text())
    assert cache[str(weights.resolve())][:2] == [weights.stat().st_size, weights.stat().st_mtime_ns]


def test_a_profile_with_the_old_sampled_identity_still_loads_and_is_migrated(tiny_dirs, tmp_path, monkeypatch):
    from omnidraft_mlx.profile.digest import sampled_digest

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    model = str(model_copy(tiny_dirs, tmp_path))
    profile = Profile(profile_dir(model, model), model, model)
    profile.ngrams.add((5, 6), 7)
    profile.save()
    manifest_path = profile.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    old = f"dir:{sampled_digest(tmp_path / 'model')}"
    manifest["draft_id"] = manifest["target_id"] = old  # as a profile saved before the full digest
    manifest_path.write_text(json.dumps(manifest))
    loaded = load_profile(model, model)
    assert len(loaded.ngrams) == len(profile.ngrams) > 0
    loaded.save()
    assert json.loads(manifest_path.read_text())["draft_id"] == model_identity(model)  # the new form from now on
    manifest["draft_id"] = "dir:" + "0" * 32  # other weights, in the old form: still refused
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(OmniDraftError, match="another draft model"):
        load_profile(model, model)


def test_rows_forwarded_one_by_one_all_go_back_when_one_fails(tiny, monkeypatch):
    """forward_trees' promise when a batch cannot share a forward: on an exception every cache
    holds what it held before, the rows forwarded before the failing one too."""
    from omnidraft_mlx.decode import batch
    from omnidraft_mlx.decode.kvcache import KVSlot
    from omnidraft_mlx.decode.tree import TokenTree

    def forward_tree(model, slot, root, tree):
        if slot is second:
            raise RuntimeError("a fault in this row's forward")
        return layouts_forward_tree(model, slot, root, tree)

    model = tiny["target"][0]
    first, second = KVSlot.fresh(model), KVSlot.fresh(model)
    for slot in (first, second):
        slot.extend(model, [5, 6, 7])
    layouts_forward_tree = batch.forward_tree
    monkeypatch.setattr(batch, "forward_tree", forward_tree)
    monkeypatch.setattr(batch, "batchable", lambda slots: False)  # one forward per row
    with pytest.raises(RuntimeError, match="this row"):
        batch.forward_trees(model, [first, second], [8, 8], [TokenTree.of([9, 10]), TokenTree.of([9])])
    assert first.tokens == [5, 6, 7] and all(c.offset == 3 for c in first.cache)
    (out,) = batch.forward_trees(model, [first], [8], [TokenTree.of([9, 10])])  # and decodes on from there
    assert first.tokens == [5, 6, 7, 8, 9, 10] and out.shape[0] == 3


def test_a_save_rewrites_only_the_parts_that_changed(tiny_dirs, tmp_path, monkeypatch):
    from omnidraft_mlx.profile.store import HISTORY, NGRAMS

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    model = str(tiny_dirs["target"])
    profile = Profile(profile_dir(model, model), model, model)
    history = profile.attach_history(HistoryIndex())
    profile.ngrams.add((5, 6), 7)
    history.add(list(range(40)))
    profile.save()
    first = dict(profile.synced)
    assert not profile.ngrams.changed and not history.changed
    profile.ngrams.add((8, 9), 10)  # the n-grams learn; the history does not
    assert profile.ngrams.changed
    profile.save()
    assert profile.synced[HISTORY] == first[HISTORY] and profile.synced[NGRAMS] != first[NGRAMS]
    again = load_profile(model, model)
    # both whole, the old file kept
    assert len(again.ngrams) == 2 and len(again.attach_history(HistoryIndex())) == len(history)


def test_serve_saves_when_quiet_and_between_rounds_once_learning_waited_save_every(tiny_dirs, tmp_path, monkeypatch):
    from omnidraft_mlx.decode.promptcache import PromptCache
    from omnidraft_mlx.learn import online
    from omnidraft_mlx.learn.online import Learning

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    model = str(tiny_dirs["target"])
    profile = Profile(profile_dir(model, model), model, model)
    learn = Learning(None, profile, None, PromptCache())
    profile.ngrams.add((5, 6), 7)
    learn.observe([1, 2], [1, 2], [3])
    learn.idle()  # a reply just now, learned just now: not yet
    learn.between_rounds()
    assert learn.saves == 0 and learn.pending
    learn.unsaved_since -= online.SAVE_EVERY_S  # replies kept the server busy that long: saved between rounds
    learn.between_rounds()
    assert learn.saves == 1 and not learn.pending
    learn.observe([1, 2], [1, 2], [3])
    learn.idle()
    assert learn.saves == 1
    learn.last_reply -= online.QUIET_S  # no reply for a while: saved
    learn.idle()
    assert learn.saves == 2 and load_profile(model, model).ngrams.entries == {(5, 6): 7}
