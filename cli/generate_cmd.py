"""`omnidraft generate`: speculative (or, with --model, plain) generation."""

from __future__ import annotations

import sys
from functools import partial
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from omnidraft_mlx.cli import options
from omnidraft_mlx.decode.policy import make_policy
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.vocab.textstream import TextStream

if TYPE_CHECKING:
    from omnidraft_mlx.loading import OpenPair


class Printer:
    """Streams target tokens as text; drafted ones optionally coloured."""

    def __init__(self, target_bytes: list[bytes | None], console, show_draft: bool, quiet: bool, shown: bool = True):
        self.stream, self.console = TextStream(target_bytes), console
        self.show_draft, self.quiet, self.shown = show_draft, quiet, shown  # shown: False on all but the lead rank

    def add(self, tokens: list[int], drafted: list[bool]) -> None:
        for t, d in zip(tokens, drafted):
            self._write(self.stream.add(t), d)

    def finish(self) -> None:
        self._write(self.stream.finish() + "\n", False)

    def _write(self, text: str, drafted: bool) -> None:
        if not self.shown:
            return
        if self.quiet or not self.show_draft:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            self.console.print(Text(text, style="cyan" if drafted else ""), end="")


def _fits_context(model, n_prompt: int, cfg) -> bool:
    from omnidraft_mlx.pair import context_limit, reply_room

    room = reply_room(context_limit([model]), [n_prompt], cfg.k)
    return room is None or cfg.max_tokens <= room


def generate(
    prompt: str = typer.Argument(..., help="The prompt; '-' reads it from standard input."),
    model: str | None = typer.Option(None, "--model", "-m", help="Plain decoding with this model (no drafter)."),
    draft: str = options.DRAFT,
    target: str = options.TARGET,
    k: int = options.K,
    temp: float = options.TEMP,
    top_p: float = options.TOP_P,
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    seed: int = options.SEED,
    system: str | None = options.SYSTEM,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    translation: str = options.TRANSLATION,
    sampling: str = options.SAMPLING,
    lookup_len: int = options.LOOKUP_LEN,
    policy: str = options.POLICY,
    gamma: str = options.GAMMA,
    max_k: int | None = options.MAX_K,
    source: str = options.SOURCE,
    no_guard: bool = options.NO_GUARD,
    tree: bool = options.TREE,
    show_draft: bool = options.SHOW_DRAFT,
    no_profile: bool = options.NO_PROFILE,
    shard: str = options.SHARD,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the generated text."),
) -> None:
    """Generate text from PROMPT, speculatively with a drafter unless --model is given. Under
    `mlx.launch` the target is split over the ranks (--shard) and rank 0 alone prints."""
    flags = dict(locals())  # the flags as given, before the body adds names
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.decode.ranks import SHARDINGS, ranks_of
    from omnidraft_mlx.prompts import user_messages
    from omnidraft_mlx.settings import check_choice

    if prompt == "-":
        prompt = sys.stdin.read()
    # The settings check themselves (one-line errors), before any model loads; plain decoding too.
    cfg = options.decoding(flags)
    policy_cfg = options.draft_length(policy, gamma, k, max_k)
    check_choice("--shard", shard, SHARDINGS)
    messages = user_messages(prompt, system)

    target_name = model or target
    target_model, target_tok, target_ids = _load(target_name, messages, raw, shard)
    lead = ranks_of(target_model).lead  # the rank that prints (decode/ranks.py)
    quiet = quiet or not lead
    if not quiet:
        warn_if_slow_blas(err_console)
    if not _fits_context(target_model, len(target_ids), cfg):
        raise OmniDraftError(
            f"prompt ({len(target_ids)} tokens) + --max-tokens {max_tokens} exceed {target_name}'s "
            "context: shorten the prompt or lower --max-tokens"
        )
    drafter = None if model else _load_drafter(draft, messages, raw, cfg, lead)
    printer = partial(Printer, console=console, show_draft=show_draft, quiet=quiet, shown=lead)
    if drafter:
        from omnidraft_mlx.loading import open_pair
        from omnidraft_mlx.models.pull import CATALOG_RESOLVER

        (draft_model, draft_tok, draft_ids) = drafter
        opened = open_pair(
            draft,
            target,
            resolver=CATALOG_RESOLVER,
            loaded=(draft_model, draft_tok, target_model, target_tok),  # each checked against the prompt
            profile=not no_profile,
            policy=make_policy(policy_cfg),
        )
        summary = _speculate(opened, draft_ids, target_ids, cfg, printer)
    else:
        summary = _plain(target_model, target_tok, target_ids, cfg, printer)
    if not quiet:
        err_console.print(f"[dim]{summary}[/]")


