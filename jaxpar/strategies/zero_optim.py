"""The optimizer on a flat shard (ZeRO): each device runs optax on ``{"shard": its S elements}``.

That equals the single-device update only for ELEMENTWISE transforms: each output element may depend on the
same element of the gradient, parameters and state, and on nothing else. sgd, momentum, adam, adamw, adadelta
are; adafactor (factored row/column moments), LAMB / LARS (per-leaf trust ratios) and optax.clip_by_global_norm
(the norm over every leaf) are not. `check` finds out before training, numerically: tx runs on a shrunk copy of
the parameters (each dimension cut to 3) once as the canonical tree and once as flat pieces, one cut through the
largest leaf, and the updates must agree. A transform that agrees once it is given the global norm
(jaxpar.optim.clip_by_global_norm, an optax extra argument ``global_norm``) gets it: the step adds the shards'
squared norms over the DATA axis. Anything else is refused with a one-line ValueError naming the fix.

The canonical optax state (tx.init(params)) maps to the flat one leaf by leaf: every subtree shaped like the
parameters (Adam's mu and nu) becomes one [N, S] array in the shard layout (jaxpar.comm.shards); every other
leaf (a step count) is shared by all devices as it is.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar import loss_scale, optim
from jaxpar.comm import shards as shard_lib

KEY = "shard"
FIX = ("use an elementwise optimizer (sgd, adam, adamw, adadelta), chained after jaxpar.optim.clip_by_global_norm "
       "for clipping, with jaxpar.optim.add_decayed_weights_to_matrices for a decay on the matrices only; to "
       "freeze part of the model, pass the strategy wrt= (an NNX filter of what is trained) instead of "
       "optax.multi_transform or optax.masked")


def flat_tree(vector: Any) -> dict:
    """The pytree the optimizer sees under ZeRO: one flat vector."""
    return {KEY: vector}


def is_flat(x) -> bool:
    return isinstance(x, dict) and list(x) == [KEY]


def _like(treedef):
    return lambda x: jax.tree.structure(x) == treedef


def layouts(tx: optax.GradientTransformation, params) -> tuple[Any, list[bool], Any]:
    """(outer treedef of tx's state with each parameter-shaped subtree as one leaf, which leaves those are,
    the flat state's outer treedef); ValueError when the two states do not correspond leaf for leaf.

    Computed once per optimizer and parameter structure (shapes, dtypes): `unplace` asks at every evaluation and
    checkpoint, and each answer traces tx.init twice."""
    leaves, treedef = jax.tree.flatten(params)
    specs = tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves)
    try:
        c_outer, kinds, f_outer = _layouts(tx, treedef, specs)
    except TypeError as e:  # an optimizer that cannot be a cache key (unhashable): computed each time
        if "unhashable" not in str(e):
            raise
        c_outer, kinds, f_outer = _layouts.__wrapped__(tx, treedef, specs)
    return c_outer, list(kinds), f_outer


@functools.lru_cache(maxsize=64)
def _layouts(tx: optax.GradientTransformation, treedef, specs: tuple) -> tuple[Any, tuple[bool, ...], Any]:
    params = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs])
    canonical = jax.eval_shape(tx.init, params)
    c_leaves, c_outer = jax.tree.flatten(canonical, is_leaf=_like(treedef))
    try:
        flat = jax.eval_shape(tx.init, flat_tree(jax.ShapeDtypeStruct((7,), jnp.float32)))
    except (TypeError, ValueError, KeyError) as e:  # e.g. a mask given as a tree of the model's parameters
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"the optimizer fails on a flat parameter vector ({type(e).__name__}: {first}); {FIX}.") \
            from e
    f_leaves, f_outer = jax.tree.flatten(flat, is_leaf=is_flat)
    shapes = [a.shape for a in jax.tree.leaves(params)]
    kinds = [_like(treedef)(x) and [a.shape for a in jax.tree.leaves(x)] == shapes for x in c_leaves]
    same = c_outer == f_outer and kinds == [is_flat(x) and x[KEY].shape == (7,) for x in f_leaves] and all(
        kind or (jax.tree.structure(a) == jax.tree.structure(b) and
                 [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(b)])
        for kind, a, b in zip(kinds, c_leaves, f_leaves))
    if not same:
        raise ValueError(f"the optimizer's state {optim.state_kind(canonical)} does not split element by element "
                         "(leaves shaped like the parameters, or shared scalars such as a step count), so ZeRO cannot "
                         f"partition it; {FIX}.")
    return c_outer, tuple(kinds), f_outer


def flat_state_shapes(tx: optax.GradientTransformation, params, size: int, dtype) -> tuple[Any, list[bool], list]:
    """(outer treedef, which leaves are sharded, the flat state's leaves as ShapeDtypeStructs) for a flat vector of
    `size` elements."""
    _, kinds, outer = layouts(tx, params)
    state = jax.eval_shape(tx.init, flat_tree(jax.ShapeDtypeStruct((size,), dtype)))
    return outer, kinds, jax.tree.flatten(state, is_leaf=is_flat)[0]


def check(tx: optax.GradientTransformation, params, rtol: float = 1e-5, slices: list | None = None) -> bool:
    """Whether tx needs the global gradient norm (True) or is elementwise (False); ValueError otherwise.
    Update steps on 3-per-dimension copies of the parameters, whole and in flat pieces, with gradients from
    jaxpar.optim.probe_gradients; and the per-parameter choices tx makes from the parameter tree (`shape_choices`)
    on the true shapes against the flat pieces -- and, given `slices` (each leaf's shape on one tensor-parallel
    rank, in flatten order), against those."""
    layouts(tx, params)
    shape_choices(tx, params, slices)
    plain, tx = not isinstance(tx, optax.GradientTransformationExtraArgs), optax.with_extra_args_support(tx)
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(params)
    shrink = [tuple(min(d, 3) for d in np.shape(a)) for a in leaves]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shrink]
    grads = optim.probe_gradients(shrink, rng)  # unit, then 1e12 with an inf: clipping and skipping show
    ravel = lambda xs: np.concatenate([np.ravel(x) for x in xs])  # noqa: E731
    sizes = [int(np.prod(x)) for x in shrink]
    big = int(np.argmax(sizes))  # cut the largest leaf in two (a per-leaf transform must see it), and the middle
    total = sum(sizes)
    cuts = sorted({0, sum(sizes[:big]) + sizes[big] // 2, total // 2, total})
    decays = decay_mask(shrink)  # what ZeRO's step gives a masked weight decay for its flat pieces

    @optim.op_by_op
    def run(tree_of, norm: bool, mask=None) -> list[np.ndarray]:
        p, out = tree_of(p0), []
        state = tx.init(p)
        for g_all in grads:
            extra = {"global_norm": jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in g_all))} if norm else {}
            extra = extra if mask is None else {**extra, "decay_mask": mask}
            u, state = tx.update(tree_of(g_all), state, p, **extra)
            p = optax.apply_updates(p, u)
            out.append(ravel(jax.tree.leaves(u)))
        return out

    def agrees(norm: bool) -> bool:  # the whole tree as the single-device step runs it: no norm given (a clip
        # after Adam measures Adam's updates there, not the gradient: handed the gradient's norm, it would differ)
        whole = run(lambda xs: jax.tree.unflatten(treedef, [jnp.asarray(x) for x in xs]), False)
        parts = [run(lambda xs, a=a, b=b: flat_tree(jnp.asarray(ravel(xs)[a:b])), norm,
                     flat_tree(jnp.asarray(decays[a:b]))) for a, b in zip(cuts[:-1], cuts[1:])]
        return all(np.allclose(np.concatenate([p[step] for p in parts]), w, rtol=rtol, atol=1e-7,
                               equal_nan=True)
                   for step, w in enumerate(whole))

    return _verdict(agrees, tx, params, "a flat parameter vector", "a slice of the parameters",
                    "optax.clip_by_global_norm, optax.apply_if_finite", plain)


def _verdict(agrees, tx, params, fails_on: str, pieces: str, examples: str, plain: bool = False) -> bool:
    """From `agrees(norm)` (the pieces' updates equal the whole tree's, given the global norm or not): False, or a
    loss scaler's True (elementwise; a loss scaler skips on the global norm, which every piece must be given), or
    True (needs the global norm); ValueError where tx fails on the pieces (a transform that looks into the parameter
    tree), or where neither agrees (`pieces`: what each device updates; `examples`: transforms that couple them)."""
    try:
        if agrees(False):
            return loss_scale.wraps(tx, params)
        if agrees(True):
            return True
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"the optimizer fails on {fails_on} ({type(e).__name__}: {e}); {FIX}.") from e
    raise ValueError(f"the optimizer is not elementwise (e.g. {examples}, or jaxpar.optim.clip_by_global_norm "
                     f"anywhere but first in the chain): its update of {pieces} differs from its update of the whole "
                     f"tree, so what each device updates would not equal the single-device step; {FIX}"
                     f"{PLAIN if plain else ''}.")


def check_slices(tx: optax.GradientTransformation, params, slices: list, axes: list, tp: int,
                 rtol: float = 1e-5) -> bool:
    """`check` for tensor parallelism without ZeRO, where each rank updates the parameter tree of its own slices
    (each leaf cut along its axis in `axes` into `tp`, flatten order, None: whole on every rank; `slices`: each
    leaf's shape there, tensor.rank_shapes): whether tx needs the global
    gradient norm (True) or is elementwise (False); ValueError otherwise. Update steps on small copies of the
    parameters, whole and as each rank's slices, with jaxpar.optim.probe_gradients; and the per-parameter choices
    tx makes from the parameter tree on the slices (`shape_choices`, flat=False). A choice by ndim (nanoGPT's "decay
    the 2-D weights") passes here: a slice keeps its leaf's ndim, where ZeRO's flat pieces (`check`) do not."""
    leaves, treedef = jax.tree.flatten(params)
    shrink = [tuple(2 * tp if k == ax else min(d, 3) for k, d in enumerate(np.shape(a))) for a, ax in zip(leaves, axes)]
    shape_choices(tx, params, slices, flat=False)  # the true slices: a size threshold shows there
    plain, tx = not isinstance(tx, optax.GradientTransformationExtraArgs), optax.with_extra_args_support(tx)
    rng = np.random.default_rng(0)
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shrink]
    grads = optim.probe_gradients(shrink, rng)  # unit, then 1e12 with an inf: clipping and skipping show

    def cut(xs, r):  # rank r's slices (None: the whole tree, as one device holds it)
        if r is None:
            return xs
        return [x if ax is None else np.split(x, tp, axis=ax)[r] for x, ax in zip(xs, axes)]

    @optim.op_by_op
    def run(r, norm: bool) -> list[list[np.ndarray]]:  # each step's update leaves on rank r
        tree = lambda xs: jax.tree.unflatten(treedef, [jnp.asarray(x) for x in cut(xs, r)])  # noqa: E731
        p, out = tree(p0), []
        state = tx.init(p)
        for g_all in grads:
            extra = {"global_norm": jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in g_all))} if norm else {}
            u, state = tx.update(tree(g_all), state, p, **extra)
            p = optax.apply_updates(p, u)
            out.append([np.asarray(a) for a in jax.tree.leaves(u)])
        return out

    def agrees(norm: bool) -> bool:  # the whole tree as the single-device step runs it: no norm given
        whole = run(None, False)
        ranks = [run(r, norm) for r in range(tp)]
        return all(np.allclose(got, want, rtol=rtol, atol=1e-7, equal_nan=True)
                   for r, steps in enumerate(ranks) for step, (us, ws) in enumerate(zip(steps, whole))
                   for got, want in zip(us, cut(ws, r)))

    return _verdict(agrees, tx, params, "a tensor-parallel rank's slices of the parameters",
                    "a tensor-parallel rank's slices of the parameters", "optax.clip_by_global_norm, optax.lamb",
                    plain)


# a plain optax.GradientTransformation (optax.MultiSteps, its .gradient_transformation(), a user's own) drops the
# extra arguments the strategies hand the optimizer: ZeRO's decay_mask, the global norm (a QA pass: MultiSteps around
# add_decayed_weights_to_matrices was refused as "not elementwise" with the advice to use that very transform)
PLAIN = ("; the optimizer is a plain optax.GradientTransformation (e.g. optax.MultiSteps), which drops the extra "
         "arguments a strategy hands it (decay_mask for jaxpar.optim.add_decayed_weights_to_matrices, global_norm for "
         "jaxpar.optim.clip_by_global_norm): inside it those two act as on one whole tree; use the strategy's "
         "grad_accum= for the accumulation instead of MultiSteps")

CHOOSERS = ("mask", "param_labels")  # optax.masked's mask, optax.multi_transform's labels: a tree, or a callable


def choosers(tx: optax.GradientTransformation, limit: int = 5000) -> list:
    """The callables in tx that choose per parameter from the parameter tree: optax.masked's `mask` (behind
    adamw(mask=...), add_decayed_weights(mask=...)) and optax.multi_transform's `param_labels`, read off the
    closures of tx's functions (optax keeps them nowhere else)."""
    found, seen, todo = [], set(), [tx]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (tuple, list)):
            todo.extend(obj)
            continue
        if isinstance(obj, functools.partial):
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
            continue
        code, cells = getattr(obj, "__code__", None), getattr(obj, "__closure__", None)
        for name, cell in zip(code.co_freevars if code is not None else (), cells or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            if name in CHOOSERS and callable(value):
                found.append((name, value))
            elif callable(value) or isinstance(value, (tuple, list, functools.partial)):
                todo.append(value)
    return found


def shape_choices(tx: optax.GradientTransformation, params, slices: list | None = None, flat: bool = True) -> None:
    """ValueError where a mask or label function of tx (`choosers`) chooses by a parameter's shape (its ndim or
    size: nanoGPT's "decay the 2-D weights" written as optax.adamw(mask=lambda p: tree_map(lambda x: x.ndim > 1,
    p))): ZeRO hands the optimizer flat pieces of many parameters and tensor parallelism each rank's slices, for
    which it would choose otherwise -- silently: the numeric check's shrunk copies miss a threshold on the size, and
    a decay too small to show. Evaluated on shapes only (jax.ShapeDtypeStruct); a function that reads values is left
    to the numeric check. `flat` False: the slices only (tensor parallelism without ZeRO)."""
    leaves, treedef = jax.tree.flatten(params)
    whole = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) for a in leaves])
    total = sum(int(np.prod(np.shape(a))) for a in leaves)
    # (where, the tree the optimizer sees there, whether its choices must match leaf for leaf or be one for all)
    views = [("ZeRO's flat pieces of the parameters", flat_tree(jax.ShapeDtypeStruct((n,), jnp.float32)), False)
             for n in (sorted({1, 7, total}) if flat else ())]
    if slices is not None:
        views.append(("a tensor-parallel rank's slices of them", jax.tree.unflatten(
            treedef, [jax.ShapeDtypeStruct(tuple(s), jnp.result_type(a)) for s, a in zip(slices, leaves)]), True))
    for name, fn in choosers(tx):
        try:
            own = _per_leaf(fn(whole), whole)
        except Exception:  # noqa: BLE001  (reads values, or wants another tree: the numeric check's to judge)
            continue
        for where, tree, leafwise in views:
            try:
                got = _per_leaf(fn(tree), tree)
            except Exception:  # noqa: BLE001
                continue
            if got != own if leafwise else not (len(set(got)) == 1 and set(own) == set(got)):
                # a rank's slices keep their leaves' paths, so only a choice by shape differs there; ZeRO's flat
                # pieces keep neither, so a choice by path is refused there too (a QA pass: the old advice, "choose
                # by the parameter's path", was refused by this same check)
                how, fix = ("by a parameter's shape", "choose by the parameter's path, not its shape, or") \
                    if leafwise else ("per parameter (by its shape or its path)",
                                      "ZeRO's flat pieces keep neither the parameters' shapes nor their paths, so no "
                                      "mask or label function can choose per parameter there: keep such a choice to "
                                      "a strategy without ZeRO (DDP, the pipeline, tensor parallelism), or")
                raise ValueError(
                    f"the optimizer's {'mask' if name == 'mask' else 'labels'} function "
                    f"{getattr(fn, '__name__', type(fn).__name__)} chooses {how}: on the parameters "
                    f"it gives {_summary(own)}, on {where} {_summary(got)}, so those elements would be updated "
                    f"otherwise than on one device, without a word; {fix} "
                    "for a decay on the matrices only use jaxpar.optim.add_decayed_weights_to_matrices "
                    "(make_optimizer(decay_params='matrices'), train.py's --decay-params matrices), which the "
                    "strategies apply per element.")


