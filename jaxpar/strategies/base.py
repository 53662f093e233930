"""The contract every strategy keeps, and the registry behind `--strategy`.

Every strategy is built from an `Objective` (the user's NNX model, loss and `wrt` filter; jaxpar.objective) and
an optax transformation, and keeps the same four calls, so the trainer, checkpoints and exports never ask which
strategy runs:

    placed = strategy.init(state)                  # the canonical TrainState onto the devices
    batch = strategy.put_batch(batch_or_rows)      # pad / mask / shard / scatter (on the loader thread)
    placed, metrics = strategy.step(placed, batch)
    state = strategy.unplace(placed)               # the canonical single-device TrainState again
"""
from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from typing import Any, Iterable, Protocol

import jax
import numpy as np
from flax import nnx

from jaxpar import loss_scale, optim
from jaxpar.batch import Rows, as_rows
from jaxpar.objective import Objective, _slash_path, metrics_of
from jaxpar.step import TrainState, make_eval_step
from jaxpar.types import Batch, Metrics

# name -> "module:function" building it; imported lazily so a strategy's deps load only when used
STRATEGIES = {
    "single": "jaxpar.strategies.single:build",
    "ddp": "jaxpar.strategies.ddp:build",
    "dp": "jaxpar.strategies.data_parallel:build",
    "pipeline": "jaxpar.strategies.pipeline:build",
    "zero": "jaxpar.strategies.zero:build",
    "tp": "jaxpar.strategies.tensor:build",
}


class Strategy(Protocol):
    """A way to run the reference step on many devices; `unplace(step(init(s)))` equals the reference step."""

    name: str

    def init(self, state: TrainState) -> Any:
        """Place the canonical state on the devices."""

    def put_batch(self, batch: Batch) -> Any:
        """Pad, mask, shard or scatter this process's rows of the global batch (runs ahead, on the loader thread)."""

    def step(self, placed: Any, batch: Any) -> tuple[Any, Metrics]:
        """One training step; metrics as the reference's (loss, correct, count)."""

    def unplace(self, placed: Any) -> TrainState:
        """The canonical single-device state (params and opt_state with the reference's tree structure)."""

    def describe(self) -> str:
        """One line: devices, mesh, algorithm."""

    def report(self, placed: Any) -> dict:
        """Extras for --report (communication, memory, schedule)."""


_EVAL_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # strategy -> its jitted eval step


def evaluate(strategy: Any, placed: Any, batches: Iterable) -> dict[str, float]:
    """The metrics of the placed state over `batches` (batch pytrees or Rows, as put_batch takes them) in eval
    mode (no dropout, BatchNorm's running statistics), as train.py reports them: the loss and every metric summed
    over all the batches, then divided by the total weight (not a mean of per-batch means). A strategy with its
    own evaluate (the pipeline: the forward-only schedule, the weights where they are) runs it; the others
    evaluate the canonical state (`unplace`) on one device."""
    if isinstance(batches, (dict, Rows, np.ndarray, jax.Array, str)):  # iterating it gave its keys or rows
        raise TypeError(f"evaluate() got one {type(batches).__name__} as batches, which it would iterate over (its "
                        "keys or rows); pass an iterable of batches: jaxpar.evaluate(strategy, placed, [batch]).")
    check_not_consumed(placed, f"evaluate() with {type(strategy).__name__}")
    own = getattr(strategy, "evaluate", None)
    if own is None:
        state = strategy.unplace(placed)
        if strategy not in _EVAL_STEPS:
            _EVAL_STEPS[strategy] = make_eval_step(getattr(strategy, "eval_objective", strategy.objective))
        step = functools.partial(_EVAL_STEPS[strategy], state.params, state.model_state)
    totals = None
    for batch in batches:
        if type(batch).__module__.startswith("jaxpar.strategies") or own is None and any(  # the pipeline's Batch,
                isinstance(a, jax.Array) and len(a.sharding.device_set) > 1 for a in jax.tree.leaves(batch)):
            # or rows over devices where the state is evaluated on one
            raise TypeError(f"evaluate() got a batch that {type(strategy).__name__}.put_batch placed (its own layout, "
                            "on its devices); pass the batches themselves (dicts of arrays or Rows), as put_batch "
                            "takes them: jaxpar.evaluate(strategy, placed, [batch]).")
        rows = as_rows(batch)
        if own is None:  # a batch the model cannot take, in one line (the pipeline's put_batch checks its own)
            getattr(strategy, "eval_objective", strategy.objective).check_inputs(rows.data, rows.mask)
        sums = jax.device_get(own(placed, rows) if own is not None else step(rows))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    if totals is None:
        raise ValueError("evaluate() got no batches; pass an iterable of at least one batch.")
    return {k: float(v) for k, v in metrics_of(totals).items()}


