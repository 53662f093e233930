"""The optimizer per stage: each stage updates its own weights with ``tx`` over ITS subtree of the canonical
parameters (the same paths, fewer leaves), and the canonical optimizer state maps to and from the stages' states.

That is exact for transforms that treat every parameter on its own (sgd, momentum, adam, adamw, adadelta,
per-leaf trust ratios). A transform that couples parameters -- ``optax.clip_by_global_norm`` scales every leaf by
the norm over ALL leaves -- would see only its stage's leaves and clip each stage by its own norm. `probe`
finds such coupling before training, numerically: it runs tx on a shrunk copy of the parameters (each dimension
cut to 3), once on the whole tree and once per stage subtree, and compares the updates. A transform that is
exact once it is given the global norm (`jaxpar.optim.clip_by_global_norm`, an optax extra argument
``global_norm``) gets it: the engine adds the stages' squared norms across stages. Anything else is refused with
a one-line ValueError naming the fix.

A stage holding a tied weight updates it apart from its other leaves (`state_parts` cuts its optimizer state by
leaf positions, computed once), with one compiled program every stage holding the tie runs: XLA compiles each
stage's whole update differently, which could leave the copies a bit apart.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar import optim


def mean_scale(vec, needs_norm: bool) -> tuple[jax.Array, dict]:
    """(1 / (the global batch weight x the backward's seed), tx's extra arguments) from the step's [Sums...,
    squared norm, seed] vector (the seed: 1, or fp16's loss scaler's power of two, so dividing it out is exact).
    Every stage's update (and ZeRO-1's) multiplies the summed gradients by this one reciprocal rather than dividing
    them: XLA:CPU lowers a division by a scalar as a multiplication by its reciprocal in some programs and not in
    others, and each stage's update is its own program."""
    inv = (1.0 / vec[1]) * (1.0 / vec[-1])
    return inv, ({"global_norm": jnp.sqrt(vec[-2]) * inv} if needs_norm else {})


def stage_tree(module, stage: int, leaves: list) -> nnx.State:
    """The stage's parameters as an nnx.State on the canonical paths (the optimizer's view)."""
    paths = [module.param_paths[j] for j in module.stage_params[stage]]
    return nnx.from_flat_state(list(zip(paths, [nnx.Param(a) if not isinstance(a, nnx.Variable) else a
                                                for a in leaves])))


def _tree(module, stage: int | None, leaves: list) -> nnx.State:
    if stage is None:
        return jax.tree.unflatten(module.param_treedef, leaves)
    return jax.tree.unflatten(stage_treedef(module, stage), leaves)


def stage_treedef(module, stage: int):
    """The treedef of the stage's parameter State (built once per module and stage)."""
    return subset_treedef(module, tuple(module.stage_params[stage]))


def _param_like(treedef):
    return lambda x: jax.tree.structure(x) == treedef


def _cached(module, what: str, objects: tuple, idx: tuple, make):
    """make(), once per module, `what`, other objects and leaf indices: kept on the module, so the cache goes with
    it; the other objects (tx) are held beside the value, so their ids cannot be reused while it lives."""
    cache = module.__dict__.setdefault("_optimizer_cache", {})
    key = (what, tuple(map(id, objects)), tuple(idx))
    if key not in cache:
        cache[key] = (objects, make())
    return cache[key][1]


def subset_treedef(module, idx: tuple):
    """The treedef of the parameter State holding canonical leaves `idx` (in that order) on their paths."""
    def make():
        canonical = jax.tree.unflatten(module.param_treedef, [0] * len(module.param_paths))
        kinds = {p: v for p, v in nnx.to_flat_state(canonical)}
        return jax.tree.structure(nnx.from_flat_state([(module.param_paths[j], kinds[module.param_paths[j]])
                                                       for j in idx]))

    return _cached(module, "treedef", (), idx, make)


def subset_layout(tx: optax.GradientTransformation, module, idx: tuple):
    """opt_layout's first two for the parameter State of canonical leaves `idx` (computed once)."""
    def make():
        treedef = subset_treedef(module, idx)
        state = jax.eval_shape(tx.init, jax.tree.unflatten(treedef, [module.param_specs[j] for j in idx]))
        leaves, outer = jax.tree.flatten(state, is_leaf=_param_like(treedef))
        return outer, [_param_like(treedef)(x) for x in leaves]

    return _cached(module, "layout", (tx,), idx, make)