def _per_leaf(choice, tree) -> list:
    """A mask or labels tree (a prefix of `tree`'s, as optax takes them) as one choice per leaf of `tree`;
    TypeError where a choice is not a bool or a label (an array: the function read values)."""
    pairs = jax.tree.leaves(jax.tree.map(lambda c, t: (c, len(jax.tree.leaves(t))), choice, tree),
                            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], int))
    out = [bool(c) if isinstance(c, (bool, np.bool_)) else c for c, n in pairs for _ in range(n)]
    if not all(isinstance(c, (bool, str, int)) for c in out):
        raise TypeError("a choice that is not a bool or a label")
    return out


def _summary(choices: list) -> str:
    counts = {c: choices.count(c) for c in dict.fromkeys(choices)}
    return ", ".join(f"{c!r} for {k} of {len(choices)} leaves" for c, k in counts.items())


def decay_values(shapes) -> list[float]:
    """Per leaf of these shapes, 1.0 where jaxpar.optim's rule decays it, else 0.0: what ZeRO packs per element into
    optax's extra argument ``decay_mask`` for jaxpar.optim.add_decayed_weights_to_matrices."""
    from jaxpar.optim import decays

    return [float(decays(tuple(s))) for s in shapes]


def decay_mask(shapes) -> np.ndarray:
    """`decay_values` spread over each leaf's elements, in order: the mask of one flat vector of those leaves."""
    return np.concatenate([np.full(int(np.prod(s)), v, np.float32) for s, v in zip(shapes, decay_values(shapes))])


