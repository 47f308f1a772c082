"""Adapting the drafter to what it is used for (paper's Algorithm 2, and a faster
teacher-forced variant for local documents).

Three modes (`omnidraft adapt --mode`; their old names stream, batch and text still work):
- speculative (learn_speculative): prompts arrive one by one; each is answered
  by speculative decoding; the verified reply goes into a buffer; every
  `interval` prompts the drafter takes a distillation update on the buffer,
  which is then cleared (on-policy).
- target (learn_from_target): the same data as speculative, faster: the target
  alone answers `interval` prompts at a time by batched greedy decoding, then
  the drafter learns from the replies. Under greedy decoding a verified reply is
  the target's own output whatever the drafter, and a batched decoding step
  costs little more than a single one, so a corpus is learned from several
  times faster (speculative is what happens while the pair is in use). The
  acceptance head learns from replays of the same replies (`head_labels`).
- teacher-forced (learn_teacher_forced): distillation directly on documents (or
  on the replies in chat transcripts): one target forward per chunk, no generation.
After every update the profile is saved (adapter, optimizer, n-grams, corpus
position), so `omnidraft adapt` resumes where it stopped.
The target mode also runs under `mlx.launch` (omnidraft_mlx.learn.distributed): each rank
answers its share of every update's prompts, the ranks average their gradients,
every rank learns n-grams and head labels from all ranks' replies, and rank 0
alone saves the profile.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from itertools import chain, zip_longest
from pathlib import Path

import mlx.core as mx
import numpy as np

from omnidraft_mlx.collectives import all_sum, check_ranks, gather_rows, share_tree, world
from omnidraft_mlx.decode.drafter import output_head
from omnidraft_mlx.decode.head import replay_depths, replay_recent
from omnidraft_mlx.decode.policy import DraftPolicy, LearnedPolicy
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.distill import DistillConfig, Distiller, Example, StepStats, make_example
from omnidraft_mlx.learn.distributed import shard
from omnidraft_mlx.pair import Pair
from omnidraft_mlx.paths import LOCAL, Resolver
from omnidraft_mlx.profile.store import Profile
from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.settings import check_choice

TEXT_SUFFIXES_SKIPPED = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".zip", ".gz", ".bin", ".safetensors", ".pyc"}


@dataclass
class Sample:
    """One corpus item: a conversation (a prompt, maybe with a reply) or a plain document."""

    messages: list[dict] | None = None
    text: str | None = None


# --- the corpus ----------------------------------------------------------------


def _messages(row, where: str) -> list[dict]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return user_messages(row["prompt"])
    msgs = row.get("messages") if isinstance(row, dict) else None
    if (
        isinstance(msgs, list)
        and msgs
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
        and any(m["content"].strip() for m in msgs)
    ):
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise OmniDraftError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., "content": ...}}]}}')


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        if b"\x00" in data[:8192]:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise OmniDraftError(f"{path} is not a UTF-8 text document (binary?): convert it to plain text first") from None


def read_jsonl(path: Path) -> list[Sample]:
    samples = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise OmniDraftError(f"{path}:{n}: not valid JSON ({e.args[0].split(':')[0]})") from None
        samples.append(Sample(messages=_messages(row, f"{path}:{n}")))
    return samples


def read_corpus(path: str | Path) -> list[Sample]:
    """Prompts from a JSONL file, or documents from a text file or a folder of them."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OmniDraftError(f"no such corpus: {path}")
    if path.is_dir():
        files = sorted(
            f
            for f in path.rglob("*")
            if f.is_file()
            and not any(p.startswith(".") for p in f.parts)
            and f.suffix.lower() not in TEXT_SUFFIXES_SKIPPED
        )
        samples = [s for f in files for s in (read_jsonl(f) if f.suffix == ".jsonl" else [Sample(text=_read_text(f))])]
    elif path.suffix in (".jsonl", ".json"):
        samples = read_jsonl(path)
    else:
        samples = [Sample(text=_read_text(path))]
    samples = [s for s in samples if s.messages or (s.text and s.text.strip())]
    if not samples:
        raise OmniDraftError(f"the corpus {path} is empty: give it prompts (JSONL) or text documents")
    return samples


