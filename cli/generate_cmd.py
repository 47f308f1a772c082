"""`omnidraft generate`: speculative (or, with --model, plain) generation."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.text import Text

from omnidraft_mlx.cli import options
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.policy import DraftPolicy, PolicyConfig, check_policy, parse_gamma
from omnidraft_mlx.textstream import TextStream
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


class Printer:
    """Streams target tokens as text; drafted ones optionally coloured."""

    def __init__(self, target_bytes: list[bytes | None], console, show_draft: bool, quiet: bool):
        self.stream, self.console = TextStream(target_bytes), console
        self.show_draft, self.quiet = show_draft, quiet

    def add(self, tokens: list[int], drafted: list[bool]) -> None:
        for t, d in zip(tokens, drafted):
            self._write(self.stream.add(t), d)

    def finish(self) -> None:
        self._write(self.stream.finish() + "\n", False)

    def _write(self, text: str, drafted: bool) -> None:
        if self.quiet or not self.show_draft:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            self.console.print(Text(text, style="cyan" if drafted else ""), end="")


def _fits_context(model, n_prompt: int, max_tokens: int) -> bool:
    from omnidraft_mlx.pair import context_length

    limit = context_length(model)
    return limit is None or n_prompt + max_tokens <= limit


def generate(
    prompt: str = typer.Argument(..., help="The prompt; '-' reads it from standard input."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Plain decoding with this model (no drafter)."),
    draft: str = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Drafter: catalog name, directory, .gguf or hub id."),
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target: catalog name, directory, .gguf or hub id."),
    k: int = typer.Option(4, "--k", "-k", help="Draft tokens per round."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    translation: str = typer.Option("text", "--translation", help="Greedy draft translation: text or tokens."),
    sampling: str = typer.Option("exact", "--sampling", help="Sampling mode: exact (lossless) or omnidraft (+n-grams)."),
    policy: str = typer.Option("learned", "--policy", help="Draft length: learned (default: fixed --k until its head has learned; saved in the profile), fixed, confidence or heuristic."),
    gamma: str = typer.Option("auto", "--gamma", help="Learned policy: stop drafting when P(a rejection) exceeds this; auto: set from the measured drafter and target costs."),
    max_k: int = typer.Option(8, "--max-k", help="Adaptive policies: most draft tokens per round."),
    source: str = options.SOURCE,
    no_guard: bool = options.NO_GUARD,
    show_draft: bool = typer.Option(False, "--show-draft", help="Colour the tokens that came from the drafter."),
    no_profile: bool = typer.Option(False, "--no-profile", help="Ignore and do not update the pair's saved profile."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the generated text."),
) -> None:
    """Generate text from PROMPT, speculatively with a drafter unless --model is given."""
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.generate import PlainStats, plain_generate
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.prompts import encode_prompt, user_messages
    from omnidraft_mlx.speculative import SpecConfig, SpecStats, speculative_generate

    if prompt == "-":
        prompt = sys.stdin.read()
    # The settings check themselves (one-line errors), before any model loads; plain decoding too.
    cfg = SpecConfig(k=k, temp=temp, top_p=top_p, max_tokens=max_tokens, seed=seed,
                     translation=translation, sampling=sampling, sources=source, guard=not no_guard)
    policy_cfg = PolicyConfig(name=check_policy(policy), k=k, max_k=max_k, gamma=parse_gamma(gamma))
    if not quiet:
        warn_if_slow_blas(err_console)
    messages = user_messages(prompt, system)

    target_name = model or target
    target_model, target_tok = load_model(target_name)
    target_ids = encode_prompt(target_tok, messages, raw)
    if not _fits_context(target_model, len(target_ids), max_tokens):
        raise OmniDraftError(
            f"prompt ({len(target_ids)} tokens) + --max-tokens {max_tokens} exceed {target_name}'s "
            "context: shorten the prompt or lower --max-tokens"
        )
    speculate = model is None
    if speculate:
        from omnidraft_mlx.pair import make_pair
        from omnidraft_mlx.profile import load_profile

        draft_model, draft_tok = load_model(draft)
        draft_ids = encode_prompt(draft_tok, messages, raw)
        if not _fits_context(draft_model, len(draft_ids), max_tokens):
            err_console.print(f"[yellow]note:[/] the prompt is too long for the drafter {draft}: plain decoding")
            speculate = False
    if speculate:
        profile = None if no_profile else load_profile(draft, target, draft_model)
        pair = make_pair(draft_model, draft_tok, target_model, target_tok, profile and profile.ngrams)
        stats = SpecStats()
        printer = Printer(pair.vmap.target_bytes, console, show_draft, quiet)
        draft_policy = DraftPolicy(policy_cfg)
        history = None
        if profile is not None:
            profile.attach_policy(draft_policy)
            history = profile.attach_history()
        try:
            for new, drafted in speculative_generate(pair, draft_ids, target_ids, cfg, stats, draft_policy, history):
                printer.add(new, drafted)
        finally:
            printer.finish()
            if profile is not None:
                profile.save()
        if not quiet:
            err_console.print(
                f"[dim]{stats.emitted} tokens, {stats.tokens_per_s:.2f} tok/s | acceptance "
                f"{stats.acceptance:.2f} | {stats.tokens_per_forward:.2f} tokens/target forward | "
                f"n-gram hits {stats.ngram_hits} (cache {len(pair.ngrams)}) | vocab intersection "
                f"{pair.vmap.size} | prefill {stats.prefill_s:.2f}s | draft {stats.draft_s:.1f}s "
                f"verify {stats.verify_s:.1f}s other {stats.other_s:.2f}s | rounds by source "
                + ", ".join(f"{name} {rounds} ({accepted}/{proposed})" for name, (rounds, proposed, accepted)
                            in stats.by_source.items()) + "[/]"
            )
    else:
        from omnidraft_mlx.pair import vocab_size
        from omnidraft_mlx.vocab import token_bytes

        stats = PlainStats()
        printer = Printer(token_bytes(target_tok, vocab_size(target_model)), console, show_draft, quiet)
        try:
            for t in plain_generate(target_model, target_tok, target_ids, stats, temp, top_p, max_tokens, seed):
                printer.add([t], [False])
        finally:
            printer.finish()
        if not quiet:
            err_console.print(
                f"[dim]{stats.emitted} tokens, {stats.tokens_per_s:.2f} tok/s | "
                f"time to first token {stats.prefill_s:.2f}s[/]"
            )
