"""Derive a shallow, cheap drafter from a pretrained one.

On a CPU a drafter's step costs about a fixed amount per layer plus the output
head, so a 30-layer drafter costs a third of a 0.5B target's step and the
speculation barely pays. Deriving keeps the few layers that matter most and
heals the cut by distillation from the full model:

1. Layer selection: greedily drop, one at a time, the layer whose removal
   raises the held-out next-token loss least (embeddings, final norm and head
   are kept). The drop order is nested, so it is cached per source model and
   any later depth reuses it.
2. Distillation: teacher-forced KL(full || shallow) over the next-token
   distributions on text found on this machine (Python sources and docs of
   installed packages) and on chat transcripts of the full model answering the
   benchmark's adaptation prompts (code, math, chat: what a drafter reads in
   use, which files lack), AdamW on the kept layers and the final norm, under
   a time budget, with resumable checkpoints.
3. The result is an ordinary MLX model directory under models_dir()/<name>,
   so every command that takes a drafter name accepts it.

The derived model shares the source's tokenizer and knows nothing of any
target: it stays a drafter for every target.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models.convert import staged_dir
from omnidraft_mlx.models.pull import _progress, resolve_model
from omnidraft_mlx.paths import INFO_FILE, is_model_dir, model_home, models_dir
from omnidraft_mlx.profile.atomic import atomic_write_text

WEIGHTS = "model.safetensors"
CHECKPOINT = "checkpoint.safetensors"


@dataclass
class DeriveConfig:
    source: str = "smollm2-135m"
    layers: int = 6
    name: str = ""  # default: <source>-<layers>l
    minutes: float = 20.0  # total distillation budget, counting resumed runs
    steps: int = 0  # also stop after this many steps in all (0: the time budget alone)
    seq_len: int = 256
    batch: int = 4
    lr: float = 3e-4  # peak; cosine decay to 10% over the time budget
    warmup: int = 20  # steps
    weight_decay: float = 0.01
    select_seqs: int = 4  # held-out sequences (of seq_len/2 tokens) scoring the layer drops
    eval_seqs: int = 16  # held-out sequences for the before/after losses
    train_tokens: int = 2_000_000  # upper bound on the training text
    replies: int = 96  # the source's transcripts per benchmark task ("adapt" prompts, cycled); 0: files only
    reply_tokens: int = 96
    reply_share: float = 0.5  # of the training windows, where there are transcripts
    checkpoint_every: float = 60.0  # seconds
    seed: int = 0

    def out_name(self) -> str:
        return self.name or f"{Path(self.source).name}-{self.layers}l"


def work_dir(name: str) -> Path:
    """Where a derivation keeps its checkpoint (outside models_dir(): not a model)."""
    return model_home() / "derive" / name


# --- text -------------------------------------------------------------------

_SKIP_DOCS = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "RECORD", "entry_points", "top_level")


def corpus_files() -> list[Path]:
    """Python sources and documentation of the interpreter and installed packages."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    files = set()
    for root in roots:
        for pattern in ("*.py", "*.md", "*.rst", "*.txt"):
            for path in root.rglob(pattern):
                if path.suffix == ".py" or not path.name.startswith(_SKIP_DOCS):
                    files.add(path)
    return sorted(files)


def _heldout(path: Path) -> bool:
    # A stable 1-in-10 split by path, so selection and evaluation never see training text.
    return hashlib.sha1(str(path).encode()).digest()[0] < 26


def adapt_prompts() -> dict[str, list[str]]:
    """The tasks' "adapt" prompts (never "heldout"); none for a task whose data
    cannot be fetched."""
    from omnidraft_mlx.tasks import TASKS, load_task

    prompts = {}
    for task in TASKS:
        try:
            prompts[task] = [p.text for p in load_task(task, "adapt")]
        except OmniDraftError:  # its data cannot be fetched here: go without
            continue
    return prompts


