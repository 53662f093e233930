"""Megatron-LM tensor parallelism, with data-parallel replicas: a (DATA, TENSOR) mesh.

Each TENSOR group of T devices holds one copy of the model with every transformer block split across it
(jaxpar.comm.megatron): the fused qkv projection and the MLP's first layer by columns (heads / hidden units), the
two output projections by rows; the token embedding (and the LM head tied to it) by vocabulary rows when T divides
the vocabulary (Megatron's VocabParallelEmbedding; logits all-gathered for the loss); everything else -- positions,
LayerNorms, biases after a row split -- is replicated. The plan is plain data computed once from the model: each
module that can be split says how (`tensor_layout()`), and the strategy turns that into, per parameter leaf, a
PartitionSpec and a column order:

    qkv columns [q | k | v] are re-ordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so rank t's contiguous slice holds
    the q, k and v of its own heads; unplace() puts them back in the canonical order.

One step, on every device (shard_map over both axes):

    sums, grads = grad(objective's summed loss over MY data shard)      # f / g inside the blocks: 2 + 2 per block
    grads[replicated] = psum(grads[replicated], TENSOR)                 # sequence parallel only: partial per rank
    grads = psum(grads, DATA)                                           # the data-parallel all-reduce
    weight, |grads|^2 = psum([weight, squared norm], (DATA, TENSOR))    # one small vector, each counted once
    state = apply_updates(tx, state, grads / weight)                    # each rank updates its own slices

Replicated parameters get identical gradients on every tensor rank (their inputs are the replicated residual
stream), so only DATA reduces them -- except under sequence parallelism, where each rank's LayerNorms, positions and
row biases saw only its tokens, and their gradients are summed over TENSOR first. The optimizer must be elementwise
(it sees slices), or jaxpar's `clip_by_global_norm`, which this strategy feeds the norm over all slices (replicated
leaves counted once). With ``zero_stage=1`` (Megatron's distributed optimizer) each tensor rank's slices are one flat
vector whose optimizer moments are split over the data replicas (jaxpar.strategies.zero1): each replica updates its
block, then one all-gather over DATA.
Attention dropout: rank t draws the whole [heads, T, T] mask of the single-device model and keeps its heads, so
the masks, and so the numbers, equal the single-device step's.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import loss_scale
from jaxpar.batch import Rows, as_rows, check_unpadded, num_rows, pad_rows, padded_size, share_of
from jaxpar.comm import cost as comm_cost
from jaxpar.config import Config
from jaxpar.mesh import DATA, TENSOR, tensor_group_error
from jaxpar.objective import Objective, OutputLoss, advance_rng, metrics_of
from jaxpar.step import TrainState, apply_updates, squared_norm
from jaxpar.strategies import zero_optim
from jaxpar.strategies.base import (LayersCheck, check_batch_size, check_objective_options, check_placed,
                                    check_state, from_process_0)
from jaxpar.strategies.ddp import from_replica_0, local_devices, psum_sums
from jaxpar.strategies.zero1 import check_reduce_is_read, is_stage

# split the output dim; the fused q|k|v output dim by heads; the input dim; an embedding table's rows (the
# vocabulary), only when T divides them (else replicated: Megatron pads the vocabulary instead, which would change
# the model)
KINDS = ("columns", "qkv", "rows", "vocab")


class Layout(NamedTuple):
    """How one parameter leaf lies on the TENSOR axis: split along `axis` (None: replicated), its entries first
    taken in `order` along that axis (None: as they are)."""

    axis: int | None = None
    order: tuple[int, ...] | None = None
    whole: str | None = None  # why a leaf the model would split stays replicated (a vocabulary T does not divide)

    def spec(self, ndim: int) -> P:
        return P(*[TENSOR if d == self.axis else None for d in range(ndim)])


def rank_shapes(leaves: list, plan: list, tp: int) -> list[tuple[int, ...]]:
    """Each leaf's shape on one tensor rank: its Layout's axis divided by `tp`."""
    return [tuple(d // tp if k == lay.axis else d for k, d in enumerate(np.shape(a))) for a, lay in zip(leaves, plan)]


def grouped_order(size: int, groups: int, tp: int) -> tuple[int, ...]:
    """Column order putting rank t's share of each of `groups` equal groups next to each other:
    [g0_t0, g1_t0, .., g0_t1, g1_t1, ..] (qkv: groups=3)."""
    per, share = size // groups, size // groups // tp
    return tuple(g * per + t * share + i for t in range(tp) for g in range(groups) for i in range(share))


def tensor_plan(model: nnx.Module, tp: int, wrt: Any = nnx.Param, *, rest: bool = False) -> list[Layout]:
    """The Layout of every leaf of ``nnx.split(model, wrt, ...)[1]`` (flatten order), from the modules'
    ``tensor_layout() -> {(attribute, ..., leaf name): (kind, axis[, unit])}`` (unit: entries that stay together,
    a head's size for qkv); ValueError when a split does not divide. `rest`: the Layouts of
    ``nnx.split(model, wrt, ...)[2]`` instead (the model state, where a split weight that `wrt` leaves out, a
    frozen one, lives: split as it would be trained)."""
    params = nnx.split(model, wrt, ...)[2 if rest else 1]
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in p) for p, _ in flat]
    paths = [p[:-1] if p and p[-1] == "value" else p for p in paths]
    wanted: dict[tuple, tuple[str, int, int]] = {}
    modules: dict[tuple, Any] = {}
    for where, node in nnx.iter_graph(model):
        modules[tuple(where)] = node
        layout = getattr(node, "tensor_layout", None)
        if isinstance(node, nnx.Module) and callable(layout):
            wanted.update({tuple(where) + rel: how for rel, how in checked_layout(node, layout()).items()})
    if not wanted:
        raise ValueError(f"{type(model).__name__} has no module that tensor parallelism can split (none defines "
                         "tensor_layout()); use a model built for it, such as jaxpar.models.gpt.GPT.")
    every = {tuple(p[:-1] if p and p[-1] == "value" else p) for p, _ in nnx.to_flat_state(nnx.state(model))}
    stray = next((key for key in wanted if key not in every), None)
    if stray is not None:  # a misspelt leaf would stay whole while its module still reduces over the ranks
        near = sorted(".".join(map(str, p[len(stray) - 1:])) for p in every if p[:len(stray) - 1] == stray[:-1])
        raise ValueError(f"tensor_layout() names {'.'.join(map(str, stray))}, which is not a variable of "
                         f"{type(model).__name__} (there: {', '.join(near) or 'nothing'}); name each leaf as nnx "
                         "does (a Linear's weight is 'kernel').")
    out = []
    for path, (_, leaf) in zip(paths, flat):
        if path not in wanted:
            out.append(Layout())
            continue
        kind, axis, unit = wanted[path]
        if not -leaf.ndim <= axis < leaf.ndim:
            raise ValueError(f"tensor_layout() splits {'.'.join(map(str, path))} along axis {axis}, which its "
                             f"shape {tuple(leaf.shape)} does not have; give an axis in 0..{leaf.ndim - 1}.")
        axis %= leaf.ndim
        linear_rules(modules.get(path[:-1]), path, kind, axis, wanted)
        size = leaf.shape[axis]
        groups = 3 if kind == "qkv" else 1
        if kind == "vocab" and size % tp:
            out.append(Layout(whole=f"{'.'.join(map(str, path))}: vocabulary {size} is not a multiple of {tp}"))
            continue
        if size % (groups * unit):  # a wrong declaration, whatever T: no count of heads to name
            raise ValueError(f"tensor_layout() splits {'.'.join(map(str, path))} ({kind}) in units of {unit}, but its "
                             f"axis {axis} has {size} entries{', three equal parts of them' if groups == 3 else ''}"
                             f", not a multiple of {groups * unit}; give the unit of one head's size, dividing "
                             f"{size // groups if size % groups == 0 else size}.")
        if size % (groups * tp * unit):
            what = f"{size // groups // unit} heads" if unit > 1 else f"{size} entries along axis {axis}"
            raise ValueError(f"{'.'.join(map(str, path))} has {what}, which --tensor-parallel {tp} does not split "
                             f"evenly; use a tensor-parallel size dividing {size // groups // unit}.")
        out.append(Layout(axis, grouped_order(size, groups, tp) if kind == "qkv" else None))
    return out


def checked_layout(module: nnx.Module, layout) -> dict[tuple, tuple[str, int, int]]:
    """A module's tensor_layout() with every entry checked before any work: a key is a tuple of attribute names
    ending in the leaf's, a value (kind, axis[, unit]) with kind one of KINDS, axis an int and unit an int >= 1;
    returns {key: (kind, axis, unit)}. ValueError naming the entry, the rule and the fix otherwise (a misspelt
    kind split as columns, an axis of another type or a unit of 0 failed deep in the plan with a bare TypeError or
    ZeroDivisionError)."""
    name = f"{type(module).__name__}.tensor_layout()"
    if not isinstance(layout, dict):
        raise ValueError(f"{name} returned a {type(layout).__name__}; it returns a dict {{(attribute, ..., leaf): "
                         "(kind, axis[, unit])}, e.g. {('up', 'kernel'): ('columns', 1)}.")
    out = {}
    for key, how in layout.items():
        if not isinstance(key, tuple) or not key or not all(isinstance(k, (str, int)) for k in key):
            raise ValueError(f"{name} has the key {key!r}; a key is a tuple of attribute names ending in the "
                             "leaf's, e.g. ('up', 'kernel').")
        where = ".".join(map(str, key))
        if not isinstance(how, tuple) or len(how) not in (2, 3):
            raise ValueError(f"{name} gives {where} {how!r}; a split is a tuple (kind, axis[, unit]), e.g. "
                             "('columns', 1).")
        kind, axis, unit = (*how, 1)[:3]
        if kind not in KINDS:
            raise ValueError(f"{name} gives {where} the kind {kind!r}, which is not one of {', '.join(KINDS)}; "
                             "use one of them.")
        for what, value, least in (("axis", axis, None), ("unit", unit, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                    (least is not None and value < least):
                rule = "an int" if least is None else f"an int >= {least}"
                raise ValueError(f"{name} gives {where} the {what} {value!r}; the {what} is {rule} "
                                 f"(e.g. ({kind!r}, {1 if what == 'axis' else axis}"
                                 f"{', 64' if what == 'unit' else ''})).")
        out[key] = (kind, int(axis), int(unit))
    return out


def linear_rules(module, path: tuple, kind: str, axis: int, wanted: dict) -> None:
    """The splits that megatron.column_linear / row_linear can run on an nnx.Linear (kernel [in, out], bias
    [out]): columns and qkv split the kernel's axis 1 and the bias with it; rows split the kernel's axis 0 and
    leave the bias whole (added once after the sum). ValueError naming the leaf and the fix otherwise (they failed
    in the first step with a shape error naming no leaf)."""
    if not isinstance(module, nnx.Linear) or path[-1] not in ("kernel", "bias"):
        return
    where, mod = ".".join(map(str, path)), ".".join(map(str, path[:-1]))
    if kind == "vocab":
        raise ValueError(f"tensor_layout() splits the nnx.Linear leaf {where} by vocabulary rows ('vocab' is for an "
                         "embedding table); split a Linear by 'columns', 'qkv' or 'rows'.")
    want = {("kernel", "rows"): 0, ("kernel", "columns"): 1, ("kernel", "qkv"): 1, ("bias", "columns"): 0,
            ("bias", "qkv"): 0}.get((path[-1], kind))
    if want is None:  # a row split's bias
        raise ValueError(f"tensor_layout() splits {where} by rows, but a row-parallel Linear's bias is added once "
                         f"after the ranks' sum (megatron.row_linear) and stays whole; drop {where} from the layout.")
    if axis != want:
        raise ValueError(f"tensor_layout() splits {where} by {kind} along axis {axis}; an nnx.Linear's "
                         f"{'kernel is [in, out] and' if path[-1] == 'kernel' else 'bias is [out]:'} {kind} split "
                         f"axis {want}: declare ({kind!r}, {want}{', unit' if kind == 'qkv' else ''}).")
    if path[-1] == "kernel" and kind != "rows" and module.bias is not None:
        bias = wanted.get(path[:-1] + ("bias",))
        if bias is None or bias[0] != kind:
            raise ValueError(f"tensor_layout() splits {where} by {kind} but not {mod}.bias; each rank adds its "
                             f"columns' bias (megatron.column_linear): declare {tuple(path[:-1]) + ('bias',)!r}: "
                             f"({kind!r}, 0{', unit' if kind == 'qkv' else ''}).")


def set_tensor_axis(model: nnx.Module, axis: str | None, tp: int, sequence_parallel: bool = False,
                    parallel_output: bool = False) -> nnx.Module:
    """Point every splittable module of `model` at `axis` (None: single-device), in place, with Megatron's sequence
    parallelism on or off and the head's logits left split by vocabulary (`parallel_output`, for modules that have
    the attribute) or gathered; returns the model. ValueError when a module asked for sequence parallelism does not
    know it."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and callable(getattr(node, "tensor_layout", None)):
            if sequence_parallel and not hasattr(node, "sequence_parallel"):
                raise ValueError(f"{type(node).__name__} splits over tensor ranks but has no `sequence_parallel` "
                                 "attribute to run on a rank's tokens; drop --sequence-parallel for this model.")
            node.tensor_axis, node.tensor_size = axis, tp
            if hasattr(node, "sequence_parallel"):
                node.sequence_parallel = sequence_parallel
            if hasattr(node, "parallel_output"):
                node.parallel_output = parallel_output
    return model


