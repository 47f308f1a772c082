"""`omnidraft doctor`: is this machine set up to run fast?"""

from __future__ import annotations

import platform

from rich.table import Table


def doctor() -> None:
    """Show the BLAS MLX runs on, its measured speed, versions and the model home."""
    import mlx.core as mx
    import mlx_lm

    from omnidraft_mlx.blas import active_blas, find_fast_blas, matmul_gflops, warn_if_slow_blas
    from omnidraft_mlx.cli.main import console
    from omnidraft_mlx.models.pull import model_home

    table = Table(show_header=False, box=None)
    table.add_row("platform", f"{platform.system()} {platform.machine()}, {platform.python_version()}")
    table.add_row("mlx / mlx-lm", f"{mx.__version__} / {mlx_lm.__version__}")
    table.add_row("device", str(mx.default_device()))
    table.add_row("BLAS", active_blas())
    table.add_row("fast BLAS found", find_fast_blas() or "none")
    table.add_row("float32 matmul 512x512", f"{matmul_gflops():.1f} GFLOP/s")
    table.add_row("model home", str(model_home()))
    console.print(table)
    warn_if_slow_blas(console)
