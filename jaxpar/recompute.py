"""Activation checkpointing for the strategies that run the whole model (single, dp, ddp, ZeRO 1-2, tp):
DeepSpeed's ``activation_checkpoint_interval`` (PipelineModule's name, which the pipeline uses too) and Megatron's
``--recompute-granularity full --recompute-method uniform --recompute-num-layers N``.

The model's flat `layers` (their composition is the model, as the pipeline takes them) run in segments of N.
A segment keeps only its input; its backward runs the segment's forward again from that input and the saved
weights and RNG state, then its vjp:

    forward:   y = segment(x)                 saved: x, the segment's state (weights, RNG counts)
    backward:  y, vjp = vjp(segment)(x + 0)   "+ 0": an exact 0.0 computed from the incoming cotangent
               dx, dstate = vjp(dy)

`jax.checkpoint` would say the same, but XLA:CPU drops the optimization barrier that keeps the recomputation
apart, so XLA merges it with the forward and keeps every residual. Here the recomputation depends on the
cotangent, which no compiler can hoist (jaxpar.comm.fetch ties ZeRO-3's re-gathers the same way). Dropout
draws the same masks in the recomputation: the RNG state it starts from is the saved one.

`recompute_call(fn, module, *args)` does the same for one call; GPT's selective recompute (Megatron's
``--recompute-granularity selective``) runs each block's core attention through it.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.comm.overlap import tie, zero_after


def recomputed(run):
    """`run(leaves, x) -> (y, state)` whose backward recomputes `run` from its saved inputs, after the
    cotangent exists."""
    @jax.custom_vjp
    def f(leaves, x):
        return run(leaves, x)

    def fwd(leaves, x):
        return run(leaves, x), (leaves, x)

    def bwd(saved, ct):
        floats = [a for a in jax.tree.leaves(ct) if jnp.issubdtype(a.dtype, jnp.floating) and a.size]
        token = zero_after(floats[0]) if floats else jnp.zeros((), jnp.float32)
        return jax.vjp(run, *tie(saved, token))[1](ct)

    f.defvjp(fwd, bwd)
    return f


def recompute_call(fn, modules, *args: Any) -> Any:
    """`fn(modules, *args)` whose backward recomputes it from `args` and the modules' saved state (weights, RNG
    counts, batch statistics); every state the call changes or adds other than the weights (RNG streams, batch
    statistics, the user's own nnx.Variables, values sown as nnx.Intermediate, which a loss may differentiate)
    comes out as a plain call's would."""
    graphdef, state = nnx.split(modules)
    leaves, treedef = jax.tree.flatten(state)

    def run(leaves, args):
        merged = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        before = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(merged, nnx.Not(nnx.Param)))}
        y = fn(merged, *args)
        # only what the call replaced or added comes back: a constant nnx.Variable the forward only reads keeps its
        # own value (written back as a new one, it read as changed to the per-sample check, a QA finding)
        after = nnx.to_flat_state(nnx.state(merged, nnx.Not(nnx.Param)))
        return y, nnx.from_flat_state([(path, v) for path, v in after if before.get(path) is not v.get_value()])

    y, changed = recomputed(run)(leaves, args)
    nnx.update(modules, changed)
    return y


def run_segments(layers, x: Any, interval: int, unpack: bool = False) -> Any:
    """The composition of `layers` on `x`, each `interval` of them recomputed in the backward; `unpack`:
    nnx.Sequential's convention (a layer's tuple or dict output is the next one's *args or **kwargs)."""
    from jaxpar.pipeline.module import call_layer

    layers = list(layers)
    for lo in range(0, len(layers), interval):
        segment = layers[lo:lo + interval]
        segment_modules = [layer for layer in segment if isinstance(layer, nnx.Module)]  # others: functions

        def compose(merged_modules, x, segment=segment, lo=lo):
            modules = iter(merged_modules)
            for i, layer in enumerate(segment, lo):
                x = call_layer(next(modules) if isinstance(layer, nnx.Module) else layer, x, unpack, i)
            return x

        x = recompute_call(compose, segment_modules, x)
    return x


def _call(self, *args, **kwargs):
    if len(args) != 1 or kwargs:
        raise ValueError(f"activation checkpointing runs {type(self).__name__}'s layers on ONE input; it was called "
                         f"with {len(args)} positional and {len(kwargs)} keyword arguments. Use interval 0.")
    return run_segments(self.layers, args[0], type(self)._recompute_interval, isinstance(self, nnx.Sequential))


_CLASSES: dict = {}


def checkpointed(model: nnx.Module, interval: int) -> nnx.Module:
    """A clone of `model` whose __call__ runs its `layers` in segments of `interval`, recomputed in the backward
    (the model itself is left as it is). `interval` 0: `model` unchanged."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"activation_checkpoint_interval={interval!r} must be an int >= 0; pass 0 (keep "
                         "every activation) or N (recompute each N-layer segment in the backward).")
    if not interval:
        return model
    from jaxpar.objective import refuse_keyed_layers  # objective imports this module

    refuse_keyed_layers(model, f"activation_checkpoint_interval={interval}", "or use 0")
    layers = getattr(model, "layers", None)
    if not layers or not all(callable(layer) for layer in layers):
        raise ValueError(f"activation_checkpoint_interval={interval} needs {type(model).__name__}'s flat `layers` "
                         "(modules and functions whose composition is the model, as the pipeline takes them); "
                         "give it a `layers` sequence (nnx.Sequential has one), or use 0.")
    key = (type(model), interval)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Recomputed{type(model).__name__}", (type(model),),
                             {"__call__": _call, "_recompute_interval": interval, "__module__": __name__})
    clone = nnx.clone(model)
    clone.__class__ = _CLASSES[key]
    return clone
