"""ZeRO stage 1 on a (data[, tensor]) mesh: the optimizer state partitioned over the D data replicas, as DeepSpeed
runs its PipelineEngine with ``"zero_optimization": {"stage": 1}`` and Megatron-LM its distributed optimizer
(``--use-distributed-optimizer``) under tensor and pipeline parallelism. Used by the pipeline (per stage, on the
stage's mesh) and by `tp` (on its whole mesh).

The leaves one device holds (under tensor parallelism: its tensor rank's slices) are one flat vector padded to D
(`jaxpar.comm.shards`, ZeRO's own plan); data replica r keeps element block r of every optimizer moment, so a
moment is a [T, D S] array, row t split over DATA. At the step's end each replica gets its block of the summed
gradient: by one reduce-scatter (Megatron's way, DeepSpeed's default ``reduce_scatter: true``; the pipeline sums
its tied weights' per-device gradients across stages first, as DeepSpeed's ReduceTiedGrads precedes ReduceGrads),
or taken from the whole gradient all-reduced (``--zero-reduce all_reduce``). Each replica updates its block with
the optimizer on the flat slice and the blocks are all-gathered into its weights again.
That equals the update without ZeRO only for elementwise optimizers, which `zero_optim.check` proves before
training.

    zero = zero1.of(mesh, device_leaves, axes)              # the plan over one device's leaves
    opt_state = zero.place(tx, params, opt_state)             # canonical (tensor order) -> flat, sharded
    block = zero.reduce_scatter(grads)                        # inside shard_map (or the whole grads below)
    params, opt_state = zero.local_update(tx, params, opt_state, None, grad_block=block / weight, ...)
    opt_state = zero.unplace(tx, params, opt_state)           # back, host arrays, for checkpoints
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.comm import shards as sh
from jaxpar.mesh import DATA, TENSOR
from jaxpar.pipeline.optimizer import mean_scale
from jaxpar.strategies import zero_optim


class StageZero(NamedTuple):
    """One stage's ZeRO-1 layout: the flat plan of one device's leaves over the D replicas, each leaf's tensor
    split axis (None: whole on every tensor rank), the tensor ranks T, and the stage's mesh."""

    plan: sh.ShardPlan
    axes: tuple[int | None, ...]
    tensor: int
    mesh: Any

    @property
    def spec(self) -> P:
        """A moment's [T, D S] layout: row t on tensor rank t, split over the data replicas."""
        return P(TENSOR if self.tensor > 1 else None, DATA)

    def _local(self, leaves: list, t: int) -> list:
        """Tensor rank t's slices of whole (tensor-ordered) leaves."""
        return [a if ax is None else np.split(a, self.tensor, axis=ax)[t] for a, ax in zip(leaves, self.axes)]

    def _whole(self, per_rank: list[list]) -> list:
        """The whole leaves from every tensor rank's slices (inverse of _local)."""
        return [per_rank[0][i] if ax is None else np.concatenate([r[i] for r in per_rank], axis=ax)
                for i, ax in enumerate(self.axes)]

    def place(self, tx, params_tree, opt_state) -> Any:
        """The stage's canonical optimizer state (whole leaves, tensor order) as the flat one: each moment one
        [T, D S] array placed by `spec`; shared scalars (a step count) replicated."""
        _, kinds, outer = zero_optim.layouts(tx, params_tree)
        leaves = jax.tree.flatten(opt_state, is_leaf=zero_optim._like(jax.tree.structure(params_tree)))[0]
        rep = NamedSharding(self.mesh, P())
        out = []
        for x, kind in zip(leaves, kinds):
            if not kind:
                out.append(jax.tree.map(lambda a: jax.device_put(jnp.array(a, copy=True), rep), x))
                continue
            whole = [np.asarray(a) for a in jax.tree.leaves(x)]
            flat = np.stack([sh.pack(self.plan, self._local(whole, t), xp=np).reshape(-1)
                             for t in range(self.tensor)])
            out.append(zero_optim.flat_tree(jax.make_array_from_callback(
                flat.shape, NamedSharding(self.mesh, self.spec), lambda idx, f=flat: f[idx])))
        return jax.tree.unflatten(outer, out)

    def unplace(self, tx, params_tree, opt_state) -> Any:
        """The stage's canonical optimizer state (host arrays, tensor order) from the flat one."""
        outer, kinds, _ = zero_optim.layouts(tx, params_tree)
        treedef = jax.tree.structure(params_tree)
        leaves = jax.tree.flatten(opt_state, is_leaf=zero_optim.is_flat)[0]
        out = []
        for x, kind in zip(leaves, kinds):
            if not kind:
                out.append(jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), x))
                continue
            flat = zero_optim.gather_to_host(x[zero_optim.KEY])
            per_rank = [sh.unpack(self.plan, row.reshape(self.plan.num_devices, -1)) for row in flat]
            out.append(jax.tree.unflatten(treedef, self._whole(per_rank)))
        return jax.tree.unflatten(outer, out)

    def opt_specs(self, tx, params_tree) -> Any:
        """The flat optimizer state's PartitionSpecs: each moment by `spec`, shared scalars replicated."""
        outer, kinds, leaves = zero_optim.flat_state_shapes(tx, params_tree, 7, jnp.float32)
        return jax.tree.unflatten(outer, [jax.tree.map(lambda _, k=kind: self.spec if k else P(), x)
                                          for x, kind in zip(leaves, kinds)])

    def reduce_scatter(self, grads: list) -> jax.Array:
        """Inside shard_map: this device's un-reduced gradient leaves summed over DATA, this replica keeping its
        block [S] of the flat vector: one reduce-scatter (Megatron's distributed optimizer, DeepSpeed's stage 1
        with ``reduce_scatter: true``) in place of the all-reduce."""
        return sh.reduce_scatter_group(sh.group_buffer(self.plan, 0, grads), DATA)

    def replicated_mask(self, dtype) -> jax.Array:
        """This replica's block [S] of 1.0 where an element belongs to a leaf every tensor rank holds whole (its
        squared norm is counted on tensor rank 0 only), 0.0 where to a tensor rank's own slice."""
        return sh.shard_of_values(self.plan, [0.0 if ax is not None else 1.0 for ax in self.axes], DATA, dtype)

    def local_update(self, tx, params: list, opt_state, grads: list | None, *, grad_block: jax.Array | None = None,
                     **extra) -> tuple[list, Any]:
        """Inside shard_map over the mesh: this replica's block of its flat weights updated with its block of
        `grads` (whole on every replica, already divided by the batch weight) or `grad_block` (the block itself,
        from `reduce_scatter`), then one all-gather over DATA; the weights (this device's leaves) and the flat
        state. `tx` takes optax extra args (the global norm)."""
        plan = self.plan
        _, kinds, _ = zero_optim.flat_state_shapes(tx, _as_tree(plan), 7, jnp.float32)

        def squeeze(state, out: bool):  # a moment's local [1, S] block <-> the [S] the optimizer sees
            parts, tree = jax.tree.flatten(state, is_leaf=zero_optim.is_flat)
            return jax.tree.unflatten(tree, [zero_optim.flat_tree(x[zero_optim.KEY][None] if out else
                                                                  x[zero_optim.KEY][0]) if kind else x
                                             for x, kind in zip(parts, kinds)])

        p = sh.shard_of(plan, params, DATA)
        g = sh.shard_of(plan, grads, DATA) if grad_block is None else grad_block
        decay = sh.shard_of_values(plan, zero_optim.decay_values([i.shape for i in plan.leaves]), DATA, g.dtype)
        updates, opt_state = tx.update(zero_optim.flat_tree(g), squeeze(opt_state, False), zero_optim.flat_tree(p),
                                       decay_mask=zero_optim.flat_tree(decay), **extra)  # masked decay's rule
        p = optax.apply_updates(zero_optim.flat_tree(p), updates)[zero_optim.KEY]
        return sh.unpack(plan, sh.all_gather_shards(p, DATA)), squeeze(opt_state, True)

    def update_fn(self, tx, params_tree, pspecs: list, *, needs_norm: bool, counts: list[int], jit,
                  scatter: bool = False, sspecs=P()):
        """The pipeline stage's update(params, opt_state, grads, state, vec) -> (params, opt_state, state), jitted
        over the stage's mesh (vec: [Sums..., squared norm, seed], its weight at 1). `grads`: the stage's reduced
        leaves, or with `scatter` the replicas' blocks [T, D S] of its reduce-scattered flat gradient. `sspecs`:
        how the model-state leaves lie (3-D: frozen split weights over TENSOR)."""
        tx = optax.with_extra_args_support(tx)

        def update(params, opt_state, grads, state, vec):
            inv, extra = mean_scale(vec, needs_norm)  # a reciprocal, as every pipeline stage's update takes it
            if scatter:
                params, opt_state = self.local_update(tx, params, opt_state, None, grad_block=grads[0] * inv,
                                                      **extra)
            else:
                params, opt_state = self.local_update(tx, params, opt_state, [g * inv for g in grads], **extra)
            state = [x + 1 if k in counts else x for k, x in enumerate(state)]  # RNG streams advance once
            return params, opt_state, state

        opt_specs = self.opt_specs(tx, params_tree)
        gspecs = self.spec if scatter else pspecs
        mapped = jax.shard_map(update, mesh=self.mesh, in_specs=(pspecs, opt_specs, gspecs, sspecs, P()),
                               out_specs=(pspecs, opt_specs, sspecs), check_vma=False)
        return jit(mapped, donate_argnums=(0, 1, 3))


