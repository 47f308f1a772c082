"""Run decoders side by side on the same prompts, in one run.

Every method decodes every prompt; methods run interleaved prompt by prompt in
a rotating order, so drift of the machine (heat, other load) hits all of them
alike. Models load once; one Pair serves the whole run, so its n-gram cache
grows over the run as it would in use (its size is recorded per record). The
pair's profile (drafter adapter, n-gram cache) is loaded unless disabled, and
nothing is ever saved to it, so runs stay reproducible.

Methods:
- `plain`: the target alone (mlx-lm's generate_step), the baseline of every speedup;
- `ours-k{k}` / `ours-k{k}-tokens`: our speculative decoding, draft translated
  as text (default) or token by token;
- `mlxlm-k{k}`: mlx-lm's own speculative decoding (same-vocabulary pairs only, one process).

Under mlx.launch the target is split over the ranks (--shard), every rank runs the
whole bench in step (each target forward is a collective), and rank 0 writes the
results: each record's `share_s` is the time the round's shares of the lead's draft
and decision took (decode/ranks.py), and `round_cost` what a forward and its
collectives cost (round_cost.py), for the time spent in communication.

Timing follows the engine's split: `ttft_s` is prompt processing (both
models), `generate_s` everything after it; tokens/s counts generated tokens
over `generate_s`. The target processes each prompt once (`prompt_s`) and every
method decodes from a copy of that cache: the work is the same for all of them,
and on long prompts or slow formats it was most of a run. A method's `ttft_s`
is that prefill plus its own (the drafter's, and plain's first forward).
Greedy outputs must equal plain decoding token for token; where one does not,
the record keeps the first differing position and the target's top-2 logit gap
there (a tiny gap is a float near-tie).
"""

from __future__ import annotations

import copy
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import zip_longest
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omnidraft_mlx.bench.agent import AGENT_STEPS, agent_prompts
from omnidraft_mlx.bench.report import prompt_speedup
from omnidraft_mlx.bench.round_cost import round_cost
from omnidraft_mlx.bench.usecases import USE_CASES, edit_prompts, file_prompts, multiturn_prompts, prompt_ids
from omnidraft_mlx.decode.drafter import output_head
from omnidraft_mlx.decode.drafts import SOURCES
from omnidraft_mlx.decode.kvcache import KVSlot, prefill
from omnidraft_mlx.decode.lookup import HistoryIndex
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.policy import POLICIES, DraftPolicy, LearnedPolicy, OraclePolicy, PolicyConfig, make_policy
from omnidraft_mlx.decode.promptcache import PromptCache
from omnidraft_mlx.decode.ranks import SHARDINGS
from omnidraft_mlx.decode.scheduler import Scheduler
from omnidraft_mlx.decode.speculative import SAMPLING_MODES, SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.paths import model_home
from omnidraft_mlx.profile.store import load_head
from omnidraft_mlx.settings import check_range, check_settings, setting
from omnidraft_mlx.tasks import TASKS, Prompt, check_task, load_task

WARMUP_PROMPT = "Say hello."
BENCH_POLICIES = (*POLICIES[1:], "oracle")  # adaptive policies to compare; the oracle is a bound
WARMUP_TOKENS = 4
ALL_TASKS = (*TASKS, *USE_CASES)  # --task all: the agent task (hours of plain decoding on a CPU) is asked for by name
BENCH_TASKS = (*ALL_TASKS, "agent")
SERVED_TASKS = ("agent",)  # our methods decode these as the server does (Serving), the rest from a shared prefill
# Method families: the drafter alone, lookups alone (context and history), both fused.
BENCH_SOURCES = {"drafter": ("drafter",), "lookup": ("context", "history"), "fused": SOURCES}


