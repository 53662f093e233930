"""ZeRO stage 1 inside the pipeline: each stage's optimizer state partitioned over the stage's D data replicas, as
DeepSpeed runs its PipelineEngine with ``"zero_optimization": {"stage": 1}`` (the 3-D recipe of Megatron-DeepSpeed).

Per stage, the weights it holds are one flat vector padded to D (`jaxpar.comm.shards`, ZeRO's own plan); replica
r keeps element block r of every optimizer moment. At the step's end the stage's gradient is whole on every
replica (summed over the replicas and the tied copies, as without ZeRO: DeepSpeed's stage 1 with
``reduce_scatter: false``); each replica updates its block with the optimizer on the flat slice and the blocks are
all-gathered into the whole weights again. That equals the update without ZeRO only for elementwise optimizers,
which `jaxpar.strategies.zero_optim.check` proves before training.

    plan = stage_plan(module, stage, D)
    opt_state = place(tx, plan, stage_params, stage_opt_state, mesh)     # canonical -> flat, sharded over DATA
    update = update_fn(tx, plan, mesh, ...)                              # the step's jitted update
    stage_opt_state = unplace(tx, plan, stage_params, opt_state)         # back, for checkpoints
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.comm import shards as sh
from jaxpar.mesh import DATA
from jaxpar.strategies import zero_optim


def stage_plan(module, stage: int, num_replicas: int) -> sh.ShardPlan:
    """The flat plan of the stage's weights (its own leaf order) over its data replicas: one group."""
    return sh.shard_plan([module.param_specs[j] for j in module.stage_params[stage]], num_replicas)


def _specs(tx, params_tree) -> Any:
    """The flat state's PartitionSpecs: element blocks over DATA, shared scalars (the step count) replicated."""
    outer, kinds, leaves = zero_optim.flat_state_shapes(tx, params_tree, 7, jnp.float32)
    return jax.tree.unflatten(outer, [jax.tree.map(lambda _, k=kind: P(DATA) if k else P(), x)
                                      for x, kind in zip(leaves, kinds)])


def place(tx, plan: sh.ShardPlan, params_tree, opt_state, mesh) -> Any:
    """The stage's canonical optimizer state as the flat one: each moment a [D S] array, replica r holding block r."""
    _, kinds, outer = zero_optim.layouts(tx, params_tree)

    def flat(a_NxS):
        vec = np.ascontiguousarray(a_NxS).reshape(-1)
        return zero_optim.flat_tree(jax.make_array_from_callback(vec.shape, NamedSharding(mesh, P(DATA)),
                                                                 lambda idx: vec[idx]))

    rep = NamedSharding(mesh, P())
    leaves = [flat(x) if kind else jax.tree.map(lambda a: jax.device_put(jnp.array(a, copy=True), rep), x)
              for x, kind in zip(zero_optim.to_flat(tx, plan, params_tree, opt_state), kinds)]
    return jax.tree.unflatten(outer, leaves)


def unplace(tx, plan: sh.ShardPlan, params_tree, opt_state) -> Any:
    """The stage's canonical optimizer state (host-gathered) from the flat one."""
    _, kinds, _ = zero_optim.layouts(tx, params_tree)
    leaves = jax.tree.flatten(opt_state, is_leaf=zero_optim.is_flat)[0]
    first = lambda a: np.asarray(a.addressable_data(0))  # noqa: E731  (a replicated leaf: any copy)
    host = [np.asarray(x[zero_optim.KEY]).reshape(plan.num_devices, -1) if kind else jax.tree.map(first, x)
            for x, kind in zip(leaves, kinds)]
    return zero_optim.from_flat(tx, plan, params_tree, host)


def update_fn(tx, plan: sh.ShardPlan, mesh, params_tree, *, needs_norm: bool, counts: list[int], jit):
    """update(params, opt_state, grads, state, vec) -> (params, opt_state, state), jitted over the stage's mesh:
    each replica updates its block of the flat weights with its block of the (replicated, summed) gradient, then
    one all-gather gives every replica the whole weights."""
    tx = optax.with_extra_args_support(tx)
    shapes = [info.shape for info in plan.leaves]

    def update(params, opt_state, grads, state, vec):
        weight = vec[1]
        p = sh.shard_of(plan, params, DATA)
        g = sh.shard_of(plan, grads, DATA) / weight
        decay = sh.shard_of(plan, zero_optim.decay_leaves(shapes, jnp, g.dtype), DATA)  # masked decay's rule
        extra = {"global_norm": jnp.sqrt(vec[-1]) / weight} if needs_norm else {}
        updates, opt_state = tx.update(zero_optim.flat_tree(g), opt_state, zero_optim.flat_tree(p),
                                       decay_mask=zero_optim.flat_tree(decay), **extra)
        p = optax.apply_updates(zero_optim.flat_tree(p), updates)[zero_optim.KEY]
        state = [x + 1 if k in counts else x for k, x in enumerate(state)]  # RNG streams advance once
        return sh.unpack(plan, sh.all_gather_shards(p, DATA)), opt_state, state

    opt_specs = _specs(tx, params_tree)
    mapped = jax.shard_map(update, mesh=mesh, in_specs=(P(), opt_specs, P(), P(), P()),
                           out_specs=(P(), opt_specs, P()), check_vma=False)
    return jit(mapped, donate_argnums=(0, 1, 3))

