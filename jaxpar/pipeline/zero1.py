"""ZeRO stage 1 inside the pipeline: each stage's optimizer state partitioned over the stage's D data replicas, as
DeepSpeed runs its PipelineEngine with ``"zero_optimization": {"stage": 1}`` and Megatron-LM its distributed
optimizer (``--use-distributed-optimizer``) under pipeline and tensor parallelism.

Per stage, the weights one device holds (3-D: its tensor rank's slices) are one flat vector padded to D
(`jaxpar.comm.shards`, ZeRO's own plan); data replica r keeps element block r of every optimizer moment, so a
moment is a [T, D S] array, row t split over DATA. At the step's end the stage's gradient is whole on every replica
(summed over the replicas and the tied copies, as without ZeRO: DeepSpeed's stage 1 with ``reduce_scatter:
false``); each replica updates its block with the optimizer on the flat slice and the blocks are all-gathered into
its weights again. That equals the update without ZeRO only for elementwise optimizers, which
`jaxpar.strategies.zero_optim.check` proves before training.

    zero = stage_zero(module, s, mesh, device_leaves)     # per stage: its plan over one device's leaves
    opt_state = zero.place(tx, stage_params, stage_opt)    # canonical (tensor order) -> flat, sharded
    update = zero.update_fn(tx, pspecs, ...)               # the step's jitted update
    stage_opt = zero.unplace(tx, stage_params, opt_state)  # back, host arrays, for checkpoints
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
        leaves = jax.tree.flatten(opt_state, is_leaf=_like(params_tree))[0]
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
            flat = np.asarray(x[zero_optim.KEY])
            per_rank = [sh.unpack(self.plan, row.reshape(self.plan.num_devices, -1)) for row in flat]
            out.append(jax.tree.unflatten(treedef, self._whole(per_rank)))
        return jax.tree.unflatten(outer, out)

    def update_fn(self, tx, params_tree, pspecs: list, *, needs_norm: bool, counts: list[int], jit):
        """update(params, opt_state, grads, state, vec) -> (params, opt_state, state), jitted over the stage's
        mesh: each replica updates its block of its flat weights with its block of the (summed) gradient, then
        one all-gather over DATA gives it its whole weights (3-D: its tensor rank's slices)."""
        tx = optax.with_extra_args_support(tx)
        plan = self.plan
        shapes = [info.shape for info in plan.leaves]
        outer, kinds, leaves = zero_optim.flat_state_shapes(tx, params_tree, 7, jnp.float32)

        def squeeze(state, out: bool):  # a moment's local [1, S] block <-> the [S] the optimizer sees
            parts, tree = jax.tree.flatten(state, is_leaf=zero_optim.is_flat)
            return jax.tree.unflatten(tree, [zero_optim.flat_tree(x[zero_optim.KEY][None] if out else
                                                                  x[zero_optim.KEY][0]) if kind else x
                                             for x, kind in zip(parts, kinds)])

        def update(params, opt_state, grads, state, vec):
            weight = vec[1]
            p = sh.shard_of(plan, params, DATA)
            g = sh.shard_of(plan, grads, DATA) / weight
            decay = sh.shard_of(plan, zero_optim.decay_leaves(shapes, jnp, g.dtype), DATA)  # masked decay's rule
            extra = {"global_norm": jnp.sqrt(vec[-1]) / weight} if needs_norm else {}
            updates, opt_state = tx.update(zero_optim.flat_tree(g), squeeze(opt_state, False),
                                           zero_optim.flat_tree(p), decay_mask=zero_optim.flat_tree(decay), **extra)
            p = optax.apply_updates(zero_optim.flat_tree(p), updates)[zero_optim.KEY]
            state = [x + 1 if k in counts else x for k, x in enumerate(state)]  # RNG streams advance once
            return sh.unpack(plan, sh.all_gather_shards(p, DATA)), squeeze(opt_state, True), state

        opt_specs = jax.tree.unflatten(outer, [jax.tree.map(lambda _, k=kind: self.spec if k else P(), x)
                                               for x, kind in zip(leaves, kinds)])
        mapped = jax.shard_map(update, mesh=self.mesh, in_specs=(pspecs, opt_specs, pspecs, P(), P()),
                               out_specs=(pspecs, opt_specs, P()), check_vma=False)
        return jit(mapped, donate_argnums=(0, 1, 3))


def _like(tree):
    treedef = jax.tree.structure(tree)
    return lambda x: jax.tree.structure(x) == treedef


def stage_zero(module, stage: int, mesh, device_params: list) -> StageZero:
    """Stage `stage`'s layout: the plan of `device_params` (one device's leaves, ShapeDtypeStructs) over the
    mesh's DATA axis, the tensor split axes from the module's plan."""
    lays = module.tensor_layouts
    axes = tuple(None if lays is None else lays[j].axis for j in module.stage_params[stage])
    return StageZero(sh.shard_plan(device_params, mesh.shape[DATA]), axes, mesh.shape.get(TENSOR, 1), mesh)
