"""torch DistributedDataParallel: replicas on the DATA mesh, the global batch sharded, gradients reduced by bucket.

One step, on every device at once (shard_map, or pmap: the same body, the same numbers):

    loss_sum, grads = grad(sum_i w_i * CE_i over MY rows)      # dropout keyed per sample: split-independent
    grads = all_reduce(bucket) for bucket in plan              # from inside the backward when overlap is on
    grads = grads / psum(count)                                # gradient of the GLOBAL mean loss
    state = apply_updates(tx, state, grads)                    # the same update on every replica

Gradient accumulation K (torch's no_sync): each device splits its rows into K micro-batches; micro-steps 1..K-1
only accumulate local gradients, the K-th reduces (its gradients + the accumulated ones) once, so K micro-steps
equal one reference step on the whole global batch. bf16 communication (torch's bf16 compress hook) casts each
bucket buffer to bf16 for the collective and back. A batch the devices do not divide is padded with w = 0 rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.comm import cost as comm_cost
from jaxpar.comm import overlap as ddp_overlap
from jaxpar.comm.buckets import BucketPlan, plan_buckets
from jaxpar.comm.collectives import ALGORITHMS, all_reduce
from jaxpar.config import Config
from jaxpar.mesh import DATA, make_mesh
from jaxpar.step import TrainState, apply_updates, loss_terms, metrics_of
from jaxpar.types import Batch, Params

SPMD = ("shard_map", "pmap")
COMM_DTYPES = {None: None, "fp32": None, "bf16": jnp.bfloat16}


def make_reduce(algorithm: str, comm_dtype=None, axis_name: str = DATA) -> ddp_overlap.Reduce:
    """flat bucket buffer -> its sum over `axis_name` by `algorithm`, sent as `comm_dtype` (None: as is)."""
    return lambda flat: all_reduce(flat, axis_name, algorithm, "sum", comm_dtype)


def bucket_plan(params: Params, bucket_cap_mb: float, order: Sequence[int] | None = None) -> BucketPlan:
    """torch's buckets over the leaves of `params`, first bucket = last layers (reduced first).

    `order` is the forward order of the leaves (ddp_overlap.forward_leaf_order); None: flatten order.
    `bucket_cap_mb` 0 puts one leaf in each bucket.
    """
    return plan_buckets(params, bucket_cap_mb, order=order)


def ddp_body(graphdef, tx: optax.GradientTransformation, plan, reduce: ddp_overlap.Reduce, *, overlap: bool = True,
             grad_accum: int = 1, compute_dtype=None, axis_name: str = DATA):
    """The per-device step `(state, local_batch) -> (state, metrics)` run under shard_map or pmap.

    `plan` is a bucket plan, or a function of the params giving one (called at trace time).
    """
    K = grad_accum

    def body(state: TrainState, batch: Batch):
        leaves, treedef = jax.tree.flatten(state.params)
        buckets = plan(state.params) if callable(plan) else plan

        def local_loss(ps, mb, acc=None, hooked=False):
            if hooked:
                ps = ddp_overlap.hook_buckets(ps, buckets, reduce, acc)
            return loss_terms(graphdef, treedef.unflatten(ps), mb, state.key, state.step,
                              compute_dtype=compute_dtype)

        grad = jax.value_and_grad(local_loss, has_aux=True)
        rows = batch["y"].shape[0]
        if rows % K:
            raise ValueError(f"each device's {rows} rows must be divisible by grad_accum={K}; pad the global "
                             f"batch to a multiple of devices x grad_accum (DistributedDataParallel.put_batch does).")
        micro = jax.tree.map(lambda a: a.reshape(K, a.shape[0] // K, *a.shape[1:]), batch)
        zero_aux = {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "correct", "count")}
        acc, aux = None, zero_aux
        # no_sync micro-steps: local sums only. Unrolled: XLA:CPU runs convolutions in a loop ~5x slower
        for k in range(K - 1):
            (_, a), g = grad(leaves, jax.tree.map(lambda x: x[k], micro))
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
            aux = jax.tree.map(jnp.add, aux, a)
        last = jax.tree.map(lambda a: a[K - 1], micro)
        if overlap:
            (_, a), grads = grad(leaves, last, acc, True)
        else:
            (_, a), grads = grad(leaves, last)
            if acc is not None:
                grads = jax.tree.map(jnp.add, grads, acc)
            grads = ddp_overlap.reduce_after_backward(grads, buckets, reduce)
        aux = jax.tree.map(jnp.add, aux, a)
        # the metrics' sum (a 3-float psum), chained after the last bucket so it stays a collective of its own
        tail = ddp_overlap.zero_after(*[grads[i] for i in buckets[-1]])
        loss_sum, correct, count = jax.lax.psum(jnp.stack([aux["loss_sum"], aux["correct"], aux["count"]]) + tail,
                                                axis_name)
        grads = [g / count for g in grads]
        state = apply_updates(tx, state, treedef.unflatten(grads))
        return state, metrics_of({"loss_sum": loss_sum, "correct": correct, "count": count})

    return body


def make_ddp_step(graphdef, tx: optax.GradientTransformation, mesh: Mesh, *, allreduce: str = "psum",
                  bucket_cap_mb: float = 25.0, overlap: bool = True, grad_accum: int = 1,
                  grad_comm_dtype: str | None = None, spmd: str = "shard_map", compute_dtype=None,
                  plan: Sequence[Sequence[int]] | None = None, leaf_order: Sequence[int] | None = None,
                  compiler_options: dict | None = None):
    """Compiled DDP step `(placed_state, placed_batch) -> (placed_state, metrics)` on the 1-D DATA `mesh`.

    shard_map: state replicated (NamedSharding(mesh, P())), batch rows sharded over DATA (see `place_batch`).
    pmap: every leaf stacked over the local devices [n_local, ...], the batch as [n_local, rows, ...].
    `plan` (buckets of leaf indices) defaults to `bucket_plan(params, bucket_cap_mb, leaf_order)`, with the
    forward order taken from the model's `layers` when `leaf_order` is None. The state argument is donated.
    """
    check_options(allreduce=allreduce, spmd=spmd, grad_accum=grad_accum, grad_comm_dtype=grad_comm_dtype,
                  bucket_cap_mb=bucket_cap_mb)
    if plan is None:
        def plan(params):  # at trace time: plain Python data from the leaves' shapes
            order = leaf_order
            if order is None:
                order = ddp_overlap.forward_leaf_order(nnx.merge(graphdef, params))
            return bucket_plan(params, bucket_cap_mb, order)
    reduce = make_reduce(allreduce, COMM_DTYPES[grad_comm_dtype])
    body = ddp_body(graphdef, tx, plan, reduce, overlap=overlap, grad_accum=grad_accum, compute_dtype=compute_dtype)
    if spmd == "pmap":
        return jax.pmap(body, axis_name=DATA, devices=list(mesh.devices.flat), donate_argnums=0)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=(P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=0, compiler_options=compiler_options)


def check_options(*, allreduce: str, spmd: str, grad_accum: int, grad_comm_dtype, bucket_cap_mb: float) -> None:
    if allreduce not in ALGORITHMS:
        raise ValueError(f"allreduce={allreduce!r} is not known; use one of {', '.join(ALGORITHMS)}.")
    if spmd not in SPMD:
        raise ValueError(f"spmd={spmd!r} is not known; use one of {', '.join(SPMD)}.")
    if grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum} must be >= 1; use 1 for no accumulation.")
    if grad_comm_dtype not in COMM_DTYPES:
        raise ValueError(f"grad_comm_dtype={grad_comm_dtype!r} is not known; use bf16, fp32 or leave it out.")
    if not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be >= 0; use 0 for one leaf per bucket.")


# ---- placement: padding, sharding, replication ---------------------------------------------------------------

def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_batch(batch: Batch, rows: int) -> dict[str, np.ndarray]:
    """`batch` (host arrays) padded with zero rows to `rows`, with `w` = 1 on real rows and 0 on padding."""
    n = len(batch["y"])
    if rows < n:
        raise ValueError(f"rows={rows} must be >= the batch's {n} rows; pad to a larger size.")
    out = {k: np.asarray(v) for k, v in batch.items()}
    out["w"] = np.asarray(out.get("w", np.ones(n, np.float32)), np.float32)
    if rows == n:
        return out
    return {k: np.concatenate([v, np.zeros((rows - n, *v.shape[1:]), v.dtype)]) for k, v in out.items()}


def local_devices(mesh: Mesh) -> list:
    """This process's devices of `mesh`, in mesh order (the rows it feeds)."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _stacked(mesh: Mesh) -> NamedSharding:
    """pmap's layout: a leading axis over this process's devices."""
    return NamedSharding(Mesh(np.array(local_devices(mesh)), (DATA,)), P(DATA))


