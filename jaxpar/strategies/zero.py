"""DeepSpeed's ZeRO stages 1-3 on the DATA mesh: DDP whose optimizer state, gradients and parameters are
partitioned over the replicas (Rajbhandari et al. 2020). One step, on every device at once (shard_map):

    stage 1:  g = grad(my rows)                          full local gradient, as DDP
              g_mine = reduce_scatter(g)  or  my slice of all_reduce(g)     after the backward (zero_reduce)
    stage 2:  g_mine = reduce_scatter(bucket) from inside the backward, bucket by bucket (DDP's hooks)
    stage 3:  params are pieces too: each layer all-gathered before its forward and its backward, its
              gradient reduce-scattered in the backward (jaxpar.comm.fetch); frozen weights (nnx.Params that
              wrt leaves out) are pieces as well, gathered with their layer, without a gradient
    then:     g_mine /= psum(weight);  p_mine, opt_mine = tx(g_mine, opt_mine, p_mine)    1/N of the optimizer
              params = all_gather(p_mine)                  stages 1-2; stage 3 keeps its pieces

The partition is a flat vector padded to N per group (jaxpar.comm.shards): one group per gradient bucket for
stages 1-2 (a single bucket is DeepSpeed's one flat buffer), one per leaf for stage 3 (DeepSpeed's ds_tensor).
The optimizer runs on the flat slice, so it must be elementwise (jaxpar.strategies.zero_optim); global-norm
clipping gets the norm through a psum of the slices' squared norms. `unplace` returns the canonical TrainState
(the tree jaxpar.init_state gives) and `init` takes one, so any strategy resumes another's checkpoint.
torch FSDP: FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2. ZeRO-Offload is not here.

Where it differs from DeepSpeed: DeepSpeed reduces each bucket slice to the rank owning it (one dist.reduce per
owner) where XLA wants equal-chunk reduce-scatters, hence one padded group per bucket here; stage 3 partitions
every parameter (DeepSpeed keeps those under stage3_param_persistence_threshold, 1e5 elements, whole), prefetches
one layer (not stage3_prefetch_bucket_size elements), and lets XLA drop the backward re-gathers of weights the
backward does not read (biases, the first layer), which DeepSpeed issues.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import loss_scale
from jaxpar.batch import Rows, as_rows, check_unpadded, num_rows, pad_rows, padded_size, share_of, split_rows
from jaxpar.comm import cost as comm_cost
from jaxpar.comm import fetch, overlap
from jaxpar.comm import shards as sh
from jaxpar.comm.buckets import check_mib, plan_buckets
from jaxpar.config import Config
from jaxpar.mesh import DATA, check_data_mesh, make_mesh
from jaxpar.objective import Objective, advance_rng, check_wrt_within, metrics_of, refuse_keyed_layers
from jaxpar.step import TrainState
from jaxpar.strategies import zero_optim
from jaxpar.strategies.base import (LayersCheck, arm_first_batch, cfg_objective, check_batch_size,
                                    check_foreign_options, check_not_consumed, check_placed, check_state,
                                    from_process_0, objective_of, processes)
from jaxpar.strategies.ddp import from_replica_0, local_devices, place_rows, psum_sums, replicate

STAGES = (1, 2, 3)
REDUCES = ("reduce_scatter", "all_reduce")
FETCHES = ("layer", "model")  # stage 3: a gather per layer of `layers`, or one of every weight
FORMULAS = {0: "(4+4+K) Psi", 1: "4 Psi + 4 Psi + K Psi/N", 2: "4 Psi + (4+K) Psi/N", 3: "(4+4+K) Psi/N"}


def paper_bytes(stage: int, num_params: int, num_devices: int, opt_bytes: int = 8, param_bytes: int = 4) -> dict:
    """The ZeRO paper's per-device bytes of parameters, gradients and optimizer state (K = opt_bytes per
    parameter: float32 Adam 8; stage 0 = DDP). Float32 Adam: 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N."""
    psi, n = num_params, num_devices
    out = {"params": param_bytes * psi / (n if stage >= 3 else 1), "gradients": param_bytes * psi / (n if stage >= 2
           else 1), "optimizer": opt_bytes * psi / (n if stage >= 1 else 1)}
    return {**out, "total": sum(out.values()), "formula": FORMULAS[stage].replace("K", str(opt_bytes))}


def zero_body(objective: Objective, tx, plan: sh.ShardPlan, stage: int, *, reduce: str = "reduce_scatter",
              grad_accum: int = 1, needs_norm: bool = False, treedef=None, axis_name=DATA, gradients_only=False,
              frozen: tuple = (), state_treedef=None, names: tuple = ({}, {})):
    """The per-device step `(state, local_rows) -> (state, metrics)` (or, with gradients_only, the gradient as
    the stage holds it after its backward: stage 1 every leaf, stages 2-3 this device's shard). Stage 3:
    `frozen` are the model-state leaves held as pieces (partitioned frozen weights), `state_treedef` the model
    state's treedef with those marked for the fetch, `names` ({offset in the shard: trained leaf}, {model-state
    leaf: frozen weight}) for the error that a loss reads one outside the model."""
    K, n = grad_accum, plan.num_devices

    def grads_of(state: TrainState, rows: Rows):
        replica = lax.axis_index(axis_name)
        micro = split_rows(rows, K)
        take = lambda k: jax.tree.map(lambda a: a[k], micro)  # noqa: E731
        leaves = None if stage == 3 else jax.tree.leaves(state.params)

        def loss(x, mb, model_state, k):
            if stage == 3:
                params = fetch.tagged(treedef, plan, x)
            elif stage == 2:
                params = jax.tree.unflatten(treedef, sh.hook_groups(leaves, x, plan, axis_name))
            else:
                params = jax.tree.unflatten(treedef, x)
            sums, new_state = objective.sums(params, model_state, mb, shard=replica * K + k)
            return sums.loss, (sums, new_state)

        wrt = {1: leaves, 2: [jnp.zeros((g.chunk,), leaves[0].dtype) for g in plan.groups] if stage == 2 else None,
               3: state.params}[stage]
        # with a loss scale: every device and micro-batch at one seed (stages 2-3 reduce inside the backward)
        grad = loss_scale.value_and_grad(loss, loss_scale.current(state.opt_state), axis_name, micro_batches=K)
        acc, total, model_state, seed = None, None, state.model_state, None
        if stage == 3:  # every piece reaches the loss through a fetch unit (checked on the trace)
            fetch.check_reads(lambda x, ms: loss(x, take(0), ms, 0), (wrt, model_state),
                              [(0, "(trained)")] + [(1 + i, names[1][i]) for i in frozen], names[0])
        for k in range(K):  # unrolled, as DDP: XLA:CPU runs convolutions in a loop several times slower
            (_, (sums, new_state)), g, seed = grad(wrt, take(k), model_state, k, seed=seed)
            model_state = advance_rng(new_state, model_state, by=0)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
            total = sums if total is None else total + sums
        model_state = advance_rng(new_state, state.model_state)
        if not objective.per_sample:  # buffers (BatchNorm running stats) of replica 0, as DDP
            model_state = from_replica_0(model_state, axis_name, state.model_state)
        return loss_scale.unscale(acc, seed), total, model_state

    def reduce_after_backward(grads: list) -> jax.Array:
        """Stage 1: each group reduced once the whole backward is done, in order (a token chains them)."""
        token, out = overlap.zero_after(*grads), []
        for k in range(len(plan.groups)):
            buf = sh.group_buffer(plan, k, grads) + token.astype(grads[0].dtype)
            piece = sh.reduce_scatter_group(buf, axis_name) if reduce == "reduce_scatter" else \
                sh.my_piece(lax.psum(buf, axis_name), n, axis_name)
            token = overlap.zero_after(piece)
            out.append(piece)
        return jnp.concatenate(out)

    def body(state: TrainState, rows: Rows):
        held, plain = jax.tree.flatten(state.model_state)
        if frozen:  # the fetch gathers the marked pieces; they leave the step as they came (never changed)
            state = state._replace(model_state=jax.tree.unflatten(state_treedef, held))
        grads, total, model_state = grads_of(state, rows)
        if frozen:
            model_state = jax.tree.unflatten(plain, [held[i] if i in frozen else a for i, a in
                                                     enumerate(jax.tree.leaves(model_state))])
        if stage == 2:
            grads = jnp.concatenate(grads)  # this device's pieces of the groups: its shard of the gradient
        if gradients_only:  # stage 1's whole leaves each with a device axis (a scalar has no axis to stack on)
            return [g[None] for g in grads] if stage == 1 else grads
        g = reduce_after_backward(grads) if stage == 1 else grads
        # the shards' squared norms (padding: 0) ride in the metrics' psum: no collective of their own
        total, squared = psum_sums(total, axis_name, overlap.zero_after(g), jnp.sum(jnp.square(g.astype(jnp.float32))))
        g = g / total.weight
        norm = jnp.sqrt(squared) / total.weight
        p = state.params if stage == 3 else sh.shard_of(plan, jax.tree.leaves(state.params), axis_name)
        extra = {"global_norm": norm} if needs_norm else {}
        decay = sh.shard_of_values(plan, zero_optim.decay_values([info.shape for info in plan.leaves]), axis_name,
                                   g.dtype)  # masked weight decay's rule per element
        updates, opt_state = optax.with_extra_args_support(tx).update(
            zero_optim.flat_tree(g), state.opt_state, zero_optim.flat_tree(p), decay_mask=zero_optim.flat_tree(decay),
            **extra)
        p = optax.apply_updates(zero_optim.flat_tree(p), updates)[zero_optim.KEY]  # in the parameters' dtype
        params = p if stage == 3 else jax.tree.unflatten(treedef, sh.unpack(plan, sh.all_gather_shards(p, axis_name)))
        metrics = {**metrics_of(total, norm), **loss_scale.metrics(loss_scale.current(state.opt_state))}
        return TrainState(params, opt_state, model_state, state.step + 1), metrics

    return body


def check_options(*, stage: int, reduce: str, grad_accum: int, bucket_cap_mb: float | None) -> None:
    if isinstance(stage, (bool, np.bool_)) or not isinstance(stage, numbers.Integral) or stage not in STAGES:
        # True == 1.0 == 1 in Python: each ran as stage 1, and printed as given
        raise ValueError(f"zero_stage={stage!r} is not a ZeRO stage; use 1 (optimizer state), 2 (+ gradients) or "
                         "3 (+ parameters), as DeepSpeed numbers them.")
    if reduce not in REDUCES:
        raise ValueError(f"zero_reduce={reduce!r} is not known; use reduce_scatter or all_reduce.")
    if reduce != "reduce_scatter" and stage != 1:
        raise ValueError(f"zero_reduce={reduce!r} applies to stage 1 only (stages 2 and 3 reduce-scatter inside the "
                         "backward); drop --zero-reduce or use --zero-stage 1.")
    if not isinstance(grad_accum, (int, np.integer)) or isinstance(grad_accum, (bool, np.bool_)) or grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum!r} must be an int >= 1; use 1 for no accumulation.")
    check_mib("bucket_cap_mb", bucket_cap_mb)


_NO_OFFLOAD = ("ZeRO-Offload and ZeRO-Infinity are not in jaxpar: the partitions stay on the devices (stage=3 "
               "holds the least, 16 Psi/N bytes in float32 Adam); leave it out")
_ONE_LAYER = ("stage 3 gathers one layer at a time and prefetches the next (prefetch=True, the default, or False; "
              "fetch='model' gathers every weight at once); leave it out")
# DeepSpeed's "zero_optimization" (and nearby) config keys that a port passes as keywords, and what jaxpar takes instead
DEEPSPEED_ONLY = {
    "zero_stage": "pass stage=1, 2 or 3", "zero_optimization": "pass stage=1, 2 or 3 and this class's own options",
    "reduce_bucket_size": "pass bucket_cap_mb=MiB (stages 1-2; DeepSpeed counts elements: reduce_bucket_size x 4 / "
                          "2**20 for float32 gradients), or leave it out for torch's 25 MiB buckets",
    "allgather_bucket_size": "stages 1-2 all-gather the updated shards once after the update, with no bucket size; "
                             "leave it out",
    "reduce_scatter": "pass reduce='reduce_scatter' (the default) or 'all_reduce' (stage 1)",
    "overlap_comm": "stage 2 always reduce-scatters each bucket from inside the backward and stage 3 prefetches "
                    "(prefetch=True); stage 1 reduces after the backward; leave it out",
    "contiguous_gradients": "each device's gradient shard is always one flat vector; leave it out",
    "stage3_prefetch_bucket_size": _ONE_LAYER, "prefetch_bucket_size": _ONE_LAYER,
    "stage3_max_live_parameters": _ONE_LAYER, "max_live_parameters": _ONE_LAYER,
    "stage3_max_reuse_distance": _ONE_LAYER, "max_reuse_distance": _ONE_LAYER,
    "stage3_param_persistence_threshold": "stage 3 partitions every parameter, small ones too (no persistence "
                                          "threshold); leave it out",
    "param_persistence_threshold": "stage 3 partitions every parameter, small ones too (no persistence threshold); "
                                   "leave it out",
    "offload_optimizer": _NO_OFFLOAD, "offload_param": _NO_OFFLOAD, "cpu_offload": _NO_OFFLOAD,
    "cpu_offload_param": _NO_OFFLOAD,
    "gradient_clipping": "chain jaxpar.optim.clip_by_global_norm(max_norm) first in tx (DeepSpeed clips at 1.0 when "
                         "its config omits it; jaxpar clips only when asked)",
    "gradient_accumulation_steps": "pass grad_accum=K",
    "fp16": "pass compute_dtype=jnp.float16 and wrap tx in jaxpar.loss_scaling(tx) (DeepSpeed's dynamic loss scaler)",
    "bf16": "pass compute_dtype=jnp.bfloat16 (the weights and optimizer state stay float32)",
}


class ZeroRedundancy:
    """DeepSpeed ZeRO on a 1-D DATA mesh: `ZeroRedundancy(model, tx, stage=2, loss_fn=..., mesh=...)` or
    `ZeroRedundancy(objective, tx, ...)`. `batch_size` (global) fixes every batch's padded shape (one compile);
    `bucket_cap_mb` sizes the reduction groups of stages 1-2 (DDP's buckets, None: torch's default); `prefetch` gathers stage 3's next
    layer one layer ahead. `fetch` (stage 3): "layer" gathers each of the model's `layers` as it runs them, in
    place of its __call__ (checked on the first batch to compute the same); "model" gathers every weight at once
    and runs the model's own __call__ (an embedding and head around `layers`, any model)."""

    name = "zero"

    def __init__(self, model: nnx.Module | Objective, tx: optax.GradientTransformation, *, stage: int = 1,
                 loss_fn=None, mesh: Mesh | None = None, reduce: str = "reduce_scatter",
                 bucket_cap_mb: float | None = None,
                 grad_accum: int = 1, batch_size: int | None = None, leaf_order: Sequence[int] | None = None,
                 prefetch: bool = True, fetch: str = "layer", **objective_options):
        self._layers_check = LayersCheck()  # armed by init where the layers run instead of __call__
        # DeepSpeed's config keys: named before the objective's "unexpected keyword argument"
        check_foreign_options("ZeroRedundancy", objective_options, DEEPSPEED_ONLY, "DeepSpeed's config key")
        check_options(stage=stage, reduce=reduce, grad_accum=grad_accum, bucket_cap_mb=bucket_cap_mb)
        grad_accum = int(grad_accum)
        if not isinstance(prefetch, (bool, np.bool_)):  # "no" would run with the prefetch on
            raise ValueError(f"prefetch={prefetch!r} must be True or False.")
        if fetch not in FETCHES:
            raise ValueError(f"fetch={fetch!r} (--zero-fetch) is not known; use 'layer' (stage 3 gathers each of the "
                             "model's `layers` as it runs them) or 'model' (every weight at once, the model's own "
                             "__call__).")
        unread = [(bucket_cap_mb is not None and stage == 3, f"bucket_cap_mb={bucket_cap_mb!r}",
                   "stage 3 gathers and reduces each leaf on its own (no buckets)"),
                  (fetch != "layer" and stage != 3, f"fetch={fetch!r}",
                   f"stage {stage} fetches no weights (stage 3's)"),
                  (prefetch is not True and stage != 3, f"prefetch={prefetch!r}",
                   f"stage {stage} fetches no weights (stage 3's)"),
                  (prefetch is not True and fetch == "model", f"prefetch={prefetch!r}",
                   "fetch='model' gathers every weight at once (no next layer to fetch ahead)")]
        for bad, given, why in unread:  # accepted and never read, a setting the user would think in force
            if bad:
                raise ValueError(f"{given} would be ignored: {why}; drop it.")
        self.objective = objective_of(model, loss_fn, who="ZeroRedundancy", **objective_options)
        if stage == 3 and self.objective.activation_checkpoint_interval:
            raise ValueError(f"ZeRO stage 3 runs each layer under its own fetching recomputation, so "
                             f"activation_checkpoint_interval={self.objective.activation_checkpoint_interval} would "
                             "be ignored; use stage 1 or 2 with it, or interval 0 with stage 3.")
        if leaf_order is None and stage < 3 and self.objective.leaf_order is not None:  # read off the model by
            leaf_order = list(self.objective.leaf_order)  # Objective.of; stage 3's own order is made in _setup
        self.tx, self.mesh, self.stage, self.reduce = tx, mesh or make_mesh(), stage, reduce
        check_data_mesh(self.mesh, "ZeroRedundancy")
        self.bucket_cap_mb, self.grad_accum, self.batch_size = bucket_cap_mb, grad_accum, check_batch_size(batch_size)
        self.leaf_order, self.prefetch, self.fetch = leaf_order, prefetch, fetch
        self.plan: sh.ShardPlan | None = None
        self._step = self._grads = self._batch_spec = None
        n_local, nproc = len(local_devices(self.mesh)), jax.process_count()
        if n_local == 0 or (nproc > 1 and self.mesh.size != jax.device_count()):
            raise ValueError(f"the ZeRO mesh of {self.mesh.size} devices must span all {jax.device_count()} devices "
                             f"of the {nproc} processes; give it a mesh over every process's devices (train.py: drop "
                             "--num-devices).")
        self.multiple = n_local * grad_accum
        self.share = share_of(self.batch_size, nproc, self.multiple)

    # -- set-up: the plan, the optimizer check, the compiled step -----------------------------------------

    def _setup(self, state: TrainState) -> None:
        n, params = self.mesh.size, state.params
        order = self.leaf_order
        if order is None:  # stage 3: each module's leaves in name order (forward_leaf_order's registration=False)
            order = overlap.forward_leaf_order(self.objective.merge(params, state.model_state), self.objective.wrt,
                                               registration=self.stage < 3)
        groups = [[i] for i in order] if self.stage == 3 else list(plan_buckets(params, self.bucket_cap_mb,
                                                                                order=order))
        self.plan = sh.shard_plan(params, n, groups)
        self.needs_norm = zero_optim.check(self.tx, params)
        self.param_treedef = jax.tree.structure(params)
        objective, treedef = self.objective, self.param_treedef
        self.frozen, state_treedef = (), None  # the model-state leaves held as pieces (stage 3's frozen weights)
        self._model_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state.model_state)
        if self.stage == 3:
            model = self.objective.merge(params, state.model_state)
            paths = {tuple(p) for p, _ in nnx.to_flat_state(params)}
            trained = {id(v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable) and tuple(p) in paths}
            if self.fetch == "layer":
                refuse_keyed_layers(model, "ZeRO stage 3 (fetch='layer')", "or pass fetch='model' (--zero-fetch model)")
            self._fetches_layers = self.fetch == "layer" and bool(getattr(model, "layers", None))  # (fetch.py)
            for i, layer in enumerate(model.layers if self._fetches_layers else ()):
                if isinstance(layer, nnx.Module):
                    check_wrt_within(layer, objective.wrt, trained, "ZeRO stage 3", f"layer {i}")
            settings = fetch.Settings(objective.wrt, DATA, objective.per_sample, self.prefetch,
                                      compute_dtype=objective.compute_dtype, whole=not self._fetches_layers)
            graphdef, eval_graphdef = fetch.fetching_graphdefs(objective, params, state.model_state, settings)
            objective = objective.replace(graphdef=graphdef, eval_graphdef=eval_graphdef,
                                          cast_params=objective.compute_dtype is None)  # cast after each gather
            treedef = fetch.tagged_treedef(params)
            self._units = fetch.units(model, objective.wrt, whole=not self._fetches_layers)
            self.frozen = tuple(fetch.frozen_leaves(state.model_state))
            self._frozen_units = [[i for i in u if i in self.frozen] for u in
                                  fetch.units(model, objective.wrt, whole=not self._fetches_layers, rest=True)]
            state_treedef = fetch.tagged_treedef(state.model_state, self.frozen)
        self.state_specs = TrainState(P(DATA) if self.stage == 3 else P(), self._opt_specs(params),
                                      self._model_state_map(lambda a, frozen: P(DATA) if frozen else P()), P())
        kw = dict(reduce=self.reduce, grad_accum=self.grad_accum, needs_norm=self.needs_norm, treedef=treedef,
                  frozen=self.frozen, state_treedef=state_treedef)
        if self.stage == 3:
            path = lambda p: "/".join(map(str, p))  # noqa: E731
            trained = [path(p) for p, _ in nnx.to_flat_state(params)]
            kw["names"] = ({g.offset: trained[g.leaves[0]] for g in self.plan.groups},
                           {i: path(p) for i, (p, _) in enumerate(nnx.to_flat_state(state.model_state))})
        body = zero_body(objective, self.tx, self.plan, self.stage, **kw)
        grads = zero_body(objective, self.tx, self.plan, self.stage, gradients_only=True, **kw)
        specs = (self.state_specs, P(DATA))
        self._step = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(self.state_specs, P()),
                                           check_vma=False), donate_argnums=0)
        self._grads = jax.jit(jax.shard_map(grads, mesh=self.mesh, in_specs=specs, out_specs=P(DATA),
                                            check_vma=False))

    def _model_state_map(self, fn, model_state=None):
        """fn(leaf, partitioned?) over the model state's leaves (default: its shapes), as a model-state tree."""
        leaves, treedef = jax.tree.flatten(self._model_state if model_state is None else model_state)
        return jax.tree.unflatten(treedef, [fn(a, i in self.frozen) for i, a in enumerate(leaves)])

    def _frozen_chunk(self, a) -> int:
        return -(-math.prod(a.shape) // self.mesh.size)

    def _opt_specs(self, params):
        outer, kinds, leaves = zero_optim.flat_state_shapes(self.tx, params, 7, jnp.float32)
        return jax.tree.unflatten(outer, [jax.tree.map(lambda _, k=kind: P(DATA) if k else P(), x)
                                          for x, kind in zip(leaves, kinds)])

    # -- the strategy contract -----------------------------------------------------------------------------

    def init(self, state: TrainState):
        """The canonical state onto the mesh: sharded leaves as [N S] arrays split over DATA, the rest replicated."""
        check_state(state, self.tx, self.objective)
        state = from_process_0(state)  # torch DDP's broadcast of rank 0's parameters at construction
        arm_first_batch(self.objective, state, self._layers_check, self.tx)  # stage 3 refuses an interval
        if self.plan is None:
            self._setup(state)
        if self.stage == 3 and self._fetches_layers:
            self._layers_check.arm(self.objective, state, "ZeRO stage 3 fetches each layer's weights as it runs the "
                                   "model's", "pass ZeroRedundancy(..., fetch='model') (--zero-fetch model: one "
                                   "fetch of every weight)", self.objective.sequential)
        _, kinds, outer = zero_optim.layouts(self.tx, state.params)
        opt = [zero_optim.flat_tree(self._place_flat(x)) if kind else replicate(x, self.mesh)
               for x, kind in zip(zero_optim.to_flat(self.tx, self.plan, state.params, state.opt_state), kinds)]
        params = self._place_flat(sh.pack(self.plan, [np.asarray(a) for a in jax.tree.leaves(state.params)], xp=np)) \
            if self.stage == 3 else replicate(state.params, self.mesh)
        model_state = self._model_state_map(lambda a, frozen: self._place_flat(self._pieces(a)) if frozen else
                                            replicate(a, self.mesh), state.model_state)
        return TrainState(params, jax.tree.unflatten(outer, opt), model_state, replicate(state.step, self.mesh))

    def _pieces(self, a) -> np.ndarray:
        """A frozen weight as the host [N, chunk] array of its pieces (zero-padded), device r holding row r."""
        a = np.asarray(a).reshape(-1)
        out = np.zeros((self.mesh.size, self._frozen_chunk(a)), a.dtype)
        out.reshape(-1)[:a.size] = a
        return out

    def _place_flat(self, flat_NxS: np.ndarray) -> jax.Array:
        """A host [N, S] array as one global [N S] array, device r holding row r."""
        flat = np.ascontiguousarray(flat_NxS).reshape(-1)
        return jax.make_array_from_callback(flat.shape, NamedSharding(self.mesh, P(DATA)), lambda idx: flat[idx])

    def put_batch(self, batch) -> Rows:
        """This process's rows, padded to its share (a multiple of its devices x grad_accum) and sharded."""
        local = None if isinstance(batch, Rows) else num_rows(batch)
        target = padded_size(batch.size if local is None else local, "ZeroRedundancy", self.batch_size,
                             self.multiple, jax.process_count())  # before any work: a larger batch is refused
        rows = as_rows(batch, offset=jax.process_index() * (local or 0))
        self._layers_check(rows)
        rows = pad_rows(rows, target)
        if not self.objective.per_sample:
            check_unpadded(rows, "per_sample=False")
        return place_rows(rows, self.mesh)

    def step(self, placed, rows):
        if self._step is None:
            raise ValueError("ZeroRedundancy.step() before init(); call placed = zero.init(state) first.")
        check_placed(rows, Rows, "ZeroRedundancy", placed, same_devices=True)
        self._batch_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), rows)
        return self._step(placed, rows)

    def unplace(self, placed) -> TrainState:
        """The canonical single-device TrainState (jaxpar.init_state's tree), gathered from the pieces."""
        check_not_consumed(placed, "ZeroRedundancy.unplace()")
        flat = lambda a: zero_optim.gather_to_host(a).reshape(self.mesh.size, -1)  # noqa: E731
        abstract = self._abstract_params()
        _, kinds, _ = zero_optim.layouts(self.tx, abstract)
        leaves = jax.tree.flatten(placed.opt_state, is_leaf=zero_optim.is_flat)[0]
        opt = [flat(x[zero_optim.KEY]) if kind else jax.tree.map(_first, x) for x, kind in zip(leaves, kinds)]
        if self.stage == 3:
            params = jax.tree.unflatten(self.param_treedef,
                                        [jnp.asarray(a) for a in sh.unpack(self.plan, flat(placed.params))])
        else:
            params = jax.tree.map(_first, placed.params)
        whole = lambda a, s: jnp.asarray(zero_optim.gather_to_host(a)[:math.prod(s.shape)].reshape(s.shape))  # noqa
        model_state = jax.tree.map(lambda a, s, f: whole(a, s) if f else _first(a), placed.model_state,
                                   self._model_state, self._model_state_map(lambda _, frozen: frozen))
        return TrainState(params, zero_optim.from_flat(self.tx, self.plan, abstract, opt), model_state,
                          _first(placed.step))

    def _abstract_params(self):
        return jax.tree.unflatten(self.param_treedef, [jax.ShapeDtypeStruct(i.shape, np.dtype(i.dtype))
                                                       for i in self.plan.leaves])

    def describe(self) -> str:
        groups = "groups planned at init" if self.plan is None else \
            f"{len(self.plan.groups)} groups, {self.plan.shard_size:,} elements per device"
        how = f", {self.reduce}" if self.stage == 1 else ""
        if self.stage == 3:
            how = ", every weight in one fetch" if self.fetch == "model" else ", prefetch" if self.prefetch else ""
        return (f"{DATA} mesh of {self.mesh.size} devices ({processes()}), ZeRO stage "
                f"{self.stage}{how}, {groups}, grad_accum={self.grad_accum}")

    # -- what it holds and sends ---------------------------------------------------------------------------

    def hlo(self, placed) -> str:
        """The compiled, scheduled HLO of the step on the last batch's shapes."""
        if self._batch_spec is None:
            raise ValueError("hlo() needs one step first (it compiles for the batch shape seen).")
        return self._step.lower(placed, self._batch_spec).compile().as_text()

    def memory(self, placed, rows=None, step: bool = True) -> dict:
        """Per-device bytes of parameters and optimizer state (the placed arrays on the mesh's first device) and of
        gradients (the outputs of the compiled gradient function: what the backward leaves behind), beside the
        ZeRO paper's formula for the same optimizer; and of the model state apart (not in `total`). `placed` and
        `rows` may be abstract (jax.ShapeDtypeStruct with shardings: see `abstract`); rows default to the last
        batch's shapes."""
        rows = self._batch_spec if rows is None else rows
        if rows is None:
            raise ValueError("memory() needs a batch shape: take one step first or pass rows (ShapeDtypeStructs).")
        device = self.mesh.devices.flat[0]
        compiled = self._grads.lower(placed, rows).compile().memory_analysis()
        temp = self._step.lower(placed, rows).compile().memory_analysis().temp_size_in_bytes if step else None
        held = {"params": held_bytes(placed.params, device), "gradients": compiled.output_size_in_bytes,
                "optimizer": held_bytes(placed.opt_state, device)}
        opt_bytes = sum(zero_optim.layouts(self.tx, self._abstract_params())[1]) * self.plan.itemsize
        # beside the paper's terms: the model state (frozen weights, statistics, RNG streams), whole on every device
        # at stages 1-2; at stage 3 its frozen weights are 1/N, as DeepSpeed's zero.Init partitions them
        return {**held, "total": sum(held.values()), "model_state": held_bytes(placed.model_state, device),
                "step_temp": temp,
                "paper": paper_bytes(self.stage, self.plan.num_elements, self.mesh.size, opt_bytes),
                "num_params": self.plan.num_elements, "padding": self.plan.padding}

    def abstract(self, state: TrainState, rows: Rows) -> tuple:
        """(placed state, rows) as ShapeDtypeStructs with this strategy's shardings, for `memory` on models too big
        to allocate: `state` may itself be abstract (jax.eval_shape of jaxpar.init_state)."""
        if self.plan is None:
            self._setup(state)
        spec = lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, p))  # noqa
        flat = jax.ShapeDtypeStruct((self.mesh.size * self.plan.shard_size,), np.dtype(self.plan.leaves[0].dtype))
        outer, kinds, leaves = zero_optim.flat_state_shapes(self.tx, state.params, flat.shape[0], flat.dtype)
        opt = [jax.tree.map(lambda a, k=kind: spec(P(DATA) if k else P(), a), x) for x, kind in zip(leaves, kinds)]
        params = spec(P(DATA), flat) if self.stage == 3 else jax.tree.map(lambda a: spec(P(), a), state.params)
        model_state = self._model_state_map(lambda a, frozen: spec(P(DATA), jax.ShapeDtypeStruct(
            (self.mesh.size * self._frozen_chunk(a),), a.dtype)) if frozen else spec(P(), a), state.model_state)
        placed = TrainState(params, jax.tree.unflatten(outer, opt), model_state, spec(P(), state.step))
        return placed, jax.tree.map(lambda a: spec(P(DATA), a), rows)

    def comm_model(self) -> dict:
        """Bytes each device sends per step by collective kind (ring costs, jaxpar.comm.cost.zero_traffic)."""
        n, itemsize, units, frozen = self.mesh.size, self.plan.itemsize, None, []
        if self.stage == 3:  # one group per leaf: a layer gathers its leaves' groups (and its frozen pieces)
            chunk = {g.leaves[0]: g.chunk for g in self.plan.groups}
            units = [n * sum(chunk[i] for i in u) * itemsize for u in self._units]
            held = jax.tree.leaves(self._model_state)
            frozen = [n * sum(self._frozen_chunk(held[i]) * np.dtype(held[i].dtype).itemsize for i in u)
                      for u in self._frozen_units if u]
        return comm_cost.zero_traffic(self.stage, n, [n * g.chunk * itemsize for g in self.plan.groups], units,
                                      self.reduce, frozen)

    def report(self, placed) -> dict:
        """The partition, the modelled traffic per step, what the compiled step really sends, and the memory."""
        model = self.comm_model()
        ddp = comm_cost.ring_bytes("all-reduce", self.mesh.size, self.plan.num_elements * self.plan.itemsize)
        out = {"devices": self.mesh.size, "processes": jax.process_count(), "zero_stage": self.stage,
               "zero_reduce": self.reduce if self.stage == 1 else "reduce_scatter", "grad_accum": self.grad_accum,
               "optimizer": "elementwise, global norm psum" if self.needs_norm else "elementwise",
               "shard_plan": str(self.plan), "model_collectives": model,
               "model_bytes_sent_per_device": sum(model.values())}
        if ddp:  # on one device DDP sends nothing: no ratio
            out["model_vs_ddp"] = sum(model.values()) / ddp
        if self._batch_spec is not None:
            text = self.hlo(placed)
            ops = comm_cost.hlo_collectives(text)
            out["hlo_collectives"] = {k: len({c.name for c in ops if c.kind == k}) for k in comm_cost.KINDS
                                      if any(c.kind == k for c in ops)}  # the metrics add one small all-reduce
            out["hlo_bytes_sent_per_device"] = max(comm_cost.hlo_bytes_per_device(text, self.mesh.size))
            if ddp:
                out["hlo_vs_ddp"] = out["hlo_bytes_sent_per_device"] / ddp
            out["held_memory"] = self.memory(placed)
        return out


