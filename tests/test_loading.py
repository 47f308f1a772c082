"""open_pair: the one way a verb opens a pair with what it learned (the profile's n-grams, the
policy's head, the history index), on the tiny models."""

from omnidraft_mlx.decode.policy import PolicyConfig, make_policy
from omnidraft_mlx.loading import open_pair
from omnidraft_mlx.profile.store import HEAD, HISTORY, profile_dir


def test_open_pair_brings_back_what_the_profile_kept(tmp_path, tiny_dirs, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    draft, target = str(tiny_dirs["draft"]), str(tiny_dirs["target"])
    policy = make_policy(PolicyConfig(name="learned"))
    first = open_pair(draft, target, policy=policy)
    assert first.profile.path == profile_dir(draft, target)  # keyed by the names given, as always
    assert first.pair.ngrams is first.profile.ngrams and first.policy is policy
    assert {HEAD, HISTORY} <= set(first.profile.parts)  # saved with every profile save from now on
    first.pair.ngrams.add((5, 6), 7)
    first.history.add(list(range(50, 80)))
    first.profile.save()

    again = open_pair(
        draft, target, loaded=(first.pair.draft, first.pair.draft_tok, first.pair.target, first.pair.target_tok)
    )
    assert len(again.pair.ngrams) == len(first.pair.ngrams) > 0
    assert len(again.history) == len(first.history) > 0
    assert again.policy is None and HEAD not in again.profile.parts

    bare = open_pair(draft, target, profile=False, policy=policy)
    assert bare.profile is None and bare.history is None and len(bare.pair.ngrams) == 0
