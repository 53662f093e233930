"""ZeRO stage 3's parameter fetching: each layer's weights all-gathered just before its forward and again just
before its backward, never kept between the two (DeepSpeed's module hooks and PartitionedParameterCoordinator).

Roughly, for the layers of a model (its `layers`, whose composition is the model, as the pipeline takes them)
and this device's pieces of every parameter (one group per leaf, jaxpar.comm.shards):

    forward,  layer k:  w_k = all_gather(pieces_k)      issued once layer k-1's INPUT exists (one layer ahead)
                        y = layer_k(w_k, x)              w_k is freed: the backward saves activations, not w_k
    backward, layer k:  w_k = all_gather(pieces_k)      issued once layer k+1's backward has its cotangent
                        dx, dw_k = vjp(layer_k)(dy)      d pieces_k = reduce_scatter(dw_k): transpose of the gather

Each leaf is its own all-gather (XLA may combine them; DeepSpeed coalesces a module's): with one buffer per
leaf, a bias that an XLA fusion of the backward re-reads keeps only itself alive, where a shared buffer kept the
layer's whole forward copy. A weight shared by two layers (GPT-2's tied wte) is fetched by both. A frozen
weight (an nnx.Param that wrt leaves out: model state) is pieces too, gathered with its layer without a
gradient. "Issued once X exists" is an exact 0.0 computed from X and added to the pieces (XLA:CPU drops
optimization barriers; an arithmetic dependency it keeps). Each layer is a custom_vjp whose forward runs `jax.checkpoint`
with a policy that saves everything but the gathered weights and layout ops on them (transposes, casts), so
the backward re-gathers; its backward ties the re-gather to the incoming cotangent. The objective's per-sample
vmap (dropout keyed by sample) would batch that custom_vjp and reduce-scatter per sample, so under vmap the
layer is a custom_vmap whose rule runs the custom_vjp once, over the whole batch, the layer vmapped inside.
XLA drops the re-gathers the backward does not read (biases, LayerNorm shifts, the first layer's weights: no
input gradient), which DeepSpeed issues; the compiled step moves a little less than the model's 1.5x.

The model's class is swapped for a subclass whose __call__ composes the layers this way (`fetching`), so the
Objective, its per-sample RNG and the user's loss run unchanged. A model without `layers` is one unit.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import custom_batching
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal

from jaxpar.comm.overlap import tie, zero_after
from jaxpar.comm.shards import ShardPlan, all_gather_shards
from jaxpar.objective import replaced_error

NAME = "zero3_gathered"  # the checkpoint name of every gathered weight: never saved for the backward
META = "zero3_shape"  # Variable metadata: the full shape of the leaf whose piece the Variable holds
_LAYOUT = {"transpose", "reshape", "convert_element_type", "broadcast_in_dim", "squeeze", "expand_dims", "copy",
           "slice", "concatenate", "dynamic_slice", "all_gather", "name", "stop_gradient"}


def save_policy(prim, *_, **params) -> bool:
    """jax.checkpoint policy: save every residual except gathered weights and layout ops (recomputed)."""
    return prim.name not in _LAYOUT


class Settings(NamedTuple):
    wrt: Any  # the objective's filter of trained state
    axis_name: str
    per_sample: bool  # the objective vmaps the loss over rows: fetch through custom_vmap
    prefetch: bool = True  # gather layer k+1 once layer k's input exists (backward: once layer k+1's began)
    base: type | None = None  # the model's own class (a model without `layers` is called through it)
    compute_dtype: Any = None  # each gathered weight cast to it (mixed precision): gathered and reduced in its own
    whole: bool = False  # one unit even with `layers`: every weight at once, through the model's own __call__


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def tagged_treedef(state: nnx.State, which: Any = None) -> Any:
    """The treedef of `state` with its Variables (those at indices `which`, default all) marked with their leaf's
    full shape: its values are then the pieces, which the fetch gathers."""
    vs, treedef = jax.tree.flatten(state, is_leaf=_is_var)
    which = range(len(vs)) if which is None else set(which)
    return jax.tree.structure(jax.tree.unflatten(treedef, [v.replace(0, **{META: tuple(v.shape)}) if i in which
                                                           else v for i, v in enumerate(vs)]), is_leaf=lambda x: False)


def is_tagged(path, v) -> bool:
    """nnx filter: a Variable that holds this device's pieces (a trained or a partitioned frozen weight)."""
    return isinstance(v, nnx.Variable) and META in v.get_metadata()


