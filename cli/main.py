"""The `omnidraft` command line."""

from __future__ import annotations

import copy
import io
import sys

import typer
from rich.console import Console
from rich.markup import escape

from omnidraft_mlx.blas import ensure_fast_blas
from omnidraft_mlx.errors import OmniDraftError

app = typer.Typer(
    help="One small drafter for any target LLM: cross-vocabulary speculative decoding on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _console(stderr: bool = False) -> Console:
    """A terminal wraps long lines to its width; a pipe or a file gets each line whole."""
    out = Console(stderr=stderr, highlight=False)
    out.soft_wrap = not out.is_terminal
    return out


console = _console()
err_console = _console(stderr=True)


def print_table(table, out: Console | None = None) -> None:
    """Print a rich table: fitted to a terminal's width; to a pipe or a file whole, each column
    as wide as its widest cell, so that nothing is cut short and grep finds every row."""
    out = out or console
    if out.is_terminal:
        out.print(table)
        return
    if table.title:  # a line of its own: rich wraps a title to the table's width
        out.print(table.title, soft_wrap=True)
        table = copy.copy(table)
        table.title = None
    whole = Console(width=100_000, file=io.StringIO(), highlight=False)
    whole.print(table)
    out.out("\n".join(line.rstrip() for line in whole.file.getvalue().splitlines()))


def _register() -> None:
    from omnidraft_mlx.cli import bench_cmd, chat_cmd, doctor_cmd, generate_cmd, models_cmd

    app.add_typer(models_cmd.app, name="models", help="Pull, import, list and remove models.")
    app.command("generate")(generate_cmd.generate)
    app.command("doctor")(doctor_cmd.doctor)
    app.command("bench")(bench_cmd.bench)
    app.command("chat")(chat_cmd.chat)
    from omnidraft_mlx.cli import adapt_cmd, profile_cmd, serve_cmd

    app.command("adapt")(adapt_cmd.adapt)
    app.command("serve")(serve_cmd.serve)
    app.add_typer(profile_cmd.app, name="profile", help="Show, reset or export what a drafter/target pair learned.")


def main() -> None:
    ensure_fast_blas()  # before anything imports mlx
    _register()
    try:
        app()
    except OmniDraftError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except RuntimeError as e:
        from omnidraft_mlx.collectives import lost_a_rank

        if not lost_a_rank(e):
            raise
        err_console.print(
            f"[bold red]error:[/] another rank of this mlx.launch has ended ({escape(str(e))}); what was saved is kept"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
