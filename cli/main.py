"""The `omnidraft` command line."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from omnidraft_mlx.blas import ensure_fast_blas
from omnidraft_mlx.errors import OmniDraftError

app = typer.Typer(
    help="One small drafter for any target LLM: cross-vocabulary speculative decoding on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


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


if __name__ == "__main__":
    main()
