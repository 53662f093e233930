"""DeepSpeed's PipelineModule for NNX: a model as a flat list of layers, cut into stages that own their weights.

The layers are NNX modules or plain callables (``nnx.relu``, lambdas), of any kinds, from a model's flat
``layers`` sequence (`PipelineModule.from_model`, nnx.Sequential has one) or a list with LayerSpec /
TiedLayerSpec entries (built into `Layers`, chained as DeepSpeed chains them). The partition is plain data
computed once: ``bounds`` over the layers, one PART per virtual stage ``v = chunk * num_stages + stage``. Each
part is a few SEGMENTS -- one layer each, or ``activation_checkpoint_interval`` layers run under jax.checkpoint --
and each segment is an ``nnx.List`` of the model's own layer objects, split into its graphdef and the indices of
its variables in the CANONICAL state (``nnx.split(model, wrt, ...)``, the tree every other strategy holds). Roughly::

    canonical params leaves  [w0 b0 | w3 b3 | w5 b5]          nnx.split(model, nnx.Param, ...)[1], flattened
    stage 0 owns             [0, 1, 2, 3]     stage 1 owns [4, 5]      (no padding: each stage its own leaves)
    segment (layers 3..4)    param_index [2, 3]: its split's leaves are canonical leaves 2, 3

A Variable object used by layers on two stages (a tied embedding and unembedding) is one canonical leaf owned by
both stages: the engine sums its gradient over them every step, so the copies stay equal (DeepSpeed's
ReduceTiedGrads). RNG streams and other non-trained state may not be shared across segments (each row's draws
must come from one place).
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.objective import check_wrt_within, refuse_keyed_layers
from jaxpar.pipeline import partition as partition_lib
from jaxpar.pipeline import schedule as schedule_lib


class LayerSpec:
    """DeepSpeed's LayerSpec: a layer class and its arguments. A class taking ``rngs`` and not given one is
    built with ``nnx.Rngs(fold_in(key(seed), layer index))``: a layer's initial weights depend only on the seed
    and its position."""

    def __init__(self, typename: type, *args, **kwargs):
        if isinstance(typename, nnx.Module) or not callable(typename):
            what = f"a built {type(typename).__name__}" if isinstance(typename, nnx.Module) else repr(typename)
            raise TypeError(f"LayerSpec({what}): pass a layer class and its arguments, e.g. "
                            "LayerSpec(nnx.Linear, 4, 8) (or a function building a layer); a layer already built "
                            "goes into the list itself.")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self, seed: int = 0, index: int = 0) -> Any:
        kwargs = dict(self.kwargs)
        try:
            cls = isinstance(self.typename, type)
            signature = inspect.signature(self.typename.__init__ if cls else self.typename)
            takes_rngs = "rngs" in signature.parameters
            if takes_rngs:  # not where the spec's own arguments give it, by position too: LayerSpec(Block, 8, rngs)
                takes_rngs = "rngs" not in signature.bind_partial(*((None,) if cls else ()), *self.args,
                                                                  **kwargs).arguments
        except (TypeError, ValueError):  # no signature, or arguments it cannot take: the call below names them
            takes_rngs = False
        if takes_rngs and "rngs" not in kwargs:
            kwargs["rngs"] = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), index))
        try:
            return self.typename(*self.args, **kwargs)
        except TypeError as e:  # its arguments: name the layer, which the constructor's message cannot
            raise TypeError(f"layer {index}: {_call(self.typename, self.args, self.kwargs)} failed: {e}; pass the "
                            "class's arguments after it, as LayerSpec(cls, *args, **kwargs).") from e

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.typename, '__name__', self.typename)})"


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's TiedLayerSpec: every spec with the same ``key`` is ONE module (built at its first position);
    later positions call ``forward_fn(module, x)`` (default: the module itself), e.g. an unembedding that reuses
    the embedding's table: ``TiedLayerSpec("embed", nnx.Embed, V, D, forward_fn=lambda m, x: m.attend(x))``.
    All the module's parameters are tied (DeepSpeed's ``tied_weight_attr`` names one; kept for the API)."""

    def __init__(self, key: str, typename: type, *args, forward_fn: Callable | None = None,
                 tied_weight_attr: str = "weight", **kwargs):
        super().__init__(typename, *args, **kwargs)
        if forward_fn is not None:
            try:
                inspect.signature(forward_fn).bind(None, None)
            except TypeError:
                raise TypeError(f"TiedLayerSpec {key!r}: forward_fn={forward_fn!r} must take (module, x), as "
                                "DeepSpeed's does; e.g. forward_fn=lambda m, x: m.attend(x).") from None
            except ValueError:  # a builtin without a signature: called as it is
                pass
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


