"""Hybrid distillation of the drafter towards the target (method.md section 3).

Per draft position of a verified sequence:
    L = L_DM + lambda * L_Ngram
- L_DM: reverse KL D_KL(q'_theta || p) over the mapped vocabulary, at draft
  tokens that map directly to a target token (p from the target at the
  aligned position, both renormalized over the vocabulary intersection);
- L_Ngram: -log q_theta(d_j) at draft sub-tokens that together spell one
  target token.
The loss is averaged over the positions that carry either term.

Target distributions are computed by one teacher-forced target forward per
batch, only for the mapped columns at direct positions, and reused by that
batch's `steps` gradient steps (nothing is stored between updates but token
ids; memory stays that of one batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from omnidraft_mlx.decode.drafter import output_head
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.profile.adapter import SHAPE, make_trainable
from omnidraft_mlx.settings import check_settings, setting
from omnidraft_mlx.vocab.align import align, as_draft_tokens


@dataclass(kw_only=True)
class DistillConfig:
    lam: float = setting(0.2, flag="--lambda", low=0.0)  # weight of the n-gram NLL
    lr: float = setting(1e-4, flag="--lr", low=0.0, open_low=True)
    weight_decay: float = setting(0.01, flag="weight_decay", low=0.0)
    lora_rank: int = setting(32, flag="--rank", low=0)  # 0 = full fine-tuning
    lora_scale: float = 2.0  # mlx-lm's LoRA scale (alpha / rank)
    layers: int = -1  # blocks to train, counted from the last; -1 = all
    batch: int = setting(8, flag="--batch", low=1)  # sequences per gradient step
    steps: int = setting(1, flag="--steps", low=1)  # gradient steps per batch (one target forward serves them all)
    max_len: int = setting(512, flag="--max-len", low=1)  # tokens per sequence (longer ones are cut)

    def __post_init__(self):
        check_settings(self)
        if self.layers == 0 or self.layers < -1:
            raise OmniDraftError(f"--layers must be -1 (all) or at least 1 (got {self.layers})")

    @classmethod
    def from_dict(cls, d: dict) -> DistillConfig:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def adapter_dict(self) -> dict:
        """What decides the shape of the saved weights (profile.adapter.SHAPE)."""
        return {name: getattr(self, name) for name in SHAPE}


@dataclass
class Example:
    """One sequence, in both tokenizations, with its training positions."""

    draft_ids: list[int]  # drafter input: its prompt + its tokenization of the text
    target_ids: list[int]
    direct_draft: np.ndarray  # drafter positions whose next token is directly mapped
    direct_target: np.ndarray  # the aligned target positions (predicting the same token)
    ngram_pos: np.ndarray  # drafter positions whose next token is an n-gram sub-token
    ngram_tok: np.ndarray  # those next tokens
    reply_start: int = 0  # where the reply begins in draft_ids

    @property
    def positions(self) -> int:
        return len(self.direct_draft) + len(self.ngram_pos)


def make_example(
    pair: Pair, draft_prompt: list[int], target_prompt: list[int], reply: list[int], max_len: int = 512
) -> Example:
    """Training positions of a target-token reply that followed the two prompts.

    Token i of a sequence is predicted by the output at position i - 1, so a
    prompt-less first token carries no loss.
    """
    draft_reply = as_draft_tokens(reply, pair.vmap, pair.draft_tok)
    al = align(draft_reply, reply, pair.vmap)
    pd, pt = len(draft_prompt), len(target_prompt)
    draft_ids = (draft_prompt + draft_reply)[:max_len]
    target_ids = (target_prompt + reply)[:max_len]

    def keep(i, j=None):
        return 0 < pd + i < len(draft_ids) and (j is None or 0 < pt + j < len(target_ids))

    direct = [(pd + i - 1, pt + j - 1) for i, j in al.direct if keep(i, j)]
    ngram = [(pd + i - 1, draft_reply[i]) for i, _ in al.ngram if keep(i)]
    arr = lambda rows, c: np.array([r[c] for r in rows], dtype=np.int32)  # noqa: E731
    return Example(
        draft_ids, target_ids, arr(direct, 0), arr(direct, 1), arr(ngram, 0), arr(ngram, 1), min(pd, len(draft_ids))
    )


def head_weight(model) -> mx.array | None:
    """The output matrix [vocab, hidden] when it is a plain matrix, else None."""
    tied = getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head")
    layer = model.model.embed_tokens if tied else model.lm_head
    return None if isinstance(layer, (nn.QuantizedEmbedding, nn.QuantizedLinear)) else layer.weight


def head_logits(model, h: mx.array, cols: mx.array | None = None) -> mx.array:
    """Float32 output logits of hidden states h, only the columns `cols` where given
    (half-precision logits would round the log-softmax and KL that follow)."""
    w = head_weight(model)
    if w is None:  # a quantized head: the full product, then the columns
        out = output_head(model)(h).astype(mx.float32)
        return out if cols is None else out[:, cols]
    return h.astype(mx.float32) @ (w if cols is None else w[cols]).astype(mx.float32).T


def _pad(seqs: list[list[int]]) -> mx.array:
    """Right-padded batch: padding comes after every real token, so causal
    attention never lets it change a real position."""
    width = max(len(s) for s in seqs)
    return mx.array(np.array([s + [0] * (width - len(s)) for s in seqs], dtype=np.int32))


def _flat(rows: list[np.ndarray], width: int) -> mx.array:
    return mx.array(np.concatenate([r + b * width for b, r in enumerate(rows)]).astype(np.int32))


def target_logprobs(pair: Pair, batch: list[Example], target_cols: mx.array) -> mx.array:
    """log p over the mapped target vocabulary at every direct position of a batch."""
    x = _pad([e.target_ids for e in batch])
    h = pair.target.model(x)
    rows = _flat([e.direct_target for e in batch], x.shape[1])
    logits = head_logits(pair.target, h.reshape(-1, h.shape[-1])[rows], target_cols).astype(mx.float32)
    return mx.stop_gradient(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def distill_loss(model, x, direct_rows, target_logp, ngram_rows, ngram_tok, draft_cols, lam, count=None):
    """(mean loss, summed reverse KL, summed n-gram NLL) over one batch; the mean is
    over `count` positions where given (a rank's share of a batch split between ranks)."""
    h = model.model(x)
    h = h.reshape(-1, h.shape[-1])
    kl = nll = mx.array(0.0)
    if direct_rows.size:
        logits = head_logits(model, h[direct_rows], draft_cols).astype(mx.float32)
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(logq) * (logq - target_logp)).sum()  # reverse KL, by hand
    if ngram_rows.size:
        nll = nn.losses.cross_entropy(head_logits(model, h[ngram_rows]).astype(mx.float32), ngram_tok).sum()
    count = max(1, direct_rows.size + ngram_rows.size) if count is None else count
    return (kl + lam * nll) / count, kl, nll


