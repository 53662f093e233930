"""GPT's products and attention on XLA:CPU, the same math as the plain calls in fewer, faster kernels.

    y = matmul(x, w)                 # x @ w; its weight gradient is one NN GEMM over every token
    logits = matmul_t(x, table)      # x @ table^T (the tied head), the same way
    y = causal_attention(q, k, v)    # jax.nn.dot_product_attention(is_causal=True), in query blocks on CPUs
    h = bias_gelu(y, b)              # gelu(y + b), its backward from y + b alone (a GPU GEMM's epilogue form)

Why: XLA:CPU lowers a dot whose contracting dimension is an operand's major one (every weight gradient,
x^T dy summed over tokens) outside YNNPACK, at about half the rate of a plain GEMM, after copying an operand into a
transposed layout; and its attention materialises the T x T scores and their gradients, masked upper half included.
The tests check values and gradients against the plain calls (and the whole backward against torch autograd).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

CPU_QUERY_BLOCK = 64  # causal attention on CPUs: query rows per block (up to 8 blocks), see causal_attention
LOW = (jnp.bfloat16, jnp.float16)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b; 16-bit operands accumulate in float32 and round once (XLA:CPU then runs YNNPACK's bf16 kernels)."""
    if a.dtype in LOW and b.dtype == a.dtype:
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return a @ b


def _materialized(a: jax.Array) -> jax.Array:
    """a, written to memory before the transposed copy reads it. XLA:CPU removes optimization barriers before it
    fuses, and fuses an elementwise producer (a LayerNorm's output, the loss's softmax gradient) into the transpose,
    re-evaluating it in strided order: 4.7 ms against about 1.2 for a plain copy at gpt-cpu's [4096, 256] on one
    thread. A conditional is a fusion boundary XLA keeps; its predicate (x == x or x != x) is always true, but XLA
    does not know it, and the other branch never runs."""
    if a.size == 0:
        return a
    first = a.reshape(-1)[0]
    return jax.lax.cond((first == first) | (first != first), lambda v: v, lambda v: -v, a)


@jax.custom_batching.custom_vmap
def _weight_grad(x: jax.Array, dy: jax.Array) -> jax.Array:
    """sum over tokens of x^T dy, [in, out], as one plain GEMM: the narrower operand transposed into memory first
    (`_materialized`, so its producer is not re-evaluated inside the transpose).

    The barriers keep XLA's simplifier from folding the transpose back into a transposed-operand dot (XLA:CPU runs
    those outside YNNPACK, in the step at well under the plain GEMM's rate)."""
    x_NxI, dy_NxO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    barrier = jax.lax.optimization_barrier
    if x_NxI.shape[1] <= dy_NxO.shape[1]:
        return _mm(barrier(_materialized(barrier(x_NxI)).T), dy_NxO)
    return barrier(_mm(barrier(_materialized(barrier(dy_NxO)).T), x_NxI)).T


@_weight_grad.def_vmap
def _weight_grad_vmap(axis_size, in_batched, x, dy):
    """Under vmap (per-sample objectives) the batch is more tokens: one GEMM over all of them, unbatched result."""
    x = x if in_batched[0] else jnp.broadcast_to(x, (axis_size, *x.shape))
    dy = dy if in_batched[1] else jnp.broadcast_to(dy, (axis_size, *dy.shape))
    return _weight_grad(x, dy), False


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] whose weight gradient is one NN GEMM over every token (_weight_grad)."""
    return _mm(x, w)


matmul.defvjp(lambda x, w: (_mm(x, w), (x, w)), lambda res, dy: (_mm(dy, res[1].T), _weight_grad(res[0], dy)))


@jax.custom_vjp
def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w^T for w [out, in] (the tied head: logits against the embedding table), the same way."""
    return _mm(x, w.T)


