"""What a drafter/target pair learns from use, kept on disk between runs.

A profile directory holds the n-gram cache (ngrams.json), the drafter's
adapter weights and optimizer state (files named by update number), and
manifest.json: format version, the two models' identities, the training
settings, the position reached in each corpus, and a short history. Saving
writes the new weight files first and the manifest last (each atomically, by
rename); files the manifest no longer names are deleted only after it is
written. So a kill at any moment leaves the previous profile loadable and
loses at most the update in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from omnidraft_mlx.atomic import atomic_write_text
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.ngram import NGramCache

FORMAT = 1
MANIFEST = "manifest.json"
NGRAMS = "ngrams.json"
HEAD = "accept_head.npz"  # the learned draft-length policy (written by DraftPolicy.save)


def _slug(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name.rstrip("/")).name)[:40]
    return f"{base}-{hashlib.sha1(name.encode()).hexdigest()[:6]}" if ("/" in name) else base


def profile_dir(draft: str, target: str) -> Path:
    from omnidraft_mlx.models.pull import model_home

    return model_home() / "profiles" / f"{_slug(draft)}__{_slug(target)}"


def model_identity(name: str) -> str:
    """What the weights are: the source GGUF's sha256 where known, else a digest
    of a local model directory's config and weight files, else the name."""
    from omnidraft_mlx.models.pull import model_hash

    if digest := model_hash(name):
        return f"gguf:{digest}"
    path = Path(name).expanduser()
    if not path.is_dir():
        return f"name:{name}"
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(1 << 16))
            fh.seek(max(0, f.stat().st_size - (1 << 16)))
            h.update(fh.read())
    return f"dir:{h.hexdigest()[:32]}"