def place_batch(batch: dict[str, np.ndarray], mesh: Mesh, spmd: str = "shard_map"):
    """This process's (padded) rows onto its devices: a global array sharded over DATA, or pmap's stacking."""
    if spmd == "pmap":
        n = len(local_devices(mesh))
        return jax.device_put({k: v.reshape(n, -1, *v.shape[1:]) for k, v in batch.items()}, _stacked(mesh))
    sharding = NamedSharding(mesh, P(DATA))
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def replicate(state: TrainState, mesh: Mesh, spmd: str = "shard_map"):
    """The canonical state on every device (fresh buffers: the step donates them): replicated, or pmap-stacked.

    Every process passes the same state (same seed); each places it on its own devices of `mesh`.
    """
    if spmd == "pmap":
        n = len(local_devices(mesh))
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state), _stacked(mesh))
    sharding = NamedSharding(mesh, P())

    def one(a):
        a = jnp.array(a, copy=True)
        shards = [jax.device_put(a, d) for d in local_devices(mesh)]
        return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)

    return jax.tree.map(one, state)


def unreplicate(placed: Any, spmd: str = "shard_map") -> Any:
    """One replica (this process's first device), as a fresh single-device copy (the state is donated later)."""
    def one(a):
        x = a.addressable_data(0)
        return jnp.array(x[0] if spmd == "pmap" else x, copy=True)

    return jax.tree.map(one, placed)