matmul_t.defvjp(lambda x, w: (_mm(x, w.T), (x, w)), lambda res, dy: (_mm(dy, res[1]), _weight_grad(dy, res[0])))


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """nnx.Linear's dot_general: on CPUs `matmul` for its x @ kernel, elsewhere lax.dot_general."""
    if jax.default_backend() == "cpu" and dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) \
            and preferred_element_type is None and not kwargs.get("out_sharding"):
        return matmul(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bias_gelu(y: jax.Array, b: jax.Array, approximate: bool = True) -> jax.Array:
    """jax.nn.gelu(y + b), b broadcast over y's leading axes and added in y's dtype; b's gradient sums in float32.

    The backward keeps y + b alone and runs gelu's VJP again from it (behind an optimization barrier, so XLA's CSE
    cannot merge that with the forward). Autodiff of gelu keeps its tanh too, a second user of the forward's ops;
    with one user each, XLA:GPU's GEMM rewriter runs the add and the tanh GELU inside the product's cuBLASLt
    epilogue (BIAS_GELU_AUX, writing y + b beside) under XLA_FLAGS=--xla_gpu_enable_cublaslt=true."""
    return jax.nn.gelu(y + b.astype(y.dtype), approximate=approximate)


def _bias_gelu_fwd(y, b, approximate):
    pre = y + b.astype(y.dtype)
    return jax.nn.gelu(pre, approximate=approximate), (pre, b)


def _bias_gelu_bwd(approximate, res, g):
    pre, b = res
    _, vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=approximate), jax.lax.optimization_barrier(pre))
    (dpre,) = vjp(g)
    db = jnp.sum(dpre.astype(jnp.float32), axis=tuple(range(dpre.ndim - b.ndim))).astype(b.dtype)
    return dpre, db


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def cudnn_attention_supported(device: jax.Device | None = None) -> bool:
    """Whether cuDNN's fused attention runs on `device` (default: the first): a CUDA GPU of compute capability 8.0
    (Ampere) or newer, as jax's cudnn implementation requires; ROCm GPUs (also "gpu") and older CUDA ones: no."""
    device = device or jax.devices()[0]
    try:
        return device.platform == "gpu" and float(getattr(device, "compute_capability", "")) >= 8.0
    except ValueError:  # ROCm names its architectures (gfx90a)
        return False


def attention_impl(setting: str, dtype, head_dim: int) -> str:
    """'cudnn' (fused flash attention) on a GPU that has it for bf16/fp16 and head sizes cuDNN takes, else 'xla';
    `setting` 'cudnn' where it cannot run is refused in one line (jax would fail deep inside its lowering)."""
    fits = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    here = jax.default_backend() == "gpu" and cudnn_attention_supported()
    if setting == "cudnn" and not (fits and here):
        raise ValueError(f"attention='cudnn' needs bf16 or fp16 compute, a head size that is a multiple of 8 up to "
                         f"128 and a CUDA GPU of compute capability >= 8.0 (here {jnp.dtype(dtype).name}, head size "
                         f"{head_dim}, {jax.devices()[0].device_kind}); use attention='auto' (or 'xla').")
    if setting != "auto":
        return setting
    return "cudnn" if fits and here else "xla"


def query_blocks(t: int) -> list[int]:
    """causal_attention's query-block bounds on CPUs: about CPU_QUERY_BLOCK rows each, at most 8 blocks."""
    return np.linspace(0, t, max(1, min(8, t // CPU_QUERY_BLOCK)) + 1).astype(int).tolist()


def cpu_score_count(t: int) -> int:
    """Scores one head of one sequence forms on CPUs (causal_attention's blocks: rows lo:hi against keys 0:hi)."""
    bounds = query_blocks(t)
    return sum((hi - lo) * hi for lo, hi in zip(bounds[:-1], bounds[1:]))


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array,
                     setting: str = "auto") -> jax.Array:
    """softmax(q k^T / sqrt(H), causal) v: on GPUs one `jax.nn.dot_product_attention` call (cuDNN's fused kernel
    for bf16/fp16); on CPUs `_blocked_attention`, in query blocks of about CPU_QUERY_BLOCK rows, each over its key
    prefix only, with its own backward.

    XLA:CPU materialises the scores and their gradients (memory-bound passes); the blocks skip most of the masked
    upper triangle (at T=256 in 4 blocks, 35 % less attention time than one causal call), and the backward makes
    fewer passes over them than autodiff of jax's call (gpt-cpu: 0.85x torch eager single, 0.88x DDP; 0.82x, 0.80x
    before; README)."""
    impl = attention_impl(setting, q_BxTxNxH.dtype, q_BxTxNxH.shape[-1])
    if jax.default_backend() != "cpu":
        return dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, is_causal=True, implementation=impl)
    if q_BxTxNxH.dtype == jnp.float16:  # XLA:CPU has no float16 product accumulated in float32
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return _blocked_attention(f32(q_BxTxNxH), f32(k_BxTxNxH), f32(v_BxTxNxH)).astype(jnp.float16)
    return _blocked_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)


