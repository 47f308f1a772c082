"""What a drafter/target pair learns from use, kept on disk between runs and
shared by the processes that use the pair at the same time.

A profile directory holds manifest.json and the files it names: the drafter's
adapter weights and optimizer state, and the learned parts (learned.py: the
n-gram cache, the acceptance head, ...), each file named by the save that wrote
it (`ngrams-000012.json`); the manifest also holds the format version, the two
models' identities, the training settings, the update count, the position
reached in each corpus, and a short history.

Reads hold a shared lock and saves an exclusive one (fcntl.flock on .lock), waiting
LOCK_WAIT_S at most for another process's (then a one-line error). A save re-reads
the manifest under its lock and builds on what another process saved since this one
loaded (or last saved):
- each learned part merges the saved one with its own learning since (learned.py);
- the update count is the sum, the history theirs then this save's record; a
  corpus position the furthest either reached (prompts are learned from once);
- adapter weights cannot be merged: a process saving an update keeps its own
  adapter and optimizer state as the newest, counts both processes' updates,
  and says so in one line; a save without an update leaves the adapter as it is.
It writes the new files first (a part that learned nothing since keeps its file: a save
costs what changed) and the manifest last (each atomically); only then do the parts count
what they wrote as saved (a save that failed keeps their learning for the next), and, with
no other writer in flight under the lock, deletes what the old manifest named and
leftovers of saves that died: a kill loses at most the save in flight and leaves
the previous profile loadable; Ctrl-C waits for a save to end. Profiles written
before the parts were versioned (ngrams.json, accept_head.npz) load as they are.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.failpoints import failpoint
from omnidraft_mlx.paths import LOCAL, Resolver, model_home
from omnidraft_mlx.profile.adapter import SHAPE, fuse_lora, make_trainable, trainable_weights
from omnidraft_mlx.profile.atomic import atomic_write_text, durable_replace
from omnidraft_mlx.profile.digest import sampled_digest, weights_digest
from omnidraft_mlx.profile.learned import Part, deferred_interrupt
from omnidraft_mlx.vocab.ngram import NGramCache

FORMAT = 1
MANIFEST = "manifest.json"
LOCK = ".lock"
NGRAMS, HEAD = "ngrams", "accept_head"  # part names; older profiles: ngrams.json, accept_head.npz
HISTORY = "history"  # lookup.HistoryIndex
LOCK_WAIT_S = 30.0  # the longest wait for another process's lock (a save takes a second or so)
LOCK_POLL_S = 0.02  # how often a waiter tries the lock again
VERSIONED = re.compile(r"[a-z_]+-\d{6}\.[a-z]+")  # a file named by the save that wrote it


def _slug(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name.rstrip("/")).name)[:40]
    return f"{base}-{hashlib.sha1(name.encode()).hexdigest()[:6]}" if ("/" in name) else base


def profile_dir(draft: str, target: str) -> Path:
    """Keyed by the names the user gave (a catalog name, a path, a hub id), not by what they resolve to."""
    return model_home() / "profiles" / f"{_slug(draft)}__{_slug(target)}"


def model_identity(name: str, resolver: Resolver = LOCAL) -> str:
    """What the weights are: the source GGUF's sha256 where known, else a digest of a local
    model directory's config and weight files, each read whole (digest.py), else the name."""
    if digest := resolver.source_digest(name):
        return f"gguf:{digest}"
    path = Path(name).expanduser()
    if not path.is_dir():
        return f"name:{name}"
    return f"weights:{weights_digest(path)}"


def same_model(recorded: str | None, name: str, resolver: Resolver = LOCAL) -> bool:
    """Whether a profile's recorded identity is the model `name` now: as model_identity says, or
    in the sampled form profiles recorded before it ("dir:"; their next save records the new one)."""
    if recorded == model_identity(name, resolver):
        return True
    path = Path(name).expanduser()
    return bool(
        recorded and recorded.startswith("dir:") and path.is_dir() and recorded == f"dir:{sampled_digest(path)}"
    )


def _print_note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


