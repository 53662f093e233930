"""The one place the test suite simulates devices: 8 CPU devices, set before JAX starts."""
import os

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.run.hostmem import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as train.py does: the CPU fast path, before JAX allocates

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
