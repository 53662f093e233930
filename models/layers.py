"""PyTorch's nn layers as Flax NNX modules, NHWC, each a plain `layer(x)`.

Weights use PyTorch's default init and keep their own layout (`kernel` HWIO for Conv2d, [in, out] for Linear);
models/convert.py maps them to torch's. Dropout is stock `nnx.Dropout`: jaxpar's per-sample mode
(jaxpar.objective) makes its masks independent of how a batch is split.
"""
from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.precision import add_wide

ConvImpl = Literal["im2col", "xla", "chunked"]
CONV_IMPLS = ("im2col", "xla", "chunked")
CONV_CHUNK = 32  # samples per convolution call of the "chunked" impl (a 2-core VM: 16-64 alike)


def torch_uniform(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """PyTorch's default init for weights and biases: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), +)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


class Linear(nnx.Module):
    """nn.Linear: y = x @ kernel + bias, kernel [in, out] (torch's weight transposed)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(torch_uniform(rngs, (in_features, out_features), in_features))
        self.bias = nnx.Param(torch_uniform(rngs, (out_features,), in_features))

    def __call__(self, x: jax.Array) -> jax.Array:
        return add_wide(x @ self.kernel[...], self.bias[...])  # 16-bit: the bias gradient sums in float32


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def default_conv_impl() -> ConvImpl:
    """"chunked" on XLA:CPU (its convolution slows down past a few dozen samples; see bench/single.py
    --conv-impl), XLA's conv (cuDNN) elsewhere. Resolved when a Conv2d is traced, so one model serves both."""
    return "chunked" if jax.default_backend() == "cpu" else "xla"


def conv_im2col(x: jax.Array, kernel: jax.Array, stride: tuple[int, int],
                padding: tuple[int, int]) -> jax.Array:
    """Convolution as one matmul over patches built from shifted strided slices.

    roughly: patches[b, i, j, (dx, dy, c)] = xpad[b, i*sh + dy, j*sw + dx, c]; out = patches @ kernel.
    Built in two passes (kh row slices, then kw column slices of those) rather than kh*kw slices: the
    same patches, far less for XLA to compile for large kernels (AlexNet's 11x11).
    """
    kh, kw, cin, cout = kernel.shape
    (sh, sw), (ph, pw) = stride, padding
    x = jnp.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    b, h, w, _ = x.shape
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"padded input {h}x{w} is smaller than the {kh}x{kw} kernel; use a larger image")
    rows = _concat([jax.lax.slice(x, (0, dy, 0, 0), (b, dy + sh * (ho - 1) + 1, w, cin), (1, sh, 1, 1))
                    for dy in range(kh)])  # [b, ho, w, kh * cin], order (dy, c)
    patches = _concat([jax.lax.slice(rows, (0, 0, dx, 0), (b, ho, dx + sw * (wo - 1) + 1, kh * cin),
                                     (1, 1, sw, 1)) for dx in range(kw)])  # [b, ho, wo, kw * kh * cin]
    return patches @ kernel.transpose(1, 0, 2, 3).reshape(kw * kh * cin, cout)


def _concat(xs: list[jax.Array]) -> jax.Array:
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)


