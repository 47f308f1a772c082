"""The server gives freed memory back to the system (engine.release_memory): without it, arrays freed
on glibc can stay resident in its heaps, and a long-running server's memory follows the largest
working set it has seen."""

import ctypes
import os
import platform

import mlx.core as mx
import pytest

from omnidraft_mlx.serve.engine import release_memory

MIB = 1 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heaps")
def test_freed_arrays_go_back_to_the_system():
    # What glibc does by itself once an array of 32 MB was freed (a verify forward's logits, say):
    # arrays up to that size come from its heaps from then on, not each from its own mapping.
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 32 * MIB) == 1
    xs = [mx.random.normal((512, 2048)) for _ in range(100)]  # 4 MB each, as a forward's activations
    mx.eval(xs)
    last = xs[-1] * 2  # held: the heap's top stays in use, so glibc cannot shrink it by itself
    mx.eval(last)
    del xs  # 400 MB freed
    held = resident()
    release_memory()
    assert held - resident() > 200 * MIB
    assert last.shape == (512, 2048)
