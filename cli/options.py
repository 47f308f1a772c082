"""Flags several verbs share, defined once."""

from __future__ import annotations

import typer

from omnidraft_mlx.decode.drafts import SOURCES
from omnidraft_mlx.decode.policy import PolicyConfig, check_policy, parse_gamma
from omnidraft_mlx.decode.speculative import SpecConfig
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

# Decoding, as `generate`, `chat` and `serve` take it (decoding() and draft_length() make the settings).
K = typer.Option(4, "--k", "-k", help="Draft tokens per round.")
MAX_K = typer.Option(None, "--max-k", help="Adaptive policies: most draft tokens per round (default: 8, or --k).")
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
TRANSLATION = typer.Option("text", "--translation", help="Greedy draft translation: text or tokens.")
SAMPLING = typer.Option("exact", "--sampling", help="Sampling mode: exact (lossless) or omnidraft (+n-grams).")
LOOKUP_LEN = typer.Option(8, "--lookup-len", help="Most tokens a lookup in the text proposes.")
SYSTEM = typer.Option(None, "--system", help="System prompt.")
SHOW_DRAFT = typer.Option(False, "--show-draft", help="Colour the tokens that came from the drafter.")
SHARD = typer.Option(
    "tensor",
    "--shard",
    help="Under mlx.launch: split the target over the ranks tensor-parallel (each layer's weights) or as a "
    "pipeline (its layers); a family that has one of the two uses that one.",
)


def decoding(flags: dict) -> SpecConfig:
    """A command's decoding flags (its parameters, as locals() gives them at its start: every verb
    names them alike) as settings, checked (a one-line error naming the flag): the same for every verb."""
    return SpecConfig(
        k=flags["k"],
        temp=flags["temp"],
        top_p=flags["top_p"],
        max_tokens=flags["max_tokens"],
        seed=flags["seed"],
        translation=flags["translation"],
        sampling=flags["sampling"],
        lookup_len=flags["lookup_len"],
        sources=flags["source"],
        guard=not flags["no_guard"],
        tree=flags["tree"],
    )


def draft_length(policy: str, gamma: str, k: int, max_k: int | None) -> PolicyConfig:
    """The draft-length flags as settings, checked; an adaptive policy's cap is at least --k unless given."""
    max_k = max(k, PolicyConfig.max_k) if max_k is None else max_k
    return PolicyConfig(name=check_policy(policy), k=k, max_k=max_k, gamma=parse_gamma(gamma))