def frozen_leaves(model_state: nnx.State) -> list[int]:
    """Indices (among `jax.tree.leaves(model_state, is_leaf=Variable)`) of the frozen weights stage 3 partitions:
    every nnx.Param that wrt leaves out, as DeepSpeed's zero.Init partitions every parameter, trained or not. Buffers
    (BatchNorm statistics, RNG streams) stay whole on every device, as DeepSpeed keeps module buffers."""
    return [i for i, v in enumerate(jax.tree.leaves(model_state, is_leaf=_is_var))
            if isinstance(v, nnx.Param) and v.get_value().size]


def tagged(treedef, plan: ShardPlan, shard: jax.Array) -> nnx.State:
    """The params State whose values are this device's pieces of each leaf (stage 3 plan: one group per leaf)."""
    by_leaf = [None] * len(plan.leaves)
    for g in plan.groups:
        by_leaf[g.leaves[0]] = shard[g.offset:g.offset + g.chunk]
    return jax.tree.unflatten(treedef, by_leaf)


def gather(variables: list, axis_name, compute_dtype=None, frozen: bool = False) -> list[jax.Array]:
    """The full weights of tagged Variables from their pieces: one all-gather per leaf, so each leaf has a buffer
    of its own (a bias that a backward fusion re-reads pins only itself); its transpose reduce-scatters each
    leaf's gradient. With `compute_dtype` (mixed precision) a floating weight is cast after its gather, so its
    gradient is reduce-scattered in the pieces' dtype (float32), as ZeRO stages 1-2 and DDP reduce: summed in
    float16 it overflowed where theirs did not. A `frozen` weight is gathered without a gradient (no
    reduce-scatter in the backward) and not cast, as the single step leaves the model state uncast."""
    out = []
    for v in variables:
        shape = v.get_metadata()[META]
        full = all_gather_shards(v.get_value(), axis_name).reshape(-1)[:math.prod(shape)].reshape(shape)
        if frozen:
            out.append(checkpoint_name(jax.lax.stop_gradient(full), NAME))
            continue
        if compute_dtype is not None and jnp.issubdtype(full.dtype, jnp.floating):
            full = full.astype(compute_dtype)
        out.append(checkpoint_name(full, NAME))
    return out


def _token(tree: Any) -> jax.Array:
    arrays = [a for a in jax.tree.leaves(tree) if hasattr(a, "dtype") and a.size]
    return zero_after(arrays[0]) if arrays else jnp.zeros((), jnp.float32)


def _full(tree, s: Settings, frozen: bool):
    """`tree` (an nnx.State of tagged Variables) with each Variable's pieces replaced by the gathered weight."""
    vs = jax.tree.leaves(tree, is_leaf=_is_var)
    dtype = None if frozen else s.compute_dtype
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=_is_var),
                              [v.replace(w) for v, w in zip(vs, gather(vs, s.axis_name, dtype, frozen))])


def _kept(layer: nnx.Module) -> dict:
    """{path: value} of the layer's variables that a per-sample forward may not replace: all but its weights,
    RNG streams and sown values (as jaxpar.objective's check, which cannot see a layer the fetch ran)."""
    state = nnx.state(layer, nnx.Not(nnx.Any(nnx.RngState, nnx.Param, nnx.Intermediate)))
    return {tuple(path): v.get_value() for path, v in nnx.to_flat_state(state)}


def _refuse_changed(given: list, after, shared: frozenset | None) -> None:
    """ValueError (at trace time) if the forward assigned or replaced a partitioned frozen weight (`given`: (path,
    value) as the unit gave them, `after`: the frozen State after the forward): its pieces cannot keep the change.
    `shared`: refuse only for these paths (per sample: the weights another unit holds too); None: for every one."""
    now = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(after)}
    for path, a in given:
        if (shared is None or path in shared) and now.get(path) is not a:
            raise ValueError(f"the forward changes frozen weight {'/'.join(map(str, path))} (an nnx.Param that wrt "
                             "leaves out), which ZeRO stage 3 partitions over the devices as DeepSpeed does every "
                             "parameter, so the change would be lost (per sample: not seen by the other layer that "
                             "holds it): keep a value the forward updates in a variable "
                             "that is not an nnx.Param (nnx.BatchStat or your own nnx.Variable type), or train it "
                             "(include it in wrt); nnx.remat inside a layer also writes its weights back as new "
                             "values: use jax.checkpoint on a pure function there, or ZeRO stage 1 or 2.")


