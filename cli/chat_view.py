"""What `omnidraft chat` shows: in-chat commands, their help, per-reply and session statistics."""

from __future__ import annotations

from omnidraft_mlx.chat import ChatSession, Conversation
from omnidraft_mlx.decode.speculative import SpecStats
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.prompts import encode_prompt
from omnidraft_mlx.timing import speedup

HELP = """\
commands:
  /help            this list
  /stats           statistics of this session
  /reset           start a new conversation (keeps the system prompt)
  /save FILE       save the conversation as JSON
  /load FILE       load a conversation saved with /save (or a JSON list of messages)
  /adapt on|off    update the drafter from the replies, or pause that
  /quit            leave (also Ctrl-D)
input: end a line with \\ to continue on the next one, or put \"\"\" alone on a line
to start and end a multi-line block. Ctrl-C stops a reply and keeps the conversation."""


def estimate(replies: list[SpecStats], plain_step_s: float | None) -> dict | None:
    """The speedup as every report defines it (timing.speedup over replies), against an
    estimate of plain decoding's rate on each: one over the target's step time timed at start."""
    if not plain_step_s:
        return None
    return speedup((s.tokens_per_s, 1 / plain_step_s) for s in replies if s.generate_s)


def stats_line(stats: SpecStats, plain_step_s: float | None, ttft_s: float | None = None) -> str:
    line = (
        f"{stats.emitted} tokens, {stats.tokens_per_s:.1f} tok/s | acceptance {stats.acceptance:.2f}"
        f" | {stats.tokens_per_forward:.2f} tokens/target forward"
    )
    if (est := estimate([stats], plain_step_s)) is not None:
        line += f" | ~{est['median']:.2f}x plain target ({1 / plain_step_s:.1f} tok/s)"
    line += f" | prefill {stats.prefill_s:.1f}s"
    return line + (f" | first token {ttft_s:.2f}s" if ttft_s is not None else "")


def stats_text(session: ChatSession) -> str:
    t, conv = session.totals, session.conv
    sent = conv.sent()
    used = len(encode_prompt(session.pair.target_tok, sent)) if any(m["content"] for m in sent) else 0
    lines = [
        f"replies {session.replies}, {t.emitted} tokens in {t.generate_s:.1f}s decoding + {t.prefill_s:.1f}s prefill",
        f"{t.tokens_per_s:.1f} tok/s | acceptance {t.acceptance:.2f} ({t.accepted}/{t.proposed})"
        f" | {t.tokens_per_forward:.2f} tokens/target forward | draft {t.draft_s:.1f}s verify {t.verify_s:.1f}s",
    ]
    if (est := estimate(session.reply_stats, session.plain_step_s)) is not None:
        lines.append(
            f"estimated speedup ~{est['median']:.2f}x (median of {est['prompts']} replies, "
            f"{est['min']:.2f}-{est['max']:.2f}x): tok/s over the target's plain rate "
            f"{1 / session.plain_step_s:.1f} tok/s (one-token forwards timed at start)"
        )
    ngrams = len(session.pair.ngrams)
    lines.append(
        f"n-gram cache {ngrams} entries (+{ngrams - session.ngrams_at_start} this session, "
        f"{t.ngram_hits} hits) | vocabulary intersection {session.pair.vmap.size}"
    )
    lines.append(
        f"conversation {len(conv.turns)} messages, {len(conv.turns) - conv.first} sent, "
        f"{used} target tokens" + (f" of {session.limit}" if session.limit else "")
    )
    if (lr := session.learner) is None:
        lines.append("drafter learning off (the n-gram cache still learns)")
    else:
        lines.append(
            f"drafter learning {'on' if session.cfg.adapt else 'paused'}: {lr.updates} updates so far, "
            f"{len(lr.buffer)}/{lr.interval} replies gathered for the next"
            + (f", last loss {lr.last.loss:.3f}" if lr.last else "")
        )
    return "\n".join(lines)


def command(session: ChatSession, line: str) -> tuple[str, bool]:
    """Run an in-chat command; (what to show, whether to quit)."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return "", True
    if name == "/help":
        return HELP, False
    if name == "/stats":
        return stats_text(session), False
    if name == "/reset":
        session.reset()
        return "new conversation", False
    if name in ("/save", "/load") and not arg:
        raise OmniDraftError(f"{name} needs a file name: {name} FILE")
    if name == "/save":
        session.conv.save(arg)
        return f"saved {len(session.conv.all_messages())} messages to {arg}", False
    if name == "/load":
        conv = Conversation.load(arg)
        conv.system = conv.system or session.conv.system  # a file without one keeps --system
        session.conv = conv
        return f"loaded {len(conv.all_messages())} messages from {arg}", False
    if name == "/adapt":
        if arg not in ("on", "off"):
            raise OmniDraftError("use /adapt on or /adapt off")
        if session.learner is None:
            raise OmniDraftError(
                "drafter learning is off for this session (started with --no-adapt or under mlx.launch, or it failed)"
            )
        session.cfg.adapt = arg == "on"
        return f"drafter learning {arg}", False
    raise OmniDraftError(f"unknown command {name}: /help lists them")