@dataclass(kw_only=True)
class BenchConfig:
    draft: str
    target: str
    tasks: list[str]
    ks: list[int] = setting(flag="--k", low=1, factory=lambda: [3, 4, 5])
    translations: list[str] = setting(flag="--translation", choices=("text", "tokens"), factory=lambda: ["text"])
    samplings: list[str] = setting(flag="--sampling", choices=SAMPLING_MODES, factory=lambda: ["exact"])  # temp > 0
    prompts: int = setting(6, flag="--prompts", low=1)  # held-out prompts per task
    max_tokens: int = setting(96, flag="--max-tokens", low=1)
    shortest: bool = False  # pick the shortest held-out prompts (--quick)
    use_profile: bool = True  # load the pair's saved profile (adapter, n-gram cache)
    mlx_lm: bool = True  # add mlx-lm's speculative decoding where the vocabularies match
    time_limit_s: float | None = None  # start no new prompt after this long (whole prompts only)
    policies: list[str] = setting(flag="--policy", choices=BENCH_POLICIES, factory=list)  # adaptive ones to add
    # The learned policy's thresholds (None: auto).
    gammas: list[float | None] = setting(flag="--gamma", low=0.0, high=1.0, factory=lambda: [None])
    # One family of methods each.
    sources: list[str] = setting(flag="--source", choices=BENCH_SOURCES, factory=lambda: ["drafter"])
    guards: list[bool] = field(default_factory=lambda: [True])  # lookup and fused methods: with the guard, without
    trees: list[bool] = field(default_factory=lambda: [False])  # drafter and fused methods: token trees (-tree), chains
    temp: float = setting(0.0, flag="--temp", low=0)  # > 0: sampled decoding (outputs compared by distribution)
    seed: int = 0  # prompt i samples with seed + i (every method alike)
    prompts_file: str | None = None  # the user's prompts (JSONL), task "file"
    fixed: bool = True  # drafter methods per --k (else only the --policy ones)
    shard: str = setting("tensor", flag="--shard", choices=SHARDINGS)  # under mlx.launch: how the target is split

    def __post_init__(self):
        if not self.tasks and not self.prompts_file:
            raise OmniDraftError(f"no task to run: use --task {', '.join(BENCH_TASKS)} or all, or --prompts-file")
        for task in self.tasks:
            check_task(task, BENCH_TASKS)
        if not self.ks:
            raise OmniDraftError("--k needs draft lengths, e.g. --k 3,4,5")
        check_settings(self)
        if self.temp == 0 and self.samplings != ["exact"]:
            raise OmniDraftError("--sampling compares sampled decoding: add --temp, e.g. --temp 0.7")
        if self.time_limit_s is not None:
            check_range("--time-limit", self.time_limit_s / 60, 0.0, open_low=True)  # set in minutes


@dataclass(frozen=True)
class DecodeSettings:
    """What every decode of a run shares."""

    max_tokens: int
    temp: float = 0.0
    seed: int = 0
    history: HistoryIndex | None = None  # the profile's, read only (None: no history)


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # plain | ours | mlxlm
    k: int | None = None
    translation: str = "text"
    sampling: str = "exact"
    policy: str = "fixed"
    gamma: float | None = None  # learned policy only; None = auto
    sources: tuple[str, ...] = ("drafter",)
    guard: bool = False
    tree: bool = False


def methods_for(cfg: BenchConfig, same_vocab: bool) -> list[Method]:
    """plain, then per source family: the drafter alone as `ours-*` (never guarded: the
    baseline), `lookup` and `fused-*` (with and/or without the guard: `-noguard`); the drafter's
    as token trees (`-tree`) and/or chains."""
    # How a draft becomes target tokens: greedy by text or by tokens; sampled exactly or with
    # n-gram merges. A same-vocabulary pair needs neither: one variant.
    if cfg.temp == 0:
        variants = [("" if t == "text" else f"-{t}", {"translation": t}) for t in cfg.translations]
    else:
        variants = [("" if s == "exact" else f"-{s}", {"sampling": s}) for s in cfg.samplings]
    variants = variants[:1] if same_vocab else variants
    drafters = []  # (name, k, variant fields, policy, gamma)
    for k in cfg.ks if cfg.fixed or not cfg.policies else []:
        drafters += [(f"k{k}{suffix}", k, fields, "fixed", None) for suffix, fields in variants]
    # Adaptive policies start from (and, untrained, behave like) the largest k.
    for p in cfg.policies:
        for g in cfg.gammas if p == "learned" else [None]:
            name = p + (f"-g{'auto' if g is None else f'{g:g}'}" if p == "learned" and len(cfg.gammas) > 1 else "")
            drafters += [(name + suffix, max(cfg.ks), fields, p, g) for suffix, fields in variants]
    methods = [Method("plain", "plain")]
    for family in cfg.sources:
        sources = BENCH_SOURCES[family]
        for guard in [False] if family == "drafter" else cfg.guards:
            tag = "-noguard" if family != "drafter" and not guard else ""
            if family == "lookup":
                methods.append(Method(f"lookup{tag}", "ours", max(cfg.ks), sources=sources, guard=guard))
                continue
            prefix = "ours" if family == "drafter" else "fused"
            methods += [
                Method(
                    f"{prefix}-{name}{tag}{'-tree' if tree else ''}",
                    "ours",
                    k,
                    policy=p,
                    gamma=g,
                    sources=sources,
                    guard=guard,
                    tree=tree,
                    **fields,
                )
                for name, k, fields, p, g in drafters
                if family == "drafter" or p != "oracle"
                for tree in cfg.trees
            ]
    if same_vocab and cfg.mlx_lm:
        methods += [Method(f"mlxlm-k{k}", "mlxlm", k) for k in cfg.ks]
    return methods


