"""Optimizers by name with PyTorch's defaults."""
from __future__ import annotations

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