def task_corpus(tasks: str, split: str = "adapt") -> list[Sample]:
    """A benchmark split as conversations: each prompt, with the dataset's reference
    answer as the reply where it has one (the speculative mode answers the prompt itself;
    teacher-forced learns from the reference). Several tasks ("code,math,chat") are
    interleaved while they last, then the longer ones' rest (math: 1,000; code: 100)."""
    from omnidraft_mlx.tasks import load_task

    per_task = [load_task(task.strip(), split) for task in tasks.split(",")]
    prompts = [p for p in chain.from_iterable(zip_longest(*per_task)) if p is not None]
    return [
        Sample(
            messages=user_messages(p.text) + ([{"role": "assistant", "content": p.reference}] if p.reference else [])
        )
        for p in prompts
    ]


def asked(messages: list[dict]) -> list[dict]:
    """A conversation without its final reply: what the models are to answer."""
    return messages[:-1] if len(messages) > 1 and messages[-1]["role"] == "assistant" else messages


# --- the learner -----------------------------------------------------------------


@dataclass
class UpdateReport:
    update: int  # updates in the profile so far
    examples: int
    steps_per_batch: int
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    save_s: float = 0.0

    @property
    def loss(self) -> float:
        """Mean loss of each batch's first step: on replies the drafter had not been trained on yet."""
        first = self.steps[:: self.steps_per_batch]
        return sum(s.loss for s in first) / len(first) if first else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.steps) / self.seconds if self.seconds else 0.0