class StateParts(NamedTuple):
    """A stage's optimizer state cut by parameter subsets, as leaf positions (plain data, computed once): part i's
    state is ``treedefs[i].unflatten([leaves[k] for k in index[i]])`` of the stage state's leaves; a leaf shared
    by every part (a step count) appears in each, parameter-shaped ones in their part only."""
    treedef: Any  # the stage state's
    treedefs: list  # each part's
    index: list[list[int]]  # each part's leaves, as positions in the stage state's
    shared: frozenset  # positions in every part


def state_parts(tx, module, stage: int, parts: list[tuple]) -> StateParts:
    """StateParts of `parts` (each a tuple of positions in the stage's parameter leaves, increasing)."""
    own = tuple(module.stage_params[stage])
    outer, kinds = subset_layout(tx, module, own)
    full = jax.tree.structure(jax.eval_shape(tx.init, _tree(module, stage, [module.param_specs[j] for j in own])))
    marked = jax.tree.unflatten(full, list(range(full.num_leaves)))
    leaves = jax.tree.flatten(marked, is_leaf=_param_like(subset_treedef(module, own)))[0]
    flat = [jax.tree.leaves(x) if kind else x for x, kind in zip(leaves, kinds)]
    treedefs, index = [], []
    for part in parts:
        idx = tuple(own[k] for k in part)
        sub_outer, _ = subset_layout(tx, module, idx)
        state = jax.tree.unflatten(sub_outer, [jax.tree.unflatten(subset_treedef(module, idx), [x[k] for k in part])
                                               if kind else x for x, kind in zip(flat, kinds)])
        got, treedef = jax.tree.flatten(state)
        treedefs.append(treedef)
        index.append(got)
    shared = frozenset.intersection(*map(frozenset, index)) if len(index) > 1 else frozenset()
    return StateParts(full, treedefs, index, shared)


def opt_layout(tx: optax.GradientTransformation, module, stage: int | None):
    """(outer treedef of tx's state with each parameter-shaped subtree as one leaf, which outer leaves those are,
    those leaves abstract), of the whole model (stage None) or one stage: computed once (unplace asks at every
    checkpoint and export)."""
    def make():
        treedef = module.param_treedef if stage is None else stage_treedef(module, stage)
        idx = range(len(module.param_paths)) if stage is None else module.stage_params[stage]
        abstract = _tree(module, stage, [module.param_specs[j] for j in idx])
        state = jax.eval_shape(tx.init, abstract)
        leaves, outer = jax.tree.flatten(state, is_leaf=_param_like(treedef))
        return outer, [_param_like(treedef)(x) for x in leaves], leaves

    outer, kinds, leaves = _cached(module, "opt_layout", (tx,), (stage,), make)
    return outer, list(kinds), list(leaves)


def check_layout(tx: optax.GradientTransformation, module) -> None:
    """ValueError unless every stage's optimizer state is the canonical one with fewer parameter leaves."""
    outer, kinds, leaves = opt_layout(tx, module, None)
    for s in range(module.num_stages):
        try:
            o, k, ls = opt_layout(tx, module, s)
        except (TypeError, ValueError, KeyError) as e:  # e.g. a mask given as a tree of the whole model
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"the optimizer fails on stage {s}'s parameters alone ({type(e).__name__}: {first}); the "
                             "pipeline updates each stage on its own: give masks and per-parameter options as "
                             "functions of the parameters (optax.adamw(mask=fn)), or use an elementwise optimizer.") \
                from e
        same = o == outer and k == kinds and all(
            kind or (jax.tree.structure(a) == jax.tree.structure(b) and
                     [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(b)])
            for kind, a, b in zip(kinds, leaves, ls))
        if not same:
            raise ValueError(f"the optimizer's state {optim.state_kind(jax.tree.unflatten(outer, leaves))} does not "
                             "split by parameter (leaves shaped like the parameters, or shared scalars such as a step "
                             "count); the pipeline updates each stage on its own: use an elementwise optimizer "
                             "(sgd, adam, adamw, adadelta) chained with jaxpar.optim.clip_by_global_norm if needed; to "
                             "freeze part of the model, pass the strategy wrt= (an NNX filter of what is trained) "
                             "instead of optax.multi_transform or optax.masked.")


