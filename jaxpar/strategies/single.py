"""The single-device strategy: the reference step, jitted, on one device."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import optax
from flax import nnx

from jaxpar.config import Config
from jaxpar.step import TrainState, make_train_step
from jaxpar.strategies.base import to_device
from jaxpar.types import Batch


@dataclass
class SingleDevice:
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    compute_dtype: object = None
    device: object = None
    name: str = "single"
    _step: object = field(init=False, repr=False)

    def __post_init__(self):
        if jax.process_count() > 1:
            raise ValueError(
                f"strategy='single' runs in one process, but jax.process_count()={jax.process_count()}; "
                "use --strategy ddp or pipeline across processes."
            )
        self.device = self.device or jax.local_devices()[0]
        self._step = make_train_step(self.graphdef, self.tx, self.compute_dtype)

    def init(self, state: TrainState) -> TrainState:
        return to_device(state, self.device)

    def put_batch(self, batch: Batch) -> Batch:
        return jax.device_put(batch, self.device)

    def step(self, state: TrainState, batch: Batch):
        return self._step(state, batch)

    def unplace(self, state: TrainState) -> TrainState:
        return state

    def describe(self) -> str:
        return f"single device {self.device}"

    def report(self, state) -> dict:
        return {"devices": 1}


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config) -> SingleDevice:
    from jaxpar.precision import compute_dtype

    return SingleDevice(nnx.graphdef(model), tx, compute_dtype(cfg.precision))