@dataclass
class DistributedDataParallel:
    """torch DDP on a 1-D DATA mesh; `batch_size` (global) fixes every batch's padded shape (one compile)."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    mesh: Mesh | None = None
    allreduce: str = "psum"
    bucket_cap_mb: float = 25.0
    overlap: bool = True
    grad_accum: int = 1
    grad_comm_dtype: str | None = None
    spmd: str = "shard_map"
    compute_dtype: Any = None
    batch_size: int | None = None
    leaf_order: Sequence[int] | None = None  # forward order of the leaves (ddp_overlap.forward_leaf_order)
    name: str = "ddp"
    plan: BucketPlan | None = field(default=None, init=False)
    _step: Any = field(default=None, init=False, repr=False)
    _batch_spec: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        check_options(allreduce=self.allreduce, spmd=self.spmd, grad_accum=self.grad_accum,
                      grad_comm_dtype=self.grad_comm_dtype, bucket_cap_mb=self.bucket_cap_mb)
        self.mesh = self.mesh or make_mesh()
        n_local, nproc = len(local_devices(self.mesh)), jax.process_count()
        if n_local == 0 or (nproc > 1 and self.mesh.size != jax.device_count()):
            raise ValueError(f"the DDP mesh of {self.mesh.size} devices must span all {jax.device_count()} devices "
                             f"of the {nproc} processes; drop --num-devices when running several processes.")
        self.multiple = n_local * self.grad_accum  # rows per process must be a multiple of this
        self.share = None if self.batch_size is None else round_up(math.ceil(self.batch_size / nproc), self.multiple)

    def init(self, state: TrainState):
        if self.plan is None:
            self.plan = bucket_plan(state.params, self.bucket_cap_mb, self.leaf_order)
            self._step = make_ddp_step(
                self.graphdef, self.tx, self.mesh, allreduce=self.allreduce, bucket_cap_mb=self.bucket_cap_mb,
                overlap=self.overlap, grad_accum=self.grad_accum, grad_comm_dtype=self.grad_comm_dtype,
                spmd=self.spmd, compute_dtype=self.compute_dtype, plan=self.plan)
        return replicate(state, self.mesh, self.spmd)

    def put_batch(self, batch: Batch):
        rows = len(batch["y"])
        if self.share is not None and rows <= self.share:
            target = self.share
        elif jax.process_count() > 1:
            raise ValueError(f"this process's batch of {rows} rows must be at most its share {self.share} of "
                             f"batch_size={self.batch_size}; pass the global --batch-size to the strategy.")
        else:
            target = round_up(rows, self.multiple)
        return place_batch(pad_batch(batch, target), self.mesh, self.spmd)

    def step(self, placed, batch):
        if self._step is None:
            raise ValueError("DistributedDataParallel.step() before init(); call placed = ddp.init(state) first.")
        self._batch_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), batch)
        state, metrics = self._step(placed, batch)
        if self.spmd == "pmap":
            metrics = jax.tree.map(lambda m: m[0], metrics)
        return state, metrics

    def unplace(self, placed) -> TrainState:
        return unreplicate(placed, self.spmd)

    def describe(self) -> str:
        buckets = "?" if self.plan is None else len(self.plan)
        comm = self.grad_comm_dtype or "fp32"
        return (f"{DATA} mesh of {self.mesh.size} devices ({jax.process_count()} processes), {self.spmd}, "
                f"allreduce={self.allreduce}, {buckets} buckets (cap {self.bucket_cap_mb:g} MB), "
                f"overlap={'on' if self.overlap else 'off'}, grad_accum={self.grad_accum}, comm {comm}")

    def hlo(self, placed) -> str:
        """The compiled, scheduled HLO of the step on the last batch's shapes."""
        if self._batch_spec is None:
            raise ValueError("hlo() needs one step first (it compiles for the batch shape seen).")
        return self._step.lower(placed, self._batch_spec).compile().as_text()

    def report(self, placed) -> dict:
        """The bucket plan, the modelled traffic per step, and what the compiled step really sends."""
        n, comm_bytes = self.mesh.size, 2 if self.grad_comm_dtype == "bf16" else 4
        model = [comm_cost.comm_cost(self.allreduce, n, b.nbytes // 4 * comm_bytes, comm_bytes)
                 for b in self.plan.buckets] if self.plan else []
        out = {"devices": n, "processes": jax.process_count(), "allreduce": self.allreduce, "spmd": self.spmd,
               "overlap": self.overlap, "grad_accum": self.grad_accum,
               "grad_comm_dtype": self.grad_comm_dtype or "fp32",
               "bucket_plan": str(self.plan), "buckets": len(model),
               "model_steps_per_step": sum(c.steps for c in model),
               "model_bytes_sent_per_device": sum(c.sent_per_device for c in model)}
        if self._batch_spec is not None:
            text = self.hlo(placed)
            ops = comm_cost.hlo_collectives(text)
            out["hlo_collectives"] = {k: len({c.name for c in ops if c.kind == k}) for k in comm_cost.KINDS
                                      if any(c.kind == k for c in ops)}  # the metrics add one 12-byte psum
            out["hlo_bytes_sent_per_device"] = max(comm_cost.hlo_bytes_per_device(text, n))
        return out


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config) -> DistributedDataParallel:
    from jaxpar.precision import compute_dtype

    return DistributedDataParallel(
        nnx.graphdef(model), tx, make_mesh(cfg.num_devices), allreduce=cfg.allreduce,
        bucket_cap_mb=cfg.bucket_cap_mb, overlap=cfg.overlap, grad_accum=cfg.grad_accum,
        grad_comm_dtype=cfg.grad_comm_dtype, spmd=cfg.spmd, compute_dtype=compute_dtype(cfg.precision),
        batch_size=cfg.batch_size, leaf_order=ddp_overlap.forward_leaf_order(model))
