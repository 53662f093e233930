"""Mixed precision: which dtype the forward and backward compute in (master weights stay float32). fp16 runs
behind a loss scaler (jaxpar.loss_scale; train.py adds DeepSpeed's dynamic one), bf16 needs none.

jaxpar casts the parameters and the model's inputs to the compute dtype; Flax modules then compute in the dtype
of what they are given, except where a module's own `dtype` says otherwise. `nnx.Embed` fixes its `dtype` to its
table's (float32) when it is built, so its lookups, and every layer after them, would compute in float32:
`check_model` refuses that before any work.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

PRECISIONS = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def compute_dtype(precision: str):
    """The compute dtype of `--precision`, None for plain float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]


def check_model(model: nnx.Module, dtype) -> None:
    """ValueError where an nnx.Embed of `model` computes in another dtype than `dtype` (the compute dtype): its
    output, and the layers after it, would run in float32 (a bf16 Embed under float16 too, by promotion) while the
    run says 16-bit."""
    if dtype is None:
        return
    for path, m in nnx.iter_graph(model):
        if isinstance(m, nnx.Embed) and m.dtype is not None and jnp.dtype(m.dtype) != jnp.dtype(dtype):
            where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
            name = f"{type(model).__name__}.{where}" if where else "the model"
            wide = jnp.dtype(m.dtype).name
            raise ValueError(f"compute_dtype={jnp.dtype(dtype).name}, but {name} is an nnx.Embed with dtype={wide} "
                             "(Flax sets an Embed's dtype to its table's when it is built), so its lookups and every "
                             f"layer after them would compute in {wide} or wider: set `{where or 'model'}.dtype = None` "
                             "after building it (the table's dtype then decides: float32 in a float32 run, the compute "
                             "dtype under jaxpar's cast), or leave compute_dtype at None.")