def setup_trainable(model, cfg: DistillConfig) -> None:
    """The adapter cfg shapes on the drafter (profile/adapter.py); everything else frozen."""
    make_trainable(model, **cfg.adapter_dict())


@dataclass
class StepStats:
    loss: float = 0.0  # mean over positions
    kl: float = 0.0  # mean reverse KL per direct position
    nll: float = 0.0  # mean NLL per n-gram sub-token
    direct: int = 0
    ngram: int = 0
    tokens: int = 0  # drafter tokens processed (padding excluded)
    seconds: float = 0.0


class Distiller:
    """Gradient steps of the drafter on batches of Examples (AdamW).

    Under mlx.launch each rank holds its share of every batch: its loss is
    normalised by the batch's positions over all ranks divided by the number of
    ranks, so averaging the ranks' gradients (mlx's average_gradients) gives the
    gradient of the mean over the whole batch, the step one process would take,
    and every rank applies the same update."""

    def __init__(self, pair: Pair, cfg: DistillConfig, group: mx.distributed.Group | None = None):
        self.pair, self.cfg = pair, cfg
        self.group = group or mx.distributed.init()
        cols = pair.vmap.draft_to_target
        # One draft column per mapped target id (several draft eos ids map to one).
        target_ids, first = np.unique(cols[cols >= 0], return_index=True)
        self.draft_cols = mx.array(np.nonzero(cols >= 0)[0][first].astype(np.int32))
        self.target_cols = mx.array(target_ids.astype(np.int32))
        self.opt = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.999], weight_decay=cfg.weight_decay)
        self.grad_fn = nn.value_and_grad(pair.draft, distill_loss)

    def steps(self, batch: list[Example]) -> list[StepStats]:
        """cfg.steps gradient steps on one batch; the target runs once for all of them."""
        return [s for s in self.step_slices(batch) if s is not None]

    def step_slices(self, batch: list[Example], piece: int | None = None) -> Iterator[StepStats | None]:
        """steps() a slice at a time: each step's gradient summed over pieces of `piece` examples
        (None: the whole batch in one), None yielded after each piece's target forward (the first
        step's), after each piece but a step's last, and the step's StepStats after it: a server
        answers requests between two slices. Each piece's
        loss is divided by the whole batch's positions, so the sum is the batch's gradient."""
        import time

        from mlx.nn.utils import average_gradients
        from mlx.utils import tree_map

        from omnidraft_mlx.collectives import all_sum

        t0 = time.perf_counter()
        batch = [e for e in batch if e.positions]
        local = [
            sum(len(e.direct_draft) for e in batch),
            sum(len(e.ngram_pos) for e in batch),
            sum(len(e.draft_ids) for e in batch),
        ]
        n_d, n_n, tokens = np.array(all_sum(mx.array(local), self.group)).tolist()  # over all ranks
        if not n_d + n_n:
            return
        share = (n_d + n_n) / self.group.size()
        size = piece or max(1, len(batch))
        pieces = [batch[i : i + size] for i in range(0, len(batch), size)] or [[]]
        inputs = []  # per piece: what its loss takes besides the drafter (the target run once, in the first step)
        for _ in range(self.cfg.steps):
            kl = nll = mx.array(0.0)
            grads = None
            for i, part in enumerate(pieces):
                if i == len(inputs):
                    inputs.append(self._inputs(part) if part else None)
                    if part:  # the target's forward is a slice of its own: each stays short
                        mx.eval(inputs[i])
                        yield None
                if part:
                    (_, part_kl, part_nll), part_grads = self.grad_fn(
                        self.pair.draft, *inputs[i], self.draft_cols, self.cfg.lam, share
                    )
                else:  # this rank has no part of the batch: it still takes part in the average
                    part_kl = part_nll = mx.array(0.0)
                    part_grads = tree_map(mx.zeros_like, self.pair.draft.trainable_parameters())
                grads = part_grads if grads is None else tree_map(mx.add, grads, part_grads)
                kl, nll = kl + part_kl, nll + part_nll
                if i < len(pieces) - 1:
                    mx.eval(grads, kl, nll)
                    yield None
            self.opt.update(self.pair.draft, average_gradients(grads, self.group))
            kl, nll = all_sum(mx.stack([kl, nll]), self.group)
            mx.eval(kl, nll, self.pair.draft.trainable_parameters(), self.opt.state)
            t1 = time.perf_counter()
            yield StepStats(
                loss=(kl.item() + self.cfg.lam * nll.item()) / (n_d + n_n),
                kl=kl.item() / max(1, n_d),
                nll=nll.item() / max(1, n_n),
                direct=n_d,
                ngram=n_n,
                tokens=tokens,
                seconds=t1 - t0,
            )
            t0 = t1

    def _inputs(self, batch: list[Example]) -> tuple:
        """(x, direct, target log-probabilities, n-gram rows, n-gram tokens) of a batch, for distill_loss."""
        target_logp = target_logprobs(self.pair, batch, self.target_cols)
        x = _pad([e.draft_ids for e in batch])
        width = x.shape[1]
        direct = _flat([e.direct_draft for e in batch], width)
        ngram = _flat([e.ngram_pos for e in batch], width)
        ngram_tok = mx.array(np.concatenate([e.ngram_tok for e in batch]).astype(np.int32))
        return x, direct, target_logp, ngram, ngram_tok

    def update(self, examples: list[Example]) -> list[StepStats]:
        """cfg.steps gradient steps on each batch of cfg.batch examples, batch after batch."""
        return self.update_batches([examples[i : i + self.cfg.batch] for i in range(0, len(examples), self.cfg.batch)])

    def update_batches(self, batches: list[list[Example]]) -> list[StepStats]:
        """cfg.steps gradient steps on each batch in turn (under mlx.launch: this rank's
        share of each; every rank passes the same number of batches)."""
        return [s for batch in batches for s in self.steps(batch)]