def conv_xla(x: jax.Array, kernel: jax.Array, stride: tuple[int, int],
             padding: tuple[int, int]) -> jax.Array:
    """Convolution with lax.conv_general_dilated (cuDNN on GPU)."""
    (ph, pw) = padding
    return jax.lax.conv_general_dilated(x, kernel, stride, ((ph, ph), (pw, pw)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_chunked(x: jax.Array, kernel: jax.Array, stride: tuple[int, int],
                 padding: tuple[int, int], chunk: int = CONV_CHUNK) -> jax.Array:
    """XLA's convolution on slices of `chunk` samples, concatenated: the same values as one call.

    XLA:CPU's convolution (forward and both backward passes) gets slower per sample as the batch grows past a
    few dozen samples (its temporaries leave the caches); measured on a 2-core VM, ConvNet, batch 256: ~1.5x
    faster in slices of 32 than in one call, and faster than im2col. The slices are unrolled, not looped:
    XLA:CPU runs a convolution inside a while loop several times slower.
    """
    b = x.shape[0]
    if b <= chunk:
        return conv_xla(x, kernel, stride, padding)
    return jnp.concatenate([conv_xla(x[i:i + chunk], kernel, stride, padding) for i in range(0, b, chunk)])


_CONVS = {"im2col": conv_im2col, "xla": conv_xla, "chunked": conv_chunked}


class Conv2d(nnx.Module):
    """nn.Conv2d on NHWC input, kernel HWIO. `impl` None picks "chunked" on CPU and XLA's conv elsewhere."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0, *,
                 rngs: nnx.Rngs, impl: ConvImpl | None = None):
        if impl is not None and impl not in CONV_IMPLS:
            raise ValueError(f"{impl=} must be one of {CONV_IMPLS} or None (pick by backend)")
        kh, kw = _pair(kernel_size)
        self.stride, self.padding, self.impl = _pair(stride), _pair(padding), impl
        fan_in = in_channels * kh * kw
        self.kernel = nnx.Param(torch_uniform(rngs, (kh, kw, in_channels, out_channels), fan_in))
        self.bias = nnx.Param(torch_uniform(rngs, (out_channels,), fan_in))

    def __call__(self, x: jax.Array) -> jax.Array:
        conv = _CONVS[self.impl or default_conv_impl()]
        return add_wide(conv(x, self.kernel[...], self.stride, self.padding), self.bias[...])


class ReLU(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


class MaxPool2d(nnx.Module):
    """nn.MaxPool2d (no padding, floor mode) on NHWC.

    A separable max of shifted strided slices (k over rows, then k over columns): on XLA:CPU its backward
    is several times cheaper than reduce_window's select-and-scatter, with the same gradients wherever
    the window's maximum is unique.
    """

    def __init__(self, kernel_size: int, stride: int | None = None):
        self.kernel_size, self.stride = kernel_size, kernel_size if stride is None else stride

    def __call__(self, x: jax.Array) -> jax.Array:
        k, s = self.kernel_size, self.stride
        b, h, w, c = x.shape
        ho, wo = (h - k) // s + 1, (w - k) // s + 1
        if ho < 1 or wo < 1:
            raise ValueError(f"input {h}x{w} is smaller than the {k}x{k} pooling window; use a larger image")
        rows = functools.reduce(jnp.maximum, [
            jax.lax.slice(x, (0, dy, 0, 0), (b, dy + s * (ho - 1) + 1, w, c), (1, s, 1, 1)) for dy in range(k)])
        return functools.reduce(jnp.maximum, [
            jax.lax.slice(rows, (0, 0, dx, 0), (b, ho, dx + s * (wo - 1) + 1, c), (1, 1, s, 1))
            for dx in range(k)])


def adaptive_bins(size: int, out: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling bins: [floor(i * size / out), ceil((i + 1) * size / out)) for each i."""
    return [((i * size) // out, -((-(i + 1) * size) // out)) for i in range(out)]


def _pool_matrix(size: int, out: int) -> jax.Array:
    rows = [[1.0 / (e - s) if s <= j < e else 0.0 for j in range(size)] for s, e in adaptive_bins(size, out)]
    return jnp.asarray(rows, jnp.float32)


class AdaptiveAvgPool2d(nnx.Module):
    """nn.AdaptiveAvgPool2d: averages torch's (possibly overlapping) bins; replicates when input < output."""

    def __init__(self, output_size: int | tuple[int, int]):
        self.output_size = _pair(output_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        (oh, ow), (h, w) = self.output_size, x.shape[1:3]
        if (h, w) == (oh, ow):
            return x
        rows, cols = _pool_matrix(h, oh).astype(x.dtype), _pool_matrix(w, ow).astype(x.dtype)
        return jnp.einsum("oh,bhwc,pw->bopc", rows, x, cols)


class Flatten(nnx.Module):
    """torch.flatten(x, 1) of the NCHW tensor torch would hold: NHWC -> NCHW, then reshape."""

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 4:
            x = x.transpose(0, 3, 1, 2)
        return x.reshape(x.shape[0], -1)


class LogSoftmax(nnx.Module):
    """nn.LogSoftmax(dim=-1), in float32 whatever x's dtype (torch autocast runs log_softmax in float32)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.log_softmax(x.astype(jnp.promote_types(x.dtype, jnp.float32)), axis=-1)
