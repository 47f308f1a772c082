"""`omnidraft doctor`: is this machine set up to run fast?"""

from __future__ import annotations

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


def doctor() -> None:
    """Show the BLAS MLX runs on, its measured speed, versions and the model home."""
    import mlx.core as mx
    import mlx_lm

    from omnidraft_mlx.blas import active_blas, find_fast_blas, matmul_gflops, warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, print_table
    from omnidraft_mlx.paths import model_home

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
    print_table(table)
    warn_if_slow_blas(console)
