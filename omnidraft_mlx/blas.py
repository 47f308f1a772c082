"""Run MLX's CPU backend on an optimized BLAS.

The Linux `mlx[cpu]` wheel links a reference BLAS: float32 matmuls run ~75x
slower than with OpenBLAS. The fix has to happen before MLX is loaded, so the
CLI re-executes itself once with a fast BLAS in LD_PRELOAD; symbols of a
preloaded library win over the wheel's bundled ones.
"""

from __future__ import annotations

import glob
import os
import sys
import time

_REEXEC_FLAG = "OMNIDRAFT_BLAS_REEXEC"
_FAST_BLAS_PATTERNS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/opt/intel/oneapi/mkl/latest/lib/intel64/libmkl_rt.so*",
    "/usr/lib/*-linux-gnu/libmkl_rt.so*",
)


def needs_fast_blas() -> bool:
    """True where MLX runs on its CPU backend with the wheel's reference BLAS."""
    return sys.platform.startswith("linux")


def find_fast_blas() -> str | None:
    """Path of an installed OpenBLAS or MKL runtime, or None."""
    override = os.environ.get("OMNIDRAFT_BLAS")
    if override:
        return override if os.path.exists(override) else None
    for pattern in _FAST_BLAS_PATTERNS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def preloaded_fast_blas() -> str | None:
    for lib in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "openblas" in lib or "mkl" in lib:
            return lib
    return None


def ensure_fast_blas() -> None:
    """Re-exec the current process with a fast BLAS preloaded, once.

    Must run before `mlx` is imported. Does nothing on macOS (Accelerate),
    when a fast BLAS is already preloaded, or when none is installed (the
    warning then comes from `warn_if_slow_blas`).
    """
    if not needs_fast_blas() or preloaded_fast_blas() or os.environ.get(_REEXEC_FLAG):
        return
    lib = find_fast_blas()
    if lib is None or "mlx" in sys.modules:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD", "")]))
    env[_REEXEC_FLAG] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def active_blas() -> str:
    """Name of the BLAS that MLX's matmuls actually call in this process."""
    if sys.platform == "darwin":
        return "Accelerate"
    import mlx.core  # noqa: F401  (loads the BLAS libraries we inspect)

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return "OpenBLAS"
    if "libmkl" in maps:
        return "MKL"
    return "reference BLAS (slow)"


def matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    """Measured float32 GFLOP/s of an n x n CPU matmul (a sanity check of the BLAS)."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def warn_if_slow_blas(console) -> None:
    if needs_fast_blas() and active_blas().startswith("reference"):
        console.print(
            "[bold red]warning:[/] MLX is running on the reference BLAS (~75x slower float32 "
            "matmuls). Install OpenBLAS (Debian: apt-get install libopenblas0-pthread) "
            "or set OMNIDRAFT_BLAS to a libopenblas.so / libmkl_rt.so path.",
            highlight=False,
        )