def split_leaf(tree) -> str | None:
    """The path of the first jax.Array leaf of `tree` that is split over devices (its sharding not fully
    replicated: a ZeRO shard, a tensor-parallel slice), or None. A canonical state is whole on every device."""
    return next((jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]
                 if isinstance(a, jax.Array) and not a.sharding.is_fully_replicated), None)


def check_state(state: TrainState, tx, objective: Objective | None = None) -> None:
    """ValueError unless the state is one of the strategy's model and optimizer: params and model_state with the
    tree and shapes of the model the objective was made from, opt_state what `tx` makes for them (as
    jaxpar.init_state(model, tx) or a checkpoint of it gives). A state of another model (other widths) would train
    that model under this one's name, one of another optimizer fail deep inside optax, or worse, line up by chance.
    Shapes only (eval_shape): each strategy's init calls it first."""
    if not isinstance(state, TrainState):
        raise TypeError(f"the state is {type(state).__name__}, not a jaxpar.TrainState (params, opt_state, "
                        "model_state, step); build it with jaxpar.init_state(model, tx).")
    split = split_leaf(state)
    if split is not None:
        raise ValueError(f"state{split} is split over devices: a strategy's placed state (its own layout: "
                         "shards, reordered columns), not a canonical one; pass strategy.unplace(placed).")
    check_tx(tx)
    if objective is not None and objective.shapes is not None:
        fix = "build the state with jaxpar.init_state(model, tx) of the model given to the strategy"
        if objective.wrt is not nnx.Param:  # the state must hold what the strategy trains
            fix += f", with its wrt: jaxpar.init_state(model, tx, wrt={objective.wrt!r}) (or wrt=strategy.objective)"
        for name, have, want in zip(("params", "model_state"), (state.params, state.model_state), objective.shapes):
            _check_tree(f"state.{name}", have, want, "the strategy's model has", fix, by_path=True,
                        dtypes=name == "params")
    have, want = state.opt_state, jax.eval_shape(tx.init, state.params)
    loss_scale.find(want)  # a loss scaler inside the optimizer, not around it, refused before any step
    _check_tree("state.opt_state", have, want, "the strategy's tx makes",
                "build the state with jaxpar.init_state(model, tx) from the optimizer given to the strategy")


def check_batch_size(batch_size) -> int | None:
    """`batch_size` (the global batch a strategy pads every batch's shape to) as an int, or None; ValueError unless
    it is an int >= 1 (it was taken silently: 0 or 2.5 fixed no shape, or an odd one, across processes)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (the global batch, --batch-size), or None "
                         "to take each batch's own size.")
    return int(batch_size)


def check_tx(tx) -> None:
    """TypeError unless `tx` is an optax transformation (before anything calls tx.init)."""
    if not callable(getattr(tx, "init", None)) or not callable(getattr(tx, "update", None)):
        raise TypeError(f"tx={tx!r} is not an optax GradientTransformation; pass one, e.g. optax.adam(1e-3).")


def processes() -> str:
    """'1 process' or 'N processes', for the strategies' describe()."""
    n = jax.process_count()
    return f"{n} process" if n == 1 else f"{n} processes"


