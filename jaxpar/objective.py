"""The model-and-loss contract every strategy trains: a Flax NNX module, a loss, and which state is trained.

    def loss_fn(model, batch):                       # any NNX module, any batch pytree
        pred = model(batch["x"])
        return jnp.sum((pred - batch["y"]) ** 2), batch["y"].size   # (summed loss, summed weight[, metrics])
    objective = Objective.of(model, loss_fn)          # wrt=nnx.Param: what is differentiated and updated

A loss returns SUMS over the batch it is given: the loss summed over its examples (rows, tokens, masked
positions), the summed weight of those examples, and optional metrics summed the same way (a dict). Every
strategy adds these up over its shards and micro-batches and divides once by the global weight, so any split of
the batch gives the gradient of the same global mean loss. Reports divide the metrics by the weight too
(accuracy = correct / weight).

`nnx.split(model, wrt, ...)` cuts the model into the trained parameters and the rest (RNG streams, BatchStat,
user variables): the rest is carried through the step and returned, never differentiated. Two modes:

- ``per_sample=True`` (the default for models without BatchStat): the loss runs on each row alone -- jax.vmap
  over rows, each row a batch of one -- and each row's random draws come from
  ``fold_in(fold_in(stream key, stream count), sample id)`` for every RNG stream of the model (stock
  `nnx.Dropout(rate, rngs=rngs)` included). Dropout masks then depend on the sample, never on the device or
  micro-batch holding it, and padding rows drop out exactly: every split gives the single-device numbers.
  The model may not change its other state in the forward (that would differ per row): use per_sample=False.
  Left at its default, the strategies check on the first batch that the loss does not mix rows
  (`check_rows_apart`).
- ``per_sample=False`` (models with BatchStat; losses over the whole batch, such as in-batch negatives): the
  loss sees the whole local shard, as in torch's DDP. BatchNorm uses the shard's statistics and its running
  buffers follow replica 0 (``broadcast_buffers=True``); random draws are keyed by the shard; shards must hold
  no padding rows. Equal to the single-device step only on one device (or with SyncBatchNorm, see
  jaxpar.sync_batch_norm).

After every training step each RNG stream's count advances by one, as if it had been drawn once.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import re
import weakref
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import loss_scale as scaling
from jaxpar import precision
from jaxpar.batch import Rows
from jaxpar.types import PyTree

LossFn = Callable[[nnx.Module, PyTree], Any]  # (model, batch) -> (loss_sum, weight_sum[, metrics])


class LossOutput(NamedTuple):
    """What a loss returns: the summed loss, the summed weight, and metrics summed the same way."""

    loss: Any
    weight: Any
    metrics: dict = {}


class Sums(NamedTuple):
    """What a step adds up over shards and micro-batches: loss, weight, real rows, metrics (all float32 sums)."""

    loss: Any
    weight: Any
    rows: Any
    metrics: dict

    def __add__(self, other: "Sums") -> "Sums":  # type: ignore[override]
        return jax.tree.map(jnp.add, self, other)


RESERVED = ("loss", "weight", "samples")  # metric names a step reports itself


_LAYERED: dict = {}  # (model class, unpack) -> its subclass whose __call__ runs `layers` in turn (check_layers)


def _same_trace(f: Callable, g: Callable, arg: Any) -> bool:
    """Whether f and g trace to the same jaxpr over the same constants (then they are the same function)."""
    try:
        a, b = jax.make_jaxpr(f)(arg), jax.make_jaxpr(g)(arg)
    except Exception:  # noqa: BLE001 -- e.g. a model that mutates its state when traced: compare by running
        return False
    return str(a.jaxpr) == str(b.jaxpr) and len(a.consts) == len(b.consts) and all(
        x is y or (jnp.shape(x) == jnp.shape(y) and bool(jnp.array_equal(x, y))) for x, y in zip(a.consts, b.consts))


_INPUTS_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # objective -> {batch signature:
# the number of classes jaxpar.cross_entropy saw in the logits when check_inputs traced the loss on it, or None}
_CLASSES: contextvars.ContextVar = contextvars.ContextVar("jaxpar_classes", default=None)  # check_inputs' recorder
_UNREAD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # objective -> (indices of the parameter leaves
# the eval-mode loss traced by check_inputs does not read, the Rows spec it was traced on): unused_params' candidates


def _slash_path(path) -> str:
    """A parameter's path as nnx writes it ('layers/0/kernel'), from a pytree key path of an nnx.State."""
    from jaxpar.comm.overlap import _path_of

    return "/".join(map(str, _path_of(path)))


def _unread_inputs(closed, n: int) -> list[int]:
    """Indices among the first `n` inputs of the closed jaxpr that its first output (the loss) does not depend on,
    by JAX's dead-code elimination; [] where it cannot tell (a primitive without a DCE rule keeps all its inputs)."""
    try:
        from jax._src.interpreters import partial_eval as pe

        jaxpr = closed.jaxpr
        _, used = pe.dce_jaxpr(jaxpr, [True] + [False] * (len(jaxpr.outvars) - 1))
    except Exception:  # noqa: BLE001 -- an internal API of JAX: without it, no check (never a false refusal)
        return []
    return [i for i in range(min(n, len(used))) if not used[i]]


_SAME_VALUES = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p", "transpose"}
_LOOKUP_MODES = ("FILL_OR_DROP", "PROMISE_IN_BOUNDS")  # jnp.take's default (NaN rows) and table[ids] (clamped on a
# CPU or GPU); an explicit mode="clip" is the user's choice and is left alone


