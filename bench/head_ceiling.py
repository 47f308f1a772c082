"""What a draft head on the target could give here, before one is built: a ceiling, offline (issue 55).

A head reads the target's own hidden state at the last verified position and the
embedding of the token after it, and guesses the target's next token; fed its own
output state and guess, it goes on (EAGLE's autoregression on features). This
measures, for one target on this machine:

1. Data. The target's teacher forward over the adaptation split of `complete`,
   `math` and `chat` (the corpus of `omnidraft adapt --task complete,math,chat`:
   the datasets' reference answers; chat has none, so the target's own greedy
   replies), and over its own greedy replies to held-out prompts of every new-text
   task: at each reply position its hidden state and its greedy next token.
2. Heads, trained with MLX on the first N = 100, 300, 1,000 replies of that corpus
   (interleaved as adapt reads it), each with a draft vocabulary of the target's
   most frequent next tokens in those replies (its output projection starts as the
   target's rows for them):
   - `table`: the target's most frequent next token after each token (no state);
   - `mlp`: fuse [norm(h); norm(emb(x))] to the hidden size, one residual MLP, the
     draft vocabulary's projection; trained unrolled over its own states for the
     first DEPTH_TRAINED positions (EAGLE-3's training-time test).
3. Acceptance on the held-out replies, per task: at every position a chain of up
   to MAX_CHAIN tokens drafted from the head's own guesses; the share of first,
   second, third tokens kept given the ones before were. The drafter's chain on
   the same replies beside it (teacher-forced in its own tokenization, as
   tree_ceiling.py does: approximate across vocabularies).
4. Prices measured now, alone: a target forward over 1 + k tokens after a
   prompt's worth of cache, one head step, one drafter step. Each reply is then
   replayed as greedy speculative decoding with chains of k = 1..MAX_CHAIN: its
   tokens per round over the round's price (verify(k) + k steps) against plain
   decoding's verify(0) per token: the speedup a chain of k would give if drafting
   cost nothing else.

    ./run.sh python -m omnidraft_mlx.bench.head_ceiling --target qwen2.5-coder-0.5b \\
        --out bench/results/head-ceiling/qwen2.5-coder-0.5b

writes OUT/ceiling.json and OUT/ceiling.png; the target's recordings are kept in
--work (default /tmp/head-ceiling/TARGET) so a second run only trains and prices.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

TRAIN_TASKS = "complete,math,chat"
EVAL_TASKS = ("write", "complete", "math", "chat")
SIZES = (100, 300, 1000)
STEPS = (600, 1200, 2400)
CHUNK = 50  # training replies recorded (and kept) together
EVAL_PROMPTS = 10  # held-out prompts a task
MAX_REPLY = 128  # tokens of a generated reply, and of a reference read
MAX_CHAIN = 5
DEPTH_TRAINED = 3
DRAFT_VOCAB = 8192
BATCH = 256  # positions a training step
WINDOW = 64  # consecutive positions of a reply a training example holds (the layer head attends within it)
CACHED = 200  # tokens in the cache before the priced forwards


@dataclass
class Recording:
    """Replies as the target saw them, concatenated. Reply r holds positions offsets[r]..offsets[r+1]-1;
    at its position j: hidden[j] the target's state after the reply's token j-1 (j=0: the prompt's last),
    tokens[j] the reply's token j, labels[j] the target's greedy token after token j-1 (what tokens[j]
    is where the reply is the target's own). labels has one more entry per reply (after its last token)
    at label_offsets."""

    tasks: list[str]
    hidden: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    label_offsets: np.ndarray

    def replies(self, n: int) -> Recording:
        end, label_end = self.offsets[n], self.label_offsets[n]
        return Recording(
            self.tasks[:n],
            self.hidden[:end],
            self.tokens[:end],
            self.labels[:label_end],
            self.offsets[: n + 1],
            self.label_offsets[: n + 1],
        )

    def of_all(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(hidden, tokens, labels) of each reply."""
        return [
            (
                self.hidden[self.offsets[r] : self.offsets[r + 1]],
                self.tokens[self.offsets[r] : self.offsets[r + 1]],
                self.labels[self.label_offsets[r] : self.label_offsets[r + 1]],
            )
            for r in range(len(self.tasks))
        ]

    @classmethod
    def of_replies(cls, tasks: list[str], replies: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Recording:
        """(hidden, tokens, labels) of each reply, concatenated."""
        hidden, tokens, labels = zip(*replies)
        offsets, label_offsets = np.cumsum([0, *map(len, tokens)]), np.cumsum([0, *map(len, labels)])
        return cls(list(tasks), *map(np.concatenate, (hidden, tokens, labels)), offsets, label_offsets)

    @classmethod
    def concat(cls, parts: list[Recording]) -> Recording:
        return cls.of_replies([t for p in parts for t in p.tasks], [r for p in parts for r in p.of_all()])

    def save(self, path: Path) -> None:
        np.savez(path, tasks=np.array(self.tasks), **{k: getattr(self, k) for k in FIELDS})

    @classmethod
    def load(cls, path: Path) -> Recording:
        data = np.load(path)
        return cls(list(data["tasks"]), *(data[k] for k in FIELDS))


FIELDS = ("hidden", "tokens", "labels", "offsets", "label_offsets")


def record(target, conversations: list[tuple[str, list[int], list[int]]]) -> Recording:
    """One teacher forward of the target over each (task, prompt ids, reply ids)."""
    from omnidraft_mlx.anatomy import hidden_states, logits

    replies = []
    for n, (_, prompt, reply) in enumerate(conversations):
        states = hidden_states(target, mx.array(prompt + reply)[None])[0, len(prompt) - 1 :]
        greedy = mx.argmax(logits(target, states), axis=-1)
        mx.eval(states, greedy)
        replies.append(
            (np.array(states[:-1].astype(mx.float16)), np.array(reply, np.int32), np.array(greedy, np.int32))
        )
        if (n + 1) % 50 == 0:
            print(f"  recorded {n + 1}/{len(conversations)} replies", flush=True)
    return Recording.of_replies([task for task, _, _ in conversations], replies)


def greedy_replies(target, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    from mlx_lm.generate import batch_generate

    out = batch_generate(target, tokenizer, prompts, max_tokens=MAX_REPLY, return_token_ids=True)
    return [list(r) for r in out.token_ids]


def cached_json(path: Path, make):
    """make()'s value, kept in `path` so a second run reads it."""
    if not path.exists():
        path.write_text(json.dumps(make()))
    return json.loads(path.read_text())


def training_conversations(target, tokenizer) -> list[list]:
    """(task, prompt ids, reply ids) in adapt's order: the reference answer where the dataset has one,
    else the target's greedy reply."""
    from omnidraft_mlx.learn.adapt import asked, task_corpus
    from omnidraft_mlx.prompts import encode_prompt

    train = []
    for sample in task_corpus(TRAIN_TASKS, "adapt"):
        prompt = encode_prompt(tokenizer, asked(sample.messages))
        reference = sample.messages[-1]["content"] if len(sample.messages) > 1 else None
        reply = list(tokenizer.encode(reference, add_special_tokens=False))[:MAX_REPLY] if reference else None
        train.append(["reference" if reference else "own", prompt, reply])
    own = [i for i, c in enumerate(train) if c[2] is None]
    print(f"generating the target's replies to {len(own)} adaptation prompts without a reference", flush=True)
    for i, reply in zip(own, greedy_replies(target, tokenizer, [train[i][1] for i in own])):
        train[i][2] = reply
    return train


def heldout_conversations(target, tokenizer) -> list[dict]:
    """{task, id, prompt, reply}: the target's greedy replies to the first EVAL_PROMPTS of each task."""
    from omnidraft_mlx.prompts import encode_prompt
    from omnidraft_mlx.tasks import load_task

    heldout = []
    for task in EVAL_TASKS:
        prompts = load_task(task, "heldout")[:EVAL_PROMPTS]
        ids = [encode_prompt(tokenizer, p.messages()) for p in prompts]
        print(f"generating the target's greedy replies to {len(ids)} held-out {task} prompts", flush=True)
        heldout += [
            {"task": task, "id": p.id, "prompt": i, "reply": r}
            for p, i, r in zip(prompts, ids, greedy_replies(target, tokenizer, ids))
        ]
    return heldout


def recorded(target, conversations: list, path: Path) -> Recording:
    if not path.exists():
        part = path.with_suffix(".part.npz")
        record(target, conversations).save(part)
        part.replace(path)  # whole or absent
    return Recording.load(path)


# --- heads -----------------------------------------------------------------------


class MLPHead(nn.Module):
    """[norm(h); norm(emb(x))] -> hidden size -> one residual MLP -> the draft vocabulary's logits,
    and the state it made (fed back for the next position). Positions are independent."""

    def __init__(self, dims: int, out_rows: mx.array):
        super().__init__()
        self.norm_h, self.norm_e = nn.RMSNorm(dims), nn.RMSNorm(dims)
        self.fuse = nn.Linear(2 * dims, dims, bias=False)
        self.norm_m = nn.RMSNorm(dims)
        self.up = nn.Linear(dims, 2 * dims, bias=False)
        self.down = nn.Linear(2 * dims, dims, bias=False)
        self.norm_out = nn.RMSNorm(dims)
        self.out = nn.Linear(dims, out_rows.shape[0], bias=False)
        self.out.weight = out_rows

    def fused(self, h: mx.array, e: mx.array) -> mx.array:
        return self.fuse(mx.concatenate([self.norm_h(h), self.norm_e(e)], axis=-1))

    def finish(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = x + self.down(nn.silu(self.up(self.norm_m(x))))
        return x, self.out(self.norm_out(x))

    def unroll(self, h: mx.array, e: mx.array, next_embedding, depth: int) -> list[mx.array]:
        """Logits at depths 1..depth from states h and embeddings e (batch x positions x dims);
        next_embedding(d, logits) is what depth d+1 is fed."""
        outs = []
        for d in range(depth):
            h, logits = self.finish(self.fused(h, e))
            outs.append(logits)
            if d + 1 < depth:
                e = next_embedding(d + 1, logits)
        return outs


class LayerHead(MLPHead):
    """EAGLE-1's head: the fused input through one pre-norm decoder layer whose causal attention sees
    the fused inputs of the positions before (no position encoding: the target's states carry it).
    At depth d a position's query also sees the keys its chain made at depths 2..d."""

    def __init__(self, dims: int, out_rows: mx.array):
        super().__init__(dims, out_rows)
        self.heads = max(1, dims // 64)
        self.norm_a = nn.RMSNorm(dims)
        self.qkv = nn.Linear(dims, 3 * dims, bias=False)
        self.o = nn.Linear(dims, dims, bias=False)

    def _qkv(self, u: mx.array) -> list[mx.array]:
        b, t, dims = u.shape
        parts = mx.split(self.qkv(self.norm_a(u)), 3, axis=-1)
        return [x.reshape(b, t, self.heads, dims // self.heads).transpose(0, 2, 1, 3) for x in parts]

    def unroll(self, h: mx.array, e: mx.array, next_embedding, depth: int) -> list[mx.array]:
        b, t, dims = h.shape
        scale = (dims // self.heads) ** -0.5
        causal = mx.triu(mx.full((t, t), -1e9), k=1)
        keys, values, chain_k, chain_v, outs = None, None, [], [], []
        for d in range(depth):
            u = self.fused(h, e)
            q, k, v = self._qkv(u)
            if keys is None:  # depth 1: the real inputs, each position seeing those before it
                keys, values = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            scores = [(q @ keys.transpose(0, 1, 3, 2)) * scale + causal]
            scores += [(q * ck).sum(-1, keepdims=True) * scale for ck in chain_k]
            p = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1)
            mixed = p[..., :t] @ values
            for i, cv in enumerate(chain_v):
                mixed = mixed + p[..., t + i : t + i + 1] * cv
            x = u + self.o(mixed.transpose(0, 2, 1, 3).reshape(b, t, dims))
            h, logits = self.finish(x)
            outs.append(logits)
            if d + 1 < depth:
                e = next_embedding(d + 1, logits)
        return outs


HEADS = {"mlp": MLPHead, "layer": LayerHead}


def draft_vocabulary(rec: Recording, size: int) -> np.ndarray:
    """The target's most frequent greedy tokens in the recording, most frequent first."""
    ids, counts = np.unique(rec.labels, return_counts=True)
    return ids[np.argsort(-counts, kind="stable")][:size]


def chain_examples(rec: Recording, depth: int) -> tuple[np.ndarray, ...]:
    """For every reply position j: the tokens fed at depths 1..depth (the reply's j, j+1, ...), the
    target tokens wanted there (labels j+1, j+2, ...), and whether each is known: the position
    exists and every token fed after the first is the target's own choice (in an accepted chain the
    head is fed the target's tokens; where a reference left them, the target's next one is unknown)."""
    fed, wanted, known = [], [], []
    for _, tokens, labels in rec.of_all():
        n = len(tokens)
        own = tokens == labels[:n]  # token j is what the target would have written there
        fed.append(ahead(tokens, 0, depth, 0))
        wanted.append(ahead(labels, 1, depth, 0)[:n])
        ok = ahead(np.ones(n + 1, bool), 1, depth, False)[:n]  # the label exists
        ok[:, 1:] &= np.cumprod(ahead(own, 1, depth - 1, False), axis=1).astype(bool)
        known.append(ok)
    return np.concatenate(fed), np.concatenate(wanted), np.concatenate(known)


def ahead(values: np.ndarray, first: int, count: int, fill) -> np.ndarray:
    """At each position j: values[j + first], ..., values[j + first + count - 1], `fill` past the end."""
    padded = np.concatenate([values, np.full(first + count, fill, values.dtype)])
    return padded[np.arange(len(values))[:, None] + first + np.arange(count)[None, :]]


def windows(rec: Recording, width: int) -> np.ndarray:
    """Each reply cut into windows of `width` consecutive positions (indices; -1 past a reply's end)."""
    rows = []
    for r in range(len(rec.tasks)):
        idx = np.arange(rec.offsets[r], rec.offsets[r + 1])
        for start in range(0, len(idx), width):
            part = idx[start : start + width]
            rows.append(np.concatenate([part, np.full(width - len(part), -1)]))
    return np.array(rows)


def train_head(head, embed, rec: Recording, to_draft: np.ndarray, steps: int, lr: float = 1e-3) -> list[float]:
    """Cross-entropy to the target's greedy tokens at depths 1..DEPTH_TRAINED, each depth fed the
    state the head made at the one before and the target's token (what an accepted chain feeds it),
    over windows of WINDOW positions. Tokens outside the draft vocabulary are not learned."""
    fed, wanted, known = chain_examples(rec, DEPTH_TRAINED)
    wanted_draft = to_draft[wanted]
    known &= wanted_draft >= 0
    rows = windows(rec, WINDOW)
    opt = optim.Adam(
        learning_rate=optim.join_schedules([optim.linear_schedule(0, lr, 100), optim.cosine_decay(lr, steps)], [100])
    )
    rng = np.random.default_rng(0)

    def loss_fn(model, h, fed_ids, want, mask):
        outs = model.unroll(h, embed(fed_ids[..., 0]), lambda d, _: embed(fed_ids[..., d]), DEPTH_TRAINED)
        total = sum(
            (nn.losses.cross_entropy(out, mx.maximum(want[..., d], 0), reduction="none") * mask[..., d]).sum()
            for d, out in enumerate(outs)
        )
        return total / (mask.sum() + 1e-6)

    step = nn.value_and_grad(head, loss_fn)
    losses = []
    for s in range(steps):
        pick = rows[rng.integers(0, len(rows), BATCH // WINDOW)]
        real, at = pick >= 0, np.maximum(pick, 0)
        loss, grads = step(
            head,
            mx.array(np.where(real[..., None], rec.hidden[at], 0).astype(np.float32)),
            mx.array(fed[at]),
            mx.array(wanted_draft[at]),
            mx.array((known[at] & real[..., None]).astype(np.float32)),
        )
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(float(loss))
        if (s + 1) % 200 == 0:
            print(f"    step {s + 1}/{steps}: loss {np.mean(losses[-200:]):.3f}", flush=True)
    return losses


def head_chains(head, embed, hidden: np.ndarray, tokens: np.ndarray, draft_ids: np.ndarray) -> np.ndarray:
    """From every position of a reply, the head's chain of MAX_CHAIN guesses (target ids), each
    fed its own guess and state."""
    to_target = mx.array(draft_ids)

    def guess(logits: mx.array) -> mx.array:
        return to_target[mx.argmax(logits, axis=-1)]

    h, e = mx.array(hidden.astype(np.float32))[None], embed(mx.array(tokens))[None]
    outs = head.unroll(h, e, lambda _, logits: embed(guess(logits)), MAX_CHAIN)
    return np.array(mx.stack([guess(out) for out in outs], axis=-1)[0])


def table_chains(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    guesses, x = [], tokens
    for _ in range(MAX_CHAIN):
        x = table[x]
        guesses.append(x)
    return np.stack(guesses, axis=1)


def next_token_table(rec: Recording, vocab: int) -> np.ndarray:
    """The target's most frequent greedy token after each token (the token itself where never seen)."""
    fed, wanted, known = chain_examples(rec, 1)
    table = np.arange(vocab)
    pairs = np.stack([fed[known[:, 0], 0], wanted[known[:, 0], 0]], axis=1)
    uniq, counts = np.unique(pairs, axis=0, return_counts=True)
    order = np.lexsort((-counts, uniq[:, 0]))
    uniq = uniq[order]
    first = np.ones(len(uniq), bool)
    first[1:] = uniq[1:, 0] != uniq[:-1, 0]
    table[uniq[first, 0]] = uniq[first, 1]
    return table


def kept_runs(guesses: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """At each position j, how many of the chain's guesses the target keeps (guess d wants label j+d)."""
    wanted = ahead(labels, 1, MAX_CHAIN, -1)[: len(guesses)]
    return np.cumprod(guesses == wanted, axis=1).sum(axis=1)


def rounds(runs: np.ndarray, k: int) -> int:
    """Rounds of greedy speculative decoding with chains of k to write the reply: a round at
    position j keeps min(run, k) drafted tokens and the target's own."""
    j, n, count = 0, len(runs), 0
    while j < n:
        j += min(int(runs[j]), k) + 1
        count += 1
    return count


def task_runs(rec: Recording, chains: list[np.ndarray]) -> dict[str, dict]:
    """Per task: the kept runs of each reply's chains and the acceptance at each depth."""
    runs: dict[str, list[np.ndarray]] = {}
    for task, chain, (_, _, labels) in zip(rec.tasks, chains, rec.of_all()):
        runs.setdefault(task, []).append(kept_runs(chain, labels))
    return {task: {"acceptance": acceptance(r), "runs": [x.tolist() for x in r]} for task, r in runs.items()}


def acceptance(runs: list[np.ndarray]) -> list[float]:
    """Share of the d-th guess kept given the ones before were, d = 1..MAX_CHAIN."""
    every = np.concatenate(runs)
    return [float((every >= d).sum() / max(1, (every >= d - 1).sum())) for d in range(1, MAX_CHAIN + 1)]


def replay(runs: list[np.ndarray], verify_s: dict[int, float], step_s: float) -> list[dict]:
    rows = []
    for k in range(MAX_CHAIN + 1):  # k = 0: plain decoding, 1.0x
        ratios, per_round = [], []
        for run in runs:
            n = rounds(run, k)
            per_round.append(len(run) / n)
            ratios.append((len(run) / n) * verify_s[0] / (verify_s[k] + k * step_s))
        rows.append(
            {
                "k": k,
                "tokens_per_round": float(np.mean(per_round)),
                "speedup_median": float(np.median(ratios)),
                "speedup_min": float(min(ratios)),
                "speedup_max": float(max(ratios)),
            }
        )
    return rows


# --- prices ----------------------------------------------------------------------


def median_s(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def prices(target, draft, embed, draft_vocab: int) -> dict:
    """Seconds of a target forward over 1 + k tokens, of a drafter step, and of each head's step
    (one position; the layer head's attention over its cache is left out: ~0.01 of its cost)."""
    from omnidraft_mlx.decode.kvcache import KVSlot, trim_cache

    verify = {}
    slot = KVSlot.fresh(target)
    mx.eval(slot.extend(target, list(range(100, 100 + CACHED))))
    for k in range(MAX_CHAIN + 1):
        x = mx.array([list(range(1000, 1001 + k))])

        def forward(x=x):
            mx.eval(target(x, cache=slot.cache).argmax(axis=-1))
            trim_cache(slot.cache, x.shape[1])

        verify[k] = median_s(forward, 7)
    dslot = KVSlot.fresh(draft)
    mx.eval(dslot.extend(draft, list(range(100, 100 + CACHED))))

    def draft_step():
        mx.eval(draft(mx.array([[1000]]), cache=dslot.cache).argmax(axis=-1))
        trim_cache(dslot.cache, 1)

    dims = embed.weight.shape[1]
    h, e = mx.random.normal((1, 1, dims)), embed(mx.array([[1000]]))
    steps = {}
    for name, kind in HEADS.items():
        head = kind(dims, mx.random.normal((draft_vocab, dims)) * 0.02)  # the shape is what costs
        mx.eval(head.parameters(), h, e)
        steps[name] = median_s(lambda head=head: mx.eval(head.unroll(h, e, None, 1)[0].argmax(axis=-1)), 50)
    return {"verify_s": verify, "drafter_step_s": median_s(draft_step, 30), "head_step_s": steps}


# --- the run -----------------------------------------------------------------------


def token_embedding(model) -> nn.Module:
    return next(m for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)))


def drafter_runs(pair, heldout: list[dict]) -> dict[str, list[np.ndarray]]:
    """The drafter's kept runs on the held-out replies, in its own tokens (tree_ceiling.reply_ranks)."""
    from omnidraft_mlx.bench.tree_ceiling import reply_ranks
    from omnidraft_mlx.tasks import load_task

    messages = {p.id: p.messages() for task in EVAL_TASKS for p in load_task(task, "heldout")}
    runs: dict[str, list[np.ndarray]] = {}
    for c in heldout:
        hit = reply_ranks(pair, messages[c["id"]], c["reply"]) == 0
        runs.setdefault(c["task"], []).append(np.cumprod(ahead(hit, 0, MAX_CHAIN, False), axis=1).sum(axis=1))
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="replies each head learns from")
    ap.add_argument("--steps", type=int, nargs="+", default=STEPS, help="training steps for each of --sizes")
    ap.add_argument("--heads", nargs="+", choices=tuple(HEADS), default=tuple(HEADS), help="heads to train")
    ap.add_argument(
        "--phase",
        choices=("all", "record", "accept", "price"),
        default="all",
        help="record: the target's recordings only; accept: then train and evaluate; price: alone, after accept",
    )
    args = ap.parse_args(argv)
    work = args.work or Path("/tmp/head-ceiling") / args.target
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    from omnidraft_mlx.loading import open_pair
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    pair = open_pair(args.draft, args.target, resolver=CATALOG_RESOLVER, profile=False, history=False, costs=False).pair
    accepted = work / "acceptance.json"
    if args.phase == "record":
        recordings(pair, work, max(args.sizes))
    if args.phase in ("all", "accept"):
        earlier = json.loads(accepted.read_text()) if accepted.exists() else None
        names = {"target": args.target, "draft": args.draft}
        result = accept(pair, work, args.sizes, args.steps, names, earlier, tuple(args.heads))
        accepted.write_text(json.dumps(result))
    if args.phase in ("all", "price"):
        price_and_write(json.loads(accepted.read_text()), pair, args.out)


def recordings(pair, work: Path, replies: int) -> tuple[list[dict], Recording, Recording]:
    """The held-out conversations, their recording, and the first `replies` training replies' recording:
    each made once and kept in `work` (training replies CHUNK at a time, so a larger N extends a smaller
    one's, and two processes may record different chunks)."""
    target, tok = pair.target, pair.target_tok
    held = cached_json(work / "heldout.json", lambda: heldout_conversations(target, tok))
    heldout = recorded(target, [(c["task"], c["prompt"], c["reply"]) for c in held], work / "heldout.npz")
    train = cached_json(work / "train.json", lambda: training_conversations(target, tok))
    chunks = []
    for start in range(0, replies, CHUNK):
        print(f"recording training replies {start + 1}-{start + CHUNK}", flush=True)
        chunks.append(recorded(target, train[start : start + CHUNK], work / f"train-{start:04d}.npz"))
    return held, heldout, Recording.concat(chunks)


def accept(
    pair,
    work: Path,
    sizes: list[int],
    steps_for: list[int],
    names: dict,
    earlier: dict | None = None,
    heads: tuple[str, ...] = tuple(HEADS),
) -> dict:
    """Train the heads on each N and keep each one's chains on the held-out replies. An earlier result
    made with the same settings keeps its heads of other sizes and lends its drafter's runs (greedy: the
    same again), so a larger N is added without training the smaller ones again."""
    target = pair.target
    held, heldout, train_all = recordings(pair, work, max(sizes))

    dims = train_all.hidden.shape[1]
    embed = token_embedding(target)
    lm_head = target.lm_head.weight if hasattr(target, "lm_head") else embed.weight
    vocab = lm_head.shape[0]

    result = {
        **names,
        "train_tasks": TRAIN_TASKS,
        "eval_prompts": EVAL_PROMPTS,
        "max_reply": MAX_REPLY,
        "draft_vocab": DRAFT_VOCAB,
        "heads": [],
    }
    same = earlier is not None and all(earlier.get(key) == value for key, value in result.items() if key != "heads")
    if same:
        result["heads"] = [h for h in earlier["heads"] if h["replies"] not in sizes]
        print(f"kept from the earlier result: N={sorted({h['replies'] for h in result['heads']})}", flush=True)
    for n, steps in zip(sizes, steps_for):
        rec = train_all.replies(n)
        draft_ids = draft_vocabulary(rec, DRAFT_VOCAB)
        to_draft = np.full(vocab, -1, np.int64)
        to_draft[draft_ids] = np.arange(len(draft_ids))
        covered = float(np.mean(to_draft[heldout.labels] >= 0))
        table = next_token_table(rec, vocab)
        evaluated = [("table", [table_chains(table, t) for _, t, _ in heldout.of_all()], {})]
        for name in heads:
            kind = HEADS[name]
            print(f"N={n}: {len(rec.tokens)} positions; training the {name} head for {steps} steps", flush=True)
            head = kind(dims, lm_head[mx.array(draft_ids)].astype(mx.float32))
            start = time.monotonic()
            losses = train_head(head, embed, rec, to_draft, steps)
            chains = [head_chains(head, embed, h, t, draft_ids) for h, t, _ in heldout.of_all()]
            extra = {
                "vocab_coverage": covered,
                "train_s": time.monotonic() - start,
                "loss": float(np.mean(losses[-100:])),
            }
            evaluated.append((name, chains, extra))
        for name, chains, extra in evaluated:
            per_task = task_runs(heldout, chains)
            result["heads"].append(
                {"head": name, "replies": n, "positions": int(len(rec.tokens)), **extra, "tasks": per_task}
            )
            print(
                f"  {name}: first-token acceptance "
                + ", ".join(f"{t} {v['acceptance'][0]:.3f}" for t, v in per_task.items()),
                flush=True,
            )
    result["heads"].sort(key=lambda h: h["replies"])  # stable: each N's heads keep their order
    if same:
        result["drafter"] = earlier["drafter"]
        return result
    print("the drafter on the same replies", flush=True)
    result["drafter"] = {
        task: {"acceptance": acceptance(runs), "runs": [r.tolist() for r in runs]}
        for task, runs in drafter_runs(pair, held).items()
    }
    return result


def price_and_write(result: dict, pair, out: Path) -> None:
    """Price the rounds (alone: the timings are the result), replay every reply, write the record."""
    print("pricing (alone)", flush=True)
    price = prices(pair.target, pair.draft, token_embedding(pair.target), result["draft_vocab"])
    result["prices"] = price
    for entry in result["heads"]:
        step = price["head_step_s"].get(entry["head"], 0.0)  # a table costs nothing
        for v in entry["tasks"].values():
            v["replay"] = replay([np.array(r) for r in v["runs"]], price["verify_s"], step)
    for v in result["drafter"].values():
        v["replay"] = replay([np.array(r) for r in v["runs"]], price["verify_s"], price["drafter_step_s"])
    (out / "ceiling.json").write_text(json.dumps(result, indent=1))
    print_summary(result)
    plot(result, out / "ceiling.png")


def best(v: dict) -> dict:
    return max(v["replay"], key=lambda r: r["speedup_median"])


def print_summary(result: dict) -> None:
    p = result["prices"]
    print(
        f"prices: target forward {1000 * p['verify_s'][0]:.1f} ms "
        f"(1+{MAX_CHAIN} tokens {1000 * p['verify_s'][MAX_CHAIN]:.1f} ms), "
        + "".join(
            f"{k} head step {1000 * v:.2f} ms ({v / p['verify_s'][0]:.3f}), " for k, v in p["head_step_s"].items()
        )
        + f"drafter step {1000 * p['drafter_step_s']:.1f} ms ({p['drafter_step_s'] / p['verify_s'][0]:.3f})"
    )
    rows = [(f"{e['head']} N={e['replies']}", e["tasks"]) for e in result["heads"]] + [("drafter", result["drafter"])]
    for name, tasks in rows:
        cells = []
        for task, v in tasks.items():
            b = best(v)
            a = v["acceptance"]
            cells.append(f"{task} {a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f} k={b['k']} {b['speedup_median']:.2f}x")
        print(f"{name:14s} " + " | ".join(cells))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["drafter"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), sharey=True)
    for ax, task in zip(axes, tasks):
        largest = max(e["replies"] for e in result["heads"])
        series = [
            (f"{e['head']} N={e['replies']}", e["tasks"][task])
            for e in result["heads"]
            if e["head"] != "table" or e["replies"] == largest
        ]
        series += [("drafter", result["drafter"][task])]
        for name, v in series:
            ax.plot([r["k"] for r in v["replay"]], [r["speedup_median"] for r in v["replay"]], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(task)
        ax.set_xlabel("chain length k")
    axes[0].set_ylabel("speedup ceiling (median per reply)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"draft heads on {result['target']}: held-out greedy replies, priced on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