def _causal_probs(q_BxNxQxH: jax.Array, k_BxNxKxH: jax.Array, lo: int) -> jax.Array:
    """float32 softmax(q k^T / sqrt(H)) of query rows lo:lo+Q against keys 0:K, key j <= row i (as
    jax.nn.dot_product_attention's XLA path: scores and softmax in float32)."""
    q_len, k_len, h = q_BxNxQxH.shape[-2], k_BxNxKxH.shape[-2], q_BxNxQxH.shape[-1]
    s_BxNxQxK = jnp.einsum("...qh,...kh->...qk", q_BxNxQxH, k_BxNxKxH, preferred_element_type=jnp.float32)
    rows = jax.lax.broadcasted_iota(int, (q_len, k_len), 0) + lo  # in the graph: a constant would be Q x K bytes
    scaled_BxNxQxK = s_BxNxQxK * np.float32(1 / np.sqrt(h))
    s_BxNxQxK = jnp.where(jax.lax.broadcasted_iota(int, (q_len, k_len), 1) <= rows, scaled_BxNxQxK, -jnp.inf)
    e_BxNxQxK = jnp.exp(s_BxNxQxK - jnp.max(s_BxNxQxK, axis=-1, keepdims=True))
    return e_BxNxQxK / jnp.sum(e_BxNxQxK, axis=-1, keepdims=True)


def _products(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum accumulated in float32 (bf16 operands as jax's attention multiplies them)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _blocked_attention(q_BxTxNxH: jax.Array, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array) -> jax.Array:
    """Causal attention in query blocks (`query_blocks`: rows lo:hi against keys 0:hi), computed head-major
    ([B, N, T, H]: one transpose of q, k, v in, of the output out, so no block copies its rows out of the
    interleaved heads). The backward keeps q, k, v, the output o and each block's float32 probabilities p, and
    forms the scores' gradient as p (dp - rowsum(do o)), flash attention's identity (rowsum(p dp) over the keys
    equals rowsum(do o) over the head): one pass over the scores where autodiff of a softmax makes three; each
    block's key and value gradients add into the prefix they cover."""
    return _blocked_fwd(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)[0]


def _blocked_fwd(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH):
    q, k, v = (jnp.swapaxes(a, -3, -2) for a in (q_BxTxNxH, k_BxTxNxH, v_BxTxNxH))  # [B, N, T, H]
    bounds = query_blocks(q.shape[-2])
    probs, outs = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        p_BxNxQxK = _causal_probs(q[..., lo:hi, :], k[..., :hi, :], lo)
        probs.append(p_BxNxQxK)
        outs.append(_products("...qk,...kh->...qh", p_BxNxQxK.astype(v.dtype), v[..., :hi, :]).astype(v.dtype))
    o_BxNxTxH = jnp.concatenate(outs, axis=-2)
    return jnp.swapaxes(o_BxNxTxH, -3, -2), (q, k, v, o_BxNxTxH, probs)


def _blocked_bwd(res, do_BxTxNxH):
    q, k, v, o, probs = res
    t, scale = q.shape[-2], np.float32(1 / np.sqrt(q.shape[-1]))
    do = jnp.swapaxes(do_BxTxNxH, -3, -2)
    delta_BxNxTx1 = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)  # not a product
    bounds = query_blocks(t)
    dqs, dk, dv = [], 0.0, 0.0
    for (lo, hi), p_BxNxQxK in zip(zip(bounds[:-1], bounds[1:]), probs):
        do_i = do[..., lo:hi, :]
        dp_BxNxQxK = _products("...qh,...kh->...qk", do_i, v[..., :hi, :])
        ds_BxNxQxK = (p_BxNxQxK * (dp_BxNxQxK - delta_BxNxTx1[..., lo:hi, :]) * scale).astype(q.dtype)
        dqs.append(_products("...qk,...kh->...qh", ds_BxNxQxK, k[..., :hi, :]))
        prefix = [(0, 0)] * (q.ndim - 2) + [(0, t - hi), (0, 0)]  # keys 0:hi of t
        dk = dk + jnp.pad(_products("...qk,...qh->...kh", ds_BxNxQxK, q[..., lo:hi, :]), prefix)
        dv = dv + jnp.pad(_products("...qk,...qh->...kh", p_BxNxQxK.astype(do.dtype), do_i), prefix)
    grads = (jnp.concatenate(dqs, axis=-2), dk, dv)
    return tuple(jnp.swapaxes(g, -3, -2).astype(a.dtype) for g, a in zip(grads, (q, k, v)))


_blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, **kwargs) -> jax.Array:
    """`jax.nn.dot_product_attention`, but float16 on CPUs runs in float32: jax asks for float16 products
    accumulated in float32 there, which XLA:CPU refuses."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), **kwargs).astype(jnp.float16)
    return jax.nn.dot_product_attention(q, k, v, **kwargs)