def _lookups(closed, first_data: int, n_data: int) -> list[tuple[int, int, int]]:
    """The embedding lookups of a traced loss: (batch leaf i, model leaf j, rows n) for each gather that reads rows
    of the model's leaf j (an nnx.Embed's table, trained or frozen; `table[ids]`, jnp.take) at indices that are batch
    leaf i's own values (reshaped, broadcast, widened, with jnp.take's wrap of negative ids), so every value of leaf
    i must lie in [0, n) as torch's nn.Embedding requires ('index out of range in self'). Inputs: the closed jaxpr's
    first `first_data` invars are the model's (parameters, then state), the next `n_data` the batch's leaves. Calls
    (jit, remat, custom_vjp, a scan's or while's body) are followed where their body takes their inputs one to one
    (a loop's first pass reads the values it was given). Anything else (ids computed from the batch or cut from it
    by lax.slice, a lookup with mode='clip', a cond's branches) is not a lookup here: no check, never a false
    refusal."""
    try:
        from jax.extend import core as jex_core
    except ImportError:  # pragma: no cover -- an older JAX: no check
        return []
    found: list = []

    def walk(jaxpr, origin: dict) -> dict:
        def of(v):
            return None if isinstance(v, jex_core.Literal) else origin.get(v)

        for eqn in jaxpr.eqns:
            name, ins = eqn.primitive.name, [of(v) for v in eqn.invars]
            out = None
            if name in _SAME_VALUES and ins and ins[0] is not None:
                out = ins[0]
            elif name == "convert_element_type" and ins[0] is not None:
                src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
                if ins[0][0] == "param" or (jnp.issubdtype(dst, jnp.integer) and dst.itemsize >= src.itemsize):
                    out = ins[0]
            elif name == "add" and ins[0] is not None and ins[0][0] == "data" and isinstance(eqn.invars[1],
                                                                                            jex_core.Literal):
                out = ("wrapped", ins[0][1])  # jnp.take's ids + n, chosen where ids < 0
            elif name == "select_n" and len(ins) == 3 and None not in ins[1:] and ins[1][1] == ins[2][1] \
                    and {ins[1][0], ins[2][0]} == {"data", "wrapped"}:
                out = ("data", ins[1][1])  # ids where >= 0, ids + n where < 0: ids in [0, n) are read as they are
            elif name == "gather" and ins[0] is not None and ins[0][0] == "param" and ins[1] is not None \
                    and ins[1][0] == "data" and eqn.params["mode"].name in _LOOKUP_MODES:
                dims = eqn.params["dimension_numbers"]
                if len(dims.start_index_map) == 1 and not dims.operand_batching_dims:
                    found.append((ins[1][1], ins[0][1], int(eqn.invars[0].aval.shape[dims.start_index_map[0]])))
            else:  # a call (jit, remat, custom_jvp/vjp): its body, its inputs and outputs one to one
                for sub in eqn.params.values():
                    sub = getattr(sub, "jaxpr", sub)
                    if isinstance(sub, jex_core.Jaxpr) and len(sub.invars) == len(eqn.invars) \
                            and len(sub.outvars) == len(eqn.outvars):
                        inner = walk(sub, {w: o for w, o in zip(sub.invars, ins) if o is not None})
                        for w, v in zip(sub.outvars, eqn.outvars):
                            if not isinstance(w, jex_core.Literal) and inner.get(w) is not None:
                                origin[v] = inner[w]
                        break
            if out is not None and len(eqn.outvars) == 1:
                origin[eqn.outvars[0]] = out
        return origin

    try:
        invars = closed.jaxpr.invars
        start = {v: ("param", j) for j, v in enumerate(invars[:first_data])}
        for i, v in enumerate(invars[first_data:first_data + n_data]):
            if jnp.issubdtype(v.aval.dtype, jnp.integer):
                start[v] = ("data", i)
        walk(closed.jaxpr, start)
    except Exception:  # noqa: BLE001 -- JAX's jaxpr internals: without them, no check (never a false refusal)
        return []
    return found


def record_classes(classes: int) -> None:
    """Called by jaxpar.cross_entropy with its logits' class count (a static shape) while check_inputs traces the
    loss: the bound check_inputs then holds the batch's class targets to, on the host, at every step."""
    seen = _CLASSES.get()
    if seen is not None:
        seen.append(int(classes))


_LIBRARIES = ("jax", "jaxlib", "flax", "opt_einsum", "numpy")  # whose shape rules refuse an input
_ABOUT_SHAPES = re.compile(r"shape|dimension|size|broadcast|rank|type|expect", re.IGNORECASE)


def _refuses_input(e: BaseException) -> bool:
    """Whether `e`, raised while the model was traced on a batch, is a shape or dtype rule of JAX or Flax
    refusing a value (dot_general's contracting dimensions, a conv's feature count, a reshape's size, an embedding
    given floats), not an error of the user's own code, of jaxpar's checks, or of tracing (a Python `if` on a
    traced value)."""
    if not isinstance(e, (TypeError, ValueError)) or isinstance(e, (jax.errors.JAXTypeError,
                                                                     jax.errors.JaxprTypeError)):
        return False
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    module = (last.tb_frame.f_globals.get("__name__") or "") if last is not None else ""
    return module.split(".")[0] in _LIBRARIES and bool(_ABOUT_SHAPES.search(str(e)))


def describe_leaves(tree: PyTree, what: str = "batch") -> str:
    """`tree`'s leaves as "batch['x'] (32, 100) float32, batch['y'] (32,) int32"."""
    return ", ".join(f"{what}{jax.tree_util.keystr(path)} {tuple(np.shape(a))} {np.result_type(a)}"
                     for path, a in jax.tree_util.tree_flatten_with_path(tree)[0])


def check_rows_leading(out: PyTree, rows: int, fix: str = "") -> None:
    """ValueError unless every leaf of the model's outputs `out` has the `rows` it was run on as its leading axis:
    outputs are cut, gathered and concatenated by rows, so a per-batch value (a scalar, a [k, D] table) cannot
    be one of them. `fix`: a strategy's own alternative, appended."""
    for path, a in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not jnp.ndim(a) or jnp.shape(a)[0] != rows:
            raise ValueError(f"the model's output{jax.tree_util.keystr(path)} is shaped {jnp.shape(a)} on {rows} "
                             "row(s), but outputs are cut and gathered by rows: give every output leaf the rows as "
                             "its leading axis (a per-batch value such as an auxiliary loss belongs in the "
                             f"loss){fix}.")


def check_wrt_within(part: Any, wrt: Any, trained: set, who: str, where: str) -> None:
    """ValueError unless `wrt` selects within `part` (a layer, or a list of layers, split on its own) exactly the
    Variables whose ids are in `trained` (what it selects within the whole model): strategies that split the model
    by layers (the pipeline, ZeRO-3) apply the filter to each part, where paths start at the part."""
    variables = {tuple(p): v for p, v in nnx.iter_graph(part) if isinstance(v, nnx.Variable)}
    selected = {id(variables[tuple(p)]) for p, _ in nnx.to_flat_state(nnx.split(part, wrt, ...)[1])}
    variables = {id(v): p for p, v in variables.items()}
    gaps = [(path, i in selected) for i, path in variables.items() if (i in selected) != (i in trained)]
    if gaps:
        path, inside = gaps[0]
        raise ValueError(f"the wrt filter {'selects' if inside else 'leaves out'} {'/'.join(map(str, path))} of "
                         f"{where} but {'not' if inside else 'does select it'} in the whole model; {who} applies wrt "
                         "to each part of the model on its own, where paths start at the part: filter by Variable "
                         "type or by names inside a layer (nnx.PathContains('bias')), not by the model's attribute "
                         "names or layer positions.")


def to_loss_output(out: Any, what: str = "loss_fn") -> LossOutput:
    """Normalise a loss's return value to float32 scalars; TypeError naming the rule otherwise (at trace time)."""
    if isinstance(out, LossOutput):
        loss, weight, metrics = out
    elif isinstance(out, (tuple, list)) and len(out) in (2, 3):
        loss, weight, metrics = (*out, {}) if len(out) == 2 else out
    else:
        raise TypeError(f"{what} returned {_kind(out)}; return (loss_sum, weight_sum) or "
                        "(loss_sum, weight_sum, metrics) -- sums over the batch, e.g. (jnp.sum(losses), losses.size).")
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(f"{what} returned metrics as {_kind(metrics)}, not a dict; return (loss_sum, weight_sum, "
                        "{'name': summed_value, ...}).")
    metrics = dict(metrics or {})
    named = [k for k in metrics if not isinstance(k, str)]  # else JAX's "Comparator raised exception while sorting
    if named:                                                # pytree dictionary keys" beside the str ones
        raise TypeError(f"{what} returned metrics named {named[0]!r} ({type(named[0]).__name__}); name each metric "
                        f"by a str, e.g. {{{str(named[0])!r}: summed_value}}.")
    clash = [k for k in metrics if k in RESERVED]
    if clash:
        raise TypeError(f"{what} returned metrics named {clash}; {RESERVED} are reported by the step itself: "
                        "rename them.")
    values = {"loss": loss, "weight": weight, **{f"metrics[{k!r}]": v for k, v in metrics.items()}}
    for name, v in values.items():
        if not isinstance(v, (int, float, np.generic, np.ndarray, jax.Array)):  # None, text: failed inside jnp.asarray
            raise TypeError(f"{what} returned {name}={v!r:.40} ({type(v).__name__}); return numbers (arrays or "
                            "Python numbers) summed over the batch, e.g. (jnp.sum(losses), losses.size).")
        if jnp.shape(v) != ():
            raise TypeError(f"{what} returned {name} of shape {jnp.shape(v)}; return scalars summed over the batch "
                            "(jnp.sum(...)), the strategies divide by the global weight.")
    f32 = lambda v: jnp.asarray(v).astype(jnp.float32)  # noqa: E731
    return LossOutput(f32(loss), f32(weight), {k: f32(v) for k, v in metrics.items()})