def _refuse_captured_lists(layer: nnx.Module, s: Settings) -> None:
    """ValueError where `layer` runs inside nnx.capture and holds an nnx.List: flax (0.12) adds its capture slot
    to the list, whose state's keys then mix ints and a name that JAX cannot sort (google/flax#5571)."""
    for path, node in nnx.iter_graph(layer):
        if isinstance(node, nnx.List) and hasattr(node, "__captures__"):
            where = "/".join(map(str, path)) or type(layer).__name__
            raise ValueError(f"nnx.capture around a model whose {where} is an nnx.List cannot pass through ZeRO "
                             "stage 3's fetch: flax adds the capture's slot to the list, whose keys then mix "
                             "ints and a name JAX cannot sort (google/flax#5571); sow with self.sow(...) and read "
                             "the values with nnx.pop(model, nnx.Intermediate) in the loss instead"
                             + (", or fetch per layer (fetch='layer')." if s.whole else "."))


def _unit(graphdef, call: Callable, s: Settings, axes, last: bool, shared: frozenset = frozenset()):
    """The custom_vjp of one layer `(pieces, frozen pieces, x, rest, after, link) -> ((y, rest'), link)`; `axes`:
    vmap in_axes of (x, rest) when the call runs over a batch of samples, None when it runs once. A forward that
    assigns (or replaces) a frozen weight is refused in batch mode, where the single step keeps the change. Per
    sample the single step drops every change but the RNG streams' at the end of the step (jaxpar.objective), and
    so does the fetch, but a later layer reads the changed value within the forward: refused where another unit
    holds the weight too (`shared`, its paths in this layer), which would gather the old one. Per sample a forward
    that replaces any other variable but the RNG streams and sown values (a counter, a statistic) is refused, as
    the single step refuses it (the fetch kept only the draws and trained on, dropping the change)."""
    def region(lp, fz, x, rest):
        full, frozen = _full(lp, s, False), _full(fz, s, True)

        def apply(x, rest, frozen):  # frozen passed in: under vmap, Variables of this trace (the forward may assign)
            model = nnx.merge(graphdef, full, frozen, rest)
            given = [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(frozen)]  # merge shares the Variables
            kept = _kept(model) if s.per_sample else {}
            y = call(model, x)
            _, _, frozen_after, rest_after = nnx.split(model, s.wrt, is_tagged, ...)
            _refuse_changed(given, frozen_after, shared if s.per_sample else None)
            now = _kept(model) if s.per_sample else {}
            changed = [path for path, a in kept.items() if now.get(path) is not a]
            if changed:  # the update below keeps only the draws: the single step refuses it, so does the fetch
                raise replaced_error(type(model).__name__, "".join(f"[{k!r}]" for k in changed[0]))
            return y, rest_after

        return apply(x, rest, frozen) if axes is None else jax.vmap(apply, in_axes=(*axes, None))(x, rest, frozen)

    region = jax.checkpoint(region, policy=save_policy)
    slots: list = []  # positions of the pieces among the backward's residuals (found at trace time)

    @jax.custom_vjp
    def unit(lp, fz, x, rest, after, link):
        return region(lp, fz, x, rest), link

    def fwd(lp, fz, x, rest, after, link):
        lp, fz = tie((lp, fz), _token(after))  # gather once `after` exists
        out, vjp = jax.vjp(region, lp, fz, x, rest)
        ids = {id(a) for a in jax.tree.leaves((lp, fz))}
        slots[:] = [i for i, r in enumerate(jax.tree.leaves(vjp)) if id(r) in ids]
        return (out, link), vjp

    def bwd(vjp, cts):
        (ct_y, ct_rest), ct_link = cts
        token = _token(ct_y) if last or not s.prefetch else ct_link  # the next layer's backward has begun
        res, treedef = jax.tree.flatten(vjp)
        for i in slots or range(len(res)):
            res[i] = tie(res[i], token)
        d_lp, _, d_x, _ = jax.tree.unflatten(treedef, res)((ct_y, ct_rest))
        return d_lp, None, d_x, None, None, _token(ct_y)

    unit.defvjp(fwd, bwd)
    return unit