def from_process_0(state: TrainState) -> TrainState:
    """Process 0's state on every process, as torch DDP broadcasts rank 0's parameters and buffers when it is
    built: processes whose models were initialised apart (an unseeded init) start alike. A process whose own
    state differed says so in one line. No-op in one process."""
    if jax.process_count() == 1:
        return state
    import sys

    from jax.experimental import multihost_utils

    from jaxpar.run.checkpoint import from_host, to_host

    mine = to_host(state)
    got = [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(mine)]
    differ = [i for i, (a, b) in enumerate(zip(mine, got)) if not np.array_equal(a, b, equal_nan=True)]
    if differ:
        path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(state)[0][differ[0]][0])
        print(f"jaxpar: process {jax.process_index()}'s initial state differs from process 0's ({len(differ)} "
              f"leaves, first {path}); every process starts from process 0's, as torch DDP does.", file=sys.stderr)
    return from_host(state, got)  # jax arrays (writable Variables), typed keys rewrapped


def check_not_consumed(placed: Any, who: str) -> list:
    """ValueError if `placed` is a state whose buffers a step consumed (donated): JAX's "Array has been deleted"
    from deep inside step, unplace, evaluate or a checkpoint's save. Returns the leaves it probed."""
    # a step donates every buffer of the state at once, so one tells: the step count where it is an array (O(1) on
    # every step; flattening a GPT-2 state took 0.3 ms), else the first parameter leaf (the pipeline's)
    probe = getattr(placed, "step", None)
    probes = [probe] if isinstance(probe, jax.Array) else jax.tree.leaves(getattr(placed, "params", placed))[:1]
    if any(isinstance(a, jax.Array) and a.is_deleted() for a in probes):
        raise ValueError(f"{who} got a placed state that an earlier step consumed (the step donates its buffers); "
                         "pass the state the last step returned (placed, metrics = strategy.step(placed, rows)), or "
                         "place it again with strategy.init(state).")
    return probes


def check_placed(batch: Any, kind: type, who: str, state: Any = None, same_devices: bool = False) -> None:
    """TypeError unless step() got the batch `who`.put_batch returns (a raw dict or array failed deep inside);
    ValueError if the placed `state` is one an earlier step consumed (its buffers donated to that step: running
    on them crashed the process on XLA:CPU's multi-device meshes), or, with `same_devices` (strategies whose
    batch and state live on the same devices), if the batch is on other devices than the state (another
    strategy's put_batch: JAX's "incompatible devices" deep inside jit)."""
    if not isinstance(batch, kind):
        raise TypeError(f"{who}.step() got a {type(batch).__name__} batch, not what {who}.put_batch returns; pass "
                        "placed, metrics = strategy.step(placed, strategy.put_batch(batch)).")
    # a step donates every buffer of the state at once, so one tells: the step count where it is an array (O(1) on
    # every step; flattening a GPT-2 state took 0.3 ms), else the first parameter leaf (the pipeline's)
    probes = check_not_consumed(state, f"{who}.step()")
    if same_devices and probes and isinstance(probes[0], jax.Array):  # a batch another strategy placed
        first = next((a for a in jax.tree.leaves(batch) if isinstance(a, jax.Array)), None)
        if first is not None and first.sharding.device_set != probes[0].sharding.device_set:
            raise ValueError(f"{who}.step() got a batch on {len(first.sharding.device_set)} device(s) other than "
                             f"its state's {len(probes[0].sharding.device_set)}: placed by another strategy's "
                             "put_batch; pass this strategy's: strategy.step(placed, strategy.put_batch(batch)).")


def refuse_sync_batch_norm(model: nnx.Module, who: str) -> None:
    """ValueError where the model has synchronised BatchNorm (an axis_name) that `who` cannot bind: as in torch,
    SyncBatchNorm needs the data-parallel strategies that see a global batch (DDP, ZeRO)."""
    # only Modules: an nnx.Rngs answers any attribute it lacks with its default stream (truthy), and refused
    # every model that keeps one (a QA finding: "synchronised BatchNorm" in a model without BatchNorm)
    if any(isinstance(node, nnx.Module) and getattr(node, "axis_name", None) is not None
           for _, node in nnx.iter_graph(model)):
        raise ValueError(f"the model has synchronised BatchNorm (an axis_name), which {who} cannot bind; as in "
                         "torch, SyncBatchNorm needs DistributedDataParallel (or ZeRO): use one of those, or leave "
                         "the model's BatchNorm unsynchronised (no jaxpar.sync_batch_norm).")


