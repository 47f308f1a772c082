"""`omnidraft chat`: a terminal chat that speculates and learns from the conversation.

The conversation logic is in omnidraft_mlx/chat.py, the commands and what the
chat shows in chat_view.py; this is the terminal: line editing and history
(readline), streaming, Ctrl-C / Ctrl-D. Under mlx.launch rank 0 is the terminal and
the other ranks follow it (ChatSession.follow).
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager

import typer

from omnidraft_mlx.cli import options
from omnidraft_mlx.errors import OmniDraftError

PROMPT, MORE = "you> ", "...> "
BLOCK = '"""'
DRAFTED, RESET = "\x1b[36m", "\x1b[0m"


def _setup_history():
    try:
        import readline  # noqa: F401  (line editing for input())
    except ImportError:  # not on every platform: plain input() still works
        return None
    from omnidraft_mlx.paths import model_home

    path = model_home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return path


def _save_history(path) -> None:
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
    except OSError:
        pass  # history is a convenience: never fail the chat over it


def read_message() -> str:
    """One message: a line, lines joined by a trailing backslash, or a \"\"\" block."""
    line = input(PROMPT)
    if line.strip() == BLOCK:
        lines = []
        while (line := input(MORE)).strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input(MORE)
    return "\n".join(lines + [line])


