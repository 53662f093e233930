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
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"num_devices={n!r} must be an int (or None for every device); pass e.g. num_devices=2.")
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


def straddler(n: int, block: int, per_process: int) -> list[int] | None:
    """The processes of the first run of `block` consecutive devices, among the first `n` of jax.devices() (process
    0's `per_process` devices, then process 1's, ...), that lies in more than one process; None when each run lies in
    one. A tensor group (T consecutive devices) and a pipeline stage (n / S consecutive: `pipeline_mesh`) are runs."""
    for k in range(n // block):
        first, last = k * block // per_process, ((k + 1) * block - 1) // per_process
        if first != last:
            return list(range(first, last + 1))
    return None


def stage_fix(n: int, per_process: int, tensor_parallel: int = 1) -> str:
    """How to keep every pipeline stage's D x T devices in one process, for the message of a layout that does not."""
    T = tensor_parallel
    fits = [s for s in range(1, n + 1) if n % (s * T) == 0 and per_process % (n // s) == 0]
    if fits:
        options = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1])
        return (f"use num_stages (--num-stages) {options}, whose stages each fit in one process's {per_process} "
                f"device{'s' if per_process > 1 else ''}")
    return (f"give each process at least the {T} devices of one stage's tensor group (--cpu-devices {T} on CPUs), "
            "or use tensor_parallel=1 (--tensor-parallel 1)")


def tensor_group_error(tensor_parallel: int, procs: list[int], per_process: int) -> ValueError:
    """The refusal of a tensor group whose devices lie in processes `procs` (each holding `per_process` devices)."""
    T = tensor_parallel
    fix = f"tensor_parallel (--tensor-parallel) at most {per_process}, dividing it" if per_process >= 2 else \
        f"at least {T} devices a process (--cpu-devices {T} on CPUs), or data parallelism (--strategy ddp)"
    return ValueError(f"tensor_parallel={T} (--tensor-parallel) puts a tensor group on devices of processes {procs}; "
                      f"keep each group within one process (Megatron keeps tensor parallelism within a node): "
                      f"use {fix}.")