@dataclass
class Profile:
    path: Path
    draft: str
    target: str
    ngrams: NGramCache = field(default_factory=NGramCache)
    manifest: dict = field(default_factory=dict)  # as this process last read or wrote it
    note: Callable[[str], None] = _print_note  # what a save did that the user should know
    resolver: Resolver = LOCAL  # names the weights the manifest records (model_identity)
    parts: dict[str, Part] = field(default_factory=dict, init=False, repr=False)
    synced: dict[str, str | None] = field(default_factory=dict, init=False)  # each part's file when loaded/saved
    optimizer_state: dict | None = field(default=None, init=False, repr=False)  # read with a trainable adapter

    def __post_init__(self):
        self.path = Path(self.path)
        self.parts[NGRAMS] = Part(self.ngrams, ".json", NGramCache.load)
        self.synced[NGRAMS] = _part_file(self.path, self.manifest, NGRAMS, ".json")

    @property
    def updates(self) -> int:
        return self.manifest.get("updates", 0)

    @property
    def distill(self) -> dict | None:
        """Settings the adapter was trained with (None: no adapter yet)."""
        return self.manifest.get("distill")

    def position(self, corpus: str) -> int:
        return self.manifest.get("corpus", {}).get(corpus, 0)

    def attach(self, name: str, obj, suffix: str, read: Callable[[Path], object]) -> None:
        """Keep `obj` (save/merge, learned.py) in the profile as the part `name`: it
        takes in what was saved of it, and every save from now on writes it."""
        self.synced[name] = _load_part(self.path, name, obj, suffix, read)
        self.parts[name] = Part(obj, suffix, read)

    def attach_policy(self, policy):
        """The draft-length policy's acceptance head, if it learns one, as a part; returns the policy."""
        if policy.head is not None:
            self.attach(HEAD, policy.head, ".npz", policy.head.read)
        return policy

    def attach_history(self, history):
        """The index of the target's earlier replies (lookup.HistoryIndex, fresh), as a part; returns it.
        It lives in the pair's profile, under the pair's lock, beside the n-grams it complements."""
        self.attach(HISTORY, history, ".json", type(history).load)
        return history

    def save(
        self,
        model=None,
        optimizer=None,
        distill: dict | None = None,
        corpus: str | None = None,
        position: int | None = None,
        record: dict | None = None,
        wait_s: float | None = None,
    ) -> None:
        """Save every part; with `model`, one more drafter update too (its trainable
        weights, optimizer state, settings, corpus position and history record).
        Builds on whatever another process saved meanwhile (module docstring); waits
        for another process's lock wait_s at most (LOCK_WAIT_S by default)."""
        try:
            with profile_lock(self.path, exclusive=True, wait_s=wait_s), deferred_interrupt():  # Ctrl-C stops a wait
                self._save_locked(model, optimizer, distill, corpus, position, record)
        except OSError as e:
            raise OmniDraftError(
                f"could not save the profile in {self.path} ({e.strerror or e}): free some disk space; "
                "the previous profile is intact"
            ) from e

    def _save_locked(self, model, optimizer, distill, corpus, position, record) -> None:
        disk = _read_manifest(self.path)
        for name, part in self.parts.items():  # take in what others saved since this process last did
            saved = _part_file(self.path, disk, name, part.suffix)
            if saved and saved != self.synced.get(name):
                part.obj.merge(_read_part(self.path / saved, part.read))
        failpoint("save", "adapter" if model is not None else "")  # in the lock and deferred signals, parts merged
        version = max(disk.get("version", 0), disk.get("updates", 0)) + 1  # above older profiles' adapter-{update}
        files = dict(disk.get("files", {}))
        manifest = {
            **disk,
            "format": FORMAT,
            "draft": self.draft,
            "target": self.target,
            "version": version,
            "draft_id": model_identity(self.draft, self.resolver),
            "target_id": model_identity(self.target, self.resolver),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        written = []

        def write(kind: str, suffix: str, save: Callable[[Path], None]) -> None:
            name = f"{kind}-{version:06d}{suffix}"
            written.append(name)
            save(self.path / name)
            if (self.path / name).exists():  # a part with nothing learned writes nothing
                files[kind] = name

        try:
            if model is not None:
                n = disk.get("updates", 0) + 1
                if (theirs := n - 1 - self.updates) > 0:
                    self.note(
                        f"another process saved {theirs} drafter update(s) to {self.path} since this one "
                        f"loaded it: this one's adapter, trained without them, is now the newest (update {n}); "
                        "both are counted and their n-grams, head labels and history are kept"
                    )
                write("adapter", ".safetensors", partial(_save_arrays, arrays=trainable_weights(model)))
                files.pop("optimizer", None)  # another adapter's state, if any, must not go with this one
                if optimizer is not None:
                    write(
                        "optimizer", ".safetensors", partial(_save_arrays, arrays=dict(tree_flatten(optimizer.state)))
                    )
                manifest["updates"] = n
                if distill is not None:
                    manifest["distill"] = distill
                if record is not None:
                    record = {**record, "update": n}
            if corpus is not None:
                done = disk.get("corpus", {})
                manifest["corpus"] = {**done, corpus: max(position or 0, done.get(corpus, 0))}
            if record is not None:
                manifest["history"] = (disk.get("history", []) + [record])[-1000:]
            for name, part in self.parts.items():
                if name not in files or getattr(part.obj, "changed", True):  # unchanged: its file stays
                    write(name, part.suffix, part.obj.save)
            manifest["files"] = files
            failpoint("manifest")  # a manifest that cannot be written (disk full): the parts keep their learning
            atomic_write_text(self.path / MANIFEST, json.dumps(manifest, indent=1))
        except BaseException:
            for name in written:
                (self.path / name).unlink(missing_ok=True)
            raise
        for name, part in self.parts.items():  # committed: what the parts wrote is shared from now on
            if files.get(name) in written:
                part.obj.mark_saved()
        self.manifest = manifest
        self.synced = {name: files.get(name) for name in self.parts}
        _remove_unnamed(self.path, files)

    def load_optimizer(self, optimizer) -> None:
        """Give the optimizer the state saved with the adapter (read by load_profile(trainable=True))."""
        if self.optimizer_state:
            optimizer.state = tree_unflatten(list(self.optimizer_state.items()))
        self.optimizer_state = None


@contextmanager
def profile_lock(path: Path, exclusive: bool, wait_s: float | None = None) -> Iterator[None]:
    """Hold the profile's lock: shared to read, exclusive to write. Reading a profile
    that does not exist (or that this user cannot lock) takes no lock. Another process
    holding it longer than wait_s (LOCK_WAIT_S by default) is a one-line OmniDraftError."""
    fd = _acquire(Path(path), exclusive, LOCK_WAIT_S if wait_s is None else wait_s)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _acquire(path: Path, exclusive: bool, wait_s: float) -> int | None:
    deadline = time.monotonic() + wait_s
    while True:
        if exclusive:
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, PermissionError):
            if exclusive and not path.exists():
                continue  # reset meanwhile
            if exclusive:
                raise
            return None
        if not _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline):
            os.close(fd)
            raise OmniDraftError(
                f"another process held the profile's lock in {path} for over {wait_s:g}s (an `omnidraft adapt`, "
                "`serve` or `chat` of this pair, maybe stopped): let it end, or stop it"
            )
        try:
            if os.stat(path / LOCK).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the profile was reset while this process waited: lock the new one


