"""A stock Flax NNX regression model and an MSE loss: what `--model` / `--loss` of train.py take.

    python examples/regression.py data.npz                     # writes a synthetic regression set
    python train.py --model examples/regression.py:make_model --loss mse \
        --dataset npz --data-path data.npz --optimizer adam --lr 1e-2 --strategy ddp --cpu-devices 4 --epochs 5

Nothing here knows about jaxpar: a plain `nnx.Sequential` (its `layers` are what the pipeline cuts into
stages), stock `nnx.Dropout` drawing from its own RNG stream, and a loss on the outputs.
"""
from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx


def make_model(in_features: int = 8, hidden: int = 32, out_features: int = 2, dropout: float = 0.2, *,
               rngs: nnx.Rngs) -> nnx.Sequential:
    """Linear -> relu -> Dropout -> Linear -> relu -> Linear."""
    return nnx.Sequential(
        nnx.Linear(in_features, hidden, rngs=rngs), nnx.relu, nnx.Dropout(dropout, rngs=rngs),
        nnx.Linear(hidden, hidden, rngs=rngs), nnx.relu,
        nnx.Linear(hidden, out_features, rngs=rngs))


def loss(outputs, batch):
    """Summed squared error and the number of target elements (torch's MSELoss mean = their ratio)."""
    err = (outputs - batch["y"]) ** 2
    return jnp.sum(err), err.size


def make_data(n: int = 512, in_features: int = 8, out_features: int = 2, seed: int = 0, n_test: int = 128):
    """A noisy smooth regression problem: y = sin(x @ A) + 0.1 noise."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((in_features, out_features)).astype(np.float32) / np.sqrt(in_features)
    x = rng.standard_normal((n + n_test, in_features)).astype(np.float32)
    y = np.sin(x @ a) + 0.1 * rng.standard_normal((n + n_test, out_features)).astype(np.float32)
    return {"x": x[:n], "y": y[:n], "x_test": x[n:], "y_test": y[n:]}


if __name__ == "__main__":
    np.savez(sys.argv[1] if len(sys.argv) > 1 else "regression.npz", **make_data())
