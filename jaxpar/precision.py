"""Mixed precision: which dtype the forward and backward compute in (master weights stay float32). fp16 runs
behind a loss scaler (jaxpar.loss_scale; train.py adds DeepSpeed's dynamic one), bf16 needs none."""
from __future__ import annotations

import jax.numpy as jnp

PRECISIONS = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def compute_dtype(precision: str):
    """The compute dtype of `--precision`, None for plain float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]