class OnlineLearner:
    """Buffers verified replies; every `interval` of them, one distillation update
    of the drafter, after which the profile (when given) is saved.

    For a loop over prompts: `observe(messages, reply_target_ids)` after each verified
    reply, then `maybe_update()`; it returns True when the drafter changed (chat and
    serve learn between replies through online.Learning).
    The drafter must have been prepared for training (load_profile(...,
    trainable=True) or distill.setup_trainable) before the learner is made.
    `policy`, when given, is the draft-length policy the decoding uses: its
    acceptance head (trained as it decodes) is saved with every update when
    the profile holds it (open_pair attaches it).
    Under mlx.launch only rank 0 writes the profile.
    """

    def __init__(
        self,
        pair: Pair,
        cfg: DistillConfig,
        interval: int = 8,
        profile: Profile | None = None,
        raw: bool = False,
        policy: DraftPolicy | None = None,
    ):
        if interval < 1:
            raise OmniDraftError("the update interval must be at least 1 prompt")
        self.pair, self.cfg, self.interval, self.profile, self.raw = pair, cfg, interval, profile, raw
        self.policy = policy
        self.group = world()
        self.distiller = Distiller(pair, cfg, self.group)
        if profile is not None:
            profile.load_optimizer(self.distiller.opt)
        if self.group.size() > 1:  # every rank trains rank 0's drafter (a new adapter is random per process)
            pair.draft.update(share_tree(pair.draft.trainable_parameters(), self.group))
            self.distiller.opt.state = share_tree(self.distiller.opt.state, self.group)
        self.buffer: list[Example] = []
        # A lookup.HistoryIndex that learns the target's replies (target and speculative modes), when set.
        self.history = None
        self.corpus: str | None = None  # where the observed prompts come from, and how far
        self.position = 0
        self.last: UpdateReport | None = None
        self.updates = profile.updates if profile else 0
        self.unsaved: dict | None = None  # the record of a drafter update the profile does not hold yet

    def example(self, messages: list[dict], reply_target_ids: list[int]) -> Example:
        """The training example of a reply to `messages` (each model gets its own chat template)."""
        return make_example(
            self.pair,
            encode_prompt(self.pair.draft_tok, messages, self.raw),
            encode_prompt(self.pair.target_tok, messages, self.raw),
            list(reply_target_ids),
            self.cfg.max_len,
        )

    def observe(self, messages: list[dict], reply_target_ids: list[int]) -> None:
        """Queue a verified reply to `messages`."""
        if reply_target_ids:
            self.add(self.example(messages, reply_target_ids))

    def add(self, example: Example) -> None:
        self.buffer.append(example)

    def maybe_update(self) -> bool:
        if len(self.buffer) < self.interval:
            return False
        self.update()
        return True

    def update(self, record: dict | None = None, batches: list[list[Example]] | None = None) -> UpdateReport | None:
        """One update on the buffer (whatever its size), then save and clear it; or, under
        mlx.launch, on this rank's share of each gradient batch (`batches`, as many on every rank)."""
        slices = self.update_slices(record, batches)
        while True:
            try:
                next(slices)
            except StopIteration as done:
                return done.value

    def update_slices(
        self,
        record: dict | None = None,
        batches: list[list[Example]] | None = None,
        piece: int | None = None,
        save: bool = True,
    ) -> Generator[None, None, UpdateReport | None]:
        """update() a slice at a time (Distiller.step_slices, pieces of `piece` examples): a
        server answers requests between two slices; returns update()'s report. Examples
        added meanwhile wait for the next update. save=False leaves the update for save()."""
        taken = len(self.buffer)
        if batches is None:
            if not self.buffer:
                return None
            batches = [self.buffer[i : i + self.cfg.batch] for i in range(0, taken, self.cfg.batch)]
        start, seconds, steps = time.perf_counter(), 0.0, []
        for batch in batches:
            for step in self.distiller.step_slices(batch, piece):
                seconds += time.perf_counter() - start  # the time between slices is not the update's
                if step is not None:
                    steps.append(step)
                yield
                start = time.perf_counter()
        self.updates += 1
        examples = int(all_sum(mx.array(sum(map(len, batches))), self.group).item())
        check_ranks(self.group)  # a rank that ended may have left garbage in the gradients: never save that
        report = UpdateReport(self.updates, examples, self.cfg.steps, steps)
        report.seconds = seconds + time.perf_counter() - start
        del self.buffer[:taken]
        self.last = report  # before the save: a Ctrl-C held through it arrives after
        if self.profile is not None and self.group.rank() == 0:
            self.unsaved = {  # until the profile holds it
                "update": report.update,
                "examples": report.examples,
                "loss": report.loss,
                "seconds": round(report.seconds, 2),
                "tokens_per_s": round(report.tokens_per_s, 1),
                "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2),
                **(record or {}),
            }
            if save:
                t0 = time.perf_counter()
                self.save()
                report.update = self.updates
                report.save_s = time.perf_counter() - t0
        return report

    def save(self, wait_s: float | None = None) -> None:
        """Save the profile: every part, and the drafter update not saved yet, if any (its adapter,
        optimizer state and record). A failed save leaves that update unsaved, for the next to save."""
        if self.unsaved is None:
            self.profile.save(wait_s=wait_s)
            return
        saved = self.profile.manifest
        try:
            self.profile.save(
                self.pair.draft, self.distiller.opt, self.cfg.__dict__, self.corpus, self.position, self.unsaved, wait_s
            )
        finally:
            if self.profile.manifest is not saved:  # committed (a Ctrl-C held through the save comes after)
                self.unsaved = None
                self.updates = self.profile.updates  # another process's updates count too


def open_learner(
    draft: str,
    target: str,
    models: tuple,
    cfg: DistillConfig,
    interval: int = 8,
    raw: bool = False,
    path: Path | None = None,
    note: Callable[[str], None] = lambda s: None,
    policy: DraftPolicy | None = None,
    history: bool = False,
    resolver: Resolver = LOCAL,
) -> OnlineLearner:
    """A learner on the pair's profile: its adapter, optimizer state and n-grams
    when they exist (the saved adapter's shape wins over cfg's), else a fresh one.
    `models` is (draft model, draft tokenizer, target model, target tokenizer);
    history=True gives the learner the profile's history index to learn replies into."""
    from omnidraft_mlx.learn.distill import setup_trainable
    from omnidraft_mlx.loading import open_pair

    opened = open_pair(
        draft,
        target,
        resolver=resolver,
        loaded=models,
        trainable=True,
        profile_path=path,
        policy=policy,
        history=history,
        costs=False,  # learning verifies no drafts
    )
    pair, profile = opened.pair, opened.profile
    if profile.distill:
        saved = DistillConfig.from_dict(profile.distill)
        if saved.adapter_dict() != cfg.adapter_dict():
            note(f"continuing the profile's adapter {saved.adapter_dict()}")
        cfg = DistillConfig(**{**cfg.__dict__, **saved.adapter_dict()})
    else:
        setup_trainable(pair.draft, cfg)
    learner = OnlineLearner(pair, cfg, interval, profile, raw, policy)
    learner.history = opened.history
    return learner