def transcripts(
    model,
    tokenizer,
    prompts: dict[str, list[str]],
    per_task: int,
    max_tokens: int,
    path: Path,
    progress=None,
    batch: int = 32,
) -> list[str]:
    """Chat transcripts of `model` answering `per_task` prompts of each task (cycled),
    replies sampled (temperature 0.8): a prompt in the chat template, then a reply, as a
    drafter reads them in use. Saved to `path` (JSONL, rewritten atomically per batch),
    so a resumed derivation generates only what is missing."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    from omnidraft_mlx.prompts import encode_prompt, user_messages

    done = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    # Tasks take turns, so every task is covered however far an interrupted run got.
    jobs = [(task, texts[i % len(texts)]) for i in range(per_task) for task, texts in prompts.items() if texts]
    bar = progress.add_task("transcripts", total=len(jobs), completed=min(len(done), len(jobs))) if progress else None
    for start in range(len(done), len(jobs), batch):
        chunk = jobs[start : start + batch]
        ids = [encode_prompt(tokenizer, user_messages(text)) for _, text in chunk]
        replies = batch_generate(
            model,
            tokenizer,
            ids,
            max_tokens=max_tokens,
            return_token_ids=True,
            sampler=make_sampler(temp=0.8, top_p=0.95),
            prefill_batch_size=len(ids),
            completion_batch_size=len(ids),
        ).token_ids
        done += [{"task": t, "text": tokenizer.decode(p + r)} for (t, _), p, r in zip(chunk, ids, replies)]
        atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in done))
        if progress:
            progress.update(bar, advance=len(chunk))
    return [d["text"] for d in done[: len(jobs)]]


def token_windows(tokenizer, texts, n_tokens: int, length: int, rng) -> np.ndarray:
    """[n, length] windows of token ids cut from the texts (in a shuffled order),
    about n_tokens in all; files are separated by the end-of-sequence token."""
    eos = tokenizer.eos_token_id
    ids, total = [], 0
    for i in rng.permutation(len(texts)):
        text = texts[i]
        if isinstance(text, Path):
            try:
                text = text.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) < 200:  # stubs and empty __init__ files
                continue
        # At most ~4 windows per file: many files beat a few big ones.
        tokens = tokenizer.encode(text[: 16 * length], add_special_tokens=False)[: 4 * length]
        ids.extend(tokens + [eos])
        total += len(tokens) + 1
        if total >= n_tokens:
            break
    n = len(ids) // length
    if n == 0:
        raise OmniDraftError("found no text to derive a drafter from (no Python sources or docs installed?)")
    return np.array(ids[: n * length], dtype=np.int32).reshape(n, length)


def datasets(tokenizer, cfg: DeriveConfig, chats: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) windows of seq_len + 1 tokens (input and shifted target); the
    transcripts `chats`, repeated, make up cfg.reply_share of the training windows."""
    files = corpus_files()
    rng = np.random.default_rng(cfg.seed)
    heldout_need = (cfg.eval_seqs + cfg.select_seqs) * (cfg.seq_len + 1)
    heldout = token_windows(tokenizer, [f for f in files if _heldout(f)], heldout_need, cfg.seq_len + 1, rng)
    train = token_windows(tokenizer, [f for f in files if not _heldout(f)], cfg.train_tokens, cfg.seq_len + 1, rng)
    if chats:
        chat = token_windows(tokenizer, chats, cfg.train_tokens, cfg.seq_len + 1, rng)
        repeat = math.ceil(cfg.reply_share / (1 - cfg.reply_share) * len(train) / len(chat))
        train = np.concatenate([train, np.tile(chat, (repeat, 1))])
    return train, heldout


# --- forward pieces ---------------------------------------------------------

SUPPORTED = ("llama", "qwen2")  # a plain list of blocks between embedding and norm/head


def _check_arch(model, name: str) -> list:
    if getattr(model, "model_type", None) not in SUPPORTED:
        raise OmniDraftError(
            f"cannot derive from '{name}' ({getattr(model, 'model_type', '?')}): supported are {', '.join(SUPPORTED)}"
        )
    return list(model.model.layers)


def _run(layers, h):
    for layer in layers:
        h = layer(h, "causal")
    return h


def _logits(model, h):
    """The final norm and output head on the last hidden state."""
    from omnidraft_mlx.decode.drafter import output_head

    return output_head(model)(model.model.norm(h))


