"""The contract every strategy keeps, and the registry behind `--strategy`.

Every strategy is built from an `Objective` (the user's NNX model, loss and `wrt` filter; jaxpar.objective) and
an optax transformation, and keeps the same four calls, so the trainer, checkpoints and exports never ask which
strategy runs:

    placed = strategy.init(state)                  # the canonical TrainState onto the devices
    batch = strategy.put_batch(batch_or_rows)      # pad / mask / shard / scatter (on the loader thread)
    placed, metrics = strategy.step(placed, batch)
    state = strategy.unplace(placed)               # the canonical single-device TrainState again
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import jax
from flax import nnx

from jaxpar.objective import Objective
from jaxpar.step import TrainState
from jaxpar.types import Batch, Metrics

# name -> "module:function" building it; imported lazily so a strategy's deps load only when used
STRATEGIES = {
    "single": "jaxpar.strategies.single:build",
    "ddp": "jaxpar.strategies.ddp:build",
    "dp": "jaxpar.strategies.data_parallel:build",
    "pipeline": "jaxpar.strategies.pipeline:build",
    "zero": "jaxpar.strategies.zero:build",
    "tp": "jaxpar.strategies.tensor:build",
}


class Strategy(Protocol):
    """A way to run the reference step on many devices; `unplace(step(init(s)))` equals the reference step."""

    name: str

    def init(self, state: TrainState) -> Any:
        """Place the canonical state on the devices."""

    def put_batch(self, batch: Batch) -> Any:
        """Pad, mask, shard or scatter this process's rows of the global batch (runs ahead, on the loader thread)."""

    def step(self, placed: Any, batch: Any) -> tuple[Any, Metrics]:
        """One training step; metrics as the reference's (loss, correct, count)."""

    def unplace(self, placed: Any) -> TrainState:
        """The canonical single-device state (params and opt_state with the reference's tree structure)."""

    def describe(self) -> str:
        """One line: devices, mesh, algorithm."""

    def report(self, placed: Any) -> dict:
        """Extras for --report (communication, memory, schedule)."""


def get_builder(name: str):
    """The `build(model, tx, cfg, loss_fn) -> Strategy` function registered under `name`."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy={name!r} is not known; use one of {', '.join(STRATEGIES)}.")
    module, fn = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def whole_batch(name: str) -> bool:
    """Whether every process of strategy `name` reads the whole global batch (its module sets WHOLE_BATCH: the
    pipeline, whose first stage needs every input and last stage every target) instead of its share."""
    return name in STRATEGIES and getattr(importlib.import_module(STRATEGIES[name].split(":")[0]), "WHOLE_BATCH", False)


def to_device(tree: Any, device) -> Any:
    """A copy of `tree` committed to one device (fully gathered first when it spans several processes)."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils

            a = multihost_utils.process_allgather(a, tiled=True)
        return jax.device_put(a, device)

    return jax.tree.map(one, tree)


def objective_of(model: nnx.Module | Objective, loss_fn=None, **kwargs) -> Objective:
    """`model` as an Objective: an Objective passes through (no other argument allowed), a module is wrapped."""
    if isinstance(model, Objective):
        if loss_fn is not None or kwargs:
            raise ValueError("an Objective already holds its loss and options; pass either an Objective, or the "
                             "model with loss_fn=... and options.")
        return model
    return Objective.of(model, loss_fn, **kwargs)


def cfg_objective(model: nnx.Module, loss_fn, cfg) -> Objective:
    """The Objective train.py's flags ask for: --precision, --per-sample, and --activation-checkpoint-interval
    (but for the pipeline, whose stages recompute their own segments)."""
    from jaxpar.precision import compute_dtype

    per_sample = {None: None, "on": True, "off": False}[cfg.per_sample]
    interval = 0 if cfg.strategy == "pipeline" else cfg.activation_checkpoint_interval
    return Objective.of(model, loss_fn, per_sample=per_sample, compute_dtype=compute_dtype(cfg.precision),
                        activation_checkpoint_interval=interval)
