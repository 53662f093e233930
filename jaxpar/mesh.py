"""Device meshes, simulated CPU devices and the divisibility rules the strategies share."""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

DATA = "data"  # data-parallel mesh axis: replicas of the model, shards of the batch
PIPE = "pipe"  # pipeline mesh axis: stages of the model
TENSOR = "tensor"  # tensor-parallel mesh axis: slices of each layer (Megatron)


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` simulated CPU devices; only effective before JAX's backend starts."""
    if n < 1:
        raise ValueError(f"cpu_devices={n} must be >= 1; pass --cpu-devices 1 or more.")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backend already initialised: fall back to the flag, which then also has no effect
        pass
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def check_divisible(value: int, by: int, what: str, by_what: str, fix: str) -> None:
    """Raise a ValueError that names both numbers, the rule and the fix when `by` does not divide `value`."""
    if by <= 0 or value % by:
        raise ValueError(f"{what}={value} must be divisible by {by_what}={by}; {fix}")


def check_data_mesh(mesh, who: str) -> None:
    """ValueError unless `mesh` is one DATA axis (what data parallelism shards the batch and the state over)."""
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "devices"):
        count = mesh if isinstance(mesh, int) and not isinstance(mesh, bool) else "num_devices"
        raise TypeError(f"{who} got mesh={mesh!r}, not a jax.sharding.Mesh; pass mesh=jaxpar.make_mesh({count}).")
    if tuple(mesh.axis_names) != (DATA,):
        raise ValueError(f"{who} runs on a 1-D mesh of axis {DATA!r}, got axes {dict(mesh.shape)}; build it with "
                         f"jaxpar.make_mesh(num_devices) (a pipeline's data axis: Pipeline(..., zero_stage=1)).")


def make_mesh(num_devices: int | None = None, pipe: int = 1, devices: Sequence | None = None):
    """A (DATA,) mesh, or (DATA, PIPE) when pipe > 1, over the first `num_devices` devices."""
    import jax
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(
            f"num_devices={n} must be between 1 and the {len(devices)} devices present; "
            f"pass fewer devices or more --cpu-devices."
        )
    check_divisible(n, pipe, "num_devices", "num_stages", "use a device count that is a multiple of the stage count.")
    grid = np.array(devices[:n], dtype=object)
    if pipe == 1:
        return Mesh(grid, (DATA,))
    return Mesh(grid.reshape(n // pipe, pipe), (DATA, PIPE))
