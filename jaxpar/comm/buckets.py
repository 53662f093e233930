"""Gradient buckets: which leaves are reduced together, computed once as plain data (torch DDP's assignment).

    plan = plan_buckets(params, bucket_cap_mb=25, order=forward_order)    # outside jit, printable
    grads = reduce_buckets(grads, plan, lambda flat: all_reduce(flat, DATA, "ring"))   # inside shard_map

torch's rule (Reducer::rebuild_buckets, i.e. the buckets DDP settles on after its first step): walk the leaves
in the order their gradients become ready -- the REVERSE of the forward order, last layer first -- adding each
leaf to the open bucket of its dtype; a bucket closes as soon as it holds >= its limit: `bucket_cap_mb`, and for
the first bucket of each dtype 1 MiB when the cap is left at its default (25 MiB; so the first all-reduce starts
early) or the cap itself when one is given (torch's BucketCapacityConfig, 2.4 and later). A leaf is never split:
the leaf that crosses the limit stays in its bucket, so a bucket can exceed the cap, and a leaf at least the
cap that opens a bucket is alone in it. bucket_cap_mb=0 gives one leaf per bucket. Buckets are listed in the
order they become ready (the position of their last leaf).

The forward order is NOT the flatten order of an nnx.State (alphabetical by module path: `classifier` before
`features`, a Linear's `bias` before its `kernel`); pass `order`, the leaf indices in forward order
(jaxpar.comm.overlap.forward_leaf_order: the model's `layers`, each layer's leaves as it defines them, as torch
registers a Linear's weight before its bias). Without it the flatten order is taken as the forward order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.types import PyTree

MiB = 1024 * 1024  # torch's bucket_cap_mb is in MiB
BUCKET_CAP_MB = 25.0  # torch DDP's bucket_cap_mb when left at None
FIRST_BUCKET_MB = 1.0  # torch's _DEFAULT_FIRST_BUCKET_BYTES: the first bucket's limit when the cap is the default
UNLIMITED = 2**63 - 1  # the byte limit of a cap of float("inf"): one bucket per dtype
Plan = Sequence[Sequence[int]]  # buckets of leaf indices: a BucketPlan, or any list of lists


class LeafInfo(NamedTuple):
    name: str  # from the tree path: "features.0.kernel"
    shape: tuple[int, ...]
    dtype: str  # numpy name, or "bytes" for a plan made from sizes
    nbytes: int


class Bucket(NamedTuple):
    leaves: tuple[int, ...]  # leaf indices (into jax.tree.leaves), in gradient-ready order
    dtype: str
    nbytes: int
    limit: int  # the byte limit it was filled to


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in reduction order. Iterating (and indexing) gives each bucket's leaf indices."""

    buckets: tuple[Bucket, ...]
    leaves: tuple[LeafInfo, ...]
    bucket_cap_bytes: int
    first_bucket_bytes: int

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (b.leaves for b in self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, k: int) -> tuple[int, ...]:
        return self.buckets[k].leaves

    def __str__(self) -> str:
        total = sum(b.nbytes for b in self.buckets)
        rows = [f"BucketPlan: {len(self)} buckets, {len(self.leaves)} leaves, {_mib(total)} "
                f"(cap {_mib(self.bucket_cap_bytes)}, first {_mib(self.first_bucket_bytes)}), in reduction order",
                f"{'bucket':>6}  {'dtype':<8} {'bytes':>10}  leaves"]
        for k, b in enumerate(self.buckets):
            names = ", ".join(self.leaves[i].name for i in b.leaves)
            rows.append(f"{k:>6}  {b.dtype:<8} {_mib(b.nbytes):>10}  {names}")
        return "\n".join(rows)


