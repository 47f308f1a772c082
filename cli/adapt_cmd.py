"""`omnidraft adapt`: the drafter learns from a local corpus (or a benchmark's adaptation split)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from omnidraft_mlx.policy import DraftPolicy, PolicyConfig, check_policy


def _samples(corpus: Optional[str], task: Optional[str], n_eval: int):
    """(training samples, held-out prompts, corpus key for the saved position)."""
    from omnidraft_mlx.adapt import read_corpus, task_corpus

    if (corpus is None) == (task is None):
        raise OmniDraftError("give either a CORPUS (JSONL of prompts, text file or folder) or --task code|math|chat")
    if task is not None:
        held = [s.messages for s in task_corpus(task, "heldout")[:n_eval]]
        return task_corpus(task, "adapt"), held, f"task:{task}"
    samples = read_corpus(corpus)
    prompts = [i for i, s in enumerate(samples) if s.messages]
    # The last few prompts are held out for evaluation and never trained on.
    held_idx = set(prompts[-n_eval:]) if n_eval and len(prompts) > n_eval else set()
    held = [samples[i].messages for i in sorted(held_idx)]
    train = [s for i, s in enumerate(samples) if i not in held_idx]
    return train, held, f"file:{Path(corpus).expanduser().resolve()}"


def adapt(
    corpus: Optional[str] = typer.Argument(None, help="JSONL of prompts ({\"prompt\"} or {\"messages\"}), a text file or a folder of them."),
    draft: str = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Drafter: catalog name, directory, .gguf or hub id."),
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target: catalog name, directory, .gguf or hub id."),
    task: Optional[str] = typer.Option(None, "--task", help="Adapt on a benchmark's adaptation split: code, math or chat."),
    mode: Optional[str] = typer.Option(None, "--mode", help="stream (generate and learn, on-policy) or text (teacher-forced, no generation); default: stream for prompts, text for documents."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Stop after this many minutes."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Stop after this many corpus items."),
    interval: int = typer.Option(8, "--interval", help="Update the drafter every this many items (the buffer size)."),
    lr: float = typer.Option(3e-4, "--lr", help="AdamW learning rate (3e-4 x 3 steps measured best; 1e-3 overfit)."),
    lam: float = typer.Option(0.2, "--lambda", help="Weight of the n-gram NLL term."),
    rank: int = typer.Option(32, "--rank", help="LoRA rank; 0 = full fine-tuning (a new profile only)."),
    layers: int = typer.Option(-1, "--layers", help="Train the last N blocks; -1 = all (a new profile only)."),
    batch: int = typer.Option(8, "--batch", help="Sequences per gradient step."),
    steps: int = typer.Option(3, "--steps", help="Gradient steps on each batch (one target forward serves them all)."),
    max_len: int = typer.Option(512, "--max-len", help="Most tokens per training sequence."),
    k: int = typer.Option(4, "--k", "-k", help="Draft tokens per round (stream mode and evaluation)."),
    policy: str = typer.Option("learned", "--policy", help="Draft length while streaming: fixed, confidence, heuristic or learned (its acceptance head learns alongside and is saved in the profile)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Reply length in stream mode."),
    n_eval: int = typer.Option(4, "--eval", help="Held-out prompts evaluated before and after (0 = none)."),
    eval_tokens: int = typer.Option(32, "--eval-tokens", help="Tokens generated per evaluation prompt."),
    raw: bool = typer.Option(False, "--raw", help="Send prompts without the chat template."),
) -> None:
    """Fine-tune the drafter for the target on CORPUS (or --task), saving the pair's profile after every update."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from omnidraft_mlx.adapt import Budget, evaluate, open_learner, stream, text
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.distill import DistillConfig
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.speculative import SpecConfig

    if mode not in (None, "stream", "text"):
        raise OmniDraftError(f"unknown --mode '{mode}': use stream or text")
    check_policy(policy)
    if min(interval, batch, steps, max_len, k, max_tokens) < 1 or n_eval < 0 or rank < 0:
        raise OmniDraftError("--interval, --batch, --steps, --max-len, --k and --max-tokens must be at least 1")
    samples, held, key = _samples(corpus, task, n_eval)
    mode = mode or ("stream" if all(s.messages for s in samples) else "text")
    if mode == "stream" and not all(s.messages for s in samples):
        raise OmniDraftError("stream mode needs prompts (JSONL or --task): use --mode text for documents")
    warn_if_slow_blas(err_console)

    draft_model, draft_tok = load_model(draft)
    target_model, target_tok = load_model(target)
    cfg = DistillConfig(lam=lam, lr=lr, lora_rank=rank, layers=layers, batch=batch, steps=steps, max_len=max_len)
    draft_policy = DraftPolicy(PolicyConfig(name=policy, k=k)) if mode == "stream" else None
    learner = open_learner(draft, target, (draft_model, draft_tok, target_model, target_tok), cfg, interval, raw,
                           note=lambda s: err_console.print(f"[yellow]note:[/] {s}"), policy=draft_policy)
    pair, profile = learner.pair, learner.profile
    learner.corpus, learner.position = key, profile.position(key)
    if learner.position >= len(samples):
        err_console.print(f"[yellow]note:[/] all {len(samples)} items of {key} were learned from already; "
                          "`omnidraft profile reset` starts over")

    def run_eval(label: str) -> dict | None:
        if not held:
            return None
        with console.status(f"evaluating on {len(held)} held-out prompts ({label})"):
            return evaluate(pair, held, k, eval_tokens)

    before = run_eval("before")
    left = len(samples) - learner.position
    total = min(left, max_prompts) if max_prompts is not None else left
    budget = Budget(minutes, max_prompts)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err_console)
    status = {"loss": None, "acc": None}

    def show(event) -> None:
        if event.update:
            status["loss"] = event.update.loss
        if event.acceptance is not None:
            status["acc"] = event.acceptance
        loss = f"{status['loss']:.3f}" if status["loss"] is not None else "-"
        acc = f"{status['acc']:.2f}" if status["acc"] is not None else "-"
        progress.update(bar, advance=1, description=f"{mode} | update {learner.updates} | loss {loss} | acceptance {acc}")

    with progress:
        bar = progress.add_task(f"{mode} | update {learner.updates}", total=total)
        if mode == "stream":
            stream(learner, samples, SpecConfig(k=k, max_tokens=max_tokens), budget, show)
        else:
            text(learner, samples, budget, show)
    after = run_eval("after")

    console.print(f"profile: {profile.path} (update {learner.updates}, position {learner.position}/{len(samples)} "
                  f"of {key}, n-gram cache {len(pair.ngrams)})")
    if learner.last:
        r = learner.last
        console.print(f"last update: {r.examples} sequences, loss {r.loss:.3f}, {r.seconds:.1f}s "
                      f"({r.tokens_per_s:.0f} training tokens/s), saved in {r.save_s:.2f}s")
    if before and after:
        console.print(f"held-out acceptance {before['acceptance']:.3f} -> {after['acceptance']:.3f}, "
                      f"tokens/target forward {before['tokens_per_forward']:.2f} -> {after['tokens_per_forward']:.2f} "
                      f"({len(held)} prompts, {eval_tokens} tokens, greedy, k={k})")