def to_stage(tx, module, stage: int, opt_state: Any) -> Any:
    """The canonical optimizer state's part for `stage`."""
    outer, kinds, _ = opt_layout(tx, module, None)
    leaves = jax.tree.flatten(opt_state, is_leaf=_param_like(module.param_treedef))[0]
    out = []
    for leaf, kind in zip(leaves, kinds):
        if kind:
            flat = jax.tree.leaves(leaf)
            out.append(_tree(module, stage, [flat[j] for j in module.stage_params[stage]]))
        else:
            out.append(leaf)
    return jax.tree.unflatten(opt_layout(tx, module, stage)[0], out)


def to_canonical(tx, module, stage_states: dict[int, Any]) -> Any:
    """The canonical optimizer state from every stage's (each leaf from the stage owning it; shared scalars from
    stage 0's)."""
    outer, kinds, _ = opt_layout(tx, module, None)
    per_stage = {s: jax.tree.flatten(st, is_leaf=_param_like(stage_treedef(module, s)))[0]
                 for s, st in stage_states.items()}
    out = []
    for i, kind in enumerate(kinds):
        if not kind:
            out.append(per_stage[0][i])
            continue
        flat = [None] * len(module.param_paths)
        for s, leaves in per_stage.items():
            for j, a in zip(module.stage_params[s], jax.tree.leaves(leaves[i])):
                if module.owner[j] == s:
                    flat[j] = a
        out.append(_tree(module, None, flat))
    return jax.tree.unflatten(outer, out)


def probe(tx: optax.GradientTransformation, module, rtol: float = 1e-5) -> bool:
    """Whether tx needs the global gradient norm (True), is per-parameter (False); ValueError if it couples the
    stages some other way. Update steps on 3-element-per-dimension copies of the parameters, with gradients from
    jaxpar.optim.probe_gradients."""
    check_layout(tx, module)
    if module.num_stages == 1:
        return False
    tx = optax.with_extra_args_support(tx)
    rng = np.random.default_rng(0)
    shrink = [tuple(min(d, 3) for d in s.shape) for s in module.param_specs]
    params = [rng.standard_normal(s).astype(np.float32) for s in shrink]
    grads = optim.probe_gradients(shrink, rng)  # unit, then 1e12 with an inf: clipping and skipping show

    @optim.op_by_op
    def run(stage, norm: bool):
        idx = list(range(len(shrink))) if stage is None else module.stage_params[stage]
        p = _tree(module, stage, [jnp.asarray(params[j]) for j in idx])
        st, out = tx.init(p), []
        for g_all in grads:
            g = _tree(module, stage, [jnp.asarray(g_all[j]) for j in idx])
            extra = {"global_norm": jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in g_all))} if norm else {}
            u, st = tx.update(g, st, p, **extra)
            p = optax.apply_updates(p, u)
            out.append(jax.tree.leaves(u))
        return out

    def coupled(norm: bool) -> str | None:
        whole = run(None, False)  # as the single-device step runs it (a clip after Adam measures Adam's updates)
        for s in range(module.num_stages):
            for step, (w, u) in enumerate(zip(whole, run(s, norm))):
                for j, a in zip(module.stage_params[s], u):
                    if not np.allclose(a, w[j], rtol=rtol, atol=1e-7, equal_nan=True):
                        return f"stage {s}'s update of {'/'.join(map(str, module.param_paths[j]))} at step {step + 1}"
        return None

    where = coupled(False)
    if where is None:
        return False
    if coupled(True) is None:
        return True
    raise ValueError(f"the optimizer couples parameters across stages ({where} differs from the whole model's), "
                     "e.g. optax.clip_by_global_norm clips by the norm over all stages and optax.apply_if_finite skips "
                     "on a non-finite gradient in any stage; the pipeline updates each "
                     "stage on its own: use jaxpar.optim.clip_by_global_norm(max_norm) first in the chain (given the "
                     "norm over all stages' gradients) or a per-parameter optimizer.")
