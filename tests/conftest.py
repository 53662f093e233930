"""The one place the test suite simulates devices: 8 CPU devices, set before JAX starts.

Compiling is most of the suite's time (the models run in milliseconds), so XLA:CPU's LLVM back end runs at -O0
(`--xla_backend_optimization_level=0`), here and in the processes the tests start (they inherit the
environment): half the compile time. The HLO passes, hence the programs' collectives, fusions and buffers, are
the same; only the machine code is slower. It changes nothing a test compares: both sides of every comparison are
compiled the same way. pytest-xdist runs the files on two workers (pyproject's addopts).
"""
import os

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={N_DEVICES} --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.run.hostmem import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as train.py does: the CPU fast path, before JAX allocates

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
