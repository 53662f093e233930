"""Device set-up for a run, before JAX's backend starts: simulated CPU devices, then jax.distributed."""
from __future__ import annotations

from jaxpar.config import Config
from jaxpar.mesh import simulate_cpu_devices


def setup(cfg: Config) -> None:
    """Apply --cpu-devices (refused where accelerators are present) and join the process group if launched so."""
    import jax

    if cfg.cpu_devices is not None:
        simulate_cpu_devices(cfg.cpu_devices)
    try:
        from jaxpar.run import distributed
    except ImportError:  # pragma: no cover - the module ships with jaxpar
        distributed = None
    if distributed is not None and hasattr(distributed, "initialize"):
        distributed.initialize(cfg)
    if cfg.cpu_devices is not None:
        backend = jax.default_backend()
        if backend != "cpu":
            raise ValueError(
                f"--cpu-devices {cfg.cpu_devices} simulates CPU devices, but this machine has {backend} "
                f"accelerators ({jax.device_count()} devices); drop --cpu-devices to use them, or set "
                "JAX_PLATFORMS=cpu to train on the CPU anyway."
            )
        have = jax.local_device_count()
        if have != cfg.cpu_devices:
            raise ValueError(
                f"--cpu-devices {cfg.cpu_devices} came too late: JAX had already started with {have} CPU devices "
                "in this process; pass it to a fresh process (or set XLA_FLAGS before importing JAX)."
            )