def refuse_keyed_layers(model: Any, who: str, fix: str) -> None:
    """ValueError if `model.layers` is a mapping (nnx.Dict, dict) or one module: iterating a mapping, as `who` runs
    the layers, gives its keys, and each strategy failed somewhere else ("'str' object is not callable", parameters
    "belong to no layer"); iterating one module failed ("'Linear' object is not iterable")."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, Mapping):
        raise ValueError(f"{who} runs {type(model).__name__}.layers one after another, but it is a "
                         f"{type(layers).__name__} (keys {list(layers)[:4]}), whose iteration gives its keys: hold "
                         f"the layers in an nnx.List (or nnx.Sequential) in the order __call__ runs them, {fix}.")
    if layers is not None:
        try:
            iter(layers)
        except TypeError:  # one module under that name: "'Linear' object is not iterable" deep inside
            raise ValueError(f"{who} runs {type(model).__name__}.layers one after another, but it is one "
                             f"{type(layers).__name__}, not a sequence of layers: hold the layers in an nnx.List "
                             f"(or make the model an nnx.Sequential) in the order __call__ runs them, {fix}.") from None


def default_inputs(batch: PyTree) -> PyTree:
    """What the model is called on by default: ``batch["x"]`` for a dict, ``batch[0]`` for a tuple or list."""
    if isinstance(batch, dict):
        if "x" not in batch:
            raise KeyError(f"the batch has keys {sorted(batch)} but no 'x'; name the model's input 'x', or pass "
                           "OutputLoss(fn, inputs=lambda batch: ...) saying what the model takes.")
        return batch["x"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    raise TypeError(f"the batch is {_kind(batch)}, which has no default input: make it a dict with the model's "
                    "input under 'x' (and the targets under 'y'), or pass OutputLoss(fn, inputs=lambda batch: ...).")


def _kind(x: Any) -> str:
    """What a user handed over, in their words: "one array" (a tracer, inside jit or vmap, is one), else the type."""
    return "one array" if hasattr(x, "shape") and hasattr(x, "dtype") else f"a {type(x).__name__}"


@dataclasses.dataclass(frozen=True)
class OutputLoss:
    """A loss on the model's outputs, DeepSpeed's ``PipelineModule(loss_fn=...)`` form.

    ``fn(outputs, batch) -> (loss_sum, weight_sum[, metrics])``; the model is called as
    ``model(inputs(batch))``. It is also a model loss (``loss(model, batch)``), so every strategy takes it; the
    pipeline and DataParallel's gathered outputs need this form, since they run the loss apart from the model.
    """

    fn: Callable[[Any, PyTree], Any]
    inputs: Callable[[PyTree], PyTree] = default_inputs

    def __post_init__(self):  # else "'int' object is not callable" at the first batch
        for name in ("fn", "inputs"):
            if not callable(getattr(self, name)):
                raise TypeError(f"OutputLoss({name}={getattr(self, name)!r}) is not callable; pass fn(outputs, batch) "
                                "-> (loss_sum, weight_sum[, metrics]) and inputs(batch) -> the model's input, e.g. "
                                "OutputLoss(jaxpar.cross_entropy).")

    def __call__(self, model: nnx.Module, batch: PyTree):
        return self.fn(model(self.inputs(batch)), batch)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _streams(model: nnx.Module) -> list:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)]


def reseed(model: nnx.Module, salt: jax.Array) -> None:
    """Point every RNG stream of `model` at ``fold_in(fold_in(key, count), salt)`` with count 0, in place."""
    for stream in _streams(model):
        base = jax.random.fold_in(stream.key.get_value(), stream.count.get_value())
        stream.key.set_value(jax.random.fold_in(base, salt))
        # count * 0, not jnp.zeros_like: under jit a fresh zeros_like is a constant literal, and NNX's
        # `count[...] += 1` then increments that shared literal in place wherever it was captured (a custom_vjp's
        # residuals and forward saw count 1 under grad while the primal saw 0)
        stream.count.set_value(stream.count.get_value() * 0)


def drop_sown(model_state: PyTree, previous: PyTree) -> PyTree:
    """`model_state` without the values a batch-mode forward sowed (nnx.Intermediate variables `previous` lacks)
    and the loss did not pop: dropped, as per sample (the state's tree grew, and the step died in a pytree
    structure error)."""
    if not (isinstance(model_state, nnx.State) and isinstance(previous, nnx.State)):
        return model_state
    had = {tuple(p) for p, _ in nnx.to_flat_state(previous)}
    flat = nnx.to_flat_state(model_state)
    if not any(tuple(p) not in had and isinstance(v, nnx.Intermediate) for p, v in flat):
        return model_state
    return nnx.from_flat_state([(p, v) for p, v in flat if tuple(p) in had or not isinstance(v, nnx.Intermediate)])


def advance_rng(model_state: PyTree, previous: PyTree | None = None, by: int = 1) -> PyTree:
    """`model_state` with its RNG streams taken from `previous` (default: itself), each count advanced `by`.

    ``by=0`` restores the streams a forward pass reseeded (gradient accumulation keeps them for every
    micro-batch and advances once per step)."""
    previous = model_state if previous is None else previous
    model_state = drop_sown(model_state, previous)

    def one(new, old):
        if isinstance(old, nnx.RngKey):
            return old
        if isinstance(old, nnx.RngCount):
            return old.replace(old.get_value() + by) if by else old
        return new

    return jax.tree.map(one, model_state, previous, is_leaf=_is_variable)


def cast_floating(tree: PyTree, dtype) -> PyTree:
    """The floating-point leaves of `tree` as `dtype` (mixed-precision compute copies); None: unchanged."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)


_CHECKED_BN: dict = {}  # an nnx.BatchNorm class -> its subclass that refuses one value per channel in training


def refuse_one_value_per_channel(model: nnx.Module) -> None:
    """Make every unsynchronised nnx.BatchNorm of `model` (a fresh merge, about to train) refuse, at trace time,
    an input with one value per channel, as torch's F.batch_norm does in training ("Expected more than 1 value
    per channel when training"): its batch variance is 0 and the layer would output its bias alone. A chunk of one
    row under DataParallel, a one-row batch or micro-batch, trained silently. Synchronised layers (an axis_name)
    count the global batch, which this cannot see, and a mask counts its own rows: both are left alone."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.BatchNorm) and node.axis_name is None:
            cls = type(node)
            if cls not in _CHECKED_BN:
                _CHECKED_BN[cls] = type(cls.__name__, (cls,), {"__call__": _checked_batch_norm(cls)})
            node.__class__ = _CHECKED_BN[cls]


def _checked_batch_norm(cls):
    def __call__(self, x, use_running_average=None, *, mask=None):
        running = self.use_running_average if use_running_average is None else use_running_average
        if running is False and mask is None:
            axes = self.axis if isinstance(self.axis, (tuple, list)) else (self.axis,)
            channels = int(np.prod([x.shape[a] for a in axes]))
            if x.size == channels:
                raise ValueError(f"{cls.__name__} got an input of shape {tuple(x.shape)} in training: one value per "
                                 "channel, whose batch variance is 0 (torch refuses it: 'Expected more than 1 value "
                                 "per channel when training'); give every device and micro-batch at least 2 rows "
                                 "(a larger batch, fewer devices or micro-batches, or --drop-last for a last batch of "
                                 "1).")
        return cls.__call__(self, x, use_running_average, mask=mask)
    return __call__


def _fresh(state: PyTree) -> PyTree:
    """`state` rebuilt in the current trace: NNX refuses to mutate a Variable made at an outer trace level (a
    model state closed over by jax.grad), and nnx.merge keeps the Variables' trace of origin."""
    return jax.tree.map(lambda a: a, state)