def is_stage(zero_stage: Any, stages: tuple) -> bool:
    """`zero_stage` is one of `stages` as an integer: True, np.True_ and 1.0 equal 1 in Python, and each ran as
    stage 1 while printed as given."""
    return isinstance(zero_stage, (int, np.integer)) and not isinstance(zero_stage, (bool, np.bool_)) and \
        zero_stage in stages


def check_reduce_is_read(zero_reduce: str, zero_stage: Any) -> None:
    """ValueError for a ZeRO-1 reduction asked of a strategy running without ZeRO (it would never be read)."""
    if zero_reduce != "reduce_scatter" and not zero_stage:
        raise ValueError(f"zero_reduce={zero_reduce!r} sets how ZeRO-1 reduces the gradients, but zero_stage is "
                         f"{zero_stage!r} (no ZeRO): pass zero_stage=1 with it, or drop zero_reduce.")


def _as_tree(plan: sh.ShardPlan) -> list:
    """The plan's leaves as ShapeDtypeStructs: a parameter tree's stand-in for the optimizer's state layout."""
    return [jax.ShapeDtypeStruct(info.shape, info.dtype) for info in plan.leaves]


def device_leaves(shapes: list, specs: list, mesh) -> list:
    """What one device of `mesh` holds of leaves of these shapes (ShapeDtypeStructs) placed by these specs."""
    return [jax.ShapeDtypeStruct(NamedSharding(mesh, spec).shard_shape(tuple(a.shape)), a.dtype)
            for a, spec in zip(shapes, specs)]


def of(mesh, device_params: list, axes) -> StageZero:
    """The layout for `device_params` (one device's leaves, ShapeDtypeStructs) over the mesh's DATA axis; `axes`
    each leaf's tensor split axis (None: whole)."""
    return StageZero(sh.shard_plan(device_params, mesh.shape[DATA]), tuple(axes), mesh.shape.get(TENSOR, 1), mesh)
