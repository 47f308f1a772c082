"""Loading models by name, and opening a pair with what it learned: the one way
every verb (generate, chat, serve, adapt, bench) gets its drafter and target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omnidraft_mlx.collectives import world
from omnidraft_mlx.decode.lookup import HistoryIndex
from omnidraft_mlx.decode.policy import DraftPolicy
from omnidraft_mlx.decode.ranks import ranks_of, shard_target
from omnidraft_mlx.decode.widths import verify_costs
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import Pair, make_pair
from omnidraft_mlx.paths import LOCAL, Resolver
from omnidraft_mlx.profile.store import Profile, load_profile


def load_model(name: str, resolver: Resolver = LOCAL, shard: str | None = None):
    """(model, tokenizer) for a model `resolver` can find: by default a local
    MLX/HF directory or a Hugging Face id; the command line's resolver adds catalog
    names (pulled on first use) and .gguf files (converted once). Given `shard` (a way,
    decode/ranks.SHARDINGS) under mlx.launch, the model is split over the ranks, each
    loading its own part of the weights (decode/ranks.shard_target)."""
    from mlx_lm import load

    group = world() if shard else None
    split = group is not None and group.size() > 1
    path = resolver.path(name)
    try:
        model, tokenizer = load(path, lazy=split)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        raise OmniDraftError(
            f"could not load model '{name}' ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
            "check the name with `omnidraft models list`, or pass a local model directory"
        ) from e
    if split:
        shard_target(model, group, shard)
    return model, tokenizer


@dataclass
class OpenPair:
    """A pair with what it learned: the profile (None: ignored), and the policy and history
    index it keeps (None: not asked for, or no profile to keep them in)."""

    pair: Pair
    profile: Profile | None
    policy: DraftPolicy | None
    history: HistoryIndex | None


def open_pair(
    draft: str,
    target: str,
    *,
    resolver: Resolver = LOCAL,
    loaded: tuple | None = None,
    shard: str | None = None,
    profile: bool = True,
    trainable: bool = False,
    profile_path: Path | None = None,
    policy: DraftPolicy | None = None,
    history: bool = True,
    costs: bool = True,
) -> OpenPair:
    """Load both models, load the pair's profile, make the pair, attach the policy, attach the
    history index, in that order (the profile's adapter goes into the drafter before the pair
    is made; the policy's head and the history take in what the profile saved of them).

    loaded: (draft model, draft tokenizer, target model, target tokenizer) when the caller
    loaded them already; shard: load_model's, for the target (split over the ranks of mlx.launch); profile=False ignores
    the profile (nothing is attached or saved; so on the ranks other than the lead of a split
    target, which draft nothing: decode/ranks.py);
    trainable keeps the adapter trainable (for learning) instead of fused; profile_path reads
    the profile from there instead of its place under model_home(); history=False attaches no
    history index; costs measures what verifying each draft length costs the target here, if
    not measured on this machine yet (decode/widths.py: a few seconds once, so no reply pays it;
    not for a split target, whose forwards every rank must run: its rounds measure it)."""
    if loaded is None:
        draft_model, draft_tok = load_model(draft, resolver)
        target_model, target_tok = load_model(target, resolver, shard)
    else:
        draft_model, draft_tok, target_model, target_tok = loaded
    ranks = ranks_of(target_model)
    profile, costs = profile and ranks.lead, costs and ranks.group is None
    saved = (
        load_profile(draft, target, draft_model, trainable=trainable, path=profile_path, resolver=resolver)
        if profile
        else None
    )
    pair = make_pair(draft_model, draft_tok, target_model, target_tok, saved.ngrams if saved else None)
    if costs:
        verify_costs(target_model)
    index = None
    if saved is not None:
        if policy is not None:
            saved.attach_policy(policy)  # its acceptance head is saved with every profile save from now on
        if history:
            index = saved.attach_history(HistoryIndex())
    return OpenPair(pair, saved, policy, index)