def _expand(row: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a[None], row)


def _has(model: nnx.Module, kind: type) -> bool:
    return any(isinstance(v, kind) for _, v in nnx.iter_graph(model))


def default_rows_per_call(model: nnx.Module) -> int | None:
    """32 on CPU for models holding a convolution, else None (all rows in one vmapped call).

    Per-sample mode vmaps the model over rows; XLA:CPU runs a convolution over many samples slower per sample
    than in slices of a few dozen (measured 2.1-2.6x on the ConvNet at 128 rows), so on CPU the rows go through
    in unrolled groups of 32. Matmul-only models lose by it (an MLP ran 1.4x slower), so they keep one call.
    """
    from jaxpar.models.layers import Conv2d

    if jax.default_backend() != "cpu":
        return None
    return 32 if _has(model, Conv2d) or _has(model, nnx.Conv) or _has(model, nnx.ConvTranspose) else None


@dataclasses.dataclass(frozen=True, eq=False)
class Objective:
    """What a strategy trains: the model's structure, its loss, which state is trained, and how the loss runs.

    Built with `Objective.of(model, loss_fn)`; see the module docstring for the two modes. ``compute_dtype``
    (bf16) casts the parameters and the model's inputs for the forward and backward; the loss, the gradients and
    the master weights stay float32. The model's inputs are an OutputLoss's ``inputs(batch)``; a loss written as
    ``loss_fn(model, batch)`` gets every floating leaf of the batch cast (targets and weights too).
    """

    graphdef: nnx.GraphDef
    eval_graphdef: nnx.GraphDef
    loss_fn: LossFn
    wrt: Any = nnx.Param
    per_sample: bool = True
    rows_per_call: int | None = None
    compute_dtype: Any = None
    activation_checkpoint_interval: int = 0  # > 0: the training forward recomputes N-layer segments (recompute.py)
    shapes: Any = None  # (params, model_state) of the model it was made from, as ShapeDtypeStructs: init checks states
    per_sample_default: bool = False  # per_sample=True by default, not chosen: check_rows_apart checks the loss
    cast_params: bool = True  # False: the parameters reach the model as given (ZeRO-3 casts each gathered weight)
    # the trained leaves in forward order, read off the model itself (jaxpar.comm.overlap.forward_leaf_order): DDP's
    # buckets and ZeRO's partitions follow it; a model rebuilt by nnx.merge has its attributes sorted by name
    leaf_order: tuple | None = None

    @classmethod
    def of(cls, model: nnx.Module, loss_fn: LossFn | None = None, *, wrt: Any = nnx.Param,
           per_sample: bool | None = None, rows_per_call: int | None | str = "auto",
           compute_dtype: Any = None, activation_checkpoint_interval: int = 0) -> "Objective":
        """The objective of `model` under `loss_fn` (default: cross-entropy on ``model(batch["x"])`` against
        integer labels ``batch["y"]``). per_sample None: True unless the model holds nnx.BatchStat.
        activation_checkpoint_interval N > 0: training runs the model's `layers` in N-layer segments that keep
        only their input and are recomputed in the backward (jaxpar.recompute); evaluation runs them plainly."""
        from jaxpar.comm.overlap import forward_leaf_order
        from jaxpar.losses import cross_entropy
        from jaxpar.recompute import checkpointed

        if not isinstance(model, nnx.Module):
            raise TypeError(f"model is a {type(model).__name__}; pass a flax.nnx.Module (an Objective is built from "
                            "the model itself).")
        precision.check_model(model, compute_dtype)
        loss_fn = OutputLoss(cross_entropy) if loss_fn is None else loss_fn
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass loss_fn(model, batch) -> (loss_sum, "
                            "weight_sum[, metrics]).")
        if per_sample is not None and not isinstance(per_sample, (bool, np.bool_)):
            raise ValueError(f"per_sample={per_sample!r} must be True, False or None (the default: True unless the "
                             "model holds BatchStat); pass a bool (train.py's --per-sample on / off).")
        batch_stats = _has(model, nnx.BatchStat)
        defaulted = per_sample is None and not batch_stats
        if per_sample is None:
            per_sample = not batch_stats
        elif per_sample and batch_stats:
            raise ValueError(f"per_sample=True, but {type(model).__name__} holds BatchStat (BatchNorm), whose "
                             "statistics need the whole batch; use per_sample=False (or leave it None).")
        if rows_per_call == "auto":
            rows_per_call = default_rows_per_call(model) if per_sample else None
        if rows_per_call is not None and (not isinstance(rows_per_call, int) or rows_per_call < 1):
            raise ValueError(f"rows_per_call={rows_per_call!r} must be an int >= 1 or None (all rows at once).")
        graphdef = nnx.split(checkpointed(model, activation_checkpoint_interval), wrt, ...)[0]
        evaluated = nnx.clone(model)
        evaluated.eval()
        for path, v in nnx.to_flat_state(nnx.state(model)):
            if v.get_value() is not None and not hasattr(v.get_value(), "dtype"):  # jax.grad and placement need arrays
                raise ValueError(f"{type(model).__name__}'s variable {'/'.join(map(str, path))} holds a "
                                 f"{type(v.get_value()).__name__} ({v.get_value()!r}), not an array; give it an array: "
                                 f"{type(v).__name__}(jnp.asarray({v.get_value()!r})).")
        for path, v in nnx.to_flat_state(nnx.split(model, wrt, ...)[1]):  # jax.grad: floating leaves only
            if v.get_value() is not None and not jnp.issubdtype(v.get_value().dtype, jnp.inexact):
                raise ValueError(f"{type(model).__name__}'s {'/'.join(map(str, path))} is a trained {type(v).__name__} "
                                 f"of dtype {v.get_value().dtype}, which has no gradient; hold it in an nnx.Variable "
                                 "of its own type (state the step carries, untrained), or pass wrt= a filter that "
                                 "leaves it out.")
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), nnx.split(model, wrt, ...)[1:])
        return cls(graphdef, nnx.split(evaluated, wrt, ...)[0], loss_fn, wrt, bool(per_sample), rows_per_call,
                   compute_dtype, activation_checkpoint_interval, shapes, defaulted,
                   leaf_order=tuple(forward_leaf_order(model, wrt)))

    def replace(self, **changes) -> "Objective":
        return dataclasses.replace(self, **changes)

    @property
    def sequential(self) -> bool:
        """Whether the model is an nnx.Sequential, whose layers take an earlier layer's tuple (dict) output as
        *args (**kwargs): where a strategy runs the `layers` itself, it does the same."""
        return issubclass(self.eval_graphdef.nodes[0].type, nnx.Sequential)

    # -- state ---------------------------------------------------------------------------------------------

    def split(self, model: nnx.Module) -> tuple[nnx.State, nnx.State]:
        """(params, model_state): what `wrt` selects, and everything else."""
        _, params, rest = nnx.split(model, self.wrt, ...)
        return params, rest

    def check_trains(self) -> "Objective":
        """ValueError when `wrt` selects none of the model's variables (a strategy would train nothing); returns self.
        An Objective that only evaluates (jaxpar.evaluate, a model without weights) needs none."""
        if self.shapes is not None and not jax.tree.leaves(self.shapes[0]):
            name = self.eval_graphdef.nodes[0].type.__name__
            raise ValueError(f"wrt={self.wrt!r} selects no variable of {name}, so nothing would train; pass a filter "
                             "that selects its trainable weights (the default nnx.Param), or a model that holds what "
                             "it names (nnx.LoRAParam needs nnx.LoRA layers).")
        return self

    def merge(self, params: nnx.State, model_state: nnx.State, *, train: bool = True) -> nnx.Module:
        """A live model from the two halves (in eval mode when train is False)."""
        return nnx.merge(self.graphdef if train else self.eval_graphdef, params, model_state)

    # -- the loss ------------------------------------------------------------------------------------------

    def _call_loss(self, model: nnx.Module, batch: PyTree, what: str) -> LossOutput:
        if self.compute_dtype is not None and isinstance(self.loss_fn, OutputLoss):
            out = model(cast_floating(self.loss_fn.inputs(batch), self.compute_dtype))
            return to_loss_output(self.loss_fn.fn(out, batch), what)
        return to_loss_output(self.loss_fn(model, cast_floating(batch, self.compute_dtype)), what)

    def sums(self, params: nnx.State, model_state: nnx.State, rows: Rows, *, train: bool = True,
             shard: Any = 0) -> tuple[Sums, nnx.State]:
        """(Sums over the real rows of `rows`, the model state after them). `shard` keys batch-mode draws."""
        if not isinstance(rows, Rows):  # a raw batch failed deep inside ('dict' object has no attribute 'mask')
            raise TypeError(f"the objective takes Rows (the batch, its mask and sample ids), not {_kind(rows)}; "
                            "pass jaxpar.as_rows(batch), or a strategy's put_batch(batch).")
        params = cast_floating(params, self.compute_dtype) if self.cast_params else params
        if not self.per_sample:
            return self._batch_sums(params, model_state, rows, train, shard)
        return self._chunked(lambda r: self._sample_sums(params, model_state, r, train), rows), \
            (advance_rng(model_state) if train else model_state)

    def _chunked(self, fn: Callable[[Rows], Sums], rows: Rows) -> Sums:
        n = rows.mask.shape[0]
        step = self.rows_per_call or n
        total = None
        for lo in range(0, n, step):  # unrolled: XLA:CPU runs convolutions inside a loop several times slower
            part = fn(jax.tree.map(lambda a: a[lo:lo + step], rows))
            total = part if total is None else total + part
        return total

    def _sample_sums(self, params, model_state, rows: Rows, train: bool) -> Sums:
        graphdef = self.graphdef if train else self.eval_graphdef

        def one(row, sid, params, model_state):
            model = nnx.merge(graphdef, params, model_state)
            if train:
                reseed(model, sid)
            before = _fixed_leaves(model)
            out = self._call_loss(model, _expand(row), "loss_fn (on one row)")
            _refuse_replaced(model, before)
            return out

        out = jax.vmap(one, in_axes=(0, 0, None, None))(rows.data, rows.ids, params, model_state)
        real = rows.mask > 0
        keep = lambda v: jnp.sum(jnp.where(real, v, 0.0))  # noqa: E731  (padding rows drop out exactly)
        return Sums(keep(out.loss), keep(out.weight), jnp.sum(rows.mask), {k: keep(v) for k, v in out.metrics.items()})

    def _batch_sums(self, params, model_state, rows: Rows, train: bool, shard) -> tuple[Sums, nnx.State]:
        model = nnx.merge(self.graphdef if train else self.eval_graphdef, params, _fresh(model_state))
        if train:
            reseed(model, shard)
            refuse_one_value_per_channel(model)
        out = self._call_loss(model, rows.data, "loss_fn")
        new_state = nnx.split(model, self.wrt, ...)[2]
        sums = Sums(out.loss, out.weight, jnp.sum(rows.mask), out.metrics)
        return sums, (advance_rng(new_state, model_state) if train else model_state)

    def value_and_grad(self, params: nnx.State, model_state: nnx.State, rows: Rows, *, shard: Any = 0,
                       loss_scale: Any = None):
        """((Sums, new model state), gradient of the SUMMED loss with respect to params); with a `loss_scale` S
        the backward runs on the scaled loss and the gradient is unscaled (jaxpar.loss_scale)."""
        def f(p):
            sums, state = self.sums(p, model_state, rows, shard=shard)
            return sums.loss, (sums, state)

        (_, aux), grads, seed = scaling.value_and_grad(f, loss_scale)(params)
        return aux, scaling.unscale(grads, seed)

    def check_inputs(self, data: PyTree, row_mask: Any = None) -> None:
        """ValueError, before any work, when the model cannot take the batch `data` (host arrays): its loss is
        traced (jax.eval_shape: no compute) on the batch's shapes, in eval mode (the model's own __call__: where a
        strategy runs the `layers` instead, check_layers says whether they are the same function), on one row per
        call (per_sample) or the whole batch, and a shape or dtype rule of JAX or Flax that refuses the batch (an
        input of 100 features reaching a Linear of 784: dot_general's contracting dimensions) is named in one line,
        the original error chained. Once per batch signature (tree, row shapes, dtypes); any other error is left to
        the step, which raises it where it always has. Then, on every batch, `check_ids`: class targets and token ids
        outside the model's outputs or vocabulary (`row_mask`: the Rows' mask, which rows count)."""
        if self.shapes is None:
            return
        leaves, treedef = jax.tree.flatten(data)
        if not leaves or any(not np.shape(a) for a in leaves):
            return  # not a batch: num_rows names that
        # a jax.Array's own dtype (np.result_type of one is a deprecated array-to-dtype conversion)
        dtypes = [jax.dtypes.canonicalize_dtype(a.dtype if isinstance(a, jax.Array) else np.result_type(a))
                  for a in leaves]
        n = 1 if self.per_sample else np.shape(leaves[0])[0]
        shapes = [(n,) + tuple(np.shape(a)[1:]) for a in leaves]
        key = (treedef, tuple(zip(shapes, map(str, dtypes))))
        seen = _INPUTS_CHECKED.setdefault(self, {})
        if key in seen:
            self.check_ids(data, row_mask, *seen[key])
            return
        specs = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)])
        rows = Rows(specs, jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32))
        refused: list = []

        def trace(params, model_state, rows):
            try:
                return self.sums(params, model_state, rows, train=False)[0]  # __call__ itself, as the user wrote it
            except Exception as e:  # noqa: BLE001 -- told apart here, where the traceback is still whole
                if _refuses_input(e):
                    refused.append(e)
                raise

        classes: list = []
        lookups: list = []
        token = _CLASSES.set(classes)
        try:
            closed = jax.make_jaxpr(trace)(*self.shapes, rows)  # a trace, no compute (as jax.eval_shape)
            n_params = len(jax.tree.leaves(self.shapes[0]))
            if self not in _UNREAD:
                _UNREAD[self] = (_unread_inputs(closed, n_params), rows)
            lookups = _lookups(closed, n_params + len(jax.tree.leaves(self.shapes[1])), len(leaves))
        except Exception as e:  # noqa: BLE001
            classes.clear()  # the loss did not trace: nothing to hold the targets to
            if refused:
                cause = refused[0]
                first = (str(cause).strip().splitlines() or [""])[0][:200]
                name = self.eval_graphdef.nodes[0].type.__name__
                if f"{name}( # " in first:  # JAX refused the model itself (its repr), not the batch
                    raise TypeError(f"the loss handed the model itself ({name}) to JAX as an array "
                                    f"({type(cause).__name__}); loss_fn is called as loss_fn(model, batch): for a "
                                    "loss of (outputs, targets) pass jaxpar.OutputLoss(lambda out, batch: ...).") \
                        from cause
                raise ValueError(f"{name} could not take the batch ({describe_leaves(data)}): "
                                 f"{type(cause).__name__}: {first.rstrip('.')}; give the model inputs shaped as its "
                                 "first layer expects (check the data's shape against the input size the model was "
                                 "built with: the dataset, or its in_features / --model).") from cause
            # not the batch's shape: the step itself raises it, where it always has
        finally:
            _CLASSES.reset(token)
        seen[key] = (classes[0] if len(set(classes)) == 1 else None, tuple(lookups))
        self.check_ids(data, row_mask, *seen[key])

    def _cross_entropy_options(self) -> tuple[str, int] | None:
        """(key, ignore_index) where the loss is jaxpar.cross_entropy on the model's outputs (the default, train.py's
        --loss cross_entropy, a functools.partial of it: label_smoothing and all; a PipelineModule's
        loss_fn=jaxpar.cross_entropy, which the pipeline wraps), else None: a loss of the user's own may read other
        targets, or none."""
        from jaxpar.losses import IGNORE_INDEX, cross_entropy

        if not isinstance(self.loss_fn, OutputLoss):
            return None
        fn, options = self.loss_fn.fn, {}
        while isinstance(fn, functools.partial) or getattr(fn, "jaxpar_wrapped", None) is not None:
            if not isinstance(fn, functools.partial):  # a PipelineModule's loss_fn, in the pipeline's wrapper
                fn = fn.jaxpar_wrapped
                continue
            if fn.args:
                return None
            options = {**fn.keywords, **options}  # the outer partial's keywords win
            fn = fn.func
        if fn is not cross_entropy:
            return None
        return options.get("key", "y"), options.get("ignore_index", IGNORE_INDEX)

    def check_ids(self, data: PyTree, row_mask: Any, classes: int | None, lookups: tuple = ()) -> None:
        """ValueError, before any work, for a counted class target outside [0, `classes`) of jaxpar.cross_entropy
        (not its ignore_index, its batch["mask"] not 0, in a real row: `row_mask` > 0 under per_sample), and for an
        id outside the rows of a parameter table the model looks it up in (`lookups`, from _lookups: nnx.Embed,
        jaxpar.GPT's wte, `table[ids]`; a real row's), where torch raises ('Target 10 is out of bounds', 'index out
        of range in self') and a jitted step cannot: the step reported a NaN loss (the target left out of the
        gradient but counted in the weight); an id >= the table's rows turned the loss and the parameters NaN
        (jnp.take's NaN rows) or read the last row (table[ids]), one below 0 read another row. On host (numpy)
        values only: min and max, O(batch), no trace, compile or sync; a leaf that is a jax.Array (Rows placed on a
        device, which put_batch passes through) is not read, and trains as before."""
        def host(a):
            return a if isinstance(a, np.ndarray) and not isinstance(a, jax.Array) else None

        rows = host(row_mask) if self.per_sample else None  # per_sample=False counts every row (padding is refused)
        if self.per_sample and rows is None:
            return  # which rows count is on a device
        real = None if rows is None or rows.all() else rows > 0

        def outside(values, n, skip=None):
            """(the first counted value outside [0, n), its index, how many) or None."""
            if values is None or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
                return None  # cross_entropy's own TypeError names float targets
            if values.min() >= 0 and values.max() < n:  # the fast path: two passes over the batch
                return None
            bad = (values < 0) | (values >= n)
            if skip is not None:
                bad &= skip
            if real is not None:
                bad &= real.reshape((-1,) + (1,) * (values.ndim - 1))
            where = np.argwhere(bad)
            if not len(where):
                return None
            at = tuple(int(i) for i in where[0])
            return int(values[at]), at, len(where)

        ce = self._cross_entropy_options() if classes else None
        if ce is not None:
            key, ignore = ce
            if isinstance(data, dict):
                y, name, mask = host(data.get(key)), f"batch[{key!r}]", data.get("mask")
            elif isinstance(data, (tuple, list)) and len(data) > 1:
                y, name, mask = host(data[1]), "batch[1]", None
            else:
                y, name, mask = None, "", None
            counted = None if y is None else y != ignore
            if mask is not None and y is not None:
                mask = host(mask)
                if mask is None or mask.shape != y.shape:
                    y = None  # on a device, or the loss's own shape error
                else:
                    counted &= mask != 0
            found = outside(y, classes, counted)
            if found:
                v, at, n = found
                more = f", and {n - 1} more" if n > 1 else ""
                grow = f", or give the model {v + 1} outputs" if v >= classes else ""
                raise ValueError(f"{name} holds class target {v} at {at}{more}, outside [0, {classes}) for the "
                                 f"model's {classes} outputs: cross_entropy would report the loss NaN and leave the "
                                 f"target out of the gradient, not of the weight (torch's CrossEntropyLoss raises "
                                 f"'Target {v} is out of bounds'); give class ids 0..{classes - 1}, skip a target with "
                                 f"ignore_index={ignore} or batch['mask'] 0{grow}.")
        if not lookups:
            return
        leaves = jax.tree_util.tree_flatten_with_path(data)[0]
        rows_of: dict = {}  # batch leaf -> (the table with the fewest rows it indexes, its rows)
        for i, j, n in lookups:
            if i < len(leaves) and (i not in rows_of or n < rows_of[i][1]):
                rows_of[i] = (j, n)
        for i, (j, n) in sorted(rows_of.items()):
            found = outside(host(leaves[i][1]), n)
            if found:
                v, at, k = found
                model = [_slash_path(path) for tree in self.shapes  # the model's leaves: parameters, then state
                         for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
                name, table = "batch" + jax.tree_util.keystr(leaves[i][0]), model[j] if j < len(model) else "?"
                more = f", and {k - 1} more" if k > 1 else ""
                top = int(host(leaves[i][1]).max())  # the table must hold the largest id, not only the first bad one
                grow = f", or build the model with a table of {top + 1} rows or more (GPT's vocab_size, nnx.Embed's " \
                    "num_embeddings)" if top >= n else ""
                raise ValueError(f"{name} holds token id {v} at {at}{more}, outside the vocabulary [0, {n}) of the "
                                 f"model's {table}: its embedding lookup would turn the logits, the loss and, after "
                                 "the update, the parameters NaN (or read a row it was not given; torch's "
                                 f"nn.Embedding raises 'index out of range in self'); give token ids 0..{n - 1}{grow}.")

    def unused_params(self) -> list[str]:
        """The paths of the trained parameters that the loss does not read, in eval mode and in training mode, on
        the shapes of the first batch check_inputs saw ([] before it saw one): torch leaves such a parameter's
        .grad None and its optimizers skip it, where here it gets a zero gradient (see check_unused_params)."""
        if self not in _UNREAD or not _UNREAD[self][0]:
            return []
        candidates, rows = _UNREAD[self]
        try:  # training mode can read more (an auxiliary head, a branch taken in training only)
            closed = jax.make_jaxpr(lambda p, s, r: self.sums(p, s, r, train=True)[0])(*self.shapes, rows)
        except Exception:  # noqa: BLE001 -- the step raises it, where it always has
            return []
        unread = set(_unread_inputs(closed, len(jax.tree.leaves(self.shapes[0]))))
        paths = [_slash_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(self.shapes[0])[0]]
        return [paths[i] for i in candidates if i in unread]

    def check_rows_apart(self, params: nnx.State, model_state: nnx.State, rows: Rows, count: int = 3) -> None:
        """ValueError when per_sample=True came by default and the mean loss (loss sum / weight sum) over the first
        `count` rows differs run row by row from run on the rows together (to 1e-4 of it; 2e-2 in 16-bit compute),
        in eval mode, then in training mode: a loss or model that mixes rows (in-batch negatives, batch statistics
        of its own, in training only too) would see one row at a time and train something else without a word.
        Not checked: jaxpar's own models under its own losses, and a mode in which the model draws random numbers
        (dropout in training: the rows' draws would differ anyway)."""
        if not (self.per_sample and self.per_sample_default) or self._own():
            return
        mask = np.asarray(rows.mask)
        real = np.flatnonzero(mask > 0)[:count]
        if len(real) < 2:
            return
        head = jax.tree.map(lambda a: np.asarray(a)[real], rows)

        run_apart = jax.jit(lambda params, model_state, rows, train: self.sums(params, model_state, rows,
                                                                               train=train)[0], static_argnums=3)
        for graphdef, train in ((self.eval_graphdef, False), (self.graphdef, True)):
            def run_together(params, model_state, data, graphdef=graphdef):  # compiled: op by op it took seconds
                model = nnx.merge(graphdef, cast_floating(params, self.compute_dtype), _fresh(model_state))
                out = self._call_loss(model, data, "loss_fn")  # the rows together, as per_sample=False runs them
                return out.loss, out.weight

            traced = jax.jit(run_together).trace(params, model_state, head.data)
            if _draws_random_bits(traced.jaxpr.jaxpr):  # row by row they are other draws: the two cannot be compared
                continue  # (from an RNG stream, or from a key the model keeps without advancing a count)
            sums = traced.lower().compile()(params, model_state, head.data)
            one_by_one = run_apart(params, model_state, head, train)
            together, apart = float(sums[0]), float(one_by_one.loss)
            weights = float(sums[1]), float(one_by_one.weight)
            if weights[0] and weights[1]:  # the mean, what the strategies train
                together, apart = together / weights[0], apart / weights[1]
            elif weights[0] != weights[1]:  # one side weighs the rows, the other not: they mix rows
                together, apart = weights
            # else: rows with no weight (every target masked) have no mean (0/0); their loss sums must agree
            low = self.compute_dtype is not None and jnp.finfo(self.compute_dtype).bits < 32
            if abs(apart - together) > (2e-2 if low else 1e-4) * max(abs(apart), abs(together), 1e-12):
                name = self.eval_graphdef.nodes[0].type.__name__
                mode = "training mode" if train else "eval mode"
                raise ValueError(f"the mean loss of {name} over the first batch's first {len(real)} rows is "
                                 f"{apart:.6g} run row by row (per_sample=True, the default) but {together:.6g} on the "
                                 f"rows together ({mode}): the loss or the model mixes rows (in-batch negatives, batch "
                                 "statistics of its own), which per_sample=True would train on one row at a time; "
                                 "pass per_sample=False (--per-sample off: each device's shard whole, as torch DDP's "
                                 "replicas see it), or per_sample=True to keep the rows apart.")

    def _own(self) -> bool:
        """Whether the model is one of jaxpar's and the loss jaxpar's own (or its default)."""
        fn = self.loss_fn.fn if isinstance(self.loss_fn, OutputLoss) else self.loss_fn
        fn = getattr(fn, "func", fn)  # functools.partial(cross_entropy, label_smoothing=...)
        kind = self.eval_graphdef.nodes[0].type  # the model's class
        return (getattr(fn, "__module__", "") or "").startswith("jaxpar.") and kind.__module__.startswith("jaxpar.")

    # -- outputs and losses apart (DataParallel's gather, the pipeline's last stage) ------------------------

    def check_layers(self, params: nnx.State, model_state: nnx.State, batch: PyTree, why: str, fix: str,
                     unpack: bool = False) -> None:
        """ValueError unless the model computes the same through its own __call__ as through its `layers` applied
        in turn (`unpack`: nnx.Sequential's tuple/dict convention), on `batch` (a few rows), in eval mode and in
        training mode (glue such as a dropout between the layers acts only there): the outputs under an
        OutputLoss, else the loss. For strategies that run the layers instead of __call__ (`why`): the pipeline,
        ZeRO-3's per-layer fetches, activation checkpointing. Once, before training: first traced (the same jaxpr
        over the same weights is the same function), then, where the traces differ, run eagerly, each side's random
        streams starting alike."""
        for graphdef, mode in ((self.eval_graphdef, "eval mode"), (self.graphdef, "training mode")):
            gap = self._layers_gap(graphdef, params, model_state, batch, unpack)
            if gap:
                raise ValueError(f"{why} `layers` one after another instead of {gap[0]}.__call__, but the two differ "
                                 f"({gap[1]} on the first batch's first rows, {mode}): write __call__ as `for layer "
                                 "in self.layers: x = layer(x)` (residuals, dropout and other glue inside the "
                                 f"layers), or {fix}.")

    def _layers_gap(self, graphdef: nnx.GraphDef, params: nnx.State, model_state: nnx.State, batch: PyTree,
                    unpack: bool) -> tuple[str, str] | None:
        """None where __call__ and the layers in turn agree under `graphdef`, else (model name, how they differ)."""
        from jaxpar.pipeline.module import apply_layers

        def models():  # each side on its own copy (merge shares the state's Variables): streams start alike, and
            # what the calls advance or trace stays in the copies
            plain, layered = (nnx.clone(nnx.merge(graphdef, params, model_state)) for _ in range(2))
            for copy in (plain, layered):  # the check runs on one device, outside any mapped axis: a
                # synchronised BatchNorm's pmean over one replica is the identity, so unbind it in the copies
                for _, node in nnx.iter_graph(copy):
                    if isinstance(node, nnx.BatchNorm) and node.axis_name is not None:
                        node.axis_name = None
            if getattr(type(plain), "_recompute_interval", 0):  # training's graph recomputes: the user's class
                plain.__class__ = layered.__class__ = type(plain).__bases__[0]
            key = (type(plain), unpack)
            if key not in _LAYERED:
                base = type(plain)  # called with more than one input, the strategies call the model itself too
                _LAYERED[key] = type(f"Layered{base.__name__}", (base,), {
                    "__call__": lambda self, *a, **k: apply_layers(self.layers, a[0], unpack) if len(a) == 1
                    and not k else base.__call__(self, *a, **k)})
            layered.__class__ = _LAYERED[key]
            return plain, layered

        if isinstance(self.loss_fn, OutputLoss):
            arg, what = cast_floating(self.loss_fn.inputs(batch), self.compute_dtype), "outputs"
            run = lambda model, x: model(x)  # noqa: E731
        else:
            arg, what = batch, "losses"
            run = lambda model, b: self._call_loss(model, b, "loss_fn")  # noqa: E731
        plain, layered = models()
        name = type(plain).__name__
        if _same_trace(lambda a: run(plain, a), lambda a: run(layered, a), arg):
            return None
        plain, layered = models()  # fresh: tracing may have left tracers in the copies
        want = run(plain, arg)
        try:  # the layers in turn may not even run on the model's input (an embedding before them, a head after)
            got = run(layered, arg)
        except Exception as e:  # noqa: BLE001 -- any error of the user's layers: the two are not the same function
            first = (str(e).strip().splitlines() or [""])[0]
            return name, f"the layers in turn fail on the model's input: {type(e).__name__}: {first[:200]}"
        w, g = jax.tree.leaves(want), jax.tree.leaves(got)
        shapes = [jnp.shape(a) for a in w], [jnp.shape(a) for a in g]
        if jax.tree.structure(want) != jax.tree.structure(got) or shapes[0] != shapes[1]:
            return name, f"{what} shaped {shapes[0]} against {shapes[1]}"
        diff = max([float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)),
                                  initial=0.0)) for a, b in zip(w, g)], default=0.0)
        size = max([float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32)), initial=0.0)) for a in w] + [1.0])
        if not diff > 1e-5 * size:  # eager, the same kernels: equal where the two are the same function
            return None
        return name, f"{what} differ by up to {diff:.3g}"

    def output_loss(self) -> OutputLoss:
        if not isinstance(self.loss_fn, OutputLoss):
            raise ValueError("this needs the loss on the model's outputs: pass jaxpar.OutputLoss(fn, inputs=...) "
                             "with fn(outputs, batch) -> (loss_sum, weight_sum[, metrics]) instead of a "
                             "loss(model, batch).")
        return self.loss_fn

    def outputs(self, params: nnx.State, model_state: nnx.State, rows: Rows, *, shard: Any = 0):
        """(the model's outputs on every row, the model state after them), in training mode: per sample
        (per_sample) or on the whole shard. Padding rows get outputs too; `output_sums` drops them."""
        loss = self.output_loss()
        params = cast_floating(params, self.compute_dtype) if self.cast_params else params

        def run(model, batch):
            return model(cast_floating(loss.inputs(batch), self.compute_dtype))

        if not self.per_sample:
            model = nnx.merge(self.graphdef, params, _fresh(model_state))
            reseed(model, shard)
            refuse_one_value_per_channel(model)
            out = run(model, rows.data)
            return out, advance_rng(nnx.split(model, self.wrt, ...)[2], model_state)

        def one(row, sid, params, model_state):
            model = nnx.merge(self.graphdef, params, model_state)
            reseed(model, sid)
            before = _fixed_leaves(model)
            out = run(model, _expand(row))
            _refuse_replaced(model, before)  # as the loss's forward does (DataParallel ran here and dropped it)
            check_rows_leading(out, 1)
            return jax.tree.map(lambda a: a[0], out)

        parts = []
        step = self.rows_per_call or rows.mask.shape[0]
        for lo in range(0, rows.mask.shape[0], step):
            chunk = jax.tree.map(lambda a: a[lo:lo + step], rows)
            parts.append(jax.vmap(one, in_axes=(0, 0, None, None))(chunk.data, chunk.ids, params, model_state))
        out = parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
        return out, advance_rng(model_state)

    def output_sums(self, outputs: PyTree, rows: Rows) -> Sums:
        """Sums of the output loss over the real rows of `rows`, given the model's `outputs` on them."""
        fn = self.output_loss().fn
        if not self.per_sample:
            out = to_loss_output(fn(outputs, rows.data), "loss fn")
            return Sums(out.loss, out.weight, jnp.sum(rows.mask), out.metrics)
        out = jax.vmap(lambda o, row: to_loss_output(fn(_expand(o), _expand(row)), "loss fn (on one row)"))(
            outputs, rows.data)
        real = rows.mask > 0
        keep = lambda v: jnp.sum(jnp.where(real, v, 0.0))  # noqa: E731
        return Sums(keep(out.loss), keep(out.weight), jnp.sum(rows.mask), {k: keep(v) for k, v in out.metrics.items()})