def _check_tree(what: str, have: Any, want: Any, whose: str, fix: str, by_path: bool = False,
                dtypes: bool = False) -> None:
    """ValueError naming the first gap unless `have` has the tree and leaf shapes of `want` (`dtypes`: and leaf
    dtypes). by_path: the same leaf paths suffice (a model's Variables carry metadata, such as an RNG stream's
    tag, that training ignores)."""
    leaves, treedef = jax.tree.flatten_with_path(have)
    w_leaves, w_treedef = jax.tree.flatten_with_path(want)
    if by_path:
        paths, w_paths = ([jax.tree_util.keystr(p) for p, _ in x] for x in (leaves, w_leaves))
        if paths != w_paths:
            i = next((k for k, (p, q) in enumerate(zip(paths, w_paths)) if p != q), min(len(paths), len(w_paths)))
            gap = (f"{what}{paths[i]} where it has {w_paths[i]}" if i < min(len(paths), len(w_paths)) else
                   f"{what}{paths[i]} is not in it" if i < len(paths) else f"its {w_paths[i]} is missing")
            raise ValueError(f"{what} is not the tree {whose} ({len(paths)} leaves against {len(w_paths)}: {gap}); "
                             f"{fix}.")
    elif treedef != w_treedef:
        raise ValueError(f"{what} is not the tree {whose} ({len(leaves)} leaves against {len(w_leaves)}: "
                         f"{_first_gap(treedef, w_treedef)}); {fix}.")
    w_leaves = [a for _, a in w_leaves]
    shapes = [(path, np.shape(a), np.shape(b)) for (path, a), b in zip(leaves, w_leaves) if np.shape(a) != np.shape(b)]
    if shapes:
        path, a, b = shapes[0]
        raise ValueError(f"{what}{jax.tree_util.keystr(path)} has shape {a} where {whose} {b} ({len(shapes)} leaves "
                         f"differ); {fix}.")
    kinds = [(path, a.dtype, b.dtype) for (path, a), b in zip(leaves, w_leaves) if dtypes and a.dtype != b.dtype]
    if kinds:  # a bfloat16 state in a float32 model would train at the state's precision without a word
        path, a, b = kinds[0]
        raise ValueError(f"{what}{jax.tree_util.keystr(path)} is {a} where {whose} {b} ({len(kinds)} leaves "
                         f"differ); {fix}, or cast the state to the model's dtypes.")


class LayersCheck:
    """The first batch's checks, once: Objective.check_layers, armed by a strategy's init with the canonical state
    where the strategy runs the model's `layers` instead of its __call__, and Objective.check_rows_apart (armed by
    `arm_first_batch`), run on the first batch's first rows by put_batch, then dropped; and before them, on every
    batch of a shape not seen yet, Objective.check_inputs (a batch the model cannot take, named in one line), and on
    every batch its check_ids (host class targets outside the model's outputs, ids outside a table it looks them up
    in)."""

    def __init__(self):
        self.pending: tuple | None = None
        self.rows: tuple | None = None
        self.inputs: Objective | None = None  # checks every new batch shape fits the model (armed by arm_rows)
        self.unused: tuple | None = None  # (objective, tx, params): check_unused_params on the first batch

    @staticmethod
    def _own(tree):  # numpy leaves (a state of the user's making) as jax arrays: the checked models would share
        # them and advance their RNG counts in place, in the caller's state too
        return jax.tree.map(lambda a: jax.numpy.array(a) if isinstance(a, np.ndarray) else a, tree)

    def arm(self, objective: Objective, state: TrainState, why: str, fix: str, unpack: bool = False) -> None:
        self.pending = (objective, self._own(state.params), self._own(state.model_state), why, fix, unpack)

    def arm_rows(self, objective: Objective, state: TrainState, tx: Any = None) -> None:
        """Check that a loss left at per_sample=True by default does not mix rows (Objective.check_rows_apart), and,
        from now on, that every batch of a new shape fits the model (Objective.check_inputs, once per shape); with
        the strategy's optimizer `tx`, that it does not move parameters the loss never reads (check_unused_params)."""
        self.inputs = objective
        if tx is not None:
            self.unused = (objective, tx, state.params)
        if objective.per_sample and objective.per_sample_default:
            self.rows = (objective, self._own(state.params), self._own(state.model_state))

    def __call__(self, rows) -> None:
        if self.inputs is not None:  # first: the checks below would fail deep inside on a batch the model refuses
            self.inputs.check_inputs(rows.data, rows.mask)
        if self.unused is not None:
            check_unused_params(*self.unused)
            self.unused = None
        if self.pending is not None:
            objective, params, model_state, why, fix, unpack = self.pending
            head = jax.tree.map(lambda a: np.asarray(a)[:2], rows.data)
            objective.check_layers(params, model_state, head, why, fix, unpack)
            self.pending = None
        if self.rows is not None:
            objective, params, model_state = self.rows
            objective.check_rows_apart(params, model_state, rows)
            self.rows = None


