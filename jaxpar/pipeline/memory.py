"""The pipeline's memory per stage under both activation policies, from the compiled functions' shapes.

Per stage (per device of it; 3-D: a tensor-split weight's slice): weights, optimizer state (ZeRO-1: its block),
the gradient accumulator, the floating model state (frozen weights, statistics; shown where there is some), and
the activations one micro-batch keeps between its forward and its backward -- the stage input plus what the
forward's vjp saved -- once with every residual kept (activation_checkpoint_interval 0, DeepSpeed's and torch's
default) and once recomputing from each segment's input (the configured interval, or the whole stage when none is
set), with a split backward's cotangents (kept from I to W), times the micro-batches the schedule holds at once
(analysis.peak_inflight); with the W's deferred and joined (defer_wgrad), the join's copy of them during its call.
Nothing is allocated: jax.eval_shape of each part's forward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.mesh import TENSOR
from jaxpar.pipeline import analysis
from jaxpar.pipeline.module import PipelineModule
from jaxpar.pipeline.stage import part_fns, split_float
from jaxpar.strategies.zero1 import device_leaves

MiB = 2 ** 20


def _bytes(tree) -> int:
    """Bytes of the arrays (or shapes) of `tree`; a typed PRNG key counts its dtype's bytes (a selective recompute's
    residuals hold dropout keys: np.dtype cannot size them, and --report failed after training)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def device_params(pipe, s: int) -> list:
    """Stage s's weights as one of its devices holds them: 3-D, the shard of each leaf's tensor-plan spec."""
    mod = pipe.module
    specs = [mod.param_specs[j] for j in mod.stage_params[s]]
    if mod.tensor_layouts is None:
        return specs
    return device_leaves(specs, [mod.tensor_layouts[j].spec(len(a.shape)) for j, a in zip(mod.stage_params[s], specs)],
                         pipe.transport.meshes[s])


def device_state(pipe, s: int) -> list:
    """Stage s's model-state leaves (frozen weights, statistics, RNG streams) as one of its devices holds them:
    3-D, a frozen split weight's slice."""
    mod, specs = pipe.module, pipe.engine.state_specs
    shapes = [specs[j] for j in mod.stage_state[s]]
    return device_leaves(shapes, [mod.state_spec(j) for j in mod.stage_state[s]], pipe.transport.meshes[s])


def activation_bytes(pipe, module: PipelineModule, layout, cotangents: bool = False) -> list[int]:
    """Per virtual stage: bytes one micro-batch keeps from its forward to its backward, per device: what the
    forward's vjp saved (per device: a leading axis of D x T) and the stage input (split over DATA, and over TENSOR
    under sequence parallelism); `cotangents`: also each segment's output gradient, which a split backward keeps
    from its I to its W."""
    engine, tr = pipe.engine, pipe.transport
    T = module.tensor_parallel
    act = pipe.D * (T if module.sequence_parallel else 1)
    out, x = [], None
    for v in range(module.num_parts):
        s = module.stage_of(v)
        fns = part_fns(module, v, pipe.objective, layout, tr.meshes[s], pipe.micro_batches, engine.compiler_options)
        params = [module.param_specs[j] for j in fns.pidx]
        state = [engine.state_specs[j] for j in fns.sidx]
        data = engine.data_specs(layout, s)
        y, saved, _ = jax.eval_shape(fns.forward, params, state, x, data, jax.ShapeDtypeStruct((), np.int32))
        held = _bytes(saved) // (pipe.D * T) + _bytes(x) // act
        if cotangents:
            dy = None if fns.last else split_float(y)[0]
            held += _bytes(jax.eval_shape(fns.input_grad, params, state, x, data, saved, dy)[1]) // (pipe.D * T)
        out.append(held)
        x = y
    return out


def table(pipe, layout) -> list[dict]:
    """One row per stage: MiB of weights, optimizer state, gradients, and activations under both policies."""
    mod, sch = pipe.module, pipe.schedule
    interval = mod.interval or max(b - a for a, b in zip(mod.bounds, mod.bounds[1:]))
    variants = {}
    for name, n in (("store", 0), ("recompute", interval)):
        other = mod
        if n != mod.interval:
            other = PipelineModule.from_model(
                mod.model, mod.num_stages, partition_method=mod.partition_method, virtual_stages=mod.virtual_stages,
                placement=mod.placement, activation_checkpoint_interval=n, wrt=mod.wrt,
                example_input=mod.example_input)
            if mod.tensor_parallel > 1:
                other.set_tensor_parallel(mod.tensor_parallel, TENSOR, pipe.parallel_output, mod.sequence_parallel)
        variants[name] = activation_bytes(pipe, other, layout, cotangents=sch.backward == "IW")
    held = analysis.peak_inflight(sch)
    deferred = sch.name.endswith("+dw")  # the flush's W call joins one part's micro-batches: a copy of them
    rows = []
    for s in range(mod.num_stages):
        params = device_params(pipe, s)
        opt = jax.eval_shape(pipe.tx.init, params)
        if pipe.zero_stage:  # ZeRO-1: one replica's block of the stage's flat moments
            size = pipe.engine.zero[s].plan.shard_size
            opt = jax.eval_shape(pipe.tx.init, {"shard": jax.ShapeDtypeStruct((size,), params[0].dtype)})
        parts = [v for v in range(mod.num_parts) if mod.stage_of(v) == s]
        frozen = [a for a in device_state(pipe, s) if jnp.issubdtype(a.dtype, jnp.floating)]
        row = {"stage": s, "params_mib": _bytes(params) / MiB, "opt_state_mib": _bytes(opt) / MiB,
               "grads_mib": _bytes(params) / MiB, "model_state_mib": _bytes(frozen) / MiB, "in_flight": held[s]}
        for name, per_part in variants.items():
            per_mb = max(per_part[v] for v in parts)  # a (micro-batch, chunk) pair holds one chunk's
            row[f"act_{name}_mib_per_microbatch"] = per_mb / MiB
            row[f"act_{name}_mib"] = per_mb * held[s] / MiB
        if deferred:  # at most: XLA drops what the products do not read (a ReLU's residual)
            row["wgrad_join_mib"] = max(variants["store"][v] for v in parts) * sch.num_microbatches / MiB
        rows.append(row)
    return rows


def text(rows: list[dict]) -> str:
    """The table as text, one line per stage."""
    return "; ".join(f"stage {r['stage']}: weights {r['params_mib']:.2f}, optimizer {r['opt_state_mib']:.2f}, "
                     f"grads {r['grads_mib']:.2f}, "
                     + (f"model state {r['model_state_mib']:.2f}, " if r["model_state_mib"] > 0 else "")
                     + f"activations {r['in_flight']} x {r['act_store_mib_per_microbatch']:.2f}"
                     f" = {r['act_store_mib']:.2f} stored / {r['in_flight']} x "
                     f"{r['act_recompute_mib_per_microbatch']:.2f} = {r['act_recompute_mib']:.2f} recomputed MiB"
                     + (f" (+ up to {r['wgrad_join_mib']:.2f} joined in the flush's W call)" if "wgrad_join_mib" in r
                        else "")
                     for r in rows)