def _ce(logits, targets):
    import mlx.core as mx
    import mlx.nn as nn

    return mx.mean(nn.losses.cross_entropy(logits, targets))


def kl_loss(student_logits, teacher_logits):
    """Mean over positions of KL(teacher || student) on the next-token distributions."""
    import mlx.core as mx

    log_p = teacher_logits - mx.logsumexp(teacher_logits, axis=-1, keepdims=True)
    log_q = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    return mx.mean(mx.sum(mx.exp(log_p) * (log_p - log_q), axis=-1))


# --- layer selection --------------------------------------------------------


def select_layers(model, windows: np.ndarray, n: int, done: dict | None = None, on_drop=None, progress=None) -> dict:
    """Greedily drop layers down to n: each round removes the layer whose removal
    raises the next-token loss on `windows` least.

    Returns {"order": dropped layer indices in drop order, "loss": loss of the
    full model then after each drop}. `done` (an earlier, possibly shorter
    result for the same model and windows) is continued, not redone; on_drop(result)
    is called after each drop (to save it).
    """
    import mlx.core as mx

    full = list(model.model.layers)
    x, y = mx.array(windows[:, :-1]), mx.array(windows[:, 1:])
    result = {"order": list(done["order"]), "loss": list(done["loss"])} if done else {"order": [], "loss": []}
    if not result["loss"]:
        result["loss"].append(_ce(_logits(model, _run(full, model.model.embed_tokens(x))), y).item())
    keep = [i for i in range(len(full)) if i not in result["order"]]
    # No bar when an earlier run already went deep enough.
    task = (
        progress.add_task("select layers", total=sum(range(n + 1, len(keep) + 1)))
        if progress and len(keep) > n
        else None
    )
    while len(keep) > n:
        # Hidden states before each kept layer: a candidate only reruns what follows it.
        h, before = model.model.embed_tokens(x), []
        for i in keep:
            before.append(h)
            h = full[i](h, "causal")
            mx.eval(h)
        losses = []
        for j in range(len(keep)):
            rest = [full[i] for i in keep[j + 1 :]]
            losses.append(_ce(_logits(model, _run(rest, before[j])), y).item())
            if task is not None:
                progress.update(task, advance=1, description=f"select layers: {len(keep)} -> {len(keep) - 1}")
        j = int(np.argmin(losses))
        result["order"].append(keep.pop(j))
        result["loss"].append(losses[j])
        if on_drop:
            on_drop(result)
    return result


def keep_layers(model, keep: list[int], full: list) -> None:
    """Make `model` run only the layers `keep` (indices into `full`, in order)."""
    model.model.layers = [full[i] for i in keep]


def kept(order: list[int], total: int, n: int) -> list[int]:
    """The n layers left after the first total - n drops of a greedy order."""
    dropped = set(order[: total - n])
    return [i for i in range(total) if i not in dropped]


# --- evaluation -------------------------------------------------------------


def heldout_losses(student, teacher, windows: np.ndarray, batch: int) -> dict:
    """Next-token loss of both models and KL(teacher || student) on held-out windows."""
    import mlx.core as mx

    sums = {"teacher_loss": 0.0, "loss": 0.0, "kl": 0.0}
    for s in range(0, len(windows), batch):
        x, y = mx.array(windows[s : s + batch, :-1]), mx.array(windows[s : s + batch, 1:])
        t, q = teacher(x), student(x)
        w = len(x) / len(windows)
        sums["teacher_loss"] += w * _ce(t, y).item()
        sums["loss"] += w * _ce(q, y).item()
        sums["kl"] += w * kl_loss(q, t).item()
    return {k: round(v, 4) for k, v in sums.items()}


# --- checkpoints ------------------------------------------------------------


