"""How far to draft each round.

Drafting a token the target will reject wastes a drafter forward; stopping
early wastes a chance to emit several tokens per target forward. Policies:
- `fixed`: always k tokens;
- `confidence`: stop when the drafter's top probability falls below p_min
  (llama.cpp's rule, applied before paying for the next token);
- `heuristic`: k grows by 2 after a fully accepted round, shrinks by 1
  otherwise (transformers' assisted generation);
- `learned`: a small acceptance head on the drafter's features predicts
  P(accept | previous accepted); stop when 1 - prod P > gamma (OmniDraft),
  the next token's P estimated by the last one's, so no forward is wasted.
  Trained online from the verification of the translated target tokens, so it
  works across vocabularies; batch adaptation trains it too, on teacher-forced
  replays of the target's replies (`replay_depths`, adapt.head_labels).

gamma "auto" (the default) is set from measured costs: one more draft token
adds prod P expected tokens and costs one drafter forward plus the target's
verification of one more token, which is worth it while prod P exceeds what
decoding makes, on average, in that time:
    gamma = 1 - (s per drafter forward + s to verify a draft token) * (tokens per s).
The second term is the slope of verification time over draft length, fitted
over recent rounds; on a CPU it is not small (measured: 6.5 % of a target
step per token on Qwen 0.5B and 1.5B, 0.16x and 0.4x what a SmolLM2 forward costs).
So a drafter that is cheap next to its target drafts further (best measured
gamma: 0.7 on Qwen 1.5B, 0.3 on Qwen 0.5B, where the drafter costs 1/7 and
0.4 of a target step); it follows the machine's load as it changes.

The head's default features are the cheap signals (log q of the token, the
entropy, the depth) and the reply's recent acceptance: a decaying mean of the
labels of its earlier rounds, from 1.0 at the start of each reply. A token's
own signals cannot tell a stretch the drafter has right (a list, a repeated
formula) from one where it is about to fail; how the last rounds went helps
(offline, on teacher-forced labels of SmolLM2 against Qwen 0.5B's replies:
held-out AUC 0.867 -> 0.874; simulated throughput +2.6 to +3.0 points per task
at gamma 0.7 with a drafter forward at 0.15 of a target step, computed from the
simulated policy's own rounds as decoding does; benchmarked with heads
relabelled for it, math went from -1.6 % / -1.4 % to +5.9 % / +4.3 % over the
best fixed length on Qwen 0.5B / 1.5B, bench/results/policies/ v8 -> v9).
The hidden state is optional: on 1,741 labels from SmolLM2 -> Qwen 0.5B (first
75 % to train, last 25 % held out), held-out AUC 0.91 with the token's three
signals, 0.86 with the 576-dim hidden state added (it overfits at this data
size); the token's log q alone has AUC 0.92. The loss is plain BCE: the
stopping rule multiplies probabilities, so they must be calibrated
(class-balanced weights shifted the mean prediction from 0.90 to 0.72).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from omnidraft_mlx.atomic import atomic_write_bytes
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.fit import VerifyCost
from omnidraft_mlx.learned import deferred_interrupt
from omnidraft_mlx.settings import check_choice, check_range

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


@dataclass
class PolicyConfig:
    name: str = "fixed"
    k: int = 4  # fixed length; start length for heuristic; length before the head has learned
    max_k: int = 8  # cap for the adaptive policies
    p_min: float = 0.6  # confidence policy threshold
    gamma: float | None = None  # learned policy: stop when P(some rejection) exceeds gamma; None = auto
    start_gamma: float = 0.5  # auto, until the costs are measured
    cost_decay: float = 0.9  # auto: weight of the past in the running cost sums, per round
    warmup: int = 256  # labelled draft tokens before the head decides
    update_every: int = 8  # rounds between head updates
    buffer: int = 8192  # bounded replay buffer of (features, label)
    hidden: bool = False  # add the drafter's hidden state to the head's features
    recent_decay: float = 0.9  # weight of the past in the reply's recent acceptance, per label

    def __post_init__(self):
        check_choice("--policy", self.name, (*POLICIES, "oracle"))  # the oracle: bench only
        check_range("--k", self.k, 1)
        if self.name != "fixed":  # the cap of the adaptive policies
            check_range("--max-k", self.max_k, self.k)
        if self.gamma is not None:
            check_range("--gamma", self.gamma, 0.0, 1.0)
        check_range("the confidence threshold p_min", self.p_min, 0.0, 1.0, open_low=True, open_high=True)


FEATURES = ("log_q", "entropy", "depth", "recent_acceptance")  # after the hidden state, if any


def token_features(hidden: mx.array | None, logits: mx.array, token, depth, recent) -> mx.array:
    """What the head sees of a drafted token (or, given rows, of each): FEATURES,
    after the hidden state if given."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    entropy = -(mx.exp(logprobs) * logprobs).sum(-1)
    logq = mx.take_along_axis(logprobs, mx.array(token)[..., None], -1)[..., 0]
    extra = mx.stack([logq, entropy, mx.array(depth, dtype=mx.float32), mx.array(recent, dtype=mx.float32)], -1)
    return extra if hidden is None else mx.concatenate([hidden.astype(mx.float32), extra], -1)