def _draws_random_bits(jaxpr) -> bool:
    """Whether a jaxpr (or one nested in it: jit, remat, scan, cond, custom_vjp) draws random bits."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("random_bits", "threefry2x32"):
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr itself
                if hasattr(inner, "eqns") and _draws_random_bits(inner):
                    return True
    return False


def _fixed_paths(model: nnx.Module) -> list:
    """(path, variable) of each of `_fixed_leaves`' values, in the same order."""
    state = nnx.state(model, nnx.Not(nnx.Any(nnx.RngState, nnx.Param, nnx.Intermediate)))
    return jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]


def _fixed_leaves(model: nnx.Module) -> list:
    """The raw values of every variable but the RNG state, the parameters and sown values (identity tells whether
    the forward replaced one: a statistic or buffer of the model's own). Parameters are left out: nnx.remat and
    nnx.scan write every variable they pass back as a new value, and no forward updates a weight. Sown values
    (`self.sow(nnx.Intermediate, ...)`) are new variables the forward makes, which the step drops per sample (a
    loss may pop them); they made the lists differ in length, and the check died in a bare StopIteration."""
    return [v.get_value() for _, v in _fixed_paths(model)]


def _refuse_replaced(model: nnx.Module, before: list) -> None:
    """Refuse a per-sample forward that replaced a variable of the model's own other than its weights."""
    after = _fixed_leaves(model)
    if [id(a) for a in after] != [id(a) for a in before]:
        paths = _fixed_paths(model)
        name = next((jax.tree_util.keystr(p) for (p, _), a, b in zip(paths, after, before) if a is not b),
                    jax.tree_util.keystr(paths[-1][0]) if paths else "?")  # one the forward added
        raise replaced_error(type(model).__name__, name)


def replaced_error(owner: str, name: str) -> ValueError:
    """The refusal of a per-sample forward in which `owner` replaced its variable `name`."""
    return ValueError(f"{owner} replaced its variable {name} (not a weight, not RNG state) in the forward, which "
                      "differs row by row under per_sample=True; use per_sample=False (the loss sees whole shards, "
                      "as torch DDP's replicas do). A constant that nnx.remat or nnx.scan passes back as a new value "
                      "reads as replaced too: use activation_checkpoint_interval instead of nnx.remat there.")


def metrics_of(sums: Sums, grad_norm: jax.Array | None = None) -> dict[str, jax.Array]:
    """A step's metrics: mean loss, summed weight, real rows, every metric divided by the weight, and (a training
    step) `grad_norm`, the global L2 norm of the mean loss's gradient before any clipping: what torch's
    clip_grad_norm_ returns, DeepSpeed's get_global_grad_norm() and Megatron's logged "grad norm"."""
    w = sums.weight
    out = {"loss": sums.loss / w, "weight": w, "samples": sums.rows, **{k: v / w for k, v in sums.metrics.items()}}
    return out if grad_norm is None else {**out, "grad_norm": grad_norm}