def make_policies(cfg: BenchConfig, methods: list[Method], profile: dict | None, vmap) -> dict[str, DraftPolicy]:
    """One policy per method for the whole run, so adaptive ones learn across prompts;
    the learned head starts from the profile's (never saved back)."""
    policies = {}
    for m in methods:
        if m.kind == "ours":
            policy = policies[m.name] = make_policy(PolicyConfig(name=m.policy, k=m.k, gamma=m.gamma))
            if policy.head is not None and profile is not None:
                load_head(policy, model_home() / profile["path"])
            if isinstance(policy, OraclePolicy):
                policy.start([], vmap)  # no reply to show it before the first prompt's
    return policies


def built_replies(progress, task: str, total: int):
    """replied(what) for the builders of scripted conversations: their earlier replies take
    minutes to decode, shown as progress."""
    if progress is None:
        return lambda what: None
    bar = progress.add_task(f"{task}: replies to build on", total=total)

    def replied(what: str) -> None:
        progress.update(bar, description=f"{what} (a reply to build on)")
        progress.advance(bar)

    return replied


def select_prompts(cfg: BenchConfig, pair, progress=None) -> list[Prompt]:
    """Held-out prompts (and the user's), tasks interleaved (code, math, chat, code, ...)."""
    per_task = []
    for task in cfg.tasks:
        if task == "edit":
            prompts = edit_prompts(cfg.prompts)
        elif task == "multiturn":
            replied = built_replies(progress, task, 2 * ((cfg.prompts + 1) // 2))
            prompts = multiturn_prompts(cfg.prompts, pair, cfg.max_tokens, replied)
        elif task == "agent":
            replied = built_replies(progress, task, cfg.prompts * (AGENT_STEPS - 1))
            prompts = agent_prompts(cfg.prompts, pair, cfg.max_tokens, replied)
        else:
            prompts = load_task(task, "heldout")
            if cfg.shortest:
                prompts = sorted(prompts, key=lambda p: len(p.text))
            prompts = prompts[: cfg.prompts]
        per_task.append(prompts)
    if cfg.prompts_file:
        per_task.append(file_prompts(cfg.prompts_file))
    return [p for group in zip_longest(*per_task) for p in group if p is not None]


def rotated(methods: list, i: int) -> list:
    i %= len(methods)
    return methods[i:] + methods[:i]


# --- one decode per method -------------------------------------------------


@dataclass
class TargetPrefix:
    """The target's cache over a prompt but its last token, and the seconds it took."""

    slot: KVSlot
    seconds: float

    @classmethod
    def of(cls, pair, target_ids: list[int]) -> TargetPrefix:
        start = time.perf_counter()
        slot = KVSlot.fresh(pair.target)
        slot.extend(pair.target, target_ids[:-1])
        return cls(slot, time.perf_counter() - start)

    def copy(self) -> KVSlot:
        """A slot of its own for one method (decoding writes into the cache)."""
        return KVSlot(copy.deepcopy(self.slot.cache), list(self.slot.tokens))


@dataclass
class Serving:
    """What the server keeps across requests, one per method for the run: a prompt cache, and a
    history index that learns from every reply (a copy of the profile's: the profile stays as it was)."""

    cache: PromptCache
    history: HistoryIndex

    @classmethod
    def start(cls, history: HistoryIndex | None) -> Serving:
        return cls(PromptCache(), copy.deepcopy(history) if history is not None else HistoryIndex())


def _run_plain(pair, target: KVSlot, target_ids: list[int], max_tokens: int, temp: float, seed: int) -> dict:
    stats = PlainStats()
    out = list(
        plain_generate(
            pair.target,
            pair.target_tok,
            target_ids[len(target.tokens) :],
            stats,
            temp=temp,
            max_tokens=max_tokens,
            seed=seed,
            prompt_cache=target.cache,
        )
    )
    return {
        "output": out,
        "ttft_s": stats.prefill_s,
        "generate_s": stats.generate_s,
        "tokens_per_s": stats.tokens_per_s,
        "rounds": len(out),
        # Plain decoding is all target forwards.
        "draft_s": 0.0,
        "verify_s": stats.generate_s,
        "other_s": 0.0,
    }


def _run_ours(
    pair,
    target: KVSlot | None,
    draft_ids,
    target_ids,
    method: Method,
    run: DecodeSettings,
    policy: DraftPolicy,
    scheduler: Scheduler | None,
    serving: Serving | None = None,
) -> dict:
    """Decoded from the target's prefix slot, or (with `serving`) on the server's path: from the method's
    prompt cache, with its history index learning from the reply."""
    stats = SpecStats()
    cfg = SpecConfig(
        k=method.k,
        max_tokens=run.max_tokens,
        translation=method.translation,
        sampling=method.sampling,
        temp=run.temp,
        seed=run.seed,
        sources=method.sources,
        guard=method.guard,
        tree=method.tree,
    )
    out = []
    if serving is None:  # the profile's history index is read, never learned into: runs stay reproducible
        rounds = speculative_generate(
            pair,
            draft_ids,
            target_ids,
            cfg,
            stats,
            policy,
            history=run.history,
            target_slot=target,
            learn_history=False,
            scheduler=scheduler,
        )
    else:
        rounds = serving.cache.generate(
            pair, draft_ids, target_ids, cfg, stats, policy, history=serving.history, scheduler=scheduler
        )
    for new, _ in rounds:
        out += new
        if isinstance(policy, OraclePolicy):
            policy.advance(new)
    return {"output": out, "ttft_s": stats.prefill_s, **stats.record()}


def _run_mlxlm(pair, target: KVSlot, target_ids: list[int], k: int, max_tokens: int) -> dict:
    """mlx-lm's speculative decoding, with the prompt processed apart (as in ours)."""
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    caches = target.cache, make_prompt_cache(pair.draft)
    prefill(pair.draft, caches[1], target_ids[:-1])
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out, drafted = [], []
    responses = stream_generate(
        pair.target,
        pair.target_tok,
        target_ids[-1:],
        max_tokens=max_tokens,
        draft_model=pair.draft,
        num_draft_tokens=k,
        prompt_cache=caches[0] + caches[1],
    )
    for r in responses:
        # The last response repeats nothing: it carries the token that stopped the loop.
        if r.finish_reason == "stop":
            break
        out.append(int(r.token))
        drafted.append(bool(r.from_draft))
    generate_s = time.perf_counter() - start
    # Each round ends with one token of the target's own; a round drafts min(k, tokens left).
    proposed = rounds = 0
    for i, from_draft in enumerate(drafted):
        if i == 0 or not drafted[i - 1]:
            proposed += min(k, max_tokens - i)
        rounds += not from_draft
    return {
        "output": out,
        "ttft_s": ttft,
        "generate_s": generate_s,
        "tokens_per_s": len(out) / generate_s if generate_s else 0.0,
        "rounds": rounds + (bool(drafted) and drafted[-1]),
        "proposed": proposed,
        "accepted": sum(drafted),
        "draft_s": None,
        "verify_s": None,
        "other_s": None,  # not visible inside mlx-lm
    }


def first_mismatch(pair, target_ids: list[int], reference: list[int], output: list[int]) -> dict | None:
    """Where `output` leaves the plain greedy `reference`, with the target's top-2 logit gap there."""
    pos = next((i for i, (a, b) in enumerate(zip(reference, output)) if a != b), None)
    if pos is None:
        if len(reference) == len(output):
            return None
        pos = min(len(reference), len(output))
    cache = make_prompt_cache(pair.target)
    hidden = prefill(pair.target, cache, target_ids + reference[:pos])
    logits = output_head(pair.target)(hidden).astype(mx.float32)
    top2 = mx.topk(logits, 2).tolist()
    return {
        "position": pos,
        "plain_token": reference[pos] if pos < len(reference) else None,
        "method_token": output[pos] if pos < len(output) else None,
        "top2_logit_gap": float(abs(top2[1] - top2[0])),
    }


def run_one(
    pair,
    method: Method,
    prompt: Prompt,
    run: DecodeSettings,
    policy: DraftPolicy | None = None,
    scheduler: Scheduler | None = None,
    prefix: TargetPrefix | None = None,
    serving: Serving | None = None,
) -> dict:
    """One decode of prompt by method (its policy and scheduler carry over from its earlier decodes),
    from the target's prefill of the prompt (made here if not given), or for our methods given
    `serving`, from the prompt cache (prompt_s 0: its prefill is the method's own)."""
    draft_ids, target_ids = prompt_ids(pair, prompt)
    served = serving is not None and method.kind == "ours"
    shared_before = pair.ranks.share_s
    prefix = TargetPrefix(None, 0.0) if served else prefix or TargetPrefix.of(pair, target_ids)
    if served:
        result = _run_ours(pair, None, draft_ids, target_ids, method, run, policy, scheduler, serving)
    elif method.kind == "plain":
        result = _run_plain(pair, prefix.copy(), target_ids, run.max_tokens, run.temp, run.seed)
    elif method.kind == "mlxlm":
        result = _run_mlxlm(pair, prefix.copy(), target_ids, method.k, run.max_tokens)
    else:
        result = _run_ours(pair, prefix.copy(), draft_ids, target_ids, method, run, policy, scheduler)
    result["prompt_s"], result["ttft_s"] = prefix.seconds, prefix.seconds + result["ttft_s"]
    result["share_s"] = pair.ranks.share_s - shared_before
    tokens = len(result["output"])
    record = {
        "prompt_id": prompt.id,
        "task": prompt.task,
        "method": method.name,
        "kind": method.kind,
        "k": method.k,
        "translation": method.translation,
        "sampling": method.sampling,
        "policy": method.policy,
        "prompt_tokens": len(target_ids),
        "seed": run.seed if run.temp else None,
        "tokens": tokens,
        "proposed": None,
        "accepted": None,
        "draft_forwards": None,
        "ngram_hits": None,
        "round_ends": None,
        "by_source": None,
        "branched": None,
        "branch_held": None,
        "tree": method.tree,
        **result,
    }
    record["acceptance"] = record["accepted"] / record["proposed"] if record["proposed"] else None
    record["tokens_per_forward"] = tokens / record["rounds"] if record["rounds"] else None
    record["ngram_cache_size"] = len(pair.ngrams) if method.kind == "ours" else None
    # The threshold in force at the end (gamma auto follows the measured costs).
    record["gamma"] = policy.gamma if isinstance(policy, LearnedPolicy) else None
    return record


# --- the whole run -------------------------------------------------------------


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def environment_base() -> dict:
    """The machine and the software the numbers were measured on."""
    import mlx_lm

    from omnidraft_mlx.blas import active_blas

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}",
        "processor": _cpu_name(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "blas": active_blas(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "omnidraft_commit": _git_commit(),
    }


def environment(cfg: BenchConfig) -> dict:
    from omnidraft_mlx.models.pull import model_hash

    return {
        **environment_base(),
        "models": {
            "draft": {"name": cfg.draft, "gguf_sha256": model_hash(cfg.draft)},
            "target": {"name": cfg.target, "gguf_sha256": model_hash(cfg.target)},
        },
    }


def recorded_path(path: Path) -> str:
    """A path as results record it: relative to OMNIDRAFT_HOME when under it (model_home() / it
    finds it again), so committed results hold no machine's paths."""
    return str(path.relative_to(model_home()) if path.is_relative_to(model_home()) else path)


def load_pair(cfg: BenchConfig):
    """Both models, once, with the pair's saved profile (adapter, n-gram cache, history index)
    unless told to ignore it; the second value describes what the profile brought (None:
    ignored), the third is the history index (None: ignored)."""
    from omnidraft_mlx.loading import open_pair
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    opened = open_pair(cfg.draft, cfg.target, resolver=CATALOG_RESOLVER, profile=cfg.use_profile, shard=cfg.shard)
    pair, profile, history = opened.pair, opened.profile, opened.history
    used = (
        None
        if profile is None
        else {
            "path": recorded_path(profile.path),
            "adapter": bool(profile.distill),
            "updates": profile.updates,
            "ngrams": len(profile.ngrams),
            "history": len(history),
        }
    )
    return pair, used, history


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    """Decode every selected prompt with every method; the records and the environment."""
    pair, profile, history = load_pair(cfg)
    if pair.ranks.group is not None:  # mlx-lm's speculative decoding would draft on every rank by itself
        cfg = replace(cfg, mlx_lm=False)
    prompts = select_prompts(cfg, pair, progress)
    methods = methods_for(cfg, pair.vmap.same_vocab)
    policies = make_policies(cfg, methods, profile, pair.vmap)
    ngrams_at_start, env = len(pair.ngrams), environment(cfg)
    run = DecodeSettings(cfg.max_tokens, cfg.temp, cfg.seed, history)

    warm = Prompt("warmup", "chat", WARMUP_PROMPT)
    for method in methods:  # first calls allocate; keep them out of the numbers
        run_one(pair, method, warm, replace(run, max_tokens=WARMUP_TOKENS), policies.get(method.name))
    cost = round_cost(pair.target, pair.target_tok)
    # One scheduler per method for the whole run, as a chat session keeps one (from after the warm-up).
    schedulers = {m.name: Scheduler() for m in methods if m.kind == "ours"}
    served = any(p.task in SERVED_TASKS for p in prompts)
    servings = {m.name: Serving.start(history) for m in methods if m.kind == "ours" and served}

    task = progress.add_task("bench", total=len(prompts) * len(methods)) if progress else None
    records, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        in_time = cfg.time_limit_s is None or time.perf_counter() - start <= cfg.time_limit_s
        if not pair.ranks.least(int(in_time)):  # every rank stops at the same prompt
            prompts = prompts[:i]  # out of time: report the prompts every method finished
            break
        target_ids = prompt_ids(pair, prompt)[1]
        done, prefix = {}, TargetPrefix.of(pair, target_ids)
        # A seed per prompt: with one seed, every prompt's replies would share their random draws.
        prompt_run = replace(run, seed=cfg.seed + i)
        for order, method in enumerate(rotated(methods, i)):
            if progress:
                progress.update(task, description=f"{prompt.id} {method.name}")
            policy = policies.get(method.name)
            if isinstance(policy, OraclePolicy):  # show it the reply (plain's, or decoded now, untimed)
                plain = done.get("plain") or run_one(pair, methods[0], prompt, prompt_run, prefix=prefix)
                policy.start(plain["output"], pair.vmap)
            serving = servings.get(method.name) if prompt.task in SERVED_TASKS else None
            record = run_one(pair, method, prompt, prompt_run, policy, schedulers.get(method.name), prefix, serving)
            record["order"] = order
            record["load_avg_1m"] = os.getloadavg()[0]  # other work on the machine, for drift
            done[method.name] = record
            if progress:
                progress.advance(task)
        plain = done["plain"]
        for method in methods:
            record = done[method.name]
            record["speedup"] = prompt_speedup(record["tokens_per_s"], plain["tokens_per_s"])
            # Sampled outputs differ from plain's by design: they are compared by distribution.
            compare = record is not plain and cfg.temp == 0
            record["mismatch"] = (
                first_mismatch(pair, target_ids, plain["output"], record["output"]) if compare else None
            )
            record["equal_to_plain"] = record["mismatch"] is None if cfg.temp == 0 else None
            records.append(record)
    return {
        "config": {
            **asdict(cfg),
            "methods": [asdict(m) for m in methods],
            "prompt_ids": [p.id for p in prompts],
            "vocab_intersection": pair.vmap.size,
            "same_vocab": pair.vmap.same_vocab,
            "ngram_cache_at_start": ngrams_at_start,
            "profile": profile,
        },
        "environment": env,
        "round_cost": cost,
        "records": records,
    }
