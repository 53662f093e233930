"""GPT's elementwise steps around its products, each with its own backward, so that XLA makes one pass of each.

    h = bias_gelu(y, bias)                # gelu(y + bias), Megatron's bias_gelu fusion (--bias-gelu-fusion)
    q, k, v = bias_split_heads(y, bias, n_head)   # the fused qkv product's bias add and split into heads

The numbers are those of the plain formulas under jaxpar's mixed precision: the sum y + bias formed in float32 and
rounded to y's dtype (jaxpar.precision.add_wide), the activation computed from that rounded sum, the bias's
gradient summed over every token in float32 from the 16-bit gradient of the sum. Only what is kept for the backward
and how the backward is grouped change:
- bias_gelu keeps the product y and the bias, not the activation's intermediates (autodiff of gelu keeps its
  tanh, a third pass of the 4C-wide activation written in the forward), and its backward forms y + bias again
  (Megatron's bias_gelu_impl keeps its input and bias the same way);
- bias_split_heads's backward joins the q, k and v gradients into the [B, T, 3C] gradient of the product once,
  behind an optimization barrier, for both of the product's gradient GEMMs (XLA:GPU otherwise joined them once
  per GEMM) and the bias's sum.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.precision import LOW

_TANH_C = math.sqrt(2.0 / math.pi)  # GPT-2's tanh GELU: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))


def _sum_f32(y: jax.Array, bias: jax.Array) -> jax.Array:
    """y + bias as add_wide forms it: in float32 when either is 16-bit, rounded to y's dtype; returned in float32."""
    if jnp.dtype(y.dtype) in LOW or jnp.dtype(bias.dtype) in LOW:
        return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype).astype(jnp.float32)
    return (y + bias).astype(jnp.float32)


def _bias_grad(g: jax.Array, bias: jax.Array) -> jax.Array:
    """The bias's gradient: g summed over its leading axes in float32, in the bias's dtype."""
    return jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - 1))).astype(bias.dtype)


def _gelu_and_slope(x: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
    """gelu(x) and its derivative, float32 (jax.nn.gelu's two forms)."""
    if approximate:
        t = jnp.tanh(_TANH_C * (x + 0.044715 * x ** 3))
        cdf = 0.5 * (1.0 + t)
        return x * cdf, cdf + 0.5 * x * (1.0 - t * t) * _TANH_C * (1.0 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))
    return x * cdf, cdf + x * jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bias_gelu(y: jax.Array, bias: jax.Array, approximate: bool = True) -> jax.Array:
    """gelu(y + bias) in y's dtype (`approximate`: GPT-2's tanh form, else the erf form), as
    jax.nn.gelu(add_wide(y, bias)) computes it; its backward keeps y and the bias only."""
    return _gelu_and_slope(_sum_f32(y, bias), approximate)[0].astype(y.dtype)


def _bias_gelu_fwd(y, bias, approximate):
    return bias_gelu(y, bias, approximate), (y, bias)


def _bias_gelu_bwd(approximate, res, g):
    y, bias = res
    slope = _gelu_and_slope(_sum_f32(y, bias), approximate)[1]
    dy = (g.astype(jnp.float32) * slope).astype(y.dtype)  # the sum's gradient, in its dtype as autodiff's
    return dy, _bias_grad(dy, bias)


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bias_split_heads(y_BxTx3C: jax.Array, bias: jax.Array, n_head: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(y + bias) split into q, k and v, each [B, T, n_head, C / n_head], in y's dtype (add_wide's sum)."""
    s = _sum_f32(y_BxTx3C, bias).astype(y_BxTx3C.dtype)
    b, t, c3 = s.shape
    return tuple(a.reshape(b, t, n_head, c3 // 3 // n_head) for a in jnp.split(s, 3, axis=-1))


def _bias_split_heads_fwd(y, bias, n_head):
    return bias_split_heads(y, bias, n_head), (bias,)


def _bias_split_heads_bwd(n_head, res, g):
    (bias,) = res
    b, t = g[0].shape[:2]
    dy = jax.lax.optimization_barrier(jnp.concatenate([a.reshape(b, t, -1) for a in g], axis=-1))
    return dy, _bias_grad(dy, bias)


bias_split_heads.defvjp(_bias_split_heads_fwd, _bias_split_heads_bwd)