def held_bytes(tree, device) -> int:
    """Bytes of `tree`'s arrays on `device`: the live shards of jax.Arrays, the shard shapes of abstract ones."""
    total = 0
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array):
            total += sum(s.data.nbytes for s in a.addressable_shards if s.device == device)
        elif device in a.sharding.device_set:
            total += math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize  # key dtypes too
    return total


def _first(a) -> jax.Array:
    """This process's first copy of a replicated leaf, as a fresh single-device array (the step donates)."""
    return jnp.array(a.addressable_data(0), copy=True)


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config, loss_fn=None) -> ZeroRedundancy:
    if cfg.spmd != "shard_map":
        raise ValueError(f"spmd={cfg.spmd!r}: ZeRO runs under shard_map only; drop --spmd.")
    if cfg.grad_comm_dtype not in (None, "fp32"):
        raise ValueError(f"grad_comm_dtype={cfg.grad_comm_dtype!r}: ZeRO reduces gradients in the parameters' "
                         "dtype; drop --grad-comm-dtype (or use --precision bf16 for bf16 compute).")
    # stage 1 unless told (DeepSpeed's config defaults to stage 0, ZeRO off, which is --strategy ddp here)
    stage = 1 if cfg.zero_stage is None else cfg.zero_stage
    reduce = cfg.zero_reduce or "reduce_scatter"  # DeepSpeed's stage 1 default: reduce_scatter: true
    return ZeroRedundancy(cfg_objective(model, loss_fn, cfg), tx, stage=stage, reduce=reduce,
                          mesh=make_mesh(cfg.num_devices), bucket_cap_mb=cfg.bucket_cap_mb, grad_accum=cfg.grad_accum,
                          batch_size=cfg.batch_size, fetch=cfg.zero_fetch or "layer")
