"""All-reduce algorithms written with `lax.ppermute`, each with a numpy twin (`*_ref`) to test against.

Every function runs inside `jax.shard_map` (or `jax.pmap`) over the named axis `axis_name` and takes ONE array,
this device's `x`; it returns the sum (op="sum") or mean (op="mean") of `x` over the axis, on every device,
bit-identical across devices (so replicas that apply it stay in lockstep). Roughly:

    ring_all_reduce              reduce-scatter then all-gather of N chunks: 2(N-1) steps of S/N bytes (optimal)
    reduce_broadcast_all_reduce  everybody -> root, root sums, root -> everybody: the root moves (N-1)S each way
    all_to_all_all_reduce        everybody -> everybody, each sums locally: (N-1)S per device
    psum_all_reduce              lax.psum: XLA's own all-reduce, the baseline

The twins take the per-device inputs stacked as `xs[N, *shape]` and return the per-device outputs stacked the
same way, adding in the same order as the device code, so float32 and integer sums match bit for bit (a mean may
differ in the last place: XLA divides by N as a multiply by 1/N). Booleans are counted, as lax.psum counts them.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.types import PyTree

OPS = ("sum", "mean")
_WIDENED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not an all-reduce op; use 'sum' or 'mean'.")


def _summable(x):
    """`x`, booleans as int32: lax.psum counts them (bool + bool would be a logical OR), and so do these."""
    return x.astype(np.int32) if x.dtype == np.bool_ else x


def _finish(total: jax.Array, n: int, op: str) -> jax.Array:
    """The sum, or the mean with lax.pmean's typing (an integer sum divided by N is float32)."""
    return total / n if op == "mean" else total