def _load(name: str, messages: list[dict], raw: bool, shard: str | None = None) -> tuple:
    """(model, tokenizer, the prompt in its tokens); shard: load_model's."""
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.prompts import encode_prompt

    model, tok = load_model(name, CATALOG_RESOLVER, shard)
    return model, tok, encode_prompt(tok, messages, raw)


def _load_drafter(draft: str, messages: list[dict], raw: bool, cfg, lead: bool):
    """The drafter, as _load gives it; None, with a note (from the lead rank), when the prompt does not fit it."""
    from omnidraft_mlx.cli.main import err_console

    drafter = _load(draft, messages, raw)
    if not _fits_context(drafter[0], len(drafter[2]), cfg):
        if lead:
            err_console.print(f"[yellow]note:[/] the prompt is too long for the drafter {draft}: plain decoding")
        return None
    return drafter


def _speculate(opened: OpenPair, draft_ids: list[int], target_ids: list[int], cfg, printer) -> str:
    """Stream the reply of the pair (saving its profile, if any, after); the statistics line."""
    from omnidraft_mlx.decode.speculative import SpecStats, speculative_generate

    pair, profile = opened.pair, opened.profile
    stats = SpecStats()
    out = printer(pair.vmap.target_bytes)
    try:
        for new, drafted in speculative_generate(
            pair, draft_ids, target_ids, cfg, stats, opened.policy, history=opened.history
        ):
            out.add(new, drafted)
    finally:
        out.finish()
        if profile is not None:
            profile.save()
    return (
        f"{stats.emitted} tokens, {stats.tokens_per_s:.2f} tok/s | acceptance "
        f"{stats.acceptance:.2f} | {stats.tokens_per_forward:.2f} tokens/target forward | "
        f"n-gram hits {stats.ngram_hits} (cache {len(pair.ngrams)}) | vocab intersection "
        f"{pair.vmap.size} | prefill {stats.prefill_s:.2f}s | draft {stats.draft_s:.1f}s "
        f"verify {stats.verify_s:.1f}s other {stats.other_s:.2f}s | rounds by source "
        + ", ".join(
            f"{name} {rounds} ({accepted}/{proposed})" for name, (rounds, proposed, accepted) in stats.by_source.items()
        )
    )


def _plain(target_model, target_tok, target_ids: list[int], cfg, printer) -> str:
    """Stream the target's plain reply; the statistics line."""
    from omnidraft_mlx.decode.plain import PlainStats, plain_generate
    from omnidraft_mlx.pair import vocab_size
    from omnidraft_mlx.vocab.tokenmap import token_bytes

    stats = PlainStats()
    out = printer(token_bytes(target_tok, vocab_size(target_model)))
    try:
        for t in plain_generate(
            target_model, target_tok, target_ids, stats, cfg.temp, cfg.top_p, cfg.max_tokens, cfg.seed
        ):
            out.add([t], [False])
    finally:
        out.finish()
    return f"{stats.emitted} tokens, {stats.tokens_per_s:.2f} tok/s | time to first token {stats.prefill_s:.2f}s"