@dataclass
class Profile:
    path: Path
    draft: str
    target: str
    ngrams: NGramCache = field(default_factory=NGramCache)
    manifest: dict = field(default_factory=dict)

    @property
    def updates(self) -> int:
        return self.manifest.get("updates", 0)

    @property
    def distill(self) -> dict | None:
        """Settings the adapter was trained with (None: no adapter yet)."""
        return self.manifest.get("distill")

    @property
    def head_path(self) -> Path:
        return self.path / HEAD

    def position(self, corpus: str) -> int:
        return self.manifest.get("corpus", {}).get(corpus, 0)

    def save(self, model, optimizer=None, distill: dict | None = None, corpus: str | None = None,
             position: int | None = None, record: dict | None = None) -> None:
        """Write the trainable weights, optimizer state and n-grams, then the manifest."""
        from omnidraft_mlx.distill import trainable_weights

        n = self.updates + 1
        files = {"adapter": f"adapter-{n:06d}.safetensors"}
        if optimizer is not None:
            files["optimizer"] = f"optimizer-{n:06d}.safetensors"
        manifest = dict(self.manifest)
        manifest.update(
            format=FORMAT, draft=self.draft, target=self.target, updates=n, files=files,
            draft_id=model_identity(self.draft), target_id=model_identity(self.target),
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        if distill is not None:
            manifest["distill"] = distill
        if corpus is not None:
            manifest["corpus"] = {**manifest.get("corpus", {}), corpus: position}
        if record is not None:
            manifest["history"] = (manifest.get("history", []) + [record])[-1000:]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            _save_arrays(self.path / files["adapter"], trainable_weights(model))
            if optimizer is not None:
                _save_arrays(self.path / files["optimizer"], dict(tree_flatten(optimizer.state)))
            self.ngrams.save(self.path / NGRAMS)
            atomic_write_text(self.path / MANIFEST, json.dumps(manifest, indent=1))
        except OSError as e:
            raise OmniDraftError(
                f"could not save the profile in {self.path} ({e.strerror or e}): free some disk space; "
                "the previous profile is intact"
            ) from e
        self.manifest = manifest
        keep = set(files.values()) | {MANIFEST, NGRAMS}
        for f in self.path.iterdir():
            if f.name not in keep and (f.suffix == ".safetensors" or f.name.endswith(".tmp")):
                f.unlink(missing_ok=True)

    def load_optimizer(self, optimizer) -> None:
        name = self.manifest.get("files", {}).get("optimizer")
        if name:
            optimizer.state = tree_unflatten(list(_load_arrays(self.path / name).items()))

    def save_ngrams(self) -> None:
        self.ngrams.save(self.path / NGRAMS)


def _save_arrays(path: Path, arrays: dict) -> None:
    """mx.save_safetensors into a temporary file, synced, then renamed."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except RuntimeError as e:  # MLX reports write failures (disk full) this way
        free = shutil.disk_usage(path.parent).free
        raise OSError(28 if free < (1 << 20) else 5, f"{e} ({free} bytes free)") from e
    finally:
        tmp.unlink(missing_ok=True)


def _load_arrays(path: Path) -> dict:
    try:
        return mx.load(str(path))
    except Exception as e:
        raise OmniDraftError(f"the profile file {path} is unreadable ({e}): run `omnidraft profile reset`") from e


def _read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise OmniDraftError(f"the profile manifest in {path} is unreadable ({e}): run `omnidraft profile reset`") from e


def check_profile(manifest: dict, path: Path, draft: str, target: str) -> None:
    """Refuse a profile made by another format, another model pair or other weights."""
    if not manifest:
        return
    fix = f"run `omnidraft profile reset --draft {draft} --target {target}` or pass --no-profile"
    if manifest.get("format") != FORMAT:
        raise OmniDraftError(f"the profile in {path} has format {manifest.get('format')}, not {FORMAT}: {fix}")
    for role, name in (("draft", draft), ("target", target)):
        if manifest.get(f"{role}_id") != model_identity(name):
            raise OmniDraftError(
                f"the profile in {path} was made for another {role} model than '{name}' "
                f"(its weights changed since): {fix}"
            )


def load_profile(draft_name: str, target_name: str, draft_model=None, trainable: bool = False,
                 path: Path | None = None) -> Profile:
    """The pair's profile (from `path` instead of the default place where given);
    its adapter is applied to draft_model when given.

    For inference (trainable=False) LoRA adapters are fused into the drafter's
    weights; for further training they stay separate and trainable.
    """
    from omnidraft_mlx.distill import DistillConfig, fuse_lora, setup_trainable, trainable_weights

    path = Path(path) if path is not None else profile_dir(draft_name, target_name)
    manifest = _read_manifest(path)
    check_profile(manifest, path, draft_name, target_name)
    ngrams = NGramCache.load(path / NGRAMS) if (path / NGRAMS).exists() else NGramCache()
    profile = Profile(path, draft_name, target_name, ngrams, manifest)
    adapter = manifest.get("files", {}).get("adapter")
    if draft_model is not None and adapter and profile.distill:
        setup_trainable(draft_model, DistillConfig.from_dict(profile.distill))
        weights = _load_arrays(path / adapter)
        expected = {k: v.shape for k, v in trainable_weights(draft_model).items()}
        if expected != {k: v.shape for k, v in weights.items()}:
            raise OmniDraftError(
                f"the adapter in {path} does not fit this drafter: run `omnidraft profile reset`"
            )
        draft_model.load_weights(list(weights.items()), strict=False)
        if not trainable:
            fuse_lora(draft_model)
        mx.eval(draft_model.parameters())
    return profile


def load_ngrams(draft: str, target: str) -> NGramCache:
    """The pair's n-gram cache alone (kept for callers not yet on load_profile)."""
    path = profile_dir(draft, target) / NGRAMS
    return NGramCache.load(path) if path.exists() else NGramCache()


def save_ngrams(draft: str, target: str, cache: NGramCache) -> None:
    cache.save(profile_dir(draft, target) / NGRAMS)


def reset_profile(draft: str, target: str) -> Path:
    path = profile_dir(draft, target)
    if path.exists():
        shutil.rmtree(path)
    return path
