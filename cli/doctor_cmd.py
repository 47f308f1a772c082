"""`omnidraft doctor`: is this machine set up to run fast?"""

from __future__ import annotations

import os
import platform

from rich.table import Table


def _gb(n) -> str:
    return f"{n / 2**30:.1f} GB"


def metal_rows() -> list[tuple[str, str]]:
    """On a Mac: the Metal GPU, its memory and the wired-memory limit (what
    mlx-lm wires for generation, and the OS cap); nothing elsewhere."""
    import subprocess

    import mlx.core as mx

    if platform.system() != "Darwin" or not mx.metal.is_available():
        return []
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    rows = [("Metal GPU", f"{info.get('device_name', '?')} ({info.get('architecture', '?')})")]
    if "memory_size" in info:
        rows.append(("unified memory", _gb(info["memory_size"])))
    if "max_recommended_working_set_size" in info:
        rows.append(("wired-memory limit (mlx-lm)", _gb(info["max_recommended_working_set_size"])))
    sysctl = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True)
    if sysctl.returncode == 0 and sysctl.stdout.strip().isdigit():
        mb = int(sysctl.stdout)
        rows.append(("iogpu.wired_limit_mb", f"{mb} MB" if mb else "0 (macOS default)"))
    return rows


# The variable each backend's launch sets (mlx.launch), in the order told apart: MLX names no backend of a group.
BACKEND_VARIABLES = (
    ("jaccl", "MLX_JACCL_COORDINATOR"),
    ("nccl", "NCCL_HOST_IP"),
    ("mpi", "MLX_MPI_LIBNAME"),
    ("ring", "MLX_HOSTFILE"),
)


def group_rows(group) -> list[tuple[str, str]]:
    """Which rank of how many this process is under mlx.launch, its backend and hosts file;
    outside a launcher, that it is a single process and how to split a target over several."""
    if group.size() == 1:
        return [
            (
                "group",
                "a single process (to split a target over ranks: mlx.launch ... -- omnidraft generate --shard ...)",
            )
        ]
    backend = next((name for name, variable in BACKEND_VARIABLES if os.environ.get(variable)), "unknown")
    rows = [("group", f"rank {group.rank()} of {group.size()} (mlx.launch)"), ("backend", backend)]
    if os.environ.get("MLX_HOSTFILE"):
        rows.append(("MLX_HOSTFILE", os.environ["MLX_HOSTFILE"]))
    return rows


def doctor() -> None:
    """Show the BLAS MLX runs on, its measured speed, versions, the model home and the group of
    ranks (under mlx.launch, rank 0 alone prints)."""
    import mlx.core as mx
    import mlx_lm

    from omnidraft_mlx.blas import active_blas, find_fast_blas, matmul_gflops, warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, print_table
    from omnidraft_mlx.collectives import world
    from omnidraft_mlx.paths import model_home

    group = world()
    if group.rank() != 0:
        return
    table = Table(show_header=False, box=None)
    table.add_row("platform", f"{platform.system()} {platform.machine()}, {platform.python_version()}")
    table.add_row("mlx / mlx-lm", f"{mx.__version__} / {mlx_lm.__version__}")
    table.add_row("device", str(mx.default_device()))
    for name, value in metal_rows():
        table.add_row(name, value)
    table.add_row("BLAS", active_blas())
    table.add_row("fast BLAS found", find_fast_blas() or "none")
    table.add_row("float32 matmul 512x512", f"{matmul_gflops():.1f} GFLOP/s")
    table.add_row("model home", str(model_home()))
    for name, value in group_rows(group):
        table.add_row(name, value)
    print_table(table)
    warn_if_slow_blas(console)
