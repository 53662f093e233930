"""Optimizers by name with PyTorch's defaults, and the global-norm clipping that strategies can feed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("sgd", "adam", "adamw", "adadelta")


def make_optimizer(name: str, lr: float | optax.Schedule, momentum: float = 0.0,
                   weight_decay: float | None = None) -> optax.GradientTransformation:
    """torch.optim's SGD (momentum 0 unless given), Adam, AdamW (weight_decay 0.01) and Adadelta (rho 0.9, eps 1e-6)."""
    if name == "sgd":
        tx = optax.sgd(lr, momentum=momentum or None)
        return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx
    if name == "adam":
        tx = optax.adam(lr, b1=0.9, b2=0.999, eps=1e-8)
        return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx
    if name == "adamw":
        return optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01 if weight_decay is None else weight_decay)
    if name == "adadelta":
        tx = optax.adadelta(lr, rho=0.9, eps=1e-6)
        return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx
    raise ValueError(f"optimizer={name!r} is not known; use one of {', '.join(OPTIMIZERS)}.")


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm that takes the norm as the extra argument ``global_norm`` when a strategy
    gives it (the pipeline: the norm over every stage's gradients, tied weights once); without it, the norm of
    the updates it sees, exactly as optax's. Chain it like optax's: ``optax.chain(clip_by_global_norm(1.0),
    optax.adam(1e-3))``."""
    def update(updates, state, params=None, *, global_norm=None, **extra):
        del params, extra
        g_norm = optax.tree.norm(updates) if global_norm is None else global_norm
        trigger = jnp.squeeze(g_norm < max_norm)
        updates = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)
