"""The single-device strategy: the reference step, jitted, on one device.

The step runs inside a one-device shard_map over the DATA axis, so models that name it (SyncBatchNorm,
`jaxpar.strategies.ddp.sync_batch_norm`) run unchanged: a collective over one device is the identity.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.batch import Rows, as_rows, check_unpadded
from jaxpar.config import Config
from jaxpar.mesh import DATA
from jaxpar.objective import Objective
from jaxpar.step import TrainState, train_step
from jaxpar.strategies.base import (LayersCheck, cfg_objective, check_placed, check_state, objective_of,
                                    arm_first_batch, to_device)


class SingleDevice:
    """The reference step on one device: `SingleDevice(model, tx, loss_fn=...)` or `SingleDevice(objective, tx)`."""

    name = "single"

    def __init__(self, model: nnx.Module | Objective, tx: optax.GradientTransformation, *, loss_fn=None,
                 device: Any = None, **objective_options):
        self._layers_check = LayersCheck()  # armed by init where the layers run instead of __call__
        if jax.process_count() > 1:
            raise ValueError(f"strategy='single' runs in one process, but jax.process_count()={jax.process_count()}; "
                             "use DistributedDataParallel or Pipeline (--strategy ddp or pipeline) across processes.")
        self.objective = objective_of(model, loss_fn, who="SingleDevice", **objective_options)
        self.tx = tx
        if device is not None and not isinstance(device, jax.Device):  # failed in jax.device_put, at init
            raise TypeError(f"device={device!r} is not a jax.Device; pass one, e.g. device=jax.local_devices()[1], "
                            "or None for the first local device.")
        self.device = device or jax.local_devices()[0]
        mesh = Mesh(np.array([self.device]), (DATA,))
        body = lambda state, rows: train_step(self.objective, tx, state, rows)  # noqa: E731
        self._step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                                           check_vma=False))

    def init(self, state: TrainState) -> TrainState:
        check_state(state, self.tx, self.objective)
        arm_first_batch(self.objective, state, self._layers_check, self.tx)
        return to_device(state, self.device)

    def put_batch(self, batch) -> Rows:
        rows = as_rows(batch)
        self._layers_check(rows)
        if not self.objective.per_sample:
            check_unpadded(rows, "per_sample=False")
        return jax.device_put(rows, self.device)

    def step(self, state: TrainState, rows: Rows):
        check_placed(rows, Rows, "SingleDevice", state)
        return self._step(state, rows)

    def unplace(self, state: TrainState) -> TrainState:
        return state

    def describe(self) -> str:
        return f"single device {self.device}"

    def report(self, state) -> dict:
        return {"devices": 1}


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config, loss_fn=None) -> SingleDevice:
    return SingleDevice(cfg_objective(model, loss_fn, cfg), tx)