def save_checkpoint(path: Path, student, opt, meta: dict) -> None:
    """Trainable weights + optimizer state + progress in one file, replaced atomically."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arrays = {f"param/{k}": v for k, v in tree_flatten(student.trainable_parameters())}
    arrays.update({f"opt/{k}": v for k, v in tree_flatten(opt.state)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata={"meta": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, student, opt) -> dict:
    """Restore what save_checkpoint wrote; returns its meta."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    arrays, metadata = mx.load(str(path), return_metadata=True)
    params = [(k[len("param/") :], v) for k, v in arrays.items() if k.startswith("param/")]
    student.load_weights(params, strict=False)
    opt.state = tree_unflatten([(k[len("opt/") :], v) for k, v in arrays.items() if k.startswith("opt/")])
    return json.loads(metadata["meta"])


# --- distillation -----------------------------------------------------------


def _lr(cfg: DeriveConfig, step: int, frac: float) -> float:
    """Linear warmup, then cosine decay to 10% over the time budget."""
    warm = min(1.0, (step + 1) / cfg.warmup)
    return cfg.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def distill(student, teacher, train: np.ndarray, cfg: DeriveConfig, ckpt: Path, meta: dict, progress=None) -> dict:
    """Teacher-forced KL distillation of `student` (its layers and final norm) for
    cfg.minutes in all, resuming from and saving to `ckpt`. Returns the final meta."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    student.freeze()
    for layer in student.model.layers:
        layer.unfreeze()
    student.model.norm.unfreeze()
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    opt.init(student.trainable_parameters())
    meta = {**meta, "step": 0, "seconds": 0.0, "loss": None}
    if ckpt.is_file():
        saved = load_checkpoint(ckpt, student, opt)
        if saved["keep"] != meta["keep"] or saved["source"] != meta["source"]:
            raise OmniDraftError(
                f"the checkpoint {ckpt} is for other layers or another source model; pass --restart to start over"
            )
        meta.update(step=saved["step"], seconds=saved["seconds"], loss=saved["loss"])

    loss_and_grad = nn.value_and_grad(student, lambda m, x, t: kl_loss(m(x), t))
    state = [student.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x, t):
        loss, grads = loss_and_grad(student, x, t)
        opt.update(student, grads)
        return loss

    budget = cfg.minutes * 60
    order = np.random.default_rng(cfg.seed).permutation(len(train))
    task = progress.add_task("distill", total=budget, completed=meta["seconds"]) if progress else None
    last_save, ema = time.monotonic(), meta["loss"]

    def frac():
        return max(meta["seconds"] / budget, meta["step"] / cfg.steps if cfg.steps else 0.0)

    while frac() < 1.0:
        start = time.perf_counter()
        # Batch i is a function of the step alone, so a resumed run sees the same data.
        rows = order[(meta["step"] * cfg.batch + np.arange(cfg.batch)) % len(order)]
        x = mx.array(train[rows, :-1])
        opt.learning_rate = mx.array(_lr(cfg, meta["step"], frac()))
        loss = train_step(x, teacher(x))
        mx.eval(loss, state)
        dt = time.perf_counter() - start
        meta["step"] += 1
        meta["seconds"] += dt
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        meta["loss"] = round(ema, 4)
        if progress:
            progress.update(task, advance=dt, description=f"distill step {meta['step']} KL {ema:.3f}")
        if time.monotonic() - last_save > cfg.checkpoint_every or frac() >= 1.0:
            save_checkpoint(ckpt, student, opt, meta)
            last_save = time.monotonic()
    return meta


# --- the derived model directory --------------------------------------------


def write_model_dir(src: Path, out: Path, student, keep: list[int], info: dict) -> Path:
    """An MLX model directory at `out` (replaced atomically): the source's config with
    the reduced depth, the student's weights, the source's tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(keep)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in keep]
    with staged_dir(out) as tmp:
        mx.save_safetensors(str(tmp / WEIGHTS), dict(tree_flatten(student.parameters())), metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in src.iterdir():
            # Tokenizer files and the like; not the weights, config or provenance.
            if f.is_file() and ".safetensors" not in f.name and f.name not in ("config.json", INFO_FILE):
                shutil.copy2(f, tmp / f.name)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    return out


def _source_cache(src: Path, kind: str, *settings) -> Path:
    """Where work that depends only on the source model (and `settings`) is kept, for any depth."""
    weights = sorted(src.glob("*.safetensors"))
    key = json.dumps([str(src), [(w.name, w.stat().st_size, int(w.stat().st_mtime)) for w in weights], *settings])
    return model_home() / "derive" / f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def _check_request(cfg: DeriveConfig, name: str) -> Path:
    """The source's model directory, once the name, the source and the budgets are usable."""
    from omnidraft_mlx.models.catalog import CATALOG

    if not name or "/" in name or name.startswith("."):
        raise OmniDraftError(f"bad model name '{name}': use a plain name such as smollm2-135m-6l")
    if name in CATALOG:
        raise OmniDraftError(f"'{name}' is a catalog model name; pass --name to choose another")
    src = Path(resolve_model(cfg.source))
    if not is_model_dir(src):
        raise OmniDraftError(f"'{cfg.source}' is not a local MLX model directory; derive needs its weights here")
    if "quantization" in json.loads((src / "config.json").read_text()):
        raise OmniDraftError(f"'{cfg.source}' is quantized: derive from a float model (models pull --dtype float32)")
    if cfg.minutes < 0 or cfg.replies < 0:
        raise OmniDraftError(f"--minutes and --replies must be >= 0, got {cfg.minutes} and {cfg.replies}")
    return src


def derive(cfg: DeriveConfig, restart: bool = False, progress: bool = True) -> Path:
    """Select, distill and write a cfg.layers-deep drafter; returns its directory."""
    import mlx.core as mx
    from mlx_lm import load

    name = cfg.out_name()
    src = _check_request(cfg, name)
    teacher, tokenizer = load(str(src))
    full = _check_arch(teacher, cfg.source)
    if not 1 <= cfg.layers < len(full):
        raise OmniDraftError(f"--layers must be between 1 and {len(full) - 1}: '{cfg.source}' has {len(full)} layers")
    student, _ = load(str(src))  # a separate copy: training it leaves the teacher intact
    mx.random.seed(cfg.seed)
    ckpt = work_dir(name) / CHECKPOINT
    if restart:
        ckpt.unlink(missing_ok=True)
    cache = _source_cache(src, "selection", cfg.seq_len, cfg.select_seqs, cfg.seed).with_suffix(".json")
    done = json.loads(cache.read_text()) if cache.is_file() else None
    with _progress(progress) as bar:
        chats = (
            transcripts(
                teacher,
                tokenizer,
                adapt_prompts(),
                cfg.replies,
                cfg.reply_tokens,
                _source_cache(src, "transcripts", cfg.reply_tokens, cfg.seed).with_suffix(".jsonl"),
                bar,
            )
            if cfg.replies
            else []
        )
        train, heldout = datasets(tokenizer, cfg, chats)
        select_windows = heldout[: cfg.select_seqs, : cfg.seq_len // 2 + 1]
        eval_windows = heldout[cfg.select_seqs : cfg.select_seqs + cfg.eval_seqs]
        selection = select_layers(
            teacher,
            select_windows,
            cfg.layers,
            done,
            on_drop=lambda r: atomic_write_text(cache, json.dumps(r)),
            progress=bar,
        )
        keep = kept(selection["order"], len(full), cfg.layers)
        keep_layers(student, keep, list(student.model.layers))
        before = heldout_losses(student, teacher, eval_windows, cfg.batch)
        meta = {"source": str(src), "keep": keep}
        meta = distill(student, teacher, train, cfg, ckpt, meta, progress=bar) if cfg.minutes > 0 else meta
        after = heldout_losses(student, teacher, eval_windows, cfg.batch) if cfg.minutes > 0 else before
    info = {
        "source": "derived",
        "derived_from": cfg.source,
        "source_layers": len(full),
        "kept_layers": keep,
        "selection_loss": dict(zip(range(len(full), 0, -1), selection["loss"])),
        "heldout_before": before,
        "heldout_after": after,
        "distill_steps": meta.get("step", 0),
        "distill_seconds": round(meta.get("seconds", 0.0), 1),
        "distill_tokens": meta.get("step", 0) * cfg.batch * cfg.seq_len,
        "train_windows": len(train),
        "transcripts": len(chats),
        "config": asdict(cfg),
    }
    return write_model_dir(src, models_dir() / name, student, keep, info)