class CtrlC:
    """What Ctrl-C (SIGINT) does: a KeyboardInterrupt at once, which stops a reply or asks for
    the message again. Across ranks it ends the chat (it stops mlx.launch's relay of the output
    too), and inside a reply (held) it waits for the round under way: every round is collectives
    all ranks run, and the lead leaving one midway would leave the others waiting in it."""

    def __init__(self, across_ranks: bool):
        self.across_ranks, self.holding, self.pending = across_ranks, False, False

    def __call__(self, signum, frame) -> None:
        if not self.holding:
            raise KeyboardInterrupt
        self.pending = True

    @contextmanager
    def held(self):
        """Across ranks, a Ctrl-C inside the block is raised at check() or when the block ends."""
        self.holding = self.across_ranks
        try:
            yield
        finally:
            self.holding = False
        self.check()

    def check(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


def chat(
    draft: str = options.DRAFT,
    target: str = options.TARGET,
    system: str | None = options.SYSTEM,
    k: int = options.K,
    policy: str = options.POLICY,
    gamma: str = options.GAMMA,
    max_k: int | None = options.MAX_K,
    temp: float = options.TEMP,
    top_p: float = options.TOP_P,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most tokens per reply."),
    seed: int = options.SEED,
    translation: str = options.TRANSLATION,
    sampling: str = options.SAMPLING,
    lookup_len: int = options.LOOKUP_LEN,
    context: int | None = typer.Option(
        None,
        "--context",
        help="Most tokens of conversation sent to the models (default: the models' limit); older turns are trimmed.",
    ),
    show_draft: bool = options.SHOW_DRAFT,
    adapt: bool = typer.Option(
        True, "--adapt/--no-adapt", help="Update the drafter from the replies (pause with /adapt off)."
    ),
    adapt_every: int = typer.Option(4, "--adapt-every", help="Replies gathered per drafter update."),
    source: str = options.SOURCE,
    no_guard: bool = options.NO_GUARD,
    tree: bool = options.TREE,
    no_profile: bool = options.NO_PROFILE,
    shard: str = options.SHARD,
) -> None:
    """Chat with TARGET, DRAFT speculating; the pair learns from the conversation. Under
    `mlx.launch` the target is split over the ranks (--shard) and rank 0 reads and prints."""
    flags = dict(locals())  # the flags as given, before the body adds names
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.chat import ChatConfig
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.collectives import world
    from omnidraft_mlx.decode.ranks import SHARDINGS
    from omnidraft_mlx.settings import check_choice

    # The settings check themselves (one-line errors), before any model loads.
    spec = options.decoding(flags)
    group = world()
    # Drafter updates run the target's forward, which across ranks all of them would have to run.
    cfg = ChatConfig(spec=spec, context=context, adapt=adapt and group.size() == 1, adapt_every=adapt_every)
    policy_cfg = options.draft_length(policy, gamma, k, max_k)
    check_choice("--shard", shard, SHARDINGS)
    console.quiet = group.rank() != 0  # rank 0 alone shows the chat
    if group.rank() == 0:
        warn_if_slow_blas(err_console)
    session = _open_session(draft, target, system, cfg, policy_cfg, no_profile, shard)
    if not session.pair.ranks.lead:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every rank: the lead ends them
        session.follow()
        return
    if adapt and not cfg.adapt:
        console.print("[dim](drafter updates are off across ranks: they would run the target on rank 0 alone)[/]")
    # Ctrl-C stops a reply even when the chat was started with SIGINT ignored, as a background
    # job of a script is (POSIX), and Python then installs no handler of its own.
    ctrl_c = CtrlC(across_ranks=session.pair.ranks.group is not None)
    signal.signal(signal.SIGINT, ctrl_c)
    history = _setup_history() if sys.stdin.isatty() else None
    try:
        _converse(session, show_draft and sys.stdout.isatty(), ctrl_c)
        session.share_turn(None)  # the other ranks end (nothing to do in one process)
    finally:
        session.learning.close()  # the last save (a failure says what it loses)
        if history:
            _save_history(history)


def _open_session(draft: str, target: str, system: str | None, cfg, policy_cfg, no_profile: bool, shard: str):
    """Load the pair (the target split over the ranks under mlx.launch) and its profile, time the
    target's plain step and say what was loaded; the session."""
    from omnidraft_mlx.chat import ChatSession, Conversation
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.decode.policy import make_policy
    from omnidraft_mlx.learn.online import make_learner
    from omnidraft_mlx.loading import open_pair
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER

    with console.status(f"loading {draft} and {target}"):
        # The profile's adapter goes into the drafter: fused, or trainable when learning goes on.
        opened = open_pair(
            draft,
            target,
            resolver=CATALOG_RESOLVER,
            shard=shard,
            profile=not no_profile,
            trainable=cfg.adapt,
            policy=make_policy(policy_cfg),
        )
        pair, profile = opened.pair, opened.profile
        learner = make_learner(pair, profile, cfg.adapt_every) if cfg.adapt else None
    session = ChatSession(pair, cfg, Conversation(system), learner, profile, opened.policy, history=opened.history)
    with console.status("timing the target's plain decoding step (for the speedup estimate)"):
        session.measure_plain_speed()
    console.print(
        f"[bold]{draft}[/] drafting for [bold]{target}[/] | vocabulary intersection {pair.vmap.size}"
        f" | n-gram cache {len(pair.ngrams)} | drafter updates {profile.updates if profile else 0}"
        f" | plain target {1 / session.plain_step_s:.1f} tok/s\n"
        + (
            "[dim]/help for commands, /quit or Ctrl-C leaves (on every rank)[/]"
            if session.pair.ranks.group
            else "[dim]/help for commands, Ctrl-C stops a reply, Ctrl-D or /quit leaves[/]"
        )
    )
    return session


def _converse(session, colour: bool, ctrl_c: CtrlC) -> None:
    """Read messages and answer them (a reply, or an in-chat command) until Ctrl-D or /quit
    (across ranks, or Ctrl-C)."""
    from omnidraft_mlx.cli.chat_view import command
    from omnidraft_mlx.cli.main import console, err_console

    while True:
        try:
            text = read_message()
        except KeyboardInterrupt:
            if ctrl_c.across_ranks:
                console.print()
                break
            console.print("\n[dim](Ctrl-D or /quit leaves)[/]")
            continue
        except EOFError:
            console.print()
            break
        try:
            if text.startswith("/"):
                out, quit_ = command(session, text)
                if out:
                    console.print(out, markup=False)
                if quit_:
                    break
            elif text.strip() and _reply(session, text, colour, console, ctrl_c) and ctrl_c.across_ranks:
                break
        except OmniDraftError as e:
            err_console.print(f"[bold red]error:[/] {e}")
        except KeyboardInterrupt:  # a second Ctrl-C, after the one that stopped the reply
            if ctrl_c.across_ranks:
                break
            console.print("\n[dim](interrupted; Ctrl-D or /quit leaves)[/]")


def _reply(session, text: str, colour: bool, console, ctrl_c: CtrlC) -> bool:
    """Answer a message (its text shared with the other ranks first, if any); whether Ctrl-C stopped it."""
    from omnidraft_mlx.cli.chat_view import stats_line

    with ctrl_c.held():
        reply = session.start(session.share_turn(text))
        for note in reply.notes:
            console.print(f"[yellow]({note})[/]")
        interrupted = False
        try:
            for piece, drafted in session.stream(reply):
                sys.stdout.write(f"{DRAFTED}{piece}{RESET}" if colour and drafted else piece)
                sys.stdout.flush()
                ctrl_c.check()  # across ranks, a Ctrl-C held during the round that wrote it
        except KeyboardInterrupt:
            interrupted = True
        finally:
            note = session.finish(reply)
    note = "interrupted" if interrupted else note
    sys.stdout.write("\n")
    if note:
        console.print(f"[yellow]({note})[/]")
    console.print(f"[dim]{stats_line(reply.stats, session.plain_step_s, reply.ttft_s)}[/]")
    if session.update_due:
        with console.status(
            f"updating the drafter on the last {session.learner.interval} replies (Ctrl-C postpones it)"
        ):
            updates = session.learner.updates
            try:
                report = session.adapt()
            except KeyboardInterrupt:  # held while the profile saved: the update may be in
                report = session.learner.last if session.learner.updates > updates else None
        saved = ""
        if session.learning.profile is not None:  # a failed save is tried again (and said so)
            saved = ", not saved yet" if session.learning.dirty else ", saved to the profile"
        console.print(
            f"[dim](drafter update {report.update}: loss {report.loss:.3f}, {report.seconds:.1f}s{saved})[/]"
            if report
            else "[dim](drafter update postponed to the next reply)[/]"
        )
    return interrupted
