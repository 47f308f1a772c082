"""The server gives freed memory back to the system (engine.release_memory): without it, arrays of a
few MB freed on glibc stay resident, and a long-running server's memory follows the largest working
set it has seen."""

import os
import platform

import mlx.core as mx
import pytest

from omnidraft_mlx.serve.engine import release_memory

MIB = 1 << 20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's heap")
def test_freed_arrays_go_back_to_the_system():
    big = mx.ones((8 * MIB // 4,))  # 8 MB, mapped on its own; freeing it raises glibc's threshold above 1 MB
    mx.eval(big)
    del big
    arrays = [mx.full((MIB // 4,), float(i)) for i in range(256)]  # 256 x 1 MB, now from the heap
    mx.eval(arrays)
    last = arrays[-1]  # held: the heap's top stays in use, so glibc cannot shrink it by itself
    del arrays
    held = resident()
    release_memory()
    assert held - resident() > 128 * MIB
    assert last[0].item() == 255.0