def fetch_call(layer: nnx.Module, x: Any, after: Any, link: jax.Array, s: Settings, call: Callable,
               last: bool, shared: frozenset = frozenset()) -> tuple[Any, jax.Array]:
    """`call(layer, x)` with the layer's weights gathered from their pieces (forward and backward); its frozen
    weights (partitioned model state) are gathered too, without a gradient; `shared`: the paths of those that
    another layer holds too."""
    _refuse_captured_lists(layer, s)
    graphdef, lp, fz, rest = nnx.split(layer, s.wrt, is_tagged, ...)
    if not s.per_sample:
        (y, new_rest), link = _unit(graphdef, call, s, None, last)(lp, fz, x, rest, after, link)
        nnx.update(layer, new_rest)
        return y, link

    @custom_batching.custom_vmap
    def batched(lp, fz, x, rest, after, link):
        return _unit(graphdef, call, s, None, last, shared)(lp, fz, x, rest, after, link)

    @batched.def_vmap
    def rule(axis_size, in_batched, lp, fz, x, rest, after, link):
        if any(jax.tree.leaves(in_batched[:2])) or in_batched[5]:
            raise ValueError("ZeRO stage 3 fetches weights that vary by sample; the parameters must be the "
                             "same for every row (do not vmap over them).")
        axes = jax.tree.map(lambda b: 0 if b else None, (in_batched[2], in_batched[3]))
        if not any(jax.tree.leaves((in_batched[2], in_batched[3]))):
            out = _unit(graphdef, call, s, None, last, shared)(lp, fz, x, rest, after, link)
            return out, jax.tree.map(lambda _: False, out)
        (y, new_rest), link = _unit(graphdef, call, s, axes, last, shared)(lp, fz, x, rest, after, link)
        return ((y, new_rest), link), ((jax.tree.map(lambda _: True, y), jax.tree.map(lambda _: True, new_rest)),
                                       False)

    (y, new_rest), link = batched(lp, fz, x, rest, after, link)
    # per sample the step keeps only the draws, but values sown in this forward (nnx.Intermediate) reach the loss,
    # which may pop and differentiate them (an auxiliary loss)
    nnx.update(layer, nnx.filter_state(new_rest, nnx.Any(nnx.RngState, nnx.Intermediate)))
    return y, link


_UNITS = ("custom_vjp_call", "custom_vjp_call_jaxpr")  # a fetch unit: gathers the pieces it is given
_LAYOUT_OF_PIECES = ("slice", "dynamic_slice", "reshape", "squeeze", "copy", "copy_p")  # pieces still


def check_reads(fn: Callable, args: tuple, pieces: list[tuple[int, str]], sliced: dict | None = None) -> None:
    """ValueError (at trace time) unless every piece reaches the computation only through a fetch unit: `fn(*args)`
    traced, `pieces` the (flat input index, weight name) of each input that holds this device's pieces, `sliced`
    {offset: name} the weights a static slice of an input at that offset holds (the trained leaves' flat shard). A loss
    that reads a weight outside the model's `__call__` (loss_fn(model, batch) scaling by `model.temp`) would
    read one device's piece, padded, where the single step reads the weight: a wrong number, mostly without an
    error (a 1-element piece broadcasts)."""
    closed = jax.make_jaxpr(fn)(*args)
    origin = {closed.jaxpr.invars[i]: name for i, name in pieces}

    def walk(jaxpr, origin):
        for eqn in jaxpr.eqns:
            got = [origin[v] for v in eqn.invars if not isinstance(v, Literal) and v in origin]
            if not got or eqn.primitive.name in _UNITS:
                continue
            if eqn.primitive.name in _LAYOUT_OF_PIECES:
                name = got[0]
                if eqn.primitive.name == "slice" and sliced:
                    name = sliced.get(eqn.params["start_indices"][0], name)
                origin.update({v: name for v in eqn.outvars})
            elif eqn.primitive.name in ("pjit", "closed_call", "core_call") and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                inner = getattr(inner, "jaxpr", inner)
                sub = {iv: origin[v] for iv, v in zip(inner.invars, eqn.invars)
                       if not isinstance(v, Literal) and v in origin}
                walk(inner, sub)
            else:
                raise ValueError(f"ZeRO stage 3 holds weight {got[0]} as 1/N pieces, gathered only where the model "
                                 f"runs, but the loss reads it elsewhere ({eqn.primitive.name}; e.g. loss_fn using "
                                 "a model attribute outside the model's __call__), where it would see this device's "
                                 "piece: read it inside the model's __call__, or use ZeRO stage 1 or 2.")

    walk(closed.jaxpr, origin)


