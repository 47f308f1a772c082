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
    from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.profile.store import load_head, load_profile, profile_files, profile_lock

    profile = load_profile(draft, target, resolver=CATALOG_RESOLVER)
    if not profile.path.exists():
        console.print(f"no profile yet for {draft} -> {target} ({profile.path})")
        return
    m = profile.manifest
    with profile_lock(profile.path, exclusive=False):
        size = sum((profile.path / f).stat().st_size for f in profile_files(profile.path))
    console.print(f"profile {profile.path} ({size / 1e6:.1f} MB)")
    console.print(f"  models: {draft} -> {target}")
    console.print(f"  n-gram cache: {len(profile.ngrams)} entries")
    console.print(
        f"  drafter updates: {profile.updates}" + (f", last saved {m['saved_at']}" if m.get("saved_at") else "")
    )
    policy = LearnedPolicy(PolicyConfig(name="learned"))
    load_head(policy, profile.path)
    if policy.head.labels:
        state = "deciding" if policy.ready else f"learning (decides after {policy.cfg.warmup})"
        console.print(f"  acceptance head: {len(policy.head.labels)} labelled draft tokens, {state}")
    if profile.distill:
        console.print("  training: " + ", ".join(f"{k}={v}" for k, v in profile.distill.items()))
    for corpus, pos in m.get("corpus", {}).items():
        console.print(f"  corpus {corpus}: {pos} items learned from")
    for rec in m.get("history", [])[-5:]:
        console.print(
            "  update " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items())
        )


@app.command()
def reset(draft: str = DRAFT, target: str = TARGET) -> None:
    """Forget everything the pair has learned (adapter, n-grams, positions)."""
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.profile.store import reset_profile

    console.print(f"removed {reset_profile(draft, target)}")


@app.command()
def export(
    out: str = typer.Argument(..., help="Archive to write (.tar.gz)."), draft: str = DRAFT, target: str = TARGET
) -> None:
    """Write the pair's profile (manifest, adapter, optimizer state, n-grams) into one archive."""
    import io
    import tarfile

    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.profile.atomic import atomic_write_bytes
    from omnidraft_mlx.profile.store import load_profile, profile_files, profile_lock

    profile = load_profile(draft, target, resolver=CATALOG_RESOLVER)
    if not profile.path.exists():
        raise OmniDraftError(f"no profile for {draft} -> {target} to export")
    buf = io.BytesIO()
    with profile_lock(profile.path, exclusive=False), tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in profile_files(profile.path):  # the manifest and what it names, as one version
            tar.add(profile.path / name, arcname=f"{profile.path.name}/{name}")
    atomic_write_bytes(out, buf.getvalue())
    console.print(f"wrote {out} ({len(buf.getvalue()) / 1e6:.1f} MB)")
