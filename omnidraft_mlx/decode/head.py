"""The acceptance head: P(a drafted token is accepted | the ones drafted before
it in the round were), learned online from verification and kept as a part of
the pair's profile (learned.py).

It learns from the verification of the translated target tokens, so it works
across vocabularies; batch adaptation trains it too, on teacher-forced replays
of the target's replies (`replay_depths`, `replay_recent`, adapt.head_labels).
Its features are cheap signals of the drafted token (log q, entropy, depth) and
the reply's recent acceptance, a decaying mean of the labels of its earlier
rounds: a token's own signals cannot tell a stretch the drafter has right (a
list, a repeated formula) from one where it is about to fail. The drafter's
hidden state can be added, but at the data sizes a profile gathers it overfits.
The loss is plain BCE: the stopping rule (policy.LearnedPolicy) multiplies the
probabilities, so they must be calibrated. The measurements behind these
choices: bench/results/policies/README.md.
"""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from omnidraft_mlx.profile.atomic import atomic_write_bytes
from omnidraft_mlx.profile.learned import deferred_interrupt

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


def _optimizer() -> optim.AdamW:
    return optim.AdamW(learning_rate=1e-3, weight_decay=0.01)


class LearnedHead:
    """The head and the bounded replay buffer of (features, label) it trains on: a
    profile part (save, merge, read). `hidden`: its features start with the drafter's
    hidden state."""

    def __init__(self, buffer: int, hidden: bool):
        self.buffer, self.hidden = buffer, hidden
        self.net: AcceptanceHead | None = None  # made on the first labels (their width)
        self.opt = _optimizer()
        self.features: list[np.ndarray] = []
        self.labels: list[float] = []
        self.rounds = 0  # decoding rounds labelled, over the head's life
        self.unsaved = 0  # labels added since loaded or saved (the newest in the buffer)
        self.synced_rounds = 0  # rounds when loaded or saved

    def p_accept(self, features: mx.array) -> float:
        return mx.sigmoid(self.net(features)).item()

    @property
    def changed(self) -> bool:
        """Learned anything since loaded or saved (a profile save skips it otherwise)."""
        return self.unsaved > 0 or self.rounds != self.synced_rounds

    def learn(self, features: np.ndarray, labels, steps: int) -> None:
        """Add labelled draft tokens (a row of features each) to the replay buffer,
        then take `steps` training steps on it."""
        if not len(labels):  # e.g. a reply cut off by max_len: nothing drafted
            return
        with deferred_interrupt():  # features and labels stay paired
            if self.net is None:
                self.net = AcceptanceHead(features.shape[1])
            self.features += list(features)
            self.labels += [float(x) for x in labels]
            del self.features[: -self.buffer], self.labels[: -self.buffer]
            self.unsaved += len(labels)
        if steps:
            self.train(steps)

    def train(self, steps: int, batch: int = 256, seed: int = 0) -> float:
        """A few BCE steps on the replay buffer; returns the last loss."""
        x, y = np.stack(self.features), np.array(self.labels, dtype=np.float32)
        rng = np.random.default_rng(seed + self.rounds)

        def loss_fn(head, xb, yb):
            return nn.losses.binary_cross_entropy(head(xb), yb, reduction="mean")

        step = nn.value_and_grad(self.net, loss_fn)
        loss = mx.array(0.0)
        for _ in range(steps):
            idx = rng.integers(0, len(y), min(batch, len(y)))
            loss, grads = step(self.net, mx.array(x[idx]), mx.array(y[idx]))
            self.opt.update(self.net, grads)
            mx.eval(self.net.parameters(), self.opt.state, loss)
        return loss.item()

    def save(self, path: str | Path) -> None:
        """The head and its replay buffer, atomically (float16 features keep it small)."""
        if self.net is None:
            return
        arrays = {f"head.{k}": np.array(v) for k, v in tree_flatten(self.net.parameters())}
        arrays["features"] = np.stack(self.features).astype(np.float16)
        arrays["labels"] = np.array(self.labels, dtype=np.float32)
        arrays["rounds"] = np.array(self.rounds)
        arrays["feature_names"] = np.array(FEATURES)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(path, buf.getvalue())

    def mark_saved(self) -> None:
        """What was saved is shared from now on (the profile calls it once its manifest names the file)."""
        self.unsaved, self.synced_rounds = 0, self.rounds

    def merge(self, other: LearnedHead) -> None:
        """Become `other` (this head as another process saved it) plus the labels this
        one gathered since it was loaded or saved; its own weights are kept when it
        learned since, other's taken otherwise (weights cannot be merged)."""
        with deferred_interrupt():
            new = min(self.unsaved, len(self.labels))
            if other.net is not None and (self.net is None or not new):
                self.net, self.opt = other.net, _optimizer()
            self.features = (other.features + self.features[len(self.features) - new :])[-self.buffer :]
            self.labels = (other.labels + self.labels[len(self.labels) - new :])[-self.buffer :]
            self.rounds += other.rounds - self.synced_rounds
            self.synced_rounds = other.rounds

    def read(self, path: str | Path) -> LearnedHead:
        """A head on this one's features, as saved at path (the profile's reader)."""
        head = LearnedHead(self.buffer, self.hidden)
        head.load(path)
        return head

    def load(self, path: str | Path) -> None:
        """Continue from a saved head (a missing file, or a head on other features,
        leaves this one untrained)."""
        if not Path(path).exists():
            return
        with np.load(path) as data:
            names = data["feature_names"].tolist() if "feature_names" in data.files else []
            if names != list(FEATURES) or (data["features"].shape[1] > len(FEATURES)) != self.hidden:
                return  # learned on other features: start afresh
            self.features = list(data["features"].astype(np.float32))
            self.labels = data["labels"].tolist()
            self.rounds = self.synced_rounds = int(data["rounds"])
            self.unsaved = 0
            weights = [(k[5:], mx.array(data[k])) for k in data.files if k.startswith("head.")]
        self.net = AcceptanceHead(self.features[0].shape[0])
        self.net.update(tree_unflatten(weights))