class Tied(nnx.Module):
    """A later use of a tied module: ``forward_fn(module, x)``."""

    def __init__(self, module: nnx.Module, forward_fn: Callable):
        self.module, self.forward_fn = module, forward_fn

    def __call__(self, x):
        return self.forward_fn(self.module, x)


def _same(a, b) -> bool:
    """Whether two specs' (class, args, kwargs) are equal (arrays by their values)."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__array__") and hasattr(b, "__array__"):
        return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _call(typename, args, kwargs) -> str:
    """How a spec reads: Embed(16, 8, dtype=...)."""
    given = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
    return f"{getattr(typename, '__name__', typename)}({', '.join(given)})"


def build_layers(specs: Sequence[Any], seed: int = 0) -> list:
    """Modules, callables and (Tied)LayerSpecs -> layer objects; tied specs share one module."""
    built, tied = [], {}  # key -> (the layer index of its first use, its (class, args, kwargs), the module)
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            made = (spec.typename, spec.args, spec.kwargs)
            if spec.key not in tied:
                tied[spec.key] = (i, made, spec.build(seed, i))
                layer = tied[spec.key][2]
                built.append(layer if spec.forward_fn is None else Tied(layer, spec.forward_fn))
                continue
            j, first, module = tied[spec.key]
            if not _same(made, first):
                raise ValueError(f"TiedLayerSpec {spec.key!r} at layer {i} is {_call(*made)}, but its first use (layer "
                                 f"{j}) builds {_call(*first)}; the key's module is built once, from the first spec "
                                 "(DeepSpeed ignores a later spec's arguments): pass the same class and arguments, or "
                                 "another key for another module.")
            built.append(Tied(module, spec.forward_fn or (lambda m, x: m(x))))
        elif isinstance(spec, LayerSpec):
            built.append(spec.build(seed, i))
        elif callable(spec):
            built.append(spec)
        else:
            raise TypeError(f"layer {i} is a {type(spec).__name__}; pass NNX modules, callables or LayerSpecs.")
    return built


class Segment(NamedTuple):
    """Layers run as one function (one vjp; under jax.checkpoint when ``remat``), and where their state lives."""
    layers: range
    graphdef: Any        # nnx.List of the layers, training mode
    eval_graphdef: Any   # the same in eval mode (dropout off, running statistics)
    param_index: tuple   # canonical param leaf of each leaf of the segment's params split
    state_index: tuple   # canonical model_state leaf of each leaf of its other state
    param_treedef: Any
    state_treedef: Any
    remat: bool


class Layers(nnx.Sequential):
    """The model a PipelineModule builds from a list of layers: each takes the previous one's output as it is (a
    tuple as ONE argument), as DeepSpeed's PipelineModule.forward chains them (Megatron-DeepSpeed's layers pass
    (hidden, mask) on so); nnx.Sequential would spread a tuple over the next layer's arguments."""

    def __call__(self, x):
        return apply_layers(self.layers, x, unpack=False)


def call_layer(layer, x, unpack: bool, index: int):
    """layer(x), the model's layer number `index`; where `unpack` (nnx.Sequential's convention), a tuple or dict
    that an earlier layer returned is this one's *args or **kwargs (the first layer takes the model's input)."""
    if unpack and index and isinstance(x, tuple):
        return layer(*x)
    if unpack and index and isinstance(x, dict):
        return layer(**x)
    return layer(x)


def apply_layers(layers, x, unpack: bool, first: int = 0):
    """`layers` applied in turn to x (layer index `first` onward), as `call_layer` calls each."""
    for i, layer in enumerate(layers, first):
        x = call_layer(layer, x, unpack, i)
    return x


def _variables(node) -> dict[tuple, Any]:
    return {tuple(p): v for p, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)}


def _flat_paths(state) -> list[tuple]:
    return [tuple(p) for p, _ in nnx.to_flat_state(state)]