# --- the two loops ---------------------------------------------------------------


STOPPED = "stopped on request"  # Budget.why_spent once `stop` is set


@dataclass
class Budget:
    """When a loop starts nothing new: after `minutes` or `max_prompts` items (None: no bound),
    or once `stop` is set (`omnidraft adapt` sets it on Ctrl-C or SIGTERM)."""

    minutes: float | None = None
    max_prompts: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    start: float = field(default_factory=time.monotonic)

    def why_spent(self, done: int) -> str | None:
        """Why nothing new is to start after `done` items, or None while something may."""
        if self.stop.is_set():
            return STOPPED
        if self.max_prompts is not None and done >= self.max_prompts:
            return f"{self.max_prompts} items are done"
        if self.minutes is not None and time.monotonic() - self.start >= 60 * self.minutes:
            return f"{self.minutes:g} minutes are up"
        return None

    def spent(self, done: int) -> bool:
        return self.why_spent(done) is not None

    def spent_on_lead(self, done: int, group) -> bool:
        """Rank 0's verdict, or a stop asked of any rank, on every rank (their clocks differ; all
        must stop together)."""
        mine = self.spent(done) if group.rank() == 0 else self.stop.is_set()
        return all_sum(mx.array(int(mine)), group).item() > 0


@dataclass
class Event:
    """What the loops report after each item (for a progress display)."""

    done: int  # items handled in this run
    position: int  # position reached in the corpus
    acceptance: float | None = None  # of the last generation (speculative)
    update: UpdateReport | None = None


MODES = ("speculative", "target", "teacher-forced")
OLD_MODES = {"stream": "speculative", "batch": "target", "text": "teacher-forced"}  # their names before


def check_mode(mode: str) -> str:
    """The adaptation mode `mode` names (an old name gives its new one); a one-line error for others."""
    mode = OLD_MODES.get(mode, mode)
    check_choice("--mode", mode, MODES)
    return mode


def _prompt(sample: Sample, mode: str) -> list[dict]:
    """What the models are to answer for a corpus item; documents have nothing to answer."""
    if sample.messages is None:
        raise OmniDraftError(
            f"the {mode} mode needs prompts (a JSONL corpus or --task); use --mode teacher-forced for documents"
        )
    return asked(sample.messages)


def learn_speculative(
    learner: OnlineLearner,
    samples: list[Sample],
    spec: SpecConfig,
    budget: Budget,
    on_event: Callable[[Event], None] = lambda e: None,
) -> list[dict]:
    """Algorithm 2: answer each prompt speculatively, learn from the verified reply.

    Returns one record per prompt (acceptance as it was when answered, the reply's target ids)."""
    pair, records, done = learner.pair, [], 0
    for idx in range(learner.position, len(samples)):
        if budget.spent(done):
            break
        msgs = _prompt(samples[idx], "speculative")
        stats = SpecStats()
        draft_ids = encode_prompt(pair.draft_tok, msgs, learner.raw)
        target_ids = encode_prompt(pair.target_tok, msgs, learner.raw)
        reply = [
            t
            for new, _ in speculative_generate(
                pair, draft_ids, target_ids, spec, stats, learner.policy, history=learner.history
            )
            for t in new
        ]
        learner.observe(msgs, reply)
        learner.position, done = idx + 1, done + 1
        records.append(
            {
                "position": idx + 1,
                **stats.record(),
                "ngrams": len(pair.ngrams),
                "updates": learner.updates,
                "reply": reply,
            }
        )
        report = learner.update(_window(records, learner.interval)) if len(learner.buffer) >= learner.interval else None
        on_event(Event(done, learner.position, stats.acceptance, report))
    if report := learner.update(_window(records, learner.interval)):  # what is left in the buffer
        on_event(Event(done, learner.position, None, report))
    return records