def _has_pieces(layer) -> bool:
    return isinstance(layer, nnx.Module) and bool(jax.tree.leaves(nnx.state(layer, is_tagged)))


def _fetching_call(self, *args, **kwargs):
    from jaxpar.pipeline.module import call_layer

    s: Settings = type(self)._zero3
    layers = None if s.whole else getattr(self, "layers", None)
    link = jnp.zeros((), jnp.float32)
    if not layers or len(args) != 1 or kwargs:  # one unit: the whole model, through its own __call__
        whole = lambda m, inputs: s.base.__call__(m, *inputs[0], **inputs[1])  # noqa: E731
        return fetch_call(self, (args, kwargs), args, link, s, whole, True)[0]
    x = prev = args[0]
    with_params = [i for i, layer in enumerate(layers) if _has_pieces(layer)]
    trained = nnx.filterlib.to_predicate(s.wrt)
    frozen = [{id(v): tuple(p) for p, v in nnx.iter_graph(layer) if is_tagged(p, v) and not trained(p, v)}
              if i in with_params else {} for i, layer in enumerate(layers)]
    held = collections.Counter(k for f in frozen for k in f)
    unpack = isinstance(self, nnx.Sequential)  # its layers take an earlier one's tuple as *args, as the pipeline's
    for i, layer in enumerate(layers):
        call = functools.partial(call_layer, unpack=unpack, index=i)
        if i in with_params:
            shared = frozenset(p for k, p in frozen[i].items() if held[k] > 1)
            y, link = fetch_call(layer, x, prev, link, s, call, i == with_params[-1], shared)
        else:
            y = call(layer, x)
        prev, x = x, y
    return x


_CLASSES: dict = {}


def fetching(model: nnx.Module, settings: Settings) -> type:
    """The subclass of type(model) whose __call__ fetches each layer's weights (made once per class+settings)."""
    key = (type(model), settings)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"ZeRO3{type(model).__name__}", (type(model),),
                             {"__call__": _fetching_call, "_zero3": settings, "__module__": __name__})
    return _CLASSES[key]


def fetching_graphdefs(objective, params: nnx.State, model_state: nnx.State, settings: Settings):
    """(train graphdef, eval graphdef) of the objective's model with the fetching __call__."""
    out = []
    for graphdef in (objective.graphdef, objective.eval_graphdef):
        model = nnx.merge(graphdef, params, model_state)
        model.__class__ = fetching(model, settings._replace(base=type(model)))
        out.append(nnx.split(model, objective.wrt, ...)[0])
    return tuple(out)


def units(model: nnx.Module, wrt: Any = nnx.Param, whole: bool = False, rest: bool = False) -> list[list[int]]:
    """The leaf indices (of `nnx.split(model, wrt, ...)[1]`, or [2], the model state, with `rest`) each layer
    fetches, in forward order; one unit of every leaf for a model without `layers`, or `whole`; layers holding
    none are left out. Outside jit: plans and cost models."""
    from jaxpar.comm.overlap import _path_of

    params = nnx.split(model, wrt, ...)[2 if rest else 1]
    index = {_path_of(p): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])}
    where = {id(node): tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}
    layers = None if whole else getattr(model, "layers", None)
    if not layers:
        return [sorted(index.values())]
    out = []
    for layer in layers:
        if isinstance(layer, nnx.Module):
            found = sorted({index[where[id(v)]] for _, v in nnx.iter_graph(layer)
                            if isinstance(v, nnx.Variable) and where.get(id(v)) in index})
            if found:
                out.append(found)
    return out