_SEEDED = ("jaxpar seeds every LayerSpec by its position, nnx.Rngs(fold_in(key(seed), layer index)), always (DeepSpeed's "
           "seed_layers=True, base_seed 1234); pass seed=N (default 0)")
# DeepSpeed PipelineModule arguments jaxpar does not take, and what a port passes instead
DEEPSPEED_ONLY = {
    "topology": "pass num_stages=S here and the data x pipe grid as jaxpar.Pipeline(..., mesh=jaxpar.strategies."
                "pipeline.pipeline_mesh(devices, num_stages=S)) (DeepSpeed's PipeDataParallelTopology)",
    "seed_layers": _SEEDED, "base_seed": _SEEDED, "seed_fn": _SEEDED,
    "activation_checkpoint_func": "activation_checkpoint_interval=N recomputes each N-layer segment with jaxpar's "
                                  "own recompute; leave it out",
    "checkpointable_layers": "activation_checkpoint_interval=N recomputes every N-layer segment, with or without "
                             "parameters; leave it out",
    "dynamic_shape": "a new batch shape compiles the stages again (Pipeline(batch_size=B) pads every batch to one "
                     "shape); leave it out",
}


class PipelineModule:
    """`model`'s layers cut into `num_stages` (x `virtual_stages`) contiguous parts; see the module docstring.

    ``layers`` (a list: modules, callables, LayerSpec, TiedLayerSpec) builds `Layers` of them (DeepSpeed's chaining);
    `from_model` takes a model's own ``layers``. partition_method: parameters | uniform | type:REGEX | profile
    (needs ``example_input``, one sample: the compiler's flop estimate per layer).
    activation_checkpoint_interval N > 0: layers run in segments of N under jax.checkpoint, so a micro-batch
    keeps only each segment's input until its backward, which recomputes the rest (0: keep every residual).
    ``loss_fn(outputs, batch)`` is the loss on the last stage when the strategy is given none (DeepSpeed's takes
    (outputs, labels); here the whole batch, so that a loss can read its mask or inputs: labels are batch["y"]).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int, loss_fn: Callable | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0, *,
                 virtual_stages: int = 1, seed: int = 0, wrt: Any = nnx.Param, example_input: Any = None,
                 model: nnx.Module | None = None, placement: str = "loop", **deepspeed_only):
        for name in deepspeed_only:  # DeepSpeed's own arguments: say what jaxpar takes instead
            if name not in DEEPSPEED_ONLY:
                raise TypeError(f"PipelineModule() got an unexpected keyword argument {name!r}")
            raise TypeError(f"PipelineModule({name}=...) is DeepSpeed's, not jaxpar's: {DEEPSPEED_ONLY[name]}.")
        if callable(partition_method):  # DeepSpeed's order: (layers, num_stages, topology, loss_fn)
            raise TypeError(f"PipelineModule's fourth argument is partition_method, got {partition_method!r}; "
                            "jaxpar's third is loss_fn (DeepSpeed's is topology): pass loss_fn= by keyword.")
        if placement not in schedule_lib.PLACEMENTS:
            raise ValueError(f"placement={placement!r} must be one of {schedule_lib.PLACEMENTS} ('v' is zbv's: chunk "
                             "1 of stage s is virtual stage 2S-1-s)")
        for label, x, low in (("num_stages", num_stages, 1), ("virtual_stages", virtual_stages, 1),
                              ("activation_checkpoint_interval", activation_checkpoint_interval, 0)):
            if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < low:
                raise ValueError(f"{label}={x!r} must be an int >= {low}.")
        num_stages, virtual_stages = int(num_stages), int(virtual_stages)
        activation_checkpoint_interval = int(activation_checkpoint_interval)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass loss_fn(outputs, batch) -> (loss_sum, "
                            "weight_sum), e.g. jaxpar.cross_entropy (DeepSpeed's takes (outputs, labels): here the "
                            "labels are batch['y']).")
        if model is None and (isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__")):
            raise TypeError(f"PipelineModule got layers={type(layers).__name__}, not a list of layers; pass them in "
                            "a list, e.g. PipelineModule([LayerSpec(...), ...], num_stages).")
        if model is None and not len(layers):
            raise ValueError("PipelineModule got no layers; pass the model's layers in order (modules, callables, "
                             "LayerSpecs, TiedLayerSpecs), or PipelineModule.from_model(model, ...) for a model "
                             "with a `layers` list.")
        if model is None:
            model = Layers(*build_layers(layers, seed))
            layers = list(model.layers)
        self.model, self.layers, self.loss_fn, self.wrt = model, list(layers), loss_fn, wrt
        # nnx.Sequential's convention, a tuple output is the next layer's *args; DeepSpeed's (Layers): one argument
        self.unpack = isinstance(model, nnx.Sequential) and not isinstance(model, Layers)
        self.num_stages, self.virtual_stages, self.placement = num_stages, virtual_stages, placement
        self.partition_method, self.interval, self.example_input = partition_method, activation_checkpoint_interval, \
            example_input
        self.seed = seed
        self.names = [type(l.module).__name__ if isinstance(l, Tied)  # DeepSpeed's: a tied use by its class's name
                      else getattr(type(l), "__name__", "layer") if isinstance(l, nnx.Module)
                      else getattr(l, "__name__", type(l).__name__) for l in self.layers]
        partition_lib.check_parts(len(self.layers), self.num_parts)
        if example_input is not None and partition_method != "profile":
            raise ValueError(f"example_input is read by partition_method='profile' only (it costs the layers), not "
                             f"{partition_method!r}; pass partition_method='profile', or drop example_input.")
        self._canonical()
        self.bounds = partition_lib.partition(
            partition_method, self.num_parts, names=self.names, params=lambda: self.layer_params,
            profile=None if example_input is None else self.layer_costs)
        self.cut()
        self._ownership()
        self.tensor_parallel, self.tensor_layouts = 1, None  # set_tensor_parallel: Megatron splits per parameter
        self.state_layouts = None  # ... and per model-state leaf (frozen weights: a fine-tune's wrt leaves them out)
        self.sequence_parallel = False

    def set_tensor_parallel(self, tp: int, axis: str, parallel_output: bool = False,
                            sequence_parallel: bool = False) -> None:
        """Split every stage's blocks over `tp` ranks of mesh axis `axis` (Megatron): the per-parameter plan of
        jaxpar.strategies.tensor (`tensor_layouts`, canonical leaf order), the model's splittable modules pointed
        at `axis` in place (a vocabulary-split head's logits left split for the loss with `parallel_output`;
        Megatron's sequence parallelism with `sequence_parallel`: between the split regions, and across stage
        boundaries, each tensor rank holds its tokens), and the segments rebuilt so their graphdefs carry it.
        ValueError (from the plan) when a split does not divide. Weights `wrt` leaves out (frozen) are split as
        the trained ones, in the model state (`state_layouts`, canonical leaf order), as TensorParallel splits them."""
        from jaxpar.strategies.tensor import set_tensor_axis, tensor_plan

        if tp == 1:
            return
        self.tensor_layouts = tensor_plan(self.model, tp, self.wrt)
        self.state_layouts = tensor_plan(self.model, tp, self.wrt, rest=True)
        set_tensor_axis(self.model, axis, tp, sequence_parallel, parallel_output)
        for layer in self.layers:  # layers that are views of the model (GPT-2's Embedding, LMHead) too
            if isinstance(layer, nnx.Module):
                set_tensor_axis(layer, axis, tp, sequence_parallel, parallel_output)
        self.tensor_parallel, self.sequence_parallel = tp, bool(sequence_parallel)
        self.cut()

    def cut(self) -> None:
        """Each virtual stage's segments, their graphdefs taken from the layers as they are now (again after a
        layer's static attributes changed: a tensor axis, an Embed's dtype)."""
        self.parts = [self._segments(v) for v in range(self.num_parts)]

    @classmethod
    def from_model(cls, model: nnx.Module, num_stages: int, **kwargs) -> "PipelineModule":
        """Cut `model`'s flat layer sequence ``model.layers``; the canonical state is ``nnx.split(model, ...)``."""
        refuse_keyed_layers(model, "the pipeline", "or pass PipelineModule a list")
        layers = getattr(model, "layers", None)
        if layers is None or isinstance(model, nnx.List):
            raise ValueError(f"{type(model).__name__} has no `layers`; a pipeline cuts a flat layer sequence: give "
                             "the model a `layers` list (nnx.Sequential has one) or pass PipelineModule a list.")
        return cls(list(layers), num_stages, model=model, **kwargs)

    # -- the canonical state and who owns it ---------------------------------------------------------------

    def _canonical(self) -> None:
        _, params, rest = nnx.split(self.model, self.wrt, ...)
        self.param_paths, self.state_paths = _flat_paths(params), _flat_paths(rest)
        self.param_treedef, self.state_treedef = jax.tree.structure(params), jax.tree.structure(rest)
        self.param_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(params)]
        self.state_kinds = [type(v) for _, v in nnx.to_flat_state(rest)]
        self.state_ndims = [jnp.ndim(a) for a in jax.tree.leaves(rest)]
        where = _variables(self.model)
        self._param_of = {id(where[p]): j for j, p in enumerate(self.param_paths)}
        self._model_vars = {id(v) for v in where.values()}
        self._state_of = {id(where[p]): j for j, p in enumerate(self.state_paths)}
        # the parameters each layer uses, a tied one at every use (DeepSpeed's _count_layer_params builds every
        # TiedLayerSpec: the last stage holds a copy of the table and runs its product too)
        self._layer_sizes = [{id(v): math.prod(v.get_value().shape) for v in _variables(layer).values()
                              if id(v) in self._param_of} if isinstance(layer, nnx.Module) else {}
                             for layer in self.layers]
        self.layer_params = [sum(sizes.values()) for sizes in self._layer_sizes]

    def held_params(self, layers: Sequence[int]) -> int:
        """The parameters layers `layers` hold between them, each (a tied one too) once."""
        return sum({k: n for i in layers for k, n in self._layer_sizes[i].items()}.values())

    def _segments(self, v: int) -> list[Segment]:
        r = range(self.bounds[v], self.bounds[v + 1])
        size = self.interval or 1
        out = []
        for lo in range(r.start, r.stop, size):
            group = range(lo, min(lo + size, r.stop))
            seg = nnx.List([self.layers[i] for i in group])
            graphdef, params, rest = nnx.split(seg, self.wrt, ...)
            evaluated = nnx.clone(seg)
            evaluated.eval()
            where = _variables(seg)
            if all(id(v) in self._model_vars for v in where.values()):  # else: the error below names the layer
                check_wrt_within(seg, self.wrt, set(self._param_of), "the pipeline",
                                 f"layers {group.start}-{group.stop - 1} (a stage's list, from index 0)")
            pidx, sidx = [], []
            for paths, index, out_list, what in ((_flat_paths(params), self._param_of, pidx, "parameter"),
                                                 (_flat_paths(rest), self._state_of, sidx, "variable")):
                for p in paths:
                    j = index.get(id(where[p]))
                    if j is None:
                        raise ValueError(f"{what} {p[1:]} of layer {group.start + p[0]} ({self.names[group.start + p[0]]}) "
                                         "is not part of the model; `layers` must be the model's own submodules.")
                    out_list.append(j)
            out.append(Segment(group, graphdef, nnx.split(evaluated, self.wrt, ...)[0], tuple(pidx), tuple(sidx),
                               jax.tree.structure(params), jax.tree.structure(rest), bool(self.interval)))
        return out

    def _ownership(self) -> None:
        S = self.num_stages
        params_of: list[set] = [set() for _ in range(S)]
        state_of: list[set] = [set() for _ in range(S)]
        seen_state: dict[int, int] = {}
        frozen_in: dict[int, set] = {}
        for v, segs in enumerate(self.parts):
            s = self.stage_of(v)
            for k, seg in enumerate(segs):
                params_of[s] |= set(seg.param_index)
                for j in seg.state_index:
                    if issubclass(self.state_kinds[j], nnx.Param):  # a frozen weight (wrt leaves it out): every
                        frozen_in.setdefault(j, set()).add((v, k))  # stage using it holds a copy (a tied wte a
                        continue  # fine-tune freezes); the stage functions refuse a forward that changes it
                    if seen_state.setdefault(j, (v, k)) != (v, k):
                        (v0, k0), where = seen_state[j], lambda v, k: ", ".join(  # noqa: E731
                            self.names[i] for i in self.parts[v][k].layers)
                        raise ValueError(f"model state {self.state_paths[j]} (not a trained parameter: an RNG "
                                         f"stream or a variable) is used by layers {where(v0, k0)} (part {v0}) and "
                                         f"{where(v, k)} (part {v}), which run apart; give each layer its own RNG "
                                         "stream and variables (nnx.Dropout(rate, rngs=rngs) forks its own; a "
                                         "module shared by TiedLayerSpec may not hold any), or put those layers in "
                                         "one segment (activation_checkpoint_interval).")
                state_of[s] |= set(seg.state_index)
        orphans = [self.param_paths[j] for j in range(len(self.param_paths)) if not any(j in p for p in params_of)]
        if orphans:
            raise ValueError(f"parameters {orphans[:3]} belong to no layer of `layers`; every trained parameter must "
                             "be used by a layer the pipeline runs.")
        self.stage_params = [sorted(p) for p in params_of]
        self.stage_state = [sorted(p) for p in state_of]
        self.extra_state = sorted(set(range(len(self.state_paths))) - set().union(*state_of))
        owners: dict[int, list[int]] = {}
        for s, idx in enumerate(self.stage_params):
            for j in idx:
                owners.setdefault(j, []).append(s)
        self.tied = {j: stages for j, stages in owners.items() if len(stages) > 1}
        self.owner = {j: stages[0] for j, stages in owners.items()}  # the copy unplace reads
        self.shared_frozen = {j for j, where in frozen_in.items() if len(where) > 1}  # copies must never change
        self.state_owner = {}
        for s, idx in enumerate(self.stage_state):
            for j in idx:
                self.state_owner.setdefault(j, s)  # a frozen weight several stages hold: the first's copy

    # -- the partition -------------------------------------------------------------------------------------

    def state_spec(self, j: int) -> P:
        """How model-state leaf j lies on a stage's devices: split over the tensor ranks (a frozen split weight,
        3-D), else replicated."""
        return P() if self.state_layouts is None else self.state_layouts[j].spec(self.state_ndims[j])

    def state_specs(self, idx) -> P | list[P]:
        """The specs of model-state leaves `idx` (a shard_map spec prefix): P() for all when nothing is split."""
        return P() if self.state_layouts is None else [self.state_spec(j) for j in idx]

    @property
    def num_parts(self) -> int:
        return self.num_stages * self.virtual_stages

    def stage_of(self, part: int) -> int:
        """The stage holding virtual stage `part` under this module's placement."""
        return schedule_lib.stage_of(part, self.num_stages, self.placement)

    def describe(self) -> str:
        """The partition: per part, its layers and parameter count; tied parameters."""
        lines = [f"PipelineModule: {len(self.layers)} layers, {self.held_params(range(len(self.layers))):,} params, "
                 f"{self.num_stages} stages x {self.virtual_stages} chunks, partition_method={self.partition_method!r}"
                 + (f", activation_checkpoint_interval={self.interval}" if self.interval else "")]
        for v in range(self.num_parts):
            r = range(self.bounds[v], self.bounds[v + 1])
            where = f"stage {self.stage_of(v)}" + (f" chunk {v // self.num_stages}" if self.virtual_stages > 1 else "")
            lines.append(f"  {where}: layers {r.start}-{r.stop - 1} {self.held_params(r):>12,} "
                         f"params  {' '.join(self.names[i] for i in r)}")
        for j, stages in self.tied.items():
            lines.append(f"  tied {'/'.join(map(str, self.param_paths[j]))} on stages {stages}")
        return "\n".join(lines)

    def layer_costs(self) -> list[float]:
        """Compiler-estimated flops of each layer's forward on ``example_input`` (1 where it cannot tell)."""
        if getattr(self, "_costs", None) is not None:
            return self._costs
        x = self.example_input
        x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        costs = []
        for layer in self.layers:
            if isinstance(layer, nnx.Module):
                graphdef, state = nnx.split(layer)
                fn = lambda st, a, g=graphdef: nnx.merge(g, st)(a)  # noqa: E731
            else:
                state, fn = (), lambda st, a, f=layer: f(a)  # noqa: E731
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
            analysis = jax.jit(fn).lower(abstract, x).compile().cost_analysis()
            analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
            costs.append(max(float((analysis or {}).get("flops", 0.0)), 1.0))
            x = jax.eval_shape(fn, abstract, x)
        self._costs = costs
        return costs
