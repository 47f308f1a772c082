"""Flags several verbs share, defined once."""

import typer

from omnidraft_mlx.drafts import SOURCES

SOURCE = typer.Option(",".join(SOURCES), "--source", help="Draft sources to choose from each round, comma-separated: "
                      "drafter (the model), context (lookup in the prompt and reply), history (lookup in earlier replies).")
NO_GUARD = typer.Option(False, "--no-guard", help="Always draft (for measurements); by default the loop decodes "
                        "plainly while no source is expected to pay.")