def replay_depths(kept: np.ndarray, max_k: int) -> np.ndarray:
    """Draft depth of each position of a reply under greedy speculative decoding
    that drafts max_k tokens a round, given whether the drafter's token at each
    position is the reply's (-1: not drafted, the target's bonus token after a
    fully accepted round). A round ends at its first rejection; the target's
    token there is the next round's context."""
    depths = np.full(len(kept), -1)
    start = 0
    while start < len(kept):
        n = 0
        while n < max_k and start + n < len(kept):
            depths[start + n] = n
            n += 1
            if not kept[start + n - 1]:
                break
        start += n + bool(kept[start + n - 1])  # a fully accepted round ends with the target's own token
    return depths


def update_recent(recent: float, labels, decay: float) -> float:
    """The recent acceptance after a round's labels."""
    for label in labels:
        recent = decay * recent + (1 - decay) * float(label)
    return recent


def replay_recent(kept: np.ndarray, depths: np.ndarray, decay: float) -> np.ndarray:
    """The recent acceptance each position of a replayed reply (`replay_depths`)
    is drafted with: every token of a round sees the value from before it."""
    recent, before, out = 1.0, 1.0, np.ones(len(kept), np.float32)
    for i, (label, depth) in enumerate(zip(kept, depths)):
        if depth == 0:
            before = recent
        out[i] = before
        if depth >= 0:
            recent = update_recent(recent, [label], decay)
    return out


