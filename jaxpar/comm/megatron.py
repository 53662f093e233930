"""Megatron-LM's tensor parallelism, written out for shard_map: the conjugate operators f and g, and the column- and
row-parallel linear layers built on them (Shoeybi et al. 2019, section 3; Megatron-LM's
`core/tensor_parallel/mappings.py` and `layers.py`).

Over the TENSOR axis of T devices a transformer block's MLP is ``Y = GeLU(X A) B`` with A split by columns and B by
rows, and its attention is split by heads (the fused qkv projection by columns, the output projection by rows):

    f(x):  forward identity,    backward all-reduce    (copy_to_tensor_region: the block's input, replicated)
    g(y):  forward all-reduce,  backward identity      (reduce_from_tensor_region: the partial sums of B's rows)

    column_linear(x) = x @ A_t + a_t          (no communication; output sharded by columns)
    row_linear(y_t)  = g(y_t @ B_t) + b       (the bias once, after the sum)

so a block costs two all-reduces forward (one g after attention, one after the MLP) and two backward (the f at the
input of each). The token embedding is split by vocabulary rows (Megatron's VocabParallelEmbedding) and so is the
tied LM head (its `parallel_output=False` form):

    vocab_parallel_embed(ids) = g(rows of MY vocabulary range, zeros elsewhere)     (one all-reduce forward)
    logits = gather_from_tensor_region(f(h) @ MY rows^T)                             (all-gather forward; f's
                                                                                      all-reduce backward)

or, Megatron's default `parallel_output=True`, the head's logits stay split (`VocabParallelLogits`) and the loss is
`vocab_parallel_cross_entropy`: a max and two sums over the ranks of [tokens] values, never the [tokens, V] logits.

With sequence parallelism (`gather_sequence`, `scatter_sequence_sum`) each f becomes an all-gather of the
sequence and each g a reduce-scatter: the same bytes, the LayerNorms and dropout on 1/T of the tokens.

With `axis=None` every function here is the plain single-device computation, so one model serves both:
jaxpar.strategies.tensor sets the axis on the modules it shards.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.comm import collectives
from jaxpar.precision import add_wide, take_wide
from jaxpar.mesh import TENSOR  # noqa: F401  (the axis these functions are called with)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tensor_region(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's f: the identity forward; the backward all-reduces the gradient over `axis` (every rank's slice
    of the next layer contributes to the input's gradient)."""
    return x


def _f_fwd(x, axis):
    return x, None


def _f_bwd(axis, _, g):
    return (lax.psum(g, axis),)


copy_to_tensor_region.defvjp(_f_fwd, _f_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tensor_region(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's g: all-reduce the partial sums forward; the backward is the identity (the output's gradient is
    already the same on every rank)."""
    return lax.psum(x, axis)


def _g_fwd(x, axis):
    return lax.psum(x, axis), None


def _g_bwd(axis, _, g):
    return (g,)


reduce_from_tensor_region.defvjp(_g_fwd, _g_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_from_tensor_region(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's gather_from_tensor_model_parallel_region: the ranks' slices of the last dimension all-gathered
    (rank order) forward; the backward keeps this rank's slice of the gradient (every rank computed the same loss
    from the gathered whole, so nothing is summed)."""
    return lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)


def _gather_fwd(x, axis):
    return gather_from_tensor_region(x, axis), None


def _gather_bwd(axis, _, g):
    n = g.shape[-1] // lax.psum(1, axis)
    return (lax.dynamic_slice_in_dim(g, lax.axis_index(axis) * n, n, axis=g.ndim - 1),)


gather_from_tensor_region.defvjp(_gather_fwd, _gather_bwd)


# -- sequence parallelism (Korthikanti et al. 2022; Megatron-LM's --sequence-parallel): between the tensor-parallel
# regions the residual stream is split over the ranks along the sequence; LayerNorms, dropout and the residual adds
# run on a rank's tokens. Megatron's g_bar (before a column split) and its conjugate (after a row split):