def check_unused_params(objective: Objective, tx: Any, params: Any) -> None:
    """ValueError when trained parameters that the loss never reads (Objective.unused_params) would still move:
    torch leaves their .grad None and its optimizers skip them, but here they get a zero gradient, and an optimizer
    with weight decay (SGD's or Adam's L2, AdamW's decoupled decay) moves a parameter on a zero gradient; they would
    drift where torch keeps them. Without decay a zero gradient moves nothing, as in torch, and nothing is said."""
    unused = objective.unused_params()
    if not unused:
        return
    moved = _moved_on_zero_gradients(tx, params, set(unused))
    if moved:
        parts = moved[0].split("/")
        holder = tuple(int(p) if p.isdigit() else p for p in parts[:-1])  # the module holding it, by its full path
        keep = f"lambda path, _: path[:{len(holder)}] == {holder!r}" if holder else f"nnx.PathContains({parts[0]!r})"
        which = f"{len(moved)} trained parameters ({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}) are" \
            if len(moved) > 1 else f"trained parameter {moved[0]} is"
        raise ValueError(f"{which} never read by the loss, yet the optimizer moves what the loss never reads on its "
                         "zero gradient (weight decay): torch leaves an unused parameter's .grad None and its "
                         "optimizer skips it, so it would drift where torch keeps it; leave it out of what is trained "
                         f"(wrt=nnx.All(nnx.Param, nnx.Not({keep})) to a strategy), remove it from the model, "
                         "or train without weight decay (weight_decay=0, train.py's --weight-decay 0).")


PROBE_STEPS = 8  # zero-gradient updates check_unused_params tries: a warmup from lr 0 or MultiSteps(k <= 7) moves later


@optim.op_by_op
def _moved_on_zero_gradients(tx: Any, params: Any, paths: set) -> list[str]:
    """The paths among `paths` that up to PROBE_STEPS updates of tx on zero gradients move (the parameters held
    where torch keeps them), from a fresh tx.init; [] where tx cannot run so (extra arguments): no verdict."""
    try:
        zeros, state = jax.tree.map(jax.numpy.zeros_like, params), tx.init(params)
        for _ in range(PROBE_STEPS):
            updates, state = tx.update(zeros, state, params)
            moved = [path for path, u in ((_slash_path(p), u) for p, u in jax.tree_util.tree_flatten_with_path(
                updates)[0]) if path in paths and bool(np.any(np.asarray(u) != 0))]
            if moved:
                return moved
    except Exception:  # noqa: BLE001 -- an optimizer that wants more (extra arguments): no verdict, no refusal
        return []
    return []


