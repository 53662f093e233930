"""The single-device reference step: every strategy must produce exactly these parameters.

Roughly, for a batch (jaxpar.batch.Rows) and an Objective (jaxpar.objective):

    (sums, model_state), grads = objective.value_and_grad(params, model_state, rows)   # grads of the SUMMED loss
    grads = grads / sums.weight                                                         # of the global mean loss
    params, opt_state = optax update

A strategy that splits the batch sums its local gradients and divides once by the global weight: the result is
the gradient of the same global mean loss.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar import loss_scale
from jaxpar.batch import Rows
from jaxpar.objective import Objective, Sums, metrics_of
from jaxpar.types import Metrics, Params


class TrainState(NamedTuple):
    """Everything a training run carries from step to step, in the canonical single-device layout."""

    params: Params  # nnx.State of what the objective's `wrt` selects: differentiated and updated
    opt_state: Any  # optax state over params, the same tree on every strategy
    model_state: Any  # nnx.State of everything else (RNG streams, BatchStat, user variables), carried along
    step: jax.Array  # int32 scalar: steps taken so far


def init_state(model: nnx.Module, tx: optax.GradientTransformation, wrt: Any = nnx.Param) -> TrainState:
    """A fresh TrainState of `model`: its `wrt` state as params (an Objective's wrt), tx.init over them."""
    from jaxpar.strategies.base import check_tx

    if not isinstance(model, nnx.Module):  # nnx.split of anything else gave a state with no params, silently
        fix = ("pass the module's model: jaxpar.init_state(module.model, tx)" if isinstance(
            getattr(model, "model", None), nnx.Module) else "pass the model given to the strategy: "
               "jaxpar.init_state(model, tx)")
        raise TypeError(f"init_state: model is a {type(model).__name__}, not a flax.nnx.Module; {fix}.")
    check_tx(tx)
    if isinstance(wrt, Objective):
        wrt = wrt.wrt
    _, params, rest = nnx.split(model, wrt, ...)
    return TrainState(params, tx.init(params), rest, jnp.zeros((), jnp.int32))


def apply_updates(tx: optax.GradientTransformation, state: TrainState, grads: Params,
                  model_state: Any = None, **extra_args) -> TrainState:
    """One optimizer update of `state` with `grads` (gradients of the global mean loss)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra_args)
    return TrainState(optax.apply_updates(state.params, updates), opt_state,
                      state.model_state if model_state is None else model_state, state.step + 1)


def squared_norm(tree: Any) -> jax.Array:
    """The sum of squares of every leaf of `tree`, accumulated in float32 (0.0 for no leaves)."""
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def grad_norm(grads: Any) -> jax.Array:
    """The global L2 norm of a gradient tree, accumulated in float32 (the step's `grad_norm` metric)."""
    return jnp.sqrt(squared_norm(grads))


def scale(tree: Any, factor: jax.Array) -> Any:
    return jax.tree.map(lambda g: g * factor, tree)


def train_step(objective: Objective, tx: optax.GradientTransformation, state: TrainState,
               rows: Rows) -> tuple[TrainState, Metrics]:
    """The reference step, unjitted: gradient of the mean loss over the whole batch, one optimizer update (with a
    loss scaler in `tx`, the backward runs on the scaled loss: jaxpar.loss_scale)."""
    s = loss_scale.current(state.opt_state)
    (sums, model_state), grads = objective.value_and_grad(state.params, state.model_state, rows, loss_scale=s)
    grads = scale(grads, 1.0 / sums.weight)
    metrics = {**metrics_of(sums, grad_norm(grads)), **loss_scale.metrics(s)}
    return apply_updates(tx, state, grads, model_state), metrics


class _Reference:
    """A jitted bare step (`lower`, `trace`, ... as jax.jit's) whose model naming a mesh axis (jaxpar.sync_batch_norm's
    pmean over DATA) is refused in one line, where JAX raised "NameError: unbound axis name: data" from the trace."""

    def __init__(self, fn: Callable, what: str):
        self.jitted, self.what = jax.jit(fn), what

    def __call__(self, *args):
        try:
            return self.jitted(*args)
        except NameError as e:
            if "unbound axis name" not in str(e):
                raise
            axis = str(e).split("unbound axis name: ", 1)[1].split(".")[0].split()[0]
            raise ValueError(f"the model reduces over the mesh axis {axis!r} (jaxpar.sync_batch_norm's statistics, "
                             f"or a collective in a layer), which {self.what} does not give it: run it under a "
                             "strategy, jaxpar.SingleDevice(model, tx) on one device (a collective over one device "
                             "is the identity) or DDP / ZeRO across devices.") from None

    def __getattr__(self, name: str):
        return getattr(self.jitted, name)


def make_train_step(objective: Objective, tx: optax.GradientTransformation):
    """Jitted reference step `(state, rows) -> (state, metrics)` on one device."""
    return _Reference(lambda state, rows: train_step(objective, tx, state, rows), "make_train_step")


def eval_sums(objective: Objective, params: Params, model_state: Any, rows: Rows) -> Sums:
    """Sums of the loss and metrics over the real rows, in eval mode (no dropout, running BatchNorm stats)."""
    return objective.sums(params, model_state, rows, train=False)[0]


def make_eval_step(objective: Objective):
    """Jitted `(params, model_state, rows) -> Sums` in eval mode."""
    return jax.jit(lambda params, model_state, rows: eval_sums(objective, params, model_state, rows))