def _mib(nbytes: int) -> str:
    if nbytes >= UNLIMITED:
        return "unlimited"
    if nbytes >= MiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_infos(tree_or_sizes: PyTree | Sequence[int]) -> tuple[LeafInfo, ...]:
    """Name, shape, dtype and bytes of every leaf (flatten order); ints are taken as byte sizes."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree_or_sizes)
    out = []
    for i, (path, leaf) in enumerate(flat):
        names = [_key_name(k) for k in path]
        name = ".".join(names[:-1] if names[-1:] == ["value"] else names)  # nnx Variable: drop ".value"
        if len(path) <= 1 and all(isinstance(k, jax.tree_util.SequenceKey) for k in path):
            name = f"leaf{i}"  # a plain list of leaves
        if isinstance(leaf, (int, np.integer)):
            out.append(LeafInfo(name, (), "bytes", int(leaf)))
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            dtype = np.dtype(leaf.dtype)
            out.append(LeafInfo(name, tuple(leaf.shape), dtype.name, int(np.prod(leaf.shape)) * dtype.itemsize))
        else:
            raise ValueError(f"leaf {name}={leaf!r} must be an array (shape, dtype) or a byte count; "
                             f"pass the params pytree or a list of leaf sizes in bytes.")
    return tuple(out)


def plan_buckets(tree_or_sizes: PyTree | Sequence[int], bucket_cap_mb: float | None = None,
                 first_bucket_mb: float | None = None, order: Sequence[int] | None = None) -> BucketPlan:
    """torch DDP's buckets (see the module doc) for the leaves of a params pytree, or a list of byte sizes.

    `bucket_cap_mb` None: torch's default, 25 MiB with a 1 MiB first bucket; a cap given is the first bucket's
    limit too, unless `first_bucket_mb` says otherwise (the first limit is min(first, cap), so bucket_cap_mb=0
    puts every leaf alone; float("inf") makes one bucket per dtype). `order`: leaf indices in FORWARD order
    (default: flatten order); buckets fill in its reverse.
    """
    first_bucket_mb = (FIRST_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb) if first_bucket_mb is None \
        else first_bucket_mb
    bucket_cap_mb = BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    check_mib("bucket_cap_mb", bucket_cap_mb)
    check_mib("first_bucket_mb", first_bucket_mb)
    infos = leaf_infos(tree_or_sizes)
    n = len(infos)
    if order is not None and not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in order):
        raise ValueError(f"order={list(order)} must hold leaf indices (ints); pass the leaves' positions in the "
                         "forward order, or None for the flatten order.")
    order = list(range(n)) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order={order} must list each of the {n} leaf indices 0..{n - 1} once (forward order); "
                         f"build it from the model's layers or pass None for the flatten order.")
    cap, first = _bytes(bucket_cap_mb), _bytes(first_bucket_mb)
    first = min(first, cap)
    ready = order[::-1]  # gradients become ready last layer first
    position = {leaf: p for p, leaf in enumerate(ready)}
    pending: dict[str, list[int]] = {}
    limit: dict[str, int] = {}
    done: list[Bucket] = []
    filled: dict[str, int] = {}
    for leaf in ready:
        dt = infos[leaf].dtype
        pending.setdefault(dt, []).append(leaf)
        filled[dt] = filled.get(dt, 0) + infos[leaf].nbytes
        if filled[dt] >= limit.setdefault(dt, first):  # torch: close once at (or past) the limit
            done.append(Bucket(tuple(pending[dt]), dt, filled[dt], limit[dt]))
            pending[dt], filled[dt], limit[dt] = [], 0, cap
    done += [Bucket(tuple(b), dt, filled[dt], limit[dt]) for dt, b in pending.items() if b]
    done.sort(key=lambda b: position[b.leaves[-1]])  # the order buckets become ready
    return BucketPlan(tuple(done), infos, cap, first)


def cap_text(plan: BucketPlan | None, bucket_cap_mb: float | None) -> str:
    """"cap 25 MiB, first 1 MiB": the limits a plan was (or will be) filled to, for describe()."""
    if plan is not None:
        return f"cap {_mib(plan.bucket_cap_bytes)}, first {_mib(plan.first_bucket_bytes)}"
    if bucket_cap_mb is None:
        return f"cap {BUCKET_CAP_MB:g} MiB, first {FIRST_BUCKET_MB:g} MiB"
    return f"cap {bucket_cap_mb:g} MiB"


def check_mib(name: str, value) -> None:
    """ValueError unless `value` is None (torch's default) or a number of MiB >= 0 (inf: no limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
        raise ValueError(f"{name}={value!r} must be a number of MiB >= 0 (torch's rule); use 0 for one leaf per "
                         "bucket, float('inf') for one bucket, or leave it out for torch's default (25, the first "
                         "bucket 1).")


def _bytes(mib: float) -> int:
    return UNLIMITED if mib * MiB >= UNLIMITED else int(mib * MiB)


def check_plan(plan: Plan, n_leaves: int) -> None:
    """ValueError unless `plan` puts each of the `n_leaves` gradient leaves in exactly one bucket: a leaf left out
    would not be all-reduced, and the replicas would drift apart without a word (a QA finding)."""
    seen = [i for bucket in plan for i in bucket]
    bad = [i for i in seen if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n_leaves]
    if bad:
        raise ValueError(f"the bucket plan names {bad[0]!r}, not a leaf index 0..{n_leaves - 1}; plan on these "
                         "gradients (jaxpar.plan_buckets(params)).")
    twice = sorted({i for i in seen if seen.count(i) > 1})
    missing = sorted(set(range(n_leaves)) - set(seen))
    if twice or missing:
        what = f"leaves {missing} in no bucket" if missing else f"leaves {twice} in two buckets"
        raise ValueError(f"the bucket plan puts {what}; put each of the {n_leaves} gradient leaves in exactly one "
                         "bucket (jaxpar.plan_buckets(params) does).")


def flatten_bucket(leaves: Sequence[jax.Array]) -> jax.Array:
    """The leaves (one dtype) raveled into one 1-D buffer, in the given order."""
    dtypes = {jnp.dtype(a.dtype) for a in leaves}
    if len(dtypes) != 1:
        raise ValueError(f"a bucket's leaves must share one dtype, got {sorted(map(str, dtypes))}; "
                         f"plan with plan_buckets, which groups leaves by dtype.")
    if len(leaves) == 1:
        return jnp.ravel(leaves[0])
    return jnp.concatenate([jnp.ravel(a) for a in leaves])


def unflatten_bucket(buf: jax.Array, shapes: Sequence[Sequence[int]]) -> list[jax.Array]:
    """Inverse of flatten_bucket: consecutive slices of the 1-D `buf` reshaped to `shapes`."""
    sizes = [int(np.prod(s)) for s in shapes]
    if buf.ndim != 1 or buf.shape[0] != sum(sizes):
        raise ValueError(f"buf.shape={buf.shape} must be ({sum(sizes)},), the total size of shapes={list(shapes)}.")
    offsets = np.cumsum([0] + sizes)
    return [buf[o:o + k].reshape(s) for o, k, s in zip(offsets, sizes, shapes)]


def reduce_buckets(grads: PyTree, plan: Plan, reduce_fn: Callable[[jax.Array], jax.Array]) -> PyTree:
    """`grads` with each bucket reduced by ONE call of `reduce_fn` on its flat buffer (inside shard_map).

    `plan` indexes jax.tree.leaves(grads); leaves in no bucket are returned unreduced.
    """
    leaves, treedef = jax.tree.flatten(grads)
    if isinstance(plan, BucketPlan):
        shapes = [tuple(a.shape) for a in leaves]
        expected = [info.shape for info in plan.leaves]
        if len(plan.leaves) != len(leaves) or any(i.dtype != "bytes" and s != e
                                                  for i, s, e in zip(plan.leaves, shapes, expected)):
            raise ValueError(f"plan was made for {len(plan.leaves)} leaves of shapes {expected}, but grads has "
                             f"{len(leaves)} leaves of shapes {shapes}; plan_buckets on this params pytree.")
    out = list(leaves)
    for bucket in plan:
        bucket = list(bucket)
        if any(not 0 <= i < len(leaves) for i in bucket):
            raise ValueError(f"bucket {bucket} names a leaf outside 0..{len(leaves) - 1}; plan on these grads.")
        parts = [leaves[i] for i in bucket]
        reduced = reduce_fn(flatten_bucket(parts))
        for i, piece in zip(bucket, unflatten_bucket(reduced, [p.shape for p in parts])):
            out[i] = piece
    return treedef.unflatten(out)