class AcceptanceHead(nn.Module):
    def __init__(self, dims: int, hidden: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.l1 = nn.Linear(dims, hidden)
        self.l2 = nn.Linear(hidden, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.l2(nn.gelu(self.l1(self.norm(x)))).squeeze(-1)  # logit of P(accept)


class DraftPolicy:
    """Decides, token by token, whether to keep drafting; learns from verification."""

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.k = cfg.k  # heuristic's current length
        self.head: AcceptanceHead | None = None
        self.opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01)
        self.features: list[np.ndarray] = []
        self.labels: list[float] = []
        self.rounds = 0
        self.unsaved = 0  # labels added since loaded or saved (the newest in the buffer)
        self.synced_rounds = 0  # rounds when loaded or saved
        self._survival = 1.0  # prod of P(accept) over this round's tokens
        self.recent = 1.0  # the reply's recent acceptance (a head feature)
        self._cost = np.zeros(4)  # decaying sums over rounds: drafting s, drafter forwards, round s, tokens emitted
        self._verify = VerifyCost(cfg.cost_decay)
        self._timed = 0  # rounds in those sums

    @property
    def gamma(self) -> float:
        """cfg.gamma, or from the measured costs (module docstring)."""
        return self.threshold(forward=True)

    def threshold(self, forward: bool) -> float:
        """gamma for one more draft token; forward=False: its drafter forward is already paid
        (the drafter read a guess ahead), so with gamma auto only its verification is priced."""
        if self.cfg.gamma is not None:
            return self.cfg.gamma
        if self._timed < 4:
            return self.cfg.start_gamma
        draft_s, forwards, round_s, tokens = self._cost
        per_token = (draft_s / forwards if forward else 0.0) + self._verify.per_token
        return float(np.clip(1.0 - per_token * tokens / round_s, 0.0, 1.0))

    def time_round(self, draft_s: float, forwards: int, verify_s: float, drafted: int, round_s: float,
                   tokens: int) -> None:
        """What one round cost and made (for gamma auto)."""
        if forwards:
            self._cost = self.cfg.cost_decay * self._cost + (draft_s, forwards, round_s, tokens)
            self._verify.add(drafted, verify_s)
            self._timed += 1

    @property
    def max_len(self) -> int:
        if self.cfg.name == "fixed" or (self.cfg.name == "learned" and not self.ready):
            return self.cfg.k
        return self.k if self.cfg.name == "heuristic" else self.cfg.max_k

    @property
    def ready(self) -> bool:
        return self.head is not None and len(self.labels) >= self.cfg.warmup

    def begin_reply(self) -> None:
        self.recent = 1.0

    def begin_round(self) -> None:
        self._survival = 1.0

    @property
    def needs_features(self) -> bool:
        return self.cfg.name == "learned"

    def features_of(self, hidden: mx.array, logits: mx.array, token, depth, recent=None) -> mx.array:
        """The head's features of a drafted token (rows, given a replay's depths and recent acceptance)."""
        recent = self.recent if recent is None else recent
        return token_features(hidden if self.cfg.hidden else None, logits, token, depth, recent)

    def wants_more(self, logits: mx.array, token: int, features: mx.array | None, forward: bool = True) -> bool:
        """Whether to draft one more token after the one just drafted (from `logits`);
        forward: the next token costs a drafter forward.

        Deciding before the drafter forward that the next token costs (rather than
        after it, on the next token's own features) saves a wasted forward per
        round; the token just drafted stands in for the next one."""
        if self.cfg.name == "confidence":
            return mx.softmax(logits)[token].item() >= self.cfg.p_min
        if self.cfg.name == "learned" and self.ready:
            p = mx.sigmoid(self.head(features)).item()
            self._survival *= p
            return 1.0 - self._survival * p <= self.threshold(forward)  # P(a rejection by the next token)
        return True

    def observe(self, features: list[mx.array], accepted: list[bool]) -> None:
        """Labels for this round's proposed draft tokens: did their text reach the output?"""
        all_accepted = all(accepted)
        if self.cfg.name == "heuristic":
            self.k = min(self.cfg.max_k, self.k + 2) if all_accepted else max(1, self.k - 1)
        if self.cfg.name != "learned" or not features:
            return
        # P(accept | previous accepted): tokens after the first rejection carry no label.
        labels = list(accepted[: accepted.index(False) + 1] if False in accepted else accepted)
        self.recent = update_recent(self.recent, labels, self.cfg.recent_decay)
        self.rounds += 1
        due = self.rounds % self.cfg.update_every == 0 and len(self.labels) + len(labels) >= 32
        self.learn(np.stack([np.array(f) for f in features[: len(labels)]]), labels, steps=4 if due else 0)

    def learn(self, features: np.ndarray, labels, steps: int) -> None:
        """Add labelled draft tokens (a row of features each) to the replay buffer,
        then take `steps` training steps on it."""
        if not len(labels):  # e.g. a reply cut off by max_len: nothing drafted
            return
        with deferred_interrupt():  # features and labels stay paired
            if self.head is None:
                self.head = AcceptanceHead(features.shape[1])
            self.features += list(features)
            self.labels += [float(x) for x in labels]
            del self.features[: -self.cfg.buffer], self.labels[: -self.cfg.buffer]
            self.unsaved += len(labels)
        if steps:
            self.train(steps)

    def train(self, steps: int, batch: int = 256, seed: int = 0) -> float:
        """A few BCE steps on the replay buffer; returns the last loss."""
        x, y = np.stack(self.features), np.array(self.labels, dtype=np.float32)
        rng = np.random.default_rng(seed + self.rounds)

        def loss_fn(head, xb, yb):
            return nn.losses.binary_cross_entropy(head(xb), yb, reduction="mean")

        step = nn.value_and_grad(self.head, loss_fn)
        loss = mx.array(0.0)
        for _ in range(steps):
            idx = rng.integers(0, len(y), min(batch, len(y)))
            loss, grads = step(self.head, mx.array(x[idx]), mx.array(y[idx]))
            self.opt.update(self.head, grads)
            mx.eval(self.head.parameters(), self.opt.state, loss)
        return loss.item()

    def save(self, path: str | Path) -> None:
        """The learned head and its replay buffer, atomically (float16 features keep it small)."""
        if self.head is None:
            return
        arrays = {f"head.{k}": np.array(v) for k, v in tree_flatten(self.head.parameters())}
        arrays["features"] = np.stack(self.features).astype(np.float16)
        arrays["labels"] = np.array(self.labels, dtype=np.float32)
        arrays["rounds"] = np.array(self.rounds)
        arrays["feature_names"] = np.array(FEATURES)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(path, buf.getvalue())
        self.unsaved, self.synced_rounds = 0, self.rounds

    def merge(self, other: "DraftPolicy") -> None:
        """Become `other` (this head as another process saved it) plus the labels this
        one gathered since it was loaded or saved; its own head weights are kept when
        it learned since, other's taken otherwise (weights cannot be merged)."""
        with deferred_interrupt():
            new = min(self.unsaved, len(self.labels))
            if other.head is not None and (self.head is None or not new):
                self.head, self.opt = other.head, optim.AdamW(learning_rate=1e-3, weight_decay=0.01)
            self.features = (other.features + self.features[len(self.features) - new :])[-self.cfg.buffer :]
            self.labels = (other.labels + self.labels[len(self.labels) - new :])[-self.cfg.buffer :]
            self.rounds += other.rounds - self.synced_rounds
            self.synced_rounds = other.rounds

    @classmethod
    def read(cls, cfg: PolicyConfig, path: str | Path) -> "DraftPolicy":
        """A policy with the head saved at path."""
        policy = cls(cfg)
        policy.load(path)
        return policy

    def load(self, path: str | Path) -> None:
        """Continue from a saved head (a missing file, or a head on other features,
        leaves the policy untrained)."""
        if not Path(path).exists():
            return
        with np.load(path) as data:
            names = data["feature_names"].tolist() if "feature_names" in data.files else []
            if names != list(FEATURES) or (data["features"].shape[1] > len(FEATURES)) != self.cfg.hidden:
                return  # learned on other features: start afresh
            self.features = list(data["features"].astype(np.float32))
            self.labels = data["labels"].tolist()
            self.rounds = self.synced_rounds = int(data["rounds"])
            self.unsaved = 0
            weights = [(k[5:], mx.array(data[k])) for k in data.files if k.startswith("head.")]
        self.head = AcceptanceHead(self.features[0].shape[0])
        self.head.update(tree_unflatten(weights))