def _send(x: jax.Array, axis_name, pairs: list[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute` along `pairs` (source, target); devices that are no target get zeros."""
    if x.dtype in _WIDENED:  # XLA:CPU widens 16-bit float collectives to f32; moving the bits keeps 2 bytes
        moved = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), axis_name, pairs)
        return lax.bitcast_convert_type(moved, x.dtype)
    return lax.ppermute(x, axis_name, pairs)


def _shift(x: jax.Array, axis_name, n: int, by: int = 1) -> jax.Array:
    """Every device i sends `x` to device (i + by) mod n: one collective-permute, every link busy."""
    return _send(x, axis_name, [(j, (j + by) % n) for j in range(n)])


def _per_device(axis_name, n: int, fn: Callable[..., jax.Array], *operands: jax.Array) -> jax.Array:
    """fn(r, *operands) with r = this device's index as a Python int (lax.switch: each device runs its branch).

    Positions that depend on the device become static slices: one pass over the data, no dynamic indexing.
    """
    return lax.switch(lax.axis_index(axis_name), [functools.partial(fn, r) for r in range(n)], *operands)


def ring_all_reduce(x: jax.Array, axis_name, op: str = "sum") -> jax.Array:
    """Reduce-scatter then all-gather around the ring 0 -> 1 -> ... -> N-1 -> 0, in 2(N-1) ppermutes of S/N.

    `x` is flattened and zero-padded to N chunks of c = ceil(size / N) elements. No step touches the whole
    buffer: each step reads one chunk with a dynamic slice; the received chunks are put in order (and the
    padding dropped) by one concatenate at the end, static on each device (measured on 8 CPU devices: faster
    than rolling the buffer by axis_index, a gather, or dynamic-update-slices into a buffer).
    """
    _check_op(op)
    x = _summable(x)
    n = lax.axis_size(axis_name)
    if n == 1 or x.size == 0:
        return _finish(x, n, op)
    i = lax.axis_index(axis_name)
    size, c = x.size, -(-x.size // n)
    flat = jnp.pad(x.reshape(-1), (0, n * c - size))

    def chunk(j):
        return lax.dynamic_slice_in_dim(flat, j * c, c)

    acc = chunk(i)
    for k in range(n - 1):  # reduce-scatter
        # why: pass my running sum of chunk (i-k) on, and add my own copy of the chunk (i-k-1) coming in
        acc = _shift(acc, axis_name, n) + chunk((i - k - 1) % n)
    got = [acc]  # the complete sum of chunk (i+1) mod N
    for k in range(n - 1):  # all-gather
        # why: forward the finished chunk I got last; chunk (i-k) arrives
        got.append(_shift(got[-1], axis_name, n))

    def in_order(r, *got):  # on device r, got[m] is chunk (r+1-m) mod N
        return jnp.concatenate([got[(r + 1 - j) % n][: size - j * c] for j in range(n) if j * c < size])

    return _finish(_per_device(axis_name, n, in_order, *got).reshape(x.shape), n, op)


def reduce_broadcast_all_reduce(x: jax.Array, axis_name, op: str = "sum", root: int = 0) -> jax.Array:
    """Gather to `root` in N-1 ppermutes (one sender each), root sums, then root sends to each device in turn.

    Linear, not a tree: every message goes through the root's one link, so the root receives and sends
    (N-1) x S while the others move S each way; that bottleneck is the point of this algorithm.
    """
    _check_op(op)
    x = _summable(x)
    n = lax.axis_size(axis_name)
    if not 0 <= root < n:
        raise ValueError(f"root={root} must be a device index on axis {axis_name!r} of size {n}; use 0..{n - 1}.")
    if n == 1:
        return _finish(x, n, op)
    total = x
    for k in range(1, n):
        # why: device root+k sends its x to the root, which adds it (the others add the zeros they get)
        total = total + _send(x, axis_name, [((root + k) % n, root)])
    # why: the root sends its total to device root+k, one device per step
    sent = [_send(total, axis_name, [(root, (root + k) % n)]) for k in range(1, n)]

    def keep(r, total, *sent):  # the root keeps its total, device root+k what the root sent it
        return total if r == root else sent[(r - root) % n - 1]

    return _finish(_per_device(axis_name, n, keep, total, *sent), n, op)


def all_to_all_all_reduce(x: jax.Array, axis_name, op: str = "sum") -> jax.Array:
    """Every device sends its whole `x` to every other (N-1 shifts) and sums all N copies itself.

    The copies are summed in device order 0..N-1 (not arrival order) so every device gets the same bits;
    all N copies are held at once: N x S memory per device.
    """
    _check_op(op)
    x = _summable(x)
    n = lax.axis_size(axis_name)
    if n == 1:
        return _finish(x, n, op)
    # why: shift by k brings me the x of device i-k
    got = [x] + [_shift(x, axis_name, n, k) for k in range(1, n)]

    def in_device_order(r, *got):  # on device r, got[k] is device (r-k)'s x
        total = got[r]
        for j in range(1, n):
            total = total + got[(r - j) % n]
        return total

    return _finish(_per_device(axis_name, n, in_device_order, *got), n, op)


def psum_all_reduce(x: jax.Array, axis_name, op: str = "sum") -> jax.Array:
    """XLA's all-reduce (lax.psum / lax.pmean): the baseline every other algorithm must match."""
    _check_op(op)
    return lax.pmean(x, axis_name) if op == "mean" else lax.psum(x, axis_name)


ALGORITHMS: dict[str, Callable[..., jax.Array]] = {
    "psum": psum_all_reduce,
    "ring": ring_all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
    "all_to_all": all_to_all_all_reduce,
}


def all_reduce(x: jax.Array, axis_name, algorithm: str = "psum", op: str = "sum", comm_dtype=None) -> jax.Array:
    """`x` reduced over `axis_name` by `algorithm` (a key of ALGORITHMS).

    `comm_dtype` (e.g. jnp.bfloat16) follows torch's bf16_compress_hook: cast to `comm_dtype`, divide by N
    first for op="mean", all-reduce, cast back to x.dtype. Where the additions happen is the algorithm's: the
    hand-written ones (ring, ...) and gloo across processes add in `comm_dtype` hop by hop; XLA's in-process psum
    adds in float32 and rounds once (a QA run: [1, 2^-8, 2^-8, 2^-8] summed to 1.015625 by psum, 1.0 by ring).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not known; use one of {', '.join(ALGORITHMS)}.")
    _check_op(op)
    fn = ALGORITHMS[algorithm]
    if comm_dtype is None:
        return fn(x, axis_name, op)
    sent = x.astype(comm_dtype)
    if op == "mean":
        sent = sent / lax.axis_size(axis_name)
    return fn(sent, axis_name, "sum").astype(x.dtype)


def tree_all_reduce(tree: PyTree, axis_name, algorithm: str = "psum", op: str = "sum", comm_dtype=None) -> PyTree:
    """`all_reduce` on every leaf: one collective (or one ppermute schedule) per leaf; see buckets.py to batch."""
    return jax.tree.map(lambda a: all_reduce(a, axis_name, algorithm, op, comm_dtype), tree)


# ---- reduce-scatter, and the all-gather whose transpose it is ------------------------------------------------

def native_reduce_scatter_is_safe(processes: int | None = None, backend: str | None = None,
                                  cpu_collectives: str | None = None) -> bool:
    """False where XLA's own reduce-scatter is not to be trusted: XLA:CPU across processes over gloo (this
    run's, unless given). There (jaxlib 0.10.2) a reduce-scatter, gloo's ReduceScatterHalvingDoubling,
    intermittently returns a wrong sum with no error: ZeRO-3 on GPT across 2 processes x 2 CPU devices got a
    wrong gradient leaf in most 4-step runs, while all-reduce, all-gather and collective-permute stayed exact.
    In one process, on GPUs, and over MPI it is XLA's."""
    processes = jax.process_count() if processes is None else processes
    backend = jax.default_backend() if backend is None else backend
    cpu_collectives = cpu_collectives or jax.config.jax_cpu_collectives_implementation
    return not (processes > 1 and backend == "cpu" and cpu_collectives == "gloo")


def ring_reduce_scatter(x: jax.Array, axis_name, dim: int = 0) -> jax.Array:
    """The reduce-scatter half of the ring over `lax.ppermute`: `x` summed over `axis_name`, device i keeping
    the i-th of N equal parts of `dim`, in N-1 steps of one part each (a reduce-scatter's bytes)."""
    n = lax.axis_size(axis_name)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of {x.shape} does not split into {n} equal parts; pad it to a multiple.")
    if n == 1:
        return x
    i, c = lax.axis_index(axis_name), x.shape[dim] // n

    def part(j):
        return lax.dynamic_slice_in_dim(x, j * c, c, axis=dim)

    acc = part((i - 1) % n)
    for k in range(n - 1):  # why: pass my running sum of part (i-k-1) on, and add my own part (i-k-2) coming in
        acc = _shift(acc, axis_name, n) + part((i - k - 2) % n)
    return acc  # after N-1 steps: the complete sum of part i


def reduce_scatter(x: jax.Array, axis_name, dim: int = 0) -> jax.Array:
    """`lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`, or `ring_reduce_scatter` where
    XLA's is unsafe (`native_reduce_scatter_is_safe`). Every reduce-scatter in jaxpar goes through here. An empty
    dimension (a zero-size parameter in a bucket of its own) has nothing to sum: each device keeps its empty slice
    (XLA refuses a reduce-scatter of a zero-length dimension)."""
    if x.shape[dim] == 0:
        return x
    if native_reduce_scatter_is_safe():
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
    return ring_reduce_scatter(x, axis_name, dim)


def all_gather(x: jax.Array, axis_name, *, axis: int = 0, tiled: bool = False) -> jax.Array:
    """`lax.all_gather`, whose transpose (the backward) is `reduce_scatter` rather than XLA's own where that is
    unsafe; elsewhere lax.all_gather itself."""
    if native_reduce_scatter_is_safe():
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    return _all_gather_rs(x, axis_name, axis, tiled)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather_rs(x, axis_name, axis, tiled):
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def _all_gather_rs_fwd(x, axis_name, axis, tiled):
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled), None


def _all_gather_rs_bwd(axis_name, axis, tiled, _, ct):
    out = ring_reduce_scatter(ct, axis_name, axis)
    return (out if tiled else out.squeeze(axis),)


_all_gather_rs.defvjp(_all_gather_rs_fwd, _all_gather_rs_bwd)


# ---- numpy twins: xs[N, *shape] (device i's input is xs[i]) -> the per-device outputs, stacked ----------------

def _finish_ref(total: np.ndarray, n: int, op: str) -> np.ndarray:
    _check_op(op)
    if op == "sum":
        return total
    if np.issubdtype(total.dtype, np.integer):
        return (total.astype(np.float32) / np.float32(n)).astype(np.float32)
    return (total / np.asarray(n, total.dtype)).astype(total.dtype)


def ring_all_reduce_ref(xs: np.ndarray, op: str = "sum") -> np.ndarray:
    xs = _summable(np.asarray(xs))
    n, shape, size = len(xs), xs.shape[1:], int(np.prod(xs.shape[1:], dtype=int))
    if n == 1 or size == 0:
        return _finish_ref(xs.copy(), n, op)
    c = -(-size // n)
    buf = np.zeros((n, n, c), xs.dtype)  # buf[device, chunk]
    buf.reshape(n, n * c)[:, :size] = xs.reshape(n, size)
    acc = [buf[i, i].copy() for i in range(n)]
    for k in range(n - 1):
        acc = [acc[(i - 1) % n] + buf[i, (i - k - 1) % n] for i in range(n)]
    for i in range(n):
        buf[i, (i + 1) % n] = acc[i]
    for k in range(n - 1):
        acc = [acc[(i - 1) % n] for i in range(n)]
        for i in range(n):
            buf[i, (i - k) % n] = acc[i]
    return _finish_ref(buf.reshape(n, n * c)[:, :size].reshape(n, *shape), n, op)


def reduce_broadcast_all_reduce_ref(xs: np.ndarray, op: str = "sum", root: int = 0) -> np.ndarray:
    xs = _summable(np.asarray(xs))
    n = len(xs)
    total = xs[root].copy()
    for k in range(1, n):
        total = total + xs[(root + k) % n]
    return _finish_ref(np.stack([total] * n), n, op)


def all_to_all_all_reduce_ref(xs: np.ndarray, op: str = "sum") -> np.ndarray:
    xs = _summable(np.asarray(xs))
    total = xs[0].copy()
    for j in range(1, len(xs)):
        total = total + xs[j]
    return _finish_ref(np.stack([total] * len(xs)), len(xs), op)


def psum_all_reduce_ref(xs: np.ndarray, op: str = "sum") -> np.ndarray:
    """XLA does not promise an order of additions: compare floats with a tolerance."""
    xs = _summable(np.asarray(xs))
    return _finish_ref(np.stack([xs.sum(0, dtype=xs.dtype)] * len(xs)), len(xs), op)


REFERENCES: dict[str, Callable[..., np.ndarray]] = {
    "psum": psum_all_reduce_ref,
    "ring": ring_all_reduce_ref,
    "reduce_broadcast": reduce_broadcast_all_reduce_ref,
    "all_to_all": all_to_all_all_reduce_ref,
}
