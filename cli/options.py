"""Flags several verbs share, defined once."""

import typer

from omnidraft_mlx.decode.drafts import SOURCES
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

DRAFT = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Drafter: catalog name, directory, .gguf or hub id.")
TARGET = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target: catalog name, directory, .gguf or hub id.")
SOURCE = typer.Option(
    ",".join(SOURCES),
    "--source",
    help="Draft sources to choose from each round, comma-separated: "
    "drafter (the model), context (lookup in the prompt and reply), history (lookup in earlier replies).",
)
NO_GUARD = typer.Option(
    False,
    "--no-guard",
    help="Always draft (for measurements); by default the loop decodes plainly while no source is expected to pay.",
)
TREE = typer.Option(
    False,
    "--tree/--no-tree",
    help="Also verify the drafter's next-best tokens beside its chain, as a "
    "token tree, where the width pays (off by default: it has not won on the measured pairs yet).",
)
NO_PROFILE = typer.Option(False, "--no-profile", help="Ignore and do not update the pair's saved profile.")

# Decoding, as `generate` and `chat` take it.
K = typer.Option(4, "--k", "-k", help="Draft tokens per round.")
POLICY = typer.Option(
    "learned",
    "--policy",
    help="Draft length: learned (default: fixed --k until its head has "
    "learned; saved in the profile), fixed, confidence or heuristic.",
)
GAMMA = typer.Option(
    "auto",
    "--gamma",
    help="Learned policy: stop drafting when P(a rejection) exceeds this; "
    "auto: set from the measured drafter and target costs.",
)
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 = greedy.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold.")
SEED = typer.Option(0, "--seed", help="Random seed for sampling.")
SYSTEM = typer.Option(None, "--system", help="System prompt.")
SHOW_DRAFT = typer.Option(False, "--show-draft", help="Colour the tokens that came from the drafter.")