def map_params(fn, tree, params, plan: Sequence[Layout]):
    """fn(leaf, layout) on every parameter-shaped subtree of `tree` (the params themselves, or optimizer moments
    shaped like them); other leaves (step counts) pass through."""
    treedef = jax.tree.structure(params)
    is_params = lambda x: jax.tree.structure(x) == treedef  # noqa: E731

    def one(sub):
        if is_params(sub):
            return jax.tree.unflatten(treedef, [fn(a, lay) for a, lay in zip(jax.tree.leaves(sub), plan)])
        return sub

    return jax.tree.map(one, tree, is_leaf=is_params)


def split_leaves(fn, tree, plan: Sequence[Layout]):
    """fn(leaf, layout) on the leaves of `tree` that `plan` splits; the others (RNG keys, counts) as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [fn(a, lay) if lay.axis is not None else a for a, lay in zip(leaves, plan)])


def _is_spec(x) -> bool:
    return isinstance(x, P)


def in_tensor_order(a, lay: Layout) -> np.ndarray:
    """A canonical leaf with its entries in rank order along the split axis (each rank's qkv columns together)."""
    a = np.asarray(a)
    return np.take(a, lay.order, axis=lay.axis) if lay.order else a


def in_canonical_order(a, lay: Layout) -> np.ndarray:
    """in_tensor_order undone: the qkv columns back in q | k | v order."""
    a = np.asarray(a)
    return np.take(a, np.argsort(lay.order), axis=lay.axis) if lay.order else a


def leaf_specs(tree, params, plan: Sequence[Layout]):
    """The PartitionSpec of every leaf of `tree` (the params, or optimizer state over them) by the plan; leaves not
    shaped like a parameter (step counts) replicated."""
    specs = map_params(lambda a, lay: lay.spec(np.ndim(a)), tree, params, plan)
    return jax.tree.map(lambda x: x if _is_spec(x) else P(), specs, is_leaf=_is_spec)


class TensorParallel:
    """Megatron tensor parallelism (T ranks) x data parallelism on a (DATA, TENSOR) mesh:
    `TensorParallel(model, tx, tensor_parallel=2, loss_fn=...)`. A copy of the model has its splittable modules
    (those with `tensor_layout()`; jaxpar.models.gpt's blocks) pointed at the TENSOR axis. `check_split`: run the
    first batch's first rows through one tensor group and through the unsplit model before the first step, and
    refuse a split that computes something else (a module that declares a split but never joins its ranks, or a
    loss(model, batch) that reads a split weight outside the model's __call__); None: only when a splitting module
    comes from outside jaxpar (its own are tested) or the loss takes the model, False: never (a model too big for
    one device)."""

    name = "tp"

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, tensor_parallel: int = 2,
                 sequence_parallel: bool = False, parallel_output: bool | None = None, loss_fn=None,
                 mesh: Mesh | None = None, batch_size: int | None = None, zero_stage: int = 0,
                 zero_reduce: str = "reduce_scatter", check_split: bool | None = None, **objective_options):
        n = jax.device_count() if mesh is None else mesh.size
        if not is_stage(zero_stage, (0, 1)):
            raise ValueError(f"zero_stage={zero_stage!r}: tensor parallelism takes ZeRO stage 0 or 1 (the optimizer "
                             "state of each tensor rank's slices partitioned over the data replicas: Megatron's "
                             "distributed optimizer); pass 0 or 1.")
        if zero_reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"zero_reduce={zero_reduce!r} is not known; use reduce_scatter (Megatron's distributed "
                             "optimizer) or all_reduce.")
        check_reduce_is_read(zero_reduce, zero_stage)
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, np.integer)):
            raise ValueError(f"tensor_parallel={tensor_parallel!r} must be an int >= 1; pass --tensor-parallel 2 or "
                             "more.")
        if tensor_parallel < 1 or n % tensor_parallel:
            divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            raise ValueError(f"tensor_parallel={tensor_parallel} (--tensor-parallel) must be >= 1 and divide the {n} "
                             f"devices; use a divisor of {n} ({divisors}).")
        self.tp = tensor_parallel
        self.mesh = mesh or Mesh(np.array(jax.devices()[:n]).reshape(n // tensor_parallel, tensor_parallel),
                                 (DATA, TENSOR))
        if tuple(self.mesh.axis_names) != (DATA, TENSOR) or self.mesh.shape[TENSOR] != tensor_parallel:
            raise ValueError(f"mesh {dict(self.mesh.shape)} must have axes ({DATA!r}, {TENSOR!r}) with {TENSOR}="
                             f"{tensor_parallel}; build it as Mesh(devices.reshape(data, tensor), (DATA, TENSOR)).")
        if not isinstance(model, nnx.Module):
            raise TypeError(f"TensorParallel takes the model itself (its blocks are pointed at the {TENSOR!r} axis), "
                            f"not a {type(model).__name__}.")
        spans = [row for row in self.mesh.devices if len({d.process_index for d in row}) > 1]
        if spans:  # each process feeds its own rows to its data ranks: a tensor group cannot straddle two
            raise tensor_group_error(tensor_parallel, sorted({d.process_index for d in spans[0]}),
                                     len(local_devices(self.mesh)))
        model = nnx.clone(model)  # its own copy, pointed at the tensor axis below: the user's model stays as it is
        wrt = objective_options.get("wrt", nnx.Param)
        check_objective_options("TensorParallel", objective_options)
        self.eval_objective = Objective.of(model, loss_fn, **objective_options)  # unsplit: jaxpar.evaluate's
        self.plan = tensor_plan(model, tensor_parallel, wrt)
        self.state_plan = tensor_plan(model, tensor_parallel, wrt, rest=True)  # frozen weights
        whole = [lay.whole for lay in self.plan if lay.whole]
        if sequence_parallel and whole:  # a whole head's logits and their gradient would be counted T times
            raise ValueError(f"--sequence-parallel needs the embedding split by vocabulary rows, but {whole[0]}; "
                             "pad the vocabulary to a multiple of --tensor-parallel (GPT-2's 50257 to 50304).")
        # each rank updates slices of leaves: the optimizer must be elementwise (or want only the global norm);
        # with ZeRO-1 it sees flat pieces of them (zero_optim.check), else the tree of its slices (check_slices)
        params = nnx.split(model, wrt, ...)[1]
        slices = rank_shapes(jax.tree.leaves(params), self.plan, tensor_parallel)
        self.needs_norm = zero_optim.check(tx, params, slices=slices) if zero_stage else \
            zero_optim.check_slices(tx, params, slices, [lay.axis for lay in self.plan], tensor_parallel)
        self.parallel_output = resolve_parallel_output(parallel_output, loss_fn) and not whole
        set_tensor_axis(model, TENSOR, tensor_parallel, sequence_parallel, self.parallel_output)
        self.sequence_parallel = bool(sequence_parallel)
        self.objective = Objective.of(model, loss_fn, **objective_options).check_trains()
        self.tx, self.batch_size = tx, check_batch_size(batch_size)
        self.data = self.mesh.shape[DATA]
        self.multiple = len(local_devices(self.mesh)) // self.tp  # rows per process: a multiple of its data ranks
        self.share = share_of(self.batch_size, jax.process_count(), self.multiple)
        self._step = self._batch_spec = None
        self.zero_stage, self.zero, self.zero_reduce = zero_stage, None, zero_reduce
        if check_split not in (None, True, False):
            raise ValueError(f"check_split={check_split!r}: pass True (check every model's split on the first "
                             "batch), False (never) or None (only modules from outside jaxpar).")
        self.foreign = sorted(set(foreign_split(model)))
        # a loss(model, batch) may read split weights outside the model's __call__, where each rank sees its slice
        self.model_loss = not isinstance(self.objective.loss_fn, OutputLoss)
        self.check_split = bool(self.foreign) or self.model_loss if check_split is None else check_split
        self._split_check: tuple | None = None  # (params, model_state): armed by init, run by put_batch, once
        self._rows_check = LayersCheck()

    # -- placement -----------------------------------------------------------------------------------------

    def _specs(self, state: TrainState) -> TrainState:
        replicated = leaf_specs(state.model_state, state.model_state, self.state_plan)
        opt = self.zero.opt_specs(self.tx, state.params) if self.zero_stage else \
            leaf_specs(state.opt_state, state.params, self.plan)
        return TrainState(leaf_specs(state.params, state.params, self.plan), opt, replicated, P())

    def init(self, state: TrainState) -> TrainState:
        """The canonical state onto the mesh: split leaves in tensor order, sharded over TENSOR; the rest replicated
        (ZeRO-1: the optimizer moments flat, each tensor rank's split over DATA)."""
        check_state(state, self.tx, self.objective)
        state = from_process_0(state)  # torch DDP's broadcast of rank 0's parameters at construction
        if self.check_split:
            self._split_check = (jax.tree.map(np.asarray, state.params), state.model_state)
        self._rows_check.arm_rows(self.eval_objective, state, self.tx)  # unsplit: runs outside the mesh
        host = state._replace(params=map_params(in_tensor_order, state.params, state.params, self.plan),
                              opt_state=map_params(in_tensor_order, state.opt_state, state.params, self.plan),
                              model_state=split_leaves(in_tensor_order, state.model_state, self.state_plan))
        if self.zero_stage and self.zero is None:
            from jaxpar.strategies import zero1

            leaves = jax.tree.leaves(state.params)
            specs = [lay.spec(np.ndim(a)) for a, lay in zip(leaves, self.plan)]
            self.zero = zero1.of(self.mesh, zero1.device_leaves(leaves, specs, self.mesh),
                                 [lay.axis for lay in self.plan])
        specs = self._specs(state)
        if self._step is None:
            self._step = self._compile(specs)
        zero_opt = self.zero.place(self.tx, host.params, host.opt_state) if self.zero_stage else None
        host = host._replace(opt_state=None) if self.zero_stage else host

        def put(a, spec):
            if jax.dtypes.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
                return jax.random.wrap_key_data(put(jax.random.key_data(a), spec), impl=jax.random.key_impl(a))
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, NamedSharding(self.mesh, spec), lambda idx: a[idx])

        if self.zero_stage:
            specs = specs._replace(opt_state=None)
        leaves, treedef = jax.tree.flatten(host)
        placed = jax.tree.unflatten(treedef, [put(a, s) for a, s in zip(leaves,
                                                                           jax.tree.leaves(specs, is_leaf=_is_spec))])
        return placed._replace(opt_state=zero_opt) if self.zero_stage else placed

    def put_batch(self, batch) -> Rows:
        """This process's rows, padded to its share, sharded over DATA (replicated over TENSOR)."""
        local = None if isinstance(batch, Rows) else num_rows(batch)
        target = padded_size(batch.size if local is None else local, "TensorParallel", self.batch_size,
                             self.multiple, jax.process_count())  # before any work: a larger batch is refused
        rows = as_rows(batch, offset=jax.process_index() * (local or 0))
        rows = pad_rows(rows, target)
        if not self.objective.per_sample:
            check_unpadded(rows, "per_sample=False")
        self._rows_check(rows)
        if self._split_check is not None:
            params, model_state = self._split_check
            check_split_computes(self, params, model_state, rows)
            self._split_check = None
        sharding = NamedSharding(self.mesh, P(DATA))
        return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, np.asarray(v)), rows)

    def unplace(self, placed: TrainState) -> TrainState:
        """The canonical single-device state: slices gathered, qkv columns back in q | k | v order."""
        def gathered(a):
            if isinstance(a, jax.Array) and not a.is_fully_addressable:
                from jax.experimental import multihost_utils

                a = multihost_utils.process_allgather(a, tiled=True)
            return a

        def back(a, lay):
            return jnp.asarray(in_canonical_order(gathered(a), lay))

        device = jax.local_devices()[0]
        first = lambda a: jax.device_put(a.addressable_data(0), device) if isinstance(a, jax.Array) else a  # noqa
        opt = placed.opt_state
        if self.zero_stage:  # the flat moments gathered and cut back into whole leaves (tensor order)
            opt = jax.tree.map(jnp.asarray, self.zero.unplace(self.tx, placed.params, opt))
        opt = map_params(back, opt, placed.params, self.plan)
        model_state = split_leaves(back, placed.model_state, self.state_plan)  # frozen split weights
        return TrainState(map_params(back, placed.params, placed.params, self.plan), jax.tree.map(first, opt),
                          jax.tree.map(first, model_state), first(placed.step))

    # -- the step ------------------------------------------------------------------------------------------

    def _compile(self, specs: TrainState):
        objective, tx, plan, needs_norm, zero1 = self.objective, self.tx, self.plan, self.needs_norm, self.zero
        sp, scatter = self.sequence_parallel, zero1 is not None and self.zero_reduce == "reduce_scatter"
        sharded = [lay.axis is not None for lay in plan]

        def body(state: TrainState, rows: Rows):
            scale = loss_scale.current(state.opt_state)

            def loss(params):
                sums, new_state = objective.sums(params, state.model_state, rows, shard=lax.axis_index(DATA))
                return sums.loss, (sums, new_state)

            # with a loss scale: every device at one seed (a tensor group's ranks hold the same rows and sums)
            (_, (sums, new_state)), grads, seed = loss_scale.value_and_grad(loss, scale, DATA)(state.params)
            grads = loss_scale.unscale(grads, seed)
            if sp:  # replicated leaves saw only this rank's tokens (LayerNorms, positions, row biases): sum them
                leaves, treedef = jax.tree.flatten(grads)
                grads = jax.tree.unflatten(treedef, [g if s else lax.psum(g, TENSOR) for g, s in zip(leaves, sharded)])
            leaves, zero = jax.tree.leaves(grads), jnp.zeros((), jnp.float32)
            first_t, first_d = lax.axis_index(TENSOR) == 0, lax.axis_index(DATA) == 0
            if scatter:  # ZeRO-1: one reduce-scatter; each replica's block of the sum, its squared norm its part
                block = zero1.reduce_scatter(leaves)
                counted = jnp.where(zero1.replicated_mask(block.dtype) > 0, first_t, True)  # whole leaves: rank 0's
                squared = jnp.sum(jnp.where(counted, jnp.square(block.astype(jnp.float32)), 0.0))
            else:
                grads = lax.psum(grads, DATA)
                # ONE small psum over the whole mesh adds the metrics (tensor rank 0's: the ranks' are equal) and
                # the gradient's squared norm (data rank 0's, as the gradient is reduced: every rank's slices, rank
                # 0's replicated leaves) -- no collective of the norm's own
                leaves = jax.tree.leaves(grads)
                local = squared_norm([g for g, s in zip(leaves, sharded) if s])
                whole = squared_norm([g for g, s in zip(leaves, sharded) if not s])
                squared = jnp.where(first_d, local + jnp.where(first_t, whole, zero), zero)
            mine = jax.tree.map(lambda a: jnp.where(first_t, a, jnp.zeros_like(a)), sums)
            total, squared = psum_sums(mine, (DATA, TENSOR), None, squared)
            grads = jax.tree.map(lambda g: g / total.weight, grads) if not scatter else None
            norm = jnp.sqrt(squared) / total.weight
            extra = {"global_norm": norm} if needs_norm else {}
            model_state = advance_rng(new_state, state.model_state)
            if not objective.per_sample:
                model_state = from_replica_0(model_state, DATA, state.model_state)
            if zero1 is not None:  # ZeRO-1: this replica's block of its slices, then one all-gather over DATA
                leaves, treedef = jax.tree.flatten(state.params)
                grad_block = block / total.weight if scatter else None
                params, opt_state = zero1.local_update(optax.with_extra_args_support(tx), leaves, state.opt_state,
                                                      None if scatter else jax.tree.leaves(grads),
                                                      grad_block=grad_block, **extra)
                return TrainState(jax.tree.unflatten(treedef, params), opt_state, model_state,
                                  state.step + 1), {**metrics_of(total, norm), **loss_scale.metrics(scale)}
            return apply_updates(tx, state, grads, model_state, **extra), {**metrics_of(total, norm),
                                                                           **loss_scale.metrics(scale)}

        step = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(DATA)), out_specs=(specs, P()),
                             check_vma=False)
        return jax.jit(step, donate_argnums=0)

    def step(self, placed: TrainState, rows: Rows):
        check_placed(rows, Rows, "TensorParallel", placed, same_devices=True)
        self._batch_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), rows)
        return self._step(placed, rows)

    def hlo(self, placed) -> str:
        return self._step.lower(placed, self._batch_spec).compile().as_text()

    def describe(self) -> str:
        return (f"({DATA}, {TENSOR}) mesh {dict(self.mesh.shape)}: Megatron tensor parallelism over {self.tp} devices "
                f"({sum(lay.axis is not None for lay in self.plan)} split leaves), {self.data} data replicas"
                + (", sequence parallel" if self.sequence_parallel else "")
                + (f", ZeRO-1 (each tensor rank's optimizer state split over its {self.data} data replicas, "
                   f"gradients by {self.zero_reduce.replace('_', '-')})" if self.zero_stage and self.data > 1 else "")
                + (", ZeRO-1 over one data replica (nothing to split)" if self.zero_stage and self.data == 1 else "")
                + (", logits split by vocabulary into the loss (parallel_output)" if self.parallel_output else "")
                + whole_note(self.plan))

    def report(self, placed) -> dict:
        """The split, and the compiled step's all-reduces within the tensor groups: forward (Megatron's g) and
        backward (f's transpose), per transformer block."""
        out = {"devices": self.mesh.size, "mesh": dict(self.mesh.shape), "tensor_parallel": self.tp,
               "zero_stage": self.zero_stage, "zero_reduce": self.zero_reduce if self.zero_stage else None,
               "split_leaves": sum(lay.axis is not None for lay in self.plan)}
        if self._batch_spec is not None:
            forward, backward = tensor_all_reduces(self.hlo(placed), self.mesh)
            out.update(tensor_all_reduces_forward=forward, tensor_all_reduces_backward=backward)
        return out