def gather_sequence(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """The ranks' sequence slices all-gathered along `dim` forward; its transpose, the backward, reduce-scatters
    (each rank's partial input gradient summed, this rank's tokens kept): Megatron's
    gather_from_sequence_parallel_region."""
    return collectives.all_gather(x, axis, axis=dim, tiled=True)


def scatter_sequence_sum(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """The ranks' partial sums reduce-scattered along `dim` (this rank's tokens of the sum) forward, all-gathered
    backward: Megatron's reduce_scatter_to_sequence_parallel_region, in place of g's all-reduce."""
    return collectives.reduce_scatter(x, axis, dim)


def my_slice(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """This rank's part of `dim` (of T equal parts): a tensor every rank holds whole, cut to its tokens."""
    n = x.shape[dim] // lax.psum(1, axis)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * n, n, axis=dim)


def vocab_parallel_embed(table_local: jax.Array, ids: jax.Array, axis: str, sequence_dim: int | None = None):
    """Megatron's VocabParallelEmbedding: this rank holds rows [t V/T, (t+1) V/T) of the table; ids outside its
    range look up zeros, and g sums the ranks' lookups (exactly one is not zero); with `sequence_dim` the sum is
    reduce-scattered along it (sequence parallelism: this rank's tokens). Ids index as nnx.Embed's do on the whole
    table: -V..-1 from the end, and NaN for an id outside the vocabulary, on every rank (zeros would train on)."""
    rows = table_local.shape[0]
    vocab = rows * lax.psum(1, axis)
    ids = jnp.where(ids < 0, ids + vocab, ids)
    local = ids - lax.axis_index(axis) * rows
    inside = (local >= 0) & (local < rows)
    out = take_wide(table_local, jnp.where(inside, local, 0))  # 16-bit: the gradient's scatter-add in float32
    outside = ((ids < 0) | (ids >= vocab))[..., None]
    out = jnp.where(inside[..., None], out, jnp.where(outside, jnp.nan, 0.0).astype(out.dtype))
    return reduce_from_tensor_region(out, axis) if sequence_dim is None else scatter_sequence_sum(out, axis,
                                                                                                   sequence_dim)


# -- the loss on vocabulary-split logits (Megatron's parallel_output=True and vocab_parallel_cross_entropy) --------

@jax.tree_util.register_pytree_node_class
class VocabParallelLogits:
    """Logits split over the ranks of `axis` by vocabulary: `local` [..., V/T] holds this rank's columns
    [t V/T, (t+1) V/T). What the tied head returns when the loss takes it (jaxpar.losses.cross_entropy does);
    ``gather()`` gives the whole [..., V] (Megatron's parallel_output=False)."""

    def __init__(self, local: jax.Array, axis: str):
        self.local, self.axis = local, axis

    def tree_flatten(self):
        return (self.local,), self.axis

    @classmethod
    def tree_unflatten(cls, axis, children):
        return cls(children[0], axis)

    def gather(self) -> jax.Array:
        return gather_from_tensor_region(self.local, self.axis)

    def __repr__(self) -> str:
        return f"VocabParallelLogits({getattr(self.local, 'shape', self.local)}, axis={self.axis!r})"


def _xent_forward(logits_local, target, axis, label_smoothing=0.0):
    logits = logits_local.astype(jnp.float32)
    v = logits.shape[-1]
    top = lax.pmax(jnp.max(logits, axis=-1), axis)  # the global max, for a stable exp
    shifted = logits - top[..., None]
    mine = target - lax.axis_index(axis) * v  # the target's column in this rank's slice
    inside = (mine >= 0) & (mine < v)
    picked = jnp.take_along_axis(shifted, jnp.where(inside, mine, 0)[..., None], axis=-1)[..., 0]
    picked = lax.psum(jnp.where(inside, picked, 0.0), axis)  # exactly one rank holds the target's logit
    exp = jnp.exp(shifted)
    total = lax.psum(jnp.sum(exp, axis=-1), axis)
    loss = jnp.log(total) - picked
    if label_smoothing:  # torch's: (1 - e) nll + e x the mean over all V classes of -log p
        classes = v * lax.psum(1, axis)
        mean_logp = lax.psum(jnp.sum(shifted, axis=-1), axis) / classes - jnp.log(total)
        loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_logp
    return loss, (exp / total[..., None], jnp.where(inside, mine, -1))


def vocab_parallel_cross_entropy(logits_local: jax.Array, target: jax.Array, axis: str,
                                 label_smoothing: float = 0.0) -> jax.Array:
    """Megatron's vocab_parallel_cross_entropy: the per-position softmax cross-entropy (float32) of logits split by
    vocabulary over `axis` (`logits_local` [..., V/T], this rank's columns) against integer targets [...] over the
    whole vocabulary, with torch's `label_smoothing`. Forward: an all-reduce max and two all-reduce sums of
    [...]-shaped values (three with smoothing); backward, local: this rank's columns of softmax - (1 - e)
    one_hot(target) - e / V."""
    return _xent(logits_local, target, axis, jnp.dtype(logits_local.dtype), float(label_smoothing))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _xent(logits_local, target, axis, dtype, label_smoothing):
    return _xent_forward(logits_local, target, axis, label_smoothing)[0]


def _xent_fwd(logits_local, target, axis, dtype, label_smoothing):
    # (loss, (softmax, the target's local column or -1))
    return _xent_forward(logits_local, target, axis, label_smoothing)


def _xent_bwd(axis, dtype, label_smoothing, residuals, g):
    softmax, mine = residuals
    onehot = jnp.arange(softmax.shape[-1]) == mine[..., None]  # mine is -1 where another rank holds the target
    grad = softmax - (1.0 - label_smoothing) * onehot
    if label_smoothing:
        grad = grad - label_smoothing / (softmax.shape[-1] * lax.psum(1, axis))
    return (grad * g[..., None]).astype(dtype), None


_xent.defvjp(_xent_fwd, _xent_bwd)


def vocab_parallel_argmax(logits_local: jax.Array, axis: str) -> jax.Array:
    """jnp.argmax over the whole vocabulary of logits split over `axis` (the first index on ties, and the first NaN
    where a row has one, as jnp.argmax): an all-reduce max of the values (the cross-entropy's own, which XLA then
    shares) and an all-reduce min of the indices that reach it, a rank's NaN ranked before any value (an all-reduce
    max may drop a NaN: XLA:CPU's does)."""
    logits_local = lax.stop_gradient(logits_local)  # an index: nothing to differentiate (pmax has no derivative)
    v = logits_local.shape[-1]
    total = v * lax.axis_size(axis)
    best = jnp.max(logits_local, axis=-1)  # NaN where this rank's part of the row has one
    index = jnp.argmax(logits_local, axis=-1).astype(jnp.int32) + lax.axis_index(axis) * v  # its first NaN if any
    ranked = jnp.where(jnp.isnan(best), index, jnp.where(best == lax.pmax(best, axis), index + total,
                                                         jnp.iinfo(jnp.int32).max))
    found = lax.pmin(ranked, axis)
    return jnp.where(found >= total, found - total, found)


def f(x: jax.Array, axis: str | None) -> jax.Array:
    """copy_to_tensor_region, or the identity when there is no tensor axis."""
    return x if axis is None else copy_to_tensor_region(x, axis)


def g(x: jax.Array, axis: str | None) -> jax.Array:
    """reduce_from_tensor_region, or the identity when there is no tensor axis."""
    return x if axis is None else reduce_from_tensor_region(x, axis)


def column_linear(linear, x: jax.Array, skip_bias_add: bool = False):
    """``x @ kernel + bias`` of an nnx.Linear whose kernel [in, out/T] and bias [out/T] hold this rank's columns.
    `skip_bias_add` (Megatron's ColumnParallelLinear flag, for its fused bias-GELU): ``(x @ kernel, bias)``, the
    bias (None without one) in the product's dtype, left for the caller to add."""
    y = jnp.dot(x, linear.kernel[...].astype(x.dtype))
    bias = None if linear.bias is None else linear.bias[...].astype(y.dtype)
    if skip_bias_add:
        return y, bias
    return y if bias is None else add_wide(y, bias)


def row_linear(linear, x: jax.Array, axis: str | None, sequence_dim: int | None = None) -> jax.Array:
    """``g(x_t @ kernel_t) + bias`` of an nnx.Linear whose kernel [in/T, out] holds this rank's rows: the partial
    products are summed over `axis`, then the (replicated) bias is added once. With `sequence_dim` (sequence
    parallelism) the sum is reduce-scattered along it instead: this rank's tokens."""
    y = jnp.dot(x, linear.kernel[...].astype(x.dtype))
    y = g(y, axis) if sequence_dim is None else scatter_sequence_sum(y, axis, sequence_dim)
    return y if linear.bias is None else add_wide(y, linear.bias[...].astype(y.dtype))


def rank(axis: str | None) -> jax.Array | int:
    """This device's index on `axis` (0 without one)."""
    return 0 if axis is None else lax.axis_index(axis)


def split_dropout(drop, x_local: jax.Array, axis: str | None, dim: int, *, rngs=None) -> jax.Array:
    """`drop` (an nnx.Dropout) on this rank's slice `x_local` of a tensor split along `dim` over the ranks of
    `axis`: one mask for the whole tensor, drawn from the same key on every rank (the unsplit model's draw, its
    `broadcast_dims` included), this rank's slice of it kept, so the numbers equal the single-device model's.
    Calling `drop(x_local)` inside a split region instead draws the same slice-shaped mask on every rank (correlated
    across ranks; the split check refuses it). Megatron forks the RNG per rank instead (independent masks, other
    numbers than unsplit). `rngs`: as nnx.Dropout's call takes it, when the module holds none. Without an axis:
    drop(x_local)."""
    if axis is None:
        return drop(x_local, rngs=rngs)
    if drop.rate == 0.0 or drop.deterministic:
        return x_local
    if drop.rate == 1.0:  # as nnx.Dropout: no NaN gradients
        return jnp.zeros_like(x_local)
    source = rngs if rngs is not None else drop.rngs
    if source is None:
        raise ValueError("split_dropout: the nnx.Dropout holds no rngs and none were passed; build it with "
                         "nnx.Dropout(rate, rngs=rngs) or pass rngs= as to its call.")
    key = source if isinstance(source, jax.Array) else \
        source[drop.rng_collection]() if hasattr(source, "__getitem__") else source()
    dim = dim % x_local.ndim
    keep, n = 1.0 - drop.rate, x_local.shape[dim]
    whole = list(x_local.shape)
    whole[dim] = n * lax.axis_size(axis)
    for d in drop.broadcast_dims:
        whole[d] = 1
    mask = jax.random.bernoulli(key, p=keep, shape=tuple(whole))
    if whole[dim] > 1:
        mask = lax.dynamic_slice_in_dim(mask, rank(axis) * n, n, dim)
    return lax.select(jnp.broadcast_to(mask, x_local.shape), x_local / keep, jnp.zeros_like(x_local))
