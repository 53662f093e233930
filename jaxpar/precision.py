"""Mixed precision: which dtype the forward and backward compute in (master weights stay float32). fp16 runs
behind a loss scaler (jaxpar.loss_scale; train.py adds DeepSpeed's dynamic one), bf16 needs none.

jaxpar casts the parameters and the model's inputs to the compute dtype; Flax modules then compute in the dtype
of what they are given, except where a module's own `dtype` says otherwise. `nnx.Embed` fixes its `dtype` to its
table's (float32) when it is built, so its lookups, and every layer after them, would compute in float32:
`check_model` refuses that before any work.

A 16-bit compute copy of a bias or an embedding table gets a gradient that is a sum over every token (the transpose
of the bias's broadcast, the scatter-add of a lookup). JAX sums those in the cotangent's dtype, 16 bits, where torch
autocast's kernels accumulate in float32. `add_wide` and `take_wide` (jaxpar's own models use them) do the add and the
lookup in float32 and round the result once, so those sums run in float32 too; float32 inputs are untouched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PRECISIONS = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}


LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def add_wide(x: jax.Array, b: jax.Array) -> jax.Array:
    """``x + b`` (b broadcast over x's leading axes) in x's dtype. With a 16-bit operand the sum is formed in float32
    and rounded once, so b's gradient, a sum over x's leading axes, accumulates in float32 (torch autocast's bias
    gradients do); the result is x's dtype either way."""
    if jnp.dtype(x.dtype) not in LOW and jnp.dtype(b.dtype) not in LOW:
        return x + b
    return (x.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def take_wide(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` (rows of the table, as nnx.Embed looks them up) in the table's dtype. A 16-bit table is read
    through a float32 view, so the gradient's scatter-add, where a token that appears n times adds n rows, sums in
    float32; the rows come out in the table's dtype."""
    if jnp.dtype(table.dtype) not in LOW:
        return jnp.take(table, ids, axis=0)
    return jnp.take(table.astype(jnp.float32), ids, axis=0).astype(table.dtype)


def compute_dtype(precision: str):
    """The compute dtype of `--precision`, None for plain float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]


def check_compute_dtype(dtype) -> None:
    """ValueError unless `dtype` is a floating dtype the step can compute in: bfloat16, float16, float32, or float64
    where JAX has 64-bit enabled (else it computes in float32, JAX warning once)."""
    fix = "pass jnp.bfloat16 or jnp.float16 (16-bit compute, float32 master weights), jnp.float32, or None"
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"compute_dtype={dtype!r} is not a dtype JAX knows; {fix}.") from None
    allowed = [jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32)]
    if d == jnp.dtype(np.float64) and not jax.config.read("jax_enable_x64"):
        raise ValueError("compute_dtype=float64, but JAX's 64-bit mode is off, so the step would compute in "
                         f"float32; enable it (jax.config.update('jax_enable_x64', True)) first, or {fix}.")
    if d not in allowed and d != jnp.dtype(np.float64):
        raise ValueError(f"compute_dtype={d.name} is not a floating dtype to compute in; {fix}.")


def check_model(model: nnx.Module, dtype) -> None:
    """ValueError where an nnx.Embed of `model` computes in another dtype than `dtype` (the compute dtype): its
    output, and the layers after it, would run in float32 (a bf16 Embed under float16 too, by promotion) while the
    run says 16-bit."""
    if dtype is None:
        return
    check_compute_dtype(dtype)
    for path, m in nnx.iter_graph(model):
        if isinstance(m, nnx.Embed) and m.dtype is not None and jnp.dtype(m.dtype) != jnp.dtype(dtype):
            where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
            name = f"{type(model).__name__}.{where}" if where else "the model"
            wide = jnp.dtype(m.dtype).name
            raise ValueError(f"compute_dtype={jnp.dtype(dtype).name}, but {name} is an nnx.Embed with dtype={wide} "
                             "(Flax sets an Embed's dtype to its table's when it is built), so its lookups and every "
                             f"layer after them would compute in {wide} or wider: set "
                             f"`{where or 'model'}.dtype = None` after building it (the table's dtype then decides: "
                             "float32 in a float32 run, the compute dtype under jaxpar's cast), or leave compute_dtype "
                             "at None.")
