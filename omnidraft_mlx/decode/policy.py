"""How far to draft each round: draft-length policies behind one interface.

Drafting a token the target will reject wastes a drafter forward; stopping
early wastes a chance to emit several tokens per target forward. A policy is
asked, after each drafted token and before the drafter forward the next one
costs, whether to go on (so a stop wastes no forward; the token just drafted
stands in for the next), and is told how the round went. Policies
(`make_policy` builds one from a PolicyConfig):
- FixedPolicy: always k tokens;
- ConfidencePolicy: stop when the drafter's top probability falls below p_min
  (llama.cpp's rule);
- HeuristicPolicy: k grows by 2 after a fully accepted round, shrinks by 1
  otherwise (transformers' assisted generation);
- LearnedPolicy: the acceptance head (head.py) predicts P(accept | previous
  accepted); stop when 1 - prod P > gamma (OmniDraft), the next token's P
  estimated by the last one's. gamma "auto" (the default) is set from the
  measured costs of drafting and verifying (fit.DraftCost);
- OraclePolicy (bench only): shown the target's reply, it stops exactly where
  the draft leaves it, the bound for any policy with the same drafter.
What the choices were measured on: bench/results/policies/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from omnidraft_mlx.decode.fit import DraftCost
from omnidraft_mlx.decode.head import LearnedHead, token_features, update_recent
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.settings import check_range, check_settings, setting
from omnidraft_mlx.vocab.align import spelled_bytes

POLICIES = ("fixed", "confidence", "heuristic", "learned")


def parse_gamma(text: str) -> float | None:
    """A --gamma value: a number, or "auto" (None: set from measured costs)."""
    if text.strip() == "auto":
        return None
    try:
        return float(text)  # its range is checked where it is used (PolicyConfig, BenchConfig)
    except ValueError:
        raise OmniDraftError(f"--gamma takes a probability between 0 and 1 or 'auto' (got '{text}')") from None


def check_policy(name: str) -> str:
    """The name of a draft-length policy, or a one-line error naming the choices."""
    if name not in POLICIES:
        raise OmniDraftError(f"unknown --policy '{name}': use one of {', '.join(POLICIES)}")
    return name


@dataclass(kw_only=True)
class PolicyConfig:
    name: str = setting("fixed", flag="--policy", choices=(*POLICIES, "oracle"))  # the oracle: bench only
    k: int = setting(4, flag="--k", low=1)  # fixed length; start length for heuristic; before the head has learned
    max_k: int = 8  # cap for the adaptive policies
    # The confidence policy's threshold.
    p_min: float = setting(0.6, flag="the confidence threshold p_min", low=0.0, high=1.0, open_low=True, open_high=True)
    # Learned policy: stop when P(some rejection) exceeds gamma; None = auto.
    gamma: float | None = setting(None, flag="--gamma", low=0.0, high=1.0)
    start_gamma: float = 0.5  # auto, until the costs are measured
    cost_decay: float = 0.9  # auto: weight of the past in the running cost sums, per round
    warmup: int = 256  # labelled draft tokens before the head decides
    update_every: int = 8  # rounds between head updates
    buffer: int = 8192  # bounded replay buffer of (features, label)
    hidden: bool = False  # add the drafter's hidden state to the head's features
    recent_decay: float = 0.9  # weight of the past in the reply's recent acceptance, per label

    def __post_init__(self):
        check_settings(self)
        if self.name != "fixed":  # the cap of the adaptive policies
            check_range("--max-k", self.max_k, self.k)


class DraftPolicy:
    """Decides, token by token, whether to keep drafting; told how each round went.
    The base drafts up to max_k tokens and learns nothing."""

    needs_features = False  # wants_more takes the head's features of each drafted token
    head: LearnedHead | None = None  # what the policy learns, kept in the pair's profile

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg

    @property
    def max_len(self) -> int:
        """The most tokens to draft this round."""
        return self.cfg.max_k

    def begin_reply(self) -> None:
        pass

    def begin_round(self) -> None:
        pass

    def wants_more(self, logits: mx.array, token: int, features: mx.array | None, forward: bool = True) -> bool:
        """Whether to draft one more token after the one just drafted (from `logits`);
        forward: the next token costs a drafter forward."""
        return True

    def observe(self, features: list[mx.array], accepted: list[bool]) -> None:
        """This round's proposed draft tokens: did their text reach the output?"""

    def time_round(
        self, draft_s: float, forwards: int, verify_s: float, drafted: int, round_s: float, tokens: int
    ) -> None:
        """What one round cost and made."""


class FixedPolicy(DraftPolicy):
    @property
    def max_len(self) -> int:
        return self.cfg.k


class ConfidencePolicy(DraftPolicy):
    def wants_more(self, logits: mx.array, token: int, features: mx.array | None, forward: bool = True) -> bool:
        return mx.softmax(logits)[token].item() >= self.cfg.p_min