def to_flat(tx, plan: shard_lib.ShardPlan, params, opt_state) -> list:
    """The canonical optax state as the flat state's leaves: parameter-shaped subtrees packed as host [N, S]
    arrays, other leaves as they are (unflatten with `layouts(...)[2]`)."""
    _, kinds, _ = layouts(tx, params)
    leaves = jax.tree.flatten(opt_state, is_leaf=_like(jax.tree.structure(params)))[0]
    return [shard_lib.pack(plan, [np.asarray(a) for a in jax.tree.leaves(x)], xp=np) if kind else x
            for x, kind in zip(leaves, kinds)]


def from_flat(tx, plan: shard_lib.ShardPlan, params, flat_leaves: list) -> Any:
    """The canonical optax state from the flat state's leaves (host [N, S] arrays for the sharded ones)."""
    outer, kinds, _ = layouts(tx, params)
    treedef = jax.tree.structure(params)
    out = [jax.tree.unflatten(treedef, [jnp.asarray(a) for a in shard_lib.unpack(plan, x)]) if kind else x
           for x, kind in zip(flat_leaves, kinds)]
    return jax.tree.unflatten(outer, out)


def gather_to_host(a: jax.Array) -> np.ndarray:
    """A sharded global array whole, on the host (gathered across processes when it spans several)."""
    if not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(a)