def arm_first_batch(objective: Objective, state: TrainState, check: LayersCheck, tx: Any = None) -> None:
    """Arm `check`'s rows check (and, given the optimizer `tx`, its unused-parameters check), and its layers check
    when the objective recomputes N-layer segments (activation checkpointing runs the layers)."""
    check.arm_rows(objective, state, tx)
    n = objective.activation_checkpoint_interval
    if n:
        check.arm(objective, state, f"activation_checkpoint_interval={n} runs the model's",
                  "use activation_checkpoint_interval 0", objective.sequential)


def _first_gap(a, b) -> str:
    """Where two treedefs' printed forms first part."""
    x, y = str(a), str(b)
    i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return f"...{x[max(0, i - 40):i + 40]}... against ...{y[max(0, i - 40):i + 40]}..."


def get_builder(name: str):
    """The `build(model, tx, cfg, loss_fn) -> Strategy` function registered under `name`."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy={name!r} is not known; use one of {', '.join(STRATEGIES)}.")
    module, fn = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def whole_batch(name: str) -> bool:
    """Whether every process of strategy `name` reads the whole global batch (its module sets WHOLE_BATCH: the
    pipeline, whose first stage needs every input and last stage every target) instead of its share."""
    return name in STRATEGIES and getattr(importlib.import_module(STRATEGIES[name].split(":")[0]), "WHOLE_BATCH", False)


def to_device(tree: Any, device) -> Any:
    """A copy of `tree` committed to one device (fully gathered first when it spans several processes)."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils

            a = multihost_utils.process_allgather(a, tiled=True)
        return jax.device_put(a, device)

    return jax.tree.map(one, tree)


def objective_of(model: nnx.Module | Objective, loss_fn=None, *, who: str = "the strategy", **kwargs) -> Objective:
    """`model` as an Objective that trains something: an Objective passes through (no other argument allowed), a
    module is wrapped; `who` (the strategy's class name) is named for an option Objective.of does not take."""
    if isinstance(model, Objective):
        if loss_fn is not None or kwargs:
            check_objective_options(who, kwargs)  # a misspelled option is named as one, not as an Objective's
            given = ", ".join(["loss_fn"] * (loss_fn is not None) + sorted(kwargs))
            raise ValueError(f"an Objective already holds its loss and options, so {given} cannot come beside it; "
                             "pass either an Objective, or the model with loss_fn=... and options.")
        return model.check_trains()
    check_objective_options(who, kwargs)
    return Objective.of(model, loss_fn, **kwargs).check_trains()


def check_foreign_options(who: str, options: dict, table: dict, whose: str = "torch's argument") -> None:
    """TypeError in one line for an option of the original (torch's constructor argument, a DeepSpeed config key)
    that `who` does not take (`table`: the option -> what to pass instead), before the generic "unexpected keyword
    argument", which named no replacement."""
    for key in options:
        if key in table:
            raise TypeError(f"{who}({key}={options[key]!r}) is {whose}, not an option of jaxpar's: {table[key]}.")


def check_objective_options(who: str, options: dict) -> None:
    """TypeError naming the strategy `who` for an option neither it nor Objective.of takes (the strategies pass
    their other keywords on to Objective.of, whose own error named Objective.of, which the user never called)."""
    known = set(inspect.signature(Objective.of).parameters) - {"cls", "model", "loss_fn"}
    for key in options:
        if key not in known:
            raise TypeError(f"{who}() got an unexpected keyword argument {key!r}; besides its own options it "
                            f"takes the objective's ({', '.join(sorted(known))}); check the spelling, or pass "
                            f"{key} to the strategy that has it.")


def cfg_objective(model: nnx.Module, loss_fn, cfg) -> Objective:
    """The Objective train.py's flags ask for: --precision, --per-sample, and --activation-checkpoint-interval
    (but for the pipeline, whose stages recompute their own segments)."""
    from jaxpar.precision import compute_dtype

    per_sample = {None: None, "on": True, "off": False}[cfg.per_sample]
    interval = 0 if cfg.strategy == "pipeline" else cfg.activation_checkpoint_interval
    return Objective.of(model, loss_fn, per_sample=per_sample, compute_dtype=compute_dtype(cfg.precision),
                        activation_checkpoint_interval=interval)
