"""The single-device reference step: every strategy must produce exactly these parameters.

A step differentiates the SUM of per-sample losses and divides by the global sample count, so a strategy that
splits the batch can sum local gradients and divide once: the result is the gradient of the global mean loss.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.types import Batch, Metrics, Params


class TrainState(NamedTuple):
    """Everything a training run carries from step to step, in the canonical single-device layout."""

    params: Params  # nnx.State of the model's parameters
    opt_state: Any  # optax state, the same tree on every strategy
    step: jax.Array  # int32 scalar: steps taken so far
    key: jax.Array  # base PRNG key; dropout keys derive from (key, step, sample index)


def init_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int = 0):
    """Split `model` into (graphdef, TrainState) with a fresh optimizer state."""
    graphdef, params = nnx.split(model)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key(seed))
    return graphdef, state


def sample_keys(key: jax.Array, step: jax.Array, idx: jax.Array) -> jax.Array:
    """One dropout key per sample: fold_in(fold_in(key, step), idx[i]); independent of how the batch is split."""
    step_key = jax.random.fold_in(key, step)
    return jax.vmap(lambda i: jax.random.fold_in(step_key, i))(idx)


def cast_floating(tree: Any, dtype) -> Any:
    """Cast the floating-point leaves of `tree` to `dtype` (mixed precision compute copies)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def apply_model(graphdef, params: Params, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    """Run the model given by (graphdef, params) on `x`; `keys` None means eval mode (no dropout)."""
    return nnx.merge(graphdef, params)(x, keys)


def sample_weights(batch: Batch) -> jax.Array:
    """Per-sample weights: the batch's `w` (0 marks padding) or ones."""
    return batch["w"] if "w" in batch else jnp.ones(batch["y"].shape, jnp.float32)


def output_terms(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
    """(loss_sum, aux) of a model output: summed cross-entropy over real samples, correct count, sample count."""
    w = sample_weights(batch)
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    loss_sum = jnp.sum(w * losses)
    correct = jnp.sum(w * (jnp.argmax(logits, -1) == batch["y"]))
    return loss_sum, {"loss_sum": loss_sum, "correct": correct, "count": jnp.sum(w)}


def loss_terms(graphdef, params: Params, batch: Batch, key: jax.Array, step: jax.Array, *,
               train: bool = True, compute_dtype=None) -> tuple[jax.Array, Metrics]:
    """Summed loss of `batch` (see `output_terms`), with per-sample dropout keys when training."""
    keys = sample_keys(key, step, batch["idx"]) if train else None
    x = batch["x"]
    if compute_dtype is not None:
        params, x = cast_floating(params, compute_dtype), x.astype(compute_dtype)
    return output_terms(apply_model(graphdef, params, x, keys), batch)


def apply_updates(tx: optax.GradientTransformation, state: TrainState, grads: Params) -> TrainState:
    """One optimizer update of `state` with `grads` (gradients of the global mean loss)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1, state.key)


def metrics_of(aux: Metrics) -> Metrics:
    """Step metrics from summed aux terms: mean loss, correct count, sample count."""
    return {"loss": aux["loss_sum"] / aux["count"], "correct": aux["correct"], "count": aux["count"]}


def grad_of_sum(graphdef, params: Params, batch: Batch, key, step, compute_dtype=None):
    """((loss_sum, aux), grads of loss_sum): the local half of every data-parallel step."""
    f = lambda p: loss_terms(graphdef, p, batch, key, step, compute_dtype=compute_dtype)  # noqa: E731
    return jax.value_and_grad(f, has_aux=True)(params)


def train_step(graphdef, tx: optax.GradientTransformation, state: TrainState, batch: Batch,
               compute_dtype=None) -> tuple[TrainState, Metrics]:
    """The reference step, unjitted: gradient of the mean loss over the whole batch, one optimizer update."""
    (_, aux), grads = grad_of_sum(graphdef, state.params, batch, state.key, state.step, compute_dtype)
    grads = jax.tree.map(lambda g: g / aux["count"], grads)
    return apply_updates(tx, state, grads), metrics_of(aux)


def make_train_step(graphdef, tx: optax.GradientTransformation, compute_dtype=None):
    """Jitted reference step `(state, batch) -> (state, metrics)` on one device."""
    return jax.jit(lambda state, batch: train_step(graphdef, tx, state, batch, compute_dtype))


def make_eval_step(graphdef):
    """Jitted `(params, batch) -> aux` (summed loss, correct, count) with dropout off."""

    def eval_step(params, batch):
        return loss_terms(graphdef, params, batch, jax.random.key(0), jnp.zeros((), jnp.int32), train=False)[1]

    return jax.jit(eval_step)
