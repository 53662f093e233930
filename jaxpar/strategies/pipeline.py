"""The pipeline strategy (DeepSpeed's PipelineEngine): stages over the PIPE axis, data replicas over DATA.

    pm = PipelineModule.from_model(model, num_stages=2)        # prints the partition
    strategy = Pipeline(pm, tx, mesh=pipeline_mesh(4, 2), schedule="1f1b", micro_batches=8)
    placed = strategy.init(state); placed, metrics = strategy.step(placed, strategy.put_batch(batch))

The placed state is a TrainState whose params are the flat stage buffers [S, V, P] sharded over PIPE and whose
opt_state is the optimizer's state over those buffers (one per stage); ``unplace`` maps both back to the
canonical whole-model trees. That mapping needs an ELEMENTWISE optimizer (sgd, momentum, adam, adamw,
adadelta: state leaves shaped like the parameters, or scalars such as a step count); optimizers that mix
parameters (global-norm clipping, LARS/LAMB trust ratios, factored states) are not supported.
Batches are padded with w = 0 rows until every data replica's rows split into `micro_batches` equal parts.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.config import Config
from jaxpar.mesh import DATA, PIPE, make_mesh
from jaxpar.pipeline.engine import lower, make_step
from jaxpar.pipeline.module import LayerSpec, PipelineModule
from jaxpar.step import TrainState
from jaxpar.types import Batch

__all__ = ["LayerSpec", "Pipeline", "PipelineModule", "build", "pipeline_mesh"]


def pipeline_mesh(devices: int | Sequence | None = None, num_stages: int = 1) -> Mesh:
    """A (DATA, PIPE) mesh with PIPE the outer axis, as DeepSpeed's PipeDataParallelTopology: stage s holds the
    consecutive devices ``s*D .. s*D + D-1``, so stages spread over processes / hosts and the data-parallel
    groups stay within them."""
    all_devices = jax.devices()
    devices = all_devices[:devices] if isinstance(devices, int) else list(devices or all_devices)
    n = len(devices)
    if not 1 <= num_stages <= n or n % num_stages:
        raise ValueError(f"num_devices={n} must be a multiple of num_stages={num_stages} (one data-parallel group "
                         f"of {num_stages} stages per {num_stages} devices); use --num-devices "
                         f"{max(num_stages, n - n % num_stages)} or --num-stages dividing {n}.")
    grid = np.array(devices, dtype=object).reshape(num_stages, n // num_stages).T  # [DATA, PIPE]
    if num_stages == 1:
        return Mesh(grid, (DATA, PIPE))
    return make_mesh(devices=list(grid.ravel()), pipe=num_stages)


def _gather(a) -> np.ndarray:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(a)


def optimizer_layout(tx: optax.GradientTransformation, module: PipelineModule):
    """(treedef of the optimizer state with each parameter-shaped subtree as ONE leaf, which leaves those are).

    The canonical state and the per-stage state share this outer tree: a parameter-shaped subtree of the
    canonical state is one flat [V, P] buffer per stage, a scalar (a step count) is one copy per stage. Raises
    ValueError for an optimizer whose state is neither (not elementwise)."""
    param_like = lambda x: jax.tree.structure(x) == module.canonical_treedef  # noqa: E731
    abstract = jax.tree.unflatten(module.canonical_treedef,
                                  [jax.ShapeDtypeStruct(s, jnp.float32) for s in module.canonical_shapes])
    canonical = jax.eval_shape(tx.init, abstract)
    leaves, outer = jax.tree.flatten(canonical, is_leaf=param_like)
    kinds = [param_like(x) for x in leaves]
    flat = jax.ShapeDtypeStruct((module.virtual_stages, module.flat_size), jnp.float32)
    stage = jax.eval_shape(tx.init, flat)
    ok = jax.tree.structure(stage) == outer
    for x, param_shaped, y in zip(leaves, kinds, jax.tree.leaves(stage)):
        if param_shaped:
            ok &= [tuple(a.shape) for a in jax.tree.leaves(x)] == module.canonical_shapes and y.shape == flat.shape
        else:
            ok &= math.prod(x.shape) == 1 and x.shape == y.shape
    if not ok:
        raise ValueError(f"the optimizer's state {jax.tree.structure(canonical)} is not elementwise (leaves shaped "
                         "like the parameters, or scalars); the pipeline updates each stage's flat buffer on its "
                         "own: use sgd, adam, adamw or adadelta.")
    return outer, kinds


class Pipeline:
    """The pipeline strategy over `mesh` (see ``pipeline_mesh``); the schedule is validated, then lowered."""

    name = "pipeline"

    def __init__(self, module: PipelineModule, tx: optax.GradientTransformation, *, mesh: Mesh,
                 schedule: str = "1f1b", micro_batches: int = 4, compute_dtype=None):
        self.module, self.tx, self.mesh, self.compute_dtype = module, tx, mesh, compute_dtype
        S, V = module.num_stages, module.virtual_stages
        if mesh.shape.get(PIPE) != S:
            raise ValueError(f"mesh {dict(mesh.shape)} must have a {PIPE!r} axis of num_stages={S}; "
                             "build it with jaxpar.strategies.pipeline.pipeline_mesh(devices, num_stages).")
        self.schedule = schedule_lib.validate(schedule_lib.make(schedule, S, micro_batches, V))
        self.plan = lower(self.schedule)
        self.micro_batches, self.data = micro_batches, mesh.shape[DATA]
        self._parts = [module.part(k, compute_dtype) for k in range(module.num_parts)]
        self._programs: dict[tuple, Any] = {}
        self._live, self._info = None, None
        self._stage_sharding = NamedSharding(mesh, P(PIPE))
        self._replicated = NamedSharding(mesh, P())
        self._rows = NamedSharding(mesh, P((PIPE, DATA)))  # row blocks in device order: process-major
        self._local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        self._opt_outer, self._opt_kinds = optimizer_layout(tx, module)

    def _param_like(self, x) -> bool:
        return jax.tree.structure(x) == self.module.canonical_treedef

    # -- placement -----------------------------------------------------------------------------------------

    def _place_stages(self, fill) -> jax.Array:
        """A [S, ...] array sharded over PIPE; `fill(stage)` runs only for this process's stages."""
        S, done = self.module.num_stages, {}

        def get(stage):
            if stage not in done:
                done[stage] = fill(stage)
            return done[stage]

        first = get(next(d for d in range(S) if self._holds(d)))
        return jax.make_array_from_callback((S,) + first.shape, self._stage_sharding,
                                            lambda idx: np.stack([get(s) for s in range(S)[idx[0]]]))

    def _holds(self, stage: int) -> bool:
        return any(d.process_index == jax.process_index() for d in self.mesh.devices[:, stage])

    def _replicate(self, x: jax.Array) -> jax.Array:
        """The same value on every device of the mesh (every process passes the same value)."""
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self._replicate(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = _gather(x)
        return jax.make_array_from_callback(host.shape, self._replicated, lambda idx: host[idx])

    def _opt_to_stages(self, opt_state) -> Any:
        leaves = jax.tree.flatten(opt_state, is_leaf=self._param_like)[0]
        out = []
        for leaf, param_like in zip(leaves, self._opt_kinds):
            if param_like:
                flat = self.module.to_flat([_gather(a) for a in jax.tree.leaves(leaf)])
                out.append(self._place_stages(lambda s, flat=flat: flat[s]))
            else:
                value = _gather(leaf)
                out.append(self._place_stages(lambda s, value=value: value))
        return jax.tree.unflatten(self._opt_outer, out)

    def init(self, state: TrainState) -> TrainState:
        """Place the canonical state: flat stage buffers over PIPE, the optimizer state per stage."""
        if jax.tree.structure(state.params) != self.module.canonical_treedef:
            raise ValueError("state.params does not have the tree of the model this pipeline was built from; "
                             "pass init_state(model, tx)[1] of the same model (or use init_fresh for LayerSpecs).")
        flat = self.module.to_flat([_gather(a) for a in jax.tree.leaves(state.params)])
        params = self._place_stages(lambda s: flat[s])
        return TrainState(params, self._opt_to_stages(state.opt_state), self._replicate(state.step),
                          self._replicate(state.key))

    def init_fresh(self, seed: int = 0) -> TrainState:
        """A fresh state built where it lives: each process builds only its own stages' layers (LayerSpecs)."""
        def fill(stage):
            leaves = self.module.stage_leaves(stage)
            full = [leaves.get(j, np.zeros(s, np.float32)) for j, s in enumerate(self.module.canonical_shapes)]
            return self.module.to_flat(full, stages=[stage])[stage]

        params = self._place_stages(fill)
        opt_state = jax.jit(jax.vmap(self.tx.init), out_shardings=self._stage_sharding)(params)
        return TrainState(params, opt_state, self._replicate(jnp.zeros((), jnp.int32)),
                          self._replicate(jax.random.key(seed)))

    def put_batch(self, batch: Batch) -> Batch:
        """This process's rows, padded (w = 0) so each data replica splits into `micro_batches` equal parts."""
        rows, nproc = len(batch["y"]), jax.process_count()
        group = self.data * self.micro_batches
        q = math.lcm(self._local_devices, group // math.gcd(group, nproc))
        pad = -rows % q
        batch = dict(batch)
        batch.setdefault("w", np.ones(rows, np.float32))
        out = {}
        for k in ("x", "y", "idx", "w"):
            v = np.asarray(batch[k])
            v = np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) if pad else v
            out[k] = jax.make_array_from_process_local_data(self._rows, v, (len(v) * nproc,) + v.shape[1:])
        return out

    # -- the step ------------------------------------------------------------------------------------------

    def _program(self, x_shape: tuple):
        if x_shape not in self._programs:
            self._programs[x_shape] = make_step(self._parts, self.module.loss_fn, self.plan, self.mesh, self.tx,
                                                x_shape=x_shape)
        return self._programs[x_shape]

    def step(self, s: TrainState, pb: Batch) -> tuple[TrainState, dict]:
        s, metrics, _ = self.step_with_grads(s, pb)
        return s, metrics

    def step_with_grads(self, s: TrainState, pb: Batch) -> tuple[TrainState, dict, jax.Array]:
        """The step, also returning the flat per-stage gradients [S, V, P] its update used."""
        fn, self._info = self._program(pb["x"].shape)
        params, opt_state, grads, metrics, self._live = fn(s.params, s.opt_state, s.step, s.key, pb)
        return TrainState(params, opt_state, s.step + 1, s.key), metrics, grads

    def canonical(self, flat: jax.Array) -> Any:
        """Flat stage buffers [S, V, P] (params or grads) -> the canonical nnx.State tree."""
        leaves = [jnp.asarray(a) for a in self.module.from_flat(_gather(flat))]
        return jax.tree.unflatten(self.module.canonical_treedef, leaves)

    def unplace(self, s: TrainState) -> TrainState:
        """The canonical state: params and opt_state with the reference's tree structure."""
        leaves = jax.tree.leaves(s.opt_state)
        opt = [self.canonical(a) if k else jnp.asarray(_gather(a)[0]) for a, k in zip(leaves, self._opt_kinds)]
        opt = jax.tree.unflatten(self._opt_outer, opt)
        step, key = (jax.device_put(a.addressable_data(0), jax.local_devices()[0]) for a in s[2:])  # replicated
        return TrainState(self.canonical(s.params), opt, step, key)

    # -- reports -------------------------------------------------------------------------------------------

    def describe(self) -> str:
        sch = self.schedule
        return (f"{self.mesh.devices.size} devices, mesh {dict(self.mesh.shape)}: {sch.num_stages} stages x "
                f"{self.data} data replicas, schedule {sch.name} ({sch.num_microbatches} micro-batches"
                + (f", {sch.virtual_stages} chunks per stage" if sch.virtual_stages > 1 else "") + ")")

    def report(self, s: TrainState | None = None) -> dict:
        """Partition, bubble fraction, activation buffers (planned and measured during the last step)."""
        pm = self.module
        out = {"devices": self.mesh.devices.size, "mesh": dict(self.mesh.shape),
               "partition": self.module.describe(), "schedule": self.schedule.name,
               "ticks": self.schedule.num_ticks, "bubble_fraction": schedule_lib.bubble_fraction(self.schedule),
               "peak_inflight": schedule_lib.peak_inflight(self.schedule),
               "activation_slots": list(self.plan.act_slots), "grad_slots": list(self.plan.grad_slots),
               "stage_params": [sum(pm.part_sizes[v] for v in range(s, pm.num_parts, pm.num_stages))
                                for s in range(pm.num_stages)],
               "param_buffer_floats_per_stage": pm.virtual_stages * pm.flat_size}  # padded to the largest part
        if self._info is not None:
            per_slot = self._info["micro_batch"] * self._info["boundary"] * 4
            out["activation_bytes_per_stage"] = (self.plan.num_act + self.plan.num_grad + 2) * per_slot
            out["boundary_floats_per_sample"] = self._info["boundary"]
        if self._live is not None:
            out["measured_live_activations"] = [int(v) for v in _gather(self._live)]
        return out


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config) -> Pipeline:
    """The strategy for train.py: --num-stages, --micro-batches, --schedule, --virtual-stages, --partition-method."""
    from jaxpar.precision import compute_dtype

    mesh = pipeline_mesh(cfg.num_devices, cfg.num_stages)
    module = PipelineModule.from_model(
        model, cfg.num_stages, partition_method=cfg.partition_method,
        activation_checkpoint_interval=cfg.activation_checkpoint_interval, virtual_stages=cfg.virtual_stages,
        example_input=_example_input(model, cfg) if cfg.partition_method == "profile" else None, seed=cfg.seed)
    return Pipeline(module, tx, mesh=mesh, schedule=cfg.schedule, micro_batches=cfg.micro_batches,
                    compute_dtype=compute_dtype(cfg.precision))


def _example_input(model: nnx.Module, cfg: Config) -> jax.ShapeDtypeStruct:
    """One sample's input shape for --partition-method profile: images from models.input_shape, vectors from the
    first layer's in_features."""
    from jaxpar import models

    first = models.as_layers(model)[0]
    shape = (first.in_features,) if hasattr(first, "in_features") else \
        models.input_shape(cfg.model, image_size=cfg.image_size)
    return jax.ShapeDtypeStruct((1,) + tuple(shape), jnp.float32)
