"""The one place the test suite simulates devices: 8 CPU devices, set before JAX starts.

Compiling is most of the suite's time (the models run in milliseconds), so XLA:CPU's LLVM back end runs at -O0
(`--xla_backend_optimization_level=0`), here and in the processes the tests start (they inherit the
environment): half the compile time. The HLO passes, hence the programs' collectives, fusions and buffers, are
the same; only the machine code is slower. It changes nothing a test compares: both sides of every comparison are
compiled the same way. pytest-xdist runs the files on two workers (pyproject's addopts).

Not used: XLA's older elemental emitter for the fusions (`--xla_cpu_use_fusion_emitters=false`). It compiles a tiny
LM's train step in 1.3 s against 2.1 s and took the suite from 1,405 to 970 s (2026-11-25), but it changes the
rounding: programs that split the batch differently then drift further apart (ZeRO-3 on a tiny GPT, one weight
6.4e-5 from the single step after 3 Adam steps; tp's loss-scaled run off its unscaled run at the key bias), so the
suite would no longer test the numbers users get.
"""
import os

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={N_DEVICES} --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent compilation cache (it shared the programs that recur across tests between the workers): on
# 2026-11-30 XLA crashed twice while serializing one executable into it (a segfault / abort inside JAX's
# compilation_cache.put_executable_and_time, test_3d's single reference step), which killed a pytest-xdist worker
# and left the run hanging; the suite is slower without it, and it changed nothing a test reads. A third abort came
# later with no cache at all (2026-11-30, inside XLA's compile of test_gpt_training's tensor-parallel step, in a
# worker that had imported torch through test_weights; not reproduced in 74 reruns of that file: 40 alone, 30 after
# test_weights, 4 after test_3d), so the cache may not have been the cause; it stays off until one is understood.
# pyproject's --capture=sys keeps the next one's native message in the log.

from jaxpar.run.hostmem import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as train.py does: the CPU fast path, before JAX allocates

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# The files that take longest (seconds of one worker, 2026-11-24: pipeline 269, gpt 162, 3d 147, ...) start first:
# pytest-xdist hands the two workers whole files in collection order, so a long file collected last leaves the
# other worker idle at the end (alphabetically the suite's two workers ended 855 / 775 s apart in a simulation of
# the measured times, longest first 815 / 814). A file missing from this list only runs later, never less.
FIRST = ("test_pipeline", "test_gpt", "test_3d", "test_tensor", "test_zero", "test_multiprocess", "test_recompute",
         "test_checkpoint", "test_contract", "test_train", "test_generate")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(FIRST)))  # stable: the order within a file is kept