def learn_from_target(
    learner: OnlineLearner,
    samples: list[Sample],
    max_tokens: int,
    budget: Budget,
    on_event: Callable[[Event], None] = lambda e: None,
) -> list[dict]:
    """The target answers `interval` prompts per batched greedy decoding; an update follows.

    Under mlx.launch the `interval` prompts are shared between the ranks (distributed.shard)
    and every rank learns n-grams and acceptance labels from all the replies, in corpus
    order, as one process would. Returns one record per prompt (its reply's target ids)."""
    from mlx_lm.generate import batch_generate

    pair, policy, group, records, done = learner.pair, learner.policy, learner.group, [], 0
    while learner.position < len(samples) and not budget.spent_on_lead(done, group):
        start = learner.position
        stop = min(len(samples), start + learner.interval)
        if budget.max_prompts is not None:
            stop = min(stop, start + budget.max_prompts - done)
        parts = shard(start, stop, learner.cfg.batch, group.rank(), group.size())
        mine = [i for part in parts for i in part]
        prompts = {i: _prompt(samples[i], "target") for i in mine}
        ids = [encode_prompt(pair.target_tok, prompts[i], learner.raw) for i in mine]
        replies = dict(
            zip(
                mine,
                batch_generate(
                    pair.target,
                    pair.target_tok,
                    ids,
                    max_tokens=max_tokens,
                    return_token_ids=True,
                    prefill_batch_size=len(ids),
                    completion_batch_size=len(ids),
                ).token_ids
                if ids
                else [],
            )
        )
        examples = {i: learner.example(prompts[i], r) for i, r in replies.items() if r}
        labels = {}
        if policy is not None:  # before the update: what this drafter would have had accepted
            labels = {i: head_labels(pair, ex, policy) for i, ex in examples.items()}
        replies = gather_rows({i: np.array(r, np.int64) for i, r in replies.items()}, group)
        for i in range(start, stop):
            reply = replies[i].tolist()
            pair.learn_ngrams(reply)  # what verification would have taught the cache
            if learner.history is not None:  # as decoding would: the prompt's tail as context
                context = encode_prompt(pair.target_tok, _prompt(samples[i], "target"), learner.raw)[
                    -learner.history.order :
                ]
                learner.history.add(context + reply, start=len(context))
            done += 1
            records.append(
                {
                    "position": i + 1,
                    "tokens": len(reply),
                    "ngrams": len(pair.ngrams),
                    "updates": learner.updates,
                    "reply": reply,
                }
            )
        if policy is not None:
            features = gather_rows({i: f for i, (f, _) in labels.items()}, group)
            kept = gather_rows({i: k for i, (_, k) in labels.items()}, group)
            for i in sorted(kept):
                policy.head.learn(features[i], kept[i], steps=len(kept[i]) // 8)
        learner.position = stop
        report = learner.update({"position": stop}, [[examples[i] for i in part if i in examples] for part in parts])
        on_event(Event(done, learner.position, None, report))
    return records


def drafter_on_reply(pair: Pair, ids: list[int], start: int) -> tuple[mx.array, mx.array, mx.array, np.ndarray]:
    """One teacher-forced drafter forward over prompt + reply (`ids`, the reply from `start`): at each
    reply position, the drafter's hidden state, logits, the token it would draft, and whether the reply
    goes on with that token."""
    hidden = pair.draft.model(mx.array(ids)[None])[0, start - 1 : -1]
    logits = output_head(pair.draft)(hidden)
    drafted = mx.argmax(logits, axis=-1)
    return hidden, logits, drafted, np.array(drafted) == np.array(ids[start:])


def head_labels(pair: Pair, example: Example, policy: LearnedPolicy) -> tuple[np.ndarray, np.ndarray]:
    """Acceptance-head data from a reply the drafter did not decode (the target mode):
    one teacher-forced drafter forward gives, at every reply position, the token
    it would draft there and whether the reply goes on with it; replaying greedy
    speculative decoding over those outcomes gives each drafted one its depth and
    the reply's recent acceptance before its round.
    Drafting the reply's own next token in the drafter's tokenization stands in
    for drafting text the target keeps. Returns (features, kept) per drafted token."""
    ids, start = example.draft_ids, max(1, example.reply_start)
    if len(ids) <= start:
        return np.zeros((0, 0), np.float32), np.zeros(0, bool)
    hidden, logits, drafted, kept = drafter_on_reply(pair, ids, start)
    depths = replay_depths(kept, policy.cfg.max_k)
    recent = replay_recent(kept, depths, policy.cfg.recent_decay)
    features = np.array(policy.features_of(hidden, logits, drafted, mx.array(depths), mx.array(recent)))
    return features[depths >= 0], kept[depths >= 0]


def _window(records: list[dict], n: int) -> dict:
    recent = records[-n:]
    proposed = sum(r["proposed"] for r in recent)
    return {
        "position": recent[-1]["position"] if recent else 0,
        "acceptance": sum(r["accepted"] for r in recent) / proposed if proposed else None,
    }


def text_examples(pair: Pair, sample: Sample, max_len: int, raw: bool = False) -> list[Example]:
    """Teacher-forced examples: the reply of a transcript, else the text in chunks."""
    msgs = sample.messages
    if msgs and len(prompt := asked(msgs)) < len(msgs):
        reply = list(pair.target_tok.encode(msgs[-1]["content"], add_special_tokens=False))
        pair.learn_ngrams(reply)
        return [
            make_example(
                pair,
                encode_prompt(pair.draft_tok, prompt, raw),
                encode_prompt(pair.target_tok, prompt, raw),
                reply,
                max_len,
            )
        ]
    text = sample.text if sample.text is not None else "\n\n".join(m["content"] for m in msgs)
    ids = list(pair.target_tok.encode(text, add_special_tokens=False))
    pair.learn_ngrams(ids)
    chunk = max(16, max_len // 2)  # the drafter's tokenization can be longer than the target's
    return [make_example(pair, [], [], ids[i : i + chunk], max_len) for i in range(0, len(ids), chunk)]


def learn_teacher_forced(
    learner: OnlineLearner, samples: list[Sample], budget: Budget, on_event: Callable[[Event], None] = lambda e: None
) -> None:
    """Teacher-forced distillation over the corpus, an update every `interval` items."""
    done = 0
    for idx in range(learner.position, len(samples)):
        if budget.spent(done):
            break
        for ex in text_examples(learner.pair, samples[idx], learner.cfg.max_len, learner.raw):
            learner.add(ex)
        learner.position, done = idx + 1, done + 1
        report = learner.update({"position": idx + 1}) if len(learner.buffer) >= learner.interval else None
        on_event(Event(done, learner.position, None, report))
    if report := learner.update({"position": learner.position}):  # what is left in the buffer
        on_event(Event(done, learner.position, None, report))


# --- evaluation ------------------------------------------------------------------


def evaluate(
    pair: Pair, prompts: list[list[dict]], k: int = 4, max_tokens: int = 48, translation: str = "text"
) -> dict:
    """Greedy speculative decoding over prompts: acceptance and tokens per target forward.
    The n-gram cache is left as it was (evaluation must not learn)."""
    pair = replace(pair, ngrams=copy.deepcopy(pair.ngrams), spelled=set(pair.spelled))
    total = SpecStats()
    for msgs in prompts:
        stats = SpecStats()
        # The drafter's own acceptance: it drafts every round, no lookups.
        cfg = SpecConfig(k=k, max_tokens=max_tokens, translation=translation, sources="drafter", guard=False)
        msgs = asked(msgs)
        for _ in speculative_generate(
            pair, encode_prompt(pair.draft_tok, msgs), encode_prompt(pair.target_tok, msgs), cfg, stats
        ):
            pass
        total += stats
    return {
        "prompts": len(prompts),
        "acceptance": total.acceptance,
        "tokens_per_forward": total.tokens_per_forward,
        "tokens_per_s": total.tokens_per_s,
        "tokens": total.emitted,
        "translation": translation,
        "k": k,
    }