def foreign_split(model: nnx.Module):
    """The names of the splitting modules (those with `tensor_layout()`) of `model` defined outside jaxpar."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and callable(getattr(node, "tensor_layout", None)) \
                and not type(node).__module__.startswith("jaxpar."):
            yield type(node).__name__


def split_gradients(strategy: TensorParallel, params, model_state, rows: Rows):
    """(loss sum, canonical gradients) of `rows` through the split model on one tensor group of this process."""
    plan, objective, sp = strategy.plan, strategy.objective, strategy.sequence_parallel
    row = next(r for r in strategy.mesh.devices if all(d.process_index == jax.process_index() for d in r))
    mesh = Mesh(np.array(row).reshape(1, -1), (DATA, TENSOR))
    specs = leaf_specs(params, params, plan)

    def body(params, model_state, rows):
        def loss(params):
            sums, _ = objective.sums(params, model_state, rows)
            return sums.loss

        value, grads = jax.value_and_grad(loss)(params)
        if sp:  # replicated leaves saw only this rank's tokens
            leaves, treedef = jax.tree.flatten(grads)
            grads = jax.tree.unflatten(treedef, [g if lay.axis is not None else lax.psum(g, TENSOR)
                                                 for g, lay in zip(leaves, plan)])
        return value, grads

    put = lambda tree, spec: jax.tree.map(  # noqa: E731
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, spec, is_leaf=_is_spec)
    ordered = map_params(in_tensor_order, params, params, plan)
    state_specs = leaf_specs(model_state, model_state, strategy.state_plan)
    model_state = split_leaves(in_tensor_order, model_state, strategy.state_plan)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, state_specs, P(DATA)), out_specs=(P(), specs),
                                 check_vma=False))
    value, grads = step(put(ordered, specs), put(model_state, state_specs),
                        jax.device_put(rows, NamedSharding(mesh, P(DATA))))
    return float(value), map_params(in_canonical_order, grads, params, plan)


def check_split_computes(strategy: TensorParallel, params, model_state, rows: Rows, count: int = 2) -> None:
    """ValueError unless the split model's loss and gradients on the first `count` rows equal the unsplit model's
    (to 1e-4 of each leaf's gradient in float32, 0.1 in 16-bit compute; a leaf whose gradient is near zero, whose
    float32 value is rounding noise -- the key's bias, a bias before a BatchNorm, whose noise reached 1.8e-6 of the
    whole gradient -- measured against 0.1 of the whole gradient): a module that declares a split in
    `tensor_layout()` but never joins its ranks' partial results computes something else (a rank's share, a sum
    never taken: errors of the order of the gradients themselves), and would train on without a word."""
    head = jax.tree.map(lambda a: np.asarray(a)[:count], rows)
    value, grads = split_gradients(strategy, params, model_state, head)

    def loss(params):
        sums, _ = strategy.eval_objective.sums(params, model_state, head)
        return sums.loss

    want, expected = jax.jit(jax.value_and_grad(loss))(params)
    dtype = strategy.objective.compute_dtype
    tol = 1e-4 if dtype is None or jnp.finfo(dtype).bits >= 32 else 0.1
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    norms = [float(np.linalg.norm(np.asarray(e, np.float64))) for _, e in flat]
    floor = 0.1 * float(np.sqrt(sum(n * n for n in norms)))
    worst, name, replicated = 0.0, "", False
    for (path, e), n, got, lay in zip(flat, norms, jax.tree.leaves(grads), strategy.plan):
        gap = float(np.linalg.norm(np.asarray(got, np.float64) - np.asarray(e, np.float64))) / max(n, floor, 1e-30)
        if gap > worst:
            worst, name = gap, jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
            replicated = lay.axis is None and not lay.whole
    want = float(want)
    if worst > tol or abs(value - want) > tol * max(abs(want), 1e-30) or np.isfinite(value) != np.isfinite(want):
        modules = ", ".join(strategy.foreign) or "its modules"
        raise ValueError(f"tensor parallelism over {strategy.tp} ranks computes another model than the unsplit one "
                         f"on the first batch's first {len(np.asarray(head.mask))} rows (loss {value:.6g} against "
                         f"{want:.6g}; the gradient of {name} off by {worst:.2g} of its size): each module that "
                         f"declares a split in tensor_layout() ({modules}) must join its ranks, megatron.f before a "
                         "column split and megatron.g (or row_linear) after a row split, and a dropout on a split "
                         "tensor must draw the whole tensor's mask (jaxpar.comm.megatron.split_dropout), not its "
                         "slice's on every rank"
                         + (f"; {name} is replicated (in no tensor_layout()), and a replicated weight used between "
                            "megatron.f and the split (or on a rank's slice) gets only that rank's share of its "
                            "gradient: apply it before f or after g, or declare its split" if replicated and
                            worst > tol else "")
                         + ("; or the loss reads a split weight outside the model's __call__ (a weight penalty), "
                            "where each rank sees its slice: compute it inside the model's __call__, or write the "
                            "loss on the model's outputs (jaxpar.OutputLoss)" if strategy.model_loss else "")
                         + "; or pass check_split=False.")


def resolve_parallel_output(parallel_output: bool | None, loss_fn) -> bool:
    """Whether the head's vocabulary-split logits go to the loss unsplit (Megatron's parallel_output=True): None,
    when the loss takes them (`jaxpar.losses.takes_vocab_parallel`; the default cross-entropy does); True, which
    the loss must take; False, never (the logits are all-gathered, parallel_output=False)."""
    from jaxpar.losses import cross_entropy, takes_vocab_parallel

    takes = takes_vocab_parallel(cross_entropy if loss_fn is None else loss_fn)
    if parallel_output and not takes:
        raise ValueError(f"parallel_output=True hands the loss logits split by vocabulary "
                         f"(jaxpar.comm.megatron.VocabParallelLogits), but the loss {loss_fn!r} does not say it "
                         "takes them; use jaxpar.cross_entropy, set `takes_vocab_parallel = True` on a loss that "
                         "handles them, or leave parallel_output=None.")
    return takes if parallel_output is None else bool(parallel_output)


def whole_note(plan: Sequence[Layout]) -> str:
    """'; kept whole: <leaf>: <why> (pad ...)' for leaves the model would split but the plan replicates, or ''."""
    whole = [lay.whole for lay in plan if lay.whole]
    return (f"; kept whole: {', '.join(whole)} (to split it, pad the vocabulary to a multiple of the "
            "tensor-parallel size as Megatron and nanoGPT do: GPT-2's 50257 to 50304)") if whole else ""


def tensor_all_reduces(hlo_text: str, mesh: Mesh) -> tuple[int, int]:
    """(forward, backward) all-reduces over the TENSOR groups of `mesh` in a compiled step's HLO: the backward
    ones are those JAX's transpose emitted (their op_name holds 'transpose(')."""
    groups = {tuple(sorted(int(d.id) for d in row)) for row in mesh.devices.reshape(-1, mesh.shape[TENSOR])}
    forward = backward = 0
    for c in comm_cost.hlo_collectives(hlo_text):
        if c.kind == "all-reduce" and set(c.groups) == groups:
            line = next(line for line in hlo_text.splitlines() if line.strip().startswith(f"%{c.name} "))
            backward += "transpose(" in line
            forward += "transpose(" not in line
    return forward, backward


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config, loss_fn=None) -> TensorParallel:
    devices = jax.devices()[:cfg.num_devices] if cfg.num_devices else jax.devices()
    n, tp = len(devices), cfg.tensor_parallel
    if tp < 1 or n % tp:
        raise ValueError(f"--tensor-parallel {tp} must be >= 1 and divide the {n} devices; use a divisor of {n}.")
    mesh = Mesh(np.array(devices).reshape(n // tp, tp), (DATA, TENSOR))
    from jaxpar.precision import compute_dtype

    return TensorParallel(model, tx, tensor_parallel=tp, sequence_parallel=cfg.sequence_parallel,
                          parallel_output=None if cfg.parallel_output else False, mesh=mesh,
                          batch_size=cfg.batch_size, loss_fn=loss_fn, zero_stage=cfg.zero_stage or 0,
                          zero_reduce=cfg.zero_reduce or "reduce_scatter",
                          per_sample={None: None, "on": True, "off": False}[cfg.per_sample],
                          compute_dtype=compute_dtype(cfg.precision),
                          activation_checkpoint_interval=cfg.activation_checkpoint_interval)
