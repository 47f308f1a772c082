"""`omnidraft profile show|reset|export`: what a drafter/target pair has learned."""

from __future__ import annotations

import typer

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

app = typer.Typer(no_args_is_help=True, help="Show, reset or export a pair's profile.")
DRAFT = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Drafter name.")
TARGET = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target name.")


@app.command()
def show(draft: str = DRAFT, target: str = TARGET) -> None:
    """What the pair's profile holds."""
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.policy import DraftPolicy, PolicyConfig
    from omnidraft_mlx.profile import load_profile

    profile = load_profile(draft, target)
    if not profile.path.exists():
        console.print(f"no profile yet for {draft} -> {target} ({profile.path})")
        return
    m = profile.manifest
    size = sum(f.stat().st_size for f in profile.path.iterdir() if f.is_file())
    console.print(f"profile {profile.path} ({size / 1e6:.1f} MB)")
    console.print(f"  models: {draft} -> {target}")
    console.print(f"  n-gram cache: {len(profile.ngrams)} entries")
    console.print(f"  drafter updates: {profile.updates}" + (f", last saved {m['saved_at']}" if m.get("saved_at") else ""))
    if profile.head_path.exists():
        policy = DraftPolicy(PolicyConfig(name="learned"))
        policy.load(profile.head_path)
        state = "deciding" if policy.ready else f"learning (decides after {policy.cfg.warmup})"
        console.print(f"  acceptance head: {len(policy.labels)} labelled draft tokens, {state}")
    if profile.distill:
        console.print("  training: " + ", ".join(f"{k}={v}" for k, v in profile.distill.items()))
    for corpus, pos in m.get("corpus", {}).items():
        console.print(f"  corpus {corpus}: {pos} items learned from")
    for rec in m.get("history", [])[-5:]:
        console.print("  update " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()))


@app.command()
def reset(draft: str = DRAFT, target: str = TARGET) -> None:
    """Forget everything the pair has learned (adapter, n-grams, positions)."""
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.profile import reset_profile

    console.print(f"removed {reset_profile(draft, target)}")


@app.command()
def export(out: str = typer.Argument(..., help="Archive to write (.tar.gz)."),
           draft: str = DRAFT, target: str = TARGET) -> None:
    """Write the pair's profile (manifest, adapter, optimizer state, n-grams) into one archive."""
    import io
    import os
    import tarfile

    from omnidraft_mlx.atomic import atomic_write_bytes
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.profile import load_profile

    profile = load_profile(draft, target)
    if not profile.path.exists():
        raise OmniDraftError(f"no profile for {draft} -> {target} to export")
    # Everything the profile holds (files of other learners too, e.g. the acceptance head),
    # but no temporary file of a save in progress and no superseded weights.
    current = set(profile.manifest.get("files", {}).values())
    names = sorted(f for f in os.listdir(profile.path)
                   if not f.startswith(".") and (not f.endswith(".safetensors") or f in current))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in names:
            tar.add(profile.path / name, arcname=f"{profile.path.name}/{name}")
    atomic_write_bytes(out, buf.getvalue())
    console.print(f"wrote {out} ({len(buf.getvalue()) / 1e6:.1f} MB)")