def _flock(fd: int, operation: int, deadline: float) -> bool:
    """flock, tried again until the deadline (a blocking flock has no timeout): whether it was taken."""
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_S)


def _part_file(path: Path, manifest: dict, name: str, suffix: str) -> str | None:
    """The file holding a part: named in the manifest, or an older profile's unversioned one."""
    if name in manifest.get("files", {}):
        return manifest["files"][name]
    return f"{name}{suffix}" if (path / f"{name}{suffix}").exists() else None


def _read_part(path: Path, read: Callable[[Path], object]):
    try:
        return read(path)
    except (OSError, ValueError, KeyError) as e:
        raise OmniDraftError(f"the profile file {path} is unreadable ({e}): run `omnidraft profile reset`") from e


def _load_part(path: Path, name: str, obj, suffix: str, read: Callable[[Path], object]) -> str | None:
    """Merge the saved part into obj; the file it came from (None: none saved)."""
    with profile_lock(path, exclusive=False):
        saved = _part_file(path, _read_manifest(path), name, suffix)
        if saved:
            obj.merge(_read_part(path / saved, read))
    return saved


def load_head(policy, path: Path) -> None:
    """Give the (learned) policy the acceptance head saved in the profile at path (read only)."""
    _load_part(Path(path), HEAD, policy.head, ".npz", policy.head.read)


