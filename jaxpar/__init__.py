"""jaxpar: PyTorch's and DeepSpeed's parallel training strategies, rebuilt in JAX and Flax NNX.

The public API is what `__all__` lists; everything else is an implementation detail.
"""
from jaxpar.hostmem import tune_host_allocator

tune_host_allocator()  # before JAX allocates anything: see jaxpar/hostmem.py

from jaxpar.config import Config  # noqa: E402
from jaxpar.mesh import DATA, PIPE, make_mesh  # noqa: E402
from jaxpar.optim import OPTIMIZERS, make_optimizer  # noqa: E402
from jaxpar.step import (  # noqa: E402
    TrainState,
    apply_updates,
    init_state,
    loss_terms,
    make_eval_step,
    make_train_step,
    sample_keys,
)
from jaxpar.strategy import STRATEGIES, Strategy, get_builder  # noqa: E402

__all__ = [
    "Config",
    "DATA",
    "PIPE",
    "make_mesh",
    "OPTIMIZERS",
    "make_optimizer",
    "TrainState",
    "apply_updates",
    "init_state",
    "loss_terms",
    "make_eval_step",
    "make_train_step",
    "sample_keys",
    "STRATEGIES",
    "Strategy",
    "get_builder",
    "tune_host_allocator",
]