class HeuristicPolicy(DraftPolicy):
    def __init__(self, cfg: PolicyConfig):
        super().__init__(cfg)
        self.k = cfg.k  # the current length

    @property
    def max_len(self) -> int:
        return self.k

    def observe(self, features: list[mx.array], accepted: list[bool]) -> None:
        self.k = min(self.cfg.max_k, self.k + 2) if all(accepted) else max(1, self.k - 1)


class LearnedPolicy(DraftPolicy):
    """Stops when the head's P(a rejection by the next token) exceeds gamma; k tokens a
    round until the head has `warmup` labels. Learns from every round."""

    needs_features = True

    def __init__(self, cfg: PolicyConfig):
        super().__init__(cfg)
        self.head = LearnedHead(cfg.buffer, cfg.hidden)
        self.cost = DraftCost(cfg.cost_decay)
        self.recent = 1.0  # the reply's recent acceptance (a head feature)
        self._survival = 1.0  # prod of P(accept) over this round's tokens

    @property
    def ready(self) -> bool:
        return self.head.net is not None and len(self.head.labels) >= self.cfg.warmup

    @property
    def max_len(self) -> int:
        return self.cfg.max_k if self.ready else self.cfg.k

    @property
    def gamma(self) -> float:
        """cfg.gamma, or from the measured costs (fit.DraftCost)."""
        return self.threshold(forward=True)

    def threshold(self, forward: bool) -> float:
        """gamma for one more draft token; forward=False: its drafter forward is already paid
        (the drafter read a guess ahead), so with gamma auto only its verification is priced."""
        if self.cfg.gamma is not None:
            return self.cfg.gamma
        measured = self.cost.gamma(forward)
        return self.cfg.start_gamma if measured is None else measured

    def time_round(
        self, draft_s: float, forwards: int, verify_s: float, drafted: int, round_s: float, tokens: int
    ) -> None:
        self.cost.add(draft_s, forwards, verify_s, drafted, round_s, tokens)

    def begin_reply(self) -> None:
        self.recent = 1.0

    def begin_round(self) -> None:
        self._survival = 1.0

    def features_of(self, hidden: mx.array, logits: mx.array, token, depth, recent=None) -> mx.array:
        """The head's features of a drafted token (rows, given a replay's depths and recent acceptance)."""
        recent = self.recent if recent is None else recent
        return token_features(hidden if self.cfg.hidden else None, logits, token, depth, recent)

    def wants_more(self, logits: mx.array, token: int, features: mx.array | None, forward: bool = True) -> bool:
        if not self.ready:
            return True
        p = self.head.p_accept(features)
        self._survival *= p
        return 1.0 - self._survival * p <= self.threshold(forward)  # P(a rejection by the next token)

    def observe(self, features: list[mx.array], accepted: list[bool]) -> None:
        if not features:
            return
        # P(accept | previous accepted): tokens after the first rejection carry no label.
        labels = list(accepted[: accepted.index(False) + 1] if False in accepted else accepted)
        self.recent = update_recent(self.recent, labels, self.cfg.recent_decay)
        head = self.head
        head.rounds += 1
        due = head.rounds % self.cfg.update_every == 0 and len(head.labels) + len(labels) >= 32
        head.learn(np.stack([np.array(f) for f in features[: len(labels)]]), labels, steps=4 if due else 0)


class OraclePolicy(DraftPolicy):
    """Bench only: shown the target's greedy reply in advance (`start`), it drafts exactly
    as long as the drafted text agrees with it and stops at the first wrong token
    (proposed for free, no forward paid after it). No draft-length policy can stop
    better with the same drafter, so its speedup bounds what any of them can gain.
    (bench/policy_replay.py replays it without showing it a reply: it stops it itself.)"""

    def __init__(self, cfg: PolicyConfig):
        super().__init__(cfg)
        self.vmap = None
        self.reply = b""  # the target's greedy reply, set per prompt
        self.committed = b""  # what the decoding has emitted so far
        self.drafted = b""

    def start(self, reply: list[int], vmap) -> None:
        """A new prompt, whose greedy reply (target ids) is `reply`; vmap: the pair's."""
        self.vmap = vmap
        self.reply = spelled_bytes(reply, vmap.target_bytes)
        self.committed = b""

    def advance(self, new: list[int]) -> None:
        """The decoding emitted `new` (target ids)."""
        self.committed += spelled_bytes(new, self.vmap.target_bytes)

    def begin_round(self) -> None:
        self.drafted = b""

    def wants_more(self, logits, token: int, features, forward: bool = True) -> bool:
        self.drafted += self.vmap.draft_bytes[token] or b""
        return self.reply.startswith(self.committed + self.drafted)


KINDS = {
    "fixed": FixedPolicy,
    "confidence": ConfidencePolicy,
    "heuristic": HeuristicPolicy,
    "learned": LearnedPolicy,
    "oracle": OraclePolicy,
}


def make_policy(cfg: PolicyConfig) -> DraftPolicy:
    """The policy cfg names."""
    return KINDS[cfg.name](cfg)
