"""Keep glibc from returning freed memory to the OS between steps (the CPU fast path; harmless on GPU).

XLA:CPU's convolution backward allocates and frees hundreds of MB of fresh buffers every step. With glibc's
defaults each large buffer is an mmap/munmap pair whose pages fault in again on first touch, so a ConvNet step
spends a large share of its time in the kernel. Raising the mmap and trim thresholds (and using one arena) makes
glibc reuse those pages instead. The GPT step gains too (its 4 MiB activations come and go every step: 15-25% on
a 2-core CPU, README "The CPU fast path"). Must run before JAX allocates: train.py (`jaxpar.cli.main`) and the
benchmarks do it, and library users may call `jaxpar.tune_host_allocator()` first thing; `import jaxpar` leaves
malloc alone. Opt out with JAXPAR_NO_MALLOPT=1.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
_SETTINGS = {M_ARENA_MAX: 1, M_MMAP_THRESHOLD: 1 << 30, M_TRIM_THRESHOLD: 2 << 30, M_TOP_PAD: 64 << 20}

applied: dict[int, bool] = {}  # which settings glibc accepted (for the README / diagnostics)


def tune_host_allocator() -> dict[int, bool]:
    """Apply the mallopt settings once; returns {param: accepted}. No-op off glibc or when opted out."""
    if applied or os.environ.get("JAXPAR_NO_MALLOPT") or not sys.platform.startswith("linux"):
        return applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return applied
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, value in _SETTINGS.items():
        applied[param] = bool(mallopt(param, value))
    return applied