def profile_files(path: Path) -> list[str]:
    """The files a profile consists of, manifest first (call under the lock)."""
    manifest = _read_manifest(path)
    named = list(manifest.get("files", {}).values())
    legacy = [f"{n}{s}" for n, s in ((NGRAMS, ".json"), (HEAD, ".npz")) if n not in manifest.get("files", {})]
    return [f for f in [MANIFEST] * bool(manifest) + named + legacy if (path / f).exists()]


def _remove_unnamed(path: Path, files: dict) -> None:
    """Delete what the manifest no longer names: superseded files, an older profile's
    unversioned part files, and leftovers of saves that died (call under the lock)."""
    named = set(files.values())
    for f in path.iterdir():
        stem = f.name.split(".")[0]
        if f.name not in named and (
            VERSIONED.fullmatch(f.name) or stem in files or (f.name.startswith(".") and ".tmp" in f.name)
        ):
            f.unlink(missing_ok=True)


def _save_arrays(path: Path, arrays: dict) -> None:
    """mx.save_safetensors into a temporary file, synced, then renamed."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        durable_replace(tmp, path)
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
        raise OmniDraftError(
            f"the profile manifest in {path} is unreadable ({e}): run `omnidraft profile reset`"
        ) from e


def check_profile(manifest: dict, path: Path, draft: str, target: str, resolver: Resolver = LOCAL) -> None:
    """Refuse a profile made by another format, another model pair or other weights."""
    if not manifest:
        return
    fix = f"run `omnidraft profile reset --draft {draft} --target {target}` or pass --no-profile"
    if manifest.get("format") != FORMAT:
        raise OmniDraftError(f"the profile in {path} has format {manifest.get('format')}, not {FORMAT}: {fix}")
    for role, name in (("draft", draft), ("target", target)):
        if not same_model(manifest.get(f"{role}_id"), name, resolver):
            raise OmniDraftError(
                f"the profile in {path} was made for another {role} model than '{name}' "
                f"(its weights changed since): {fix}"
            )


def load_profile(
    draft_name: str,
    target_name: str,
    draft_model=None,
    trainable: bool = False,
    path: Path | None = None,
    resolver: Resolver = LOCAL,
) -> Profile:
    """The pair's profile (from `path` instead of the default place where given);
    its adapter is applied to draft_model when given. `resolver` tells which
    weights the names stand for (the profile refuses others).

    For inference (trainable=False) LoRA adapters are fused into the drafter's
    weights; for further training they stay separate and trainable.
    """
    path = Path(path) if path is not None else profile_dir(draft_name, target_name)
    with profile_lock(path, exclusive=False):  # the manifest and the files it names, as one version
        manifest = _read_manifest(path)
        check_profile(manifest, path, draft_name, target_name, resolver)
        profile = Profile(path, draft_name, target_name, manifest=manifest, resolver=resolver)
        if profile.synced[NGRAMS]:
            profile.ngrams = profile.parts[NGRAMS].obj = _read_part(path / profile.synced[NGRAMS], NGramCache.load)
        files = manifest.get("files", {})
        adapter = files.get("adapter") if draft_model is not None and profile.distill else None
        weights = _load_arrays(path / adapter) if adapter else None
        if weights is not None and trainable and files.get("optimizer"):
            profile.optimizer_state = _load_arrays(path / files["optimizer"])
    if weights is not None:
        make_trainable(draft_model, **{name: profile.distill[name] for name in SHAPE})
        expected = {k: v.shape for k, v in trainable_weights(draft_model).items()}
        if expected != {k: v.shape for k, v in weights.items()}:
            raise OmniDraftError(f"the adapter in {path} does not fit this drafter: run `omnidraft profile reset`")
        draft_model.load_weights(list(weights.items()), strict=False)
        if not trainable:
            fuse_lora(draft_model)
        mx.eval(draft_model.parameters())
    return profile


def reset_profile(draft: str, target: str) -> Path:
    path = profile_dir(draft, target)
    if path.exists():
        with profile_lock(path, exclusive=True):  # not in the middle of another process's save
            shutil.rmtree(path)
    return path
