"""DeepSpeed's PipelineModule for NNX: a model as a flat list of layers, cut into stages, held as flat buffers.

The partition is plain data, computed once: ``bounds`` over the layers, one part per VIRTUAL stage
``v = chunk * num_stages + stage`` (interleaved schedules give each stage ``virtual_stages`` chunks). Each
part's parameters live in one flat float32 vector, padded to the longest part, so stages of different shapes
share one SPMD buffer ``[num_stages, virtual_stages, P]``; a part's function unravels its own slice.
Roughly::

    flat[s, c, o:o + n].reshape(shape) == canonical leaf (part v = c*S + s, offset o, size n)
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.pipeline import partition as partition_lib

LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict]]  # (outputs, batch) -> (loss_sum, aux)


class LayerSpec:
    """DeepSpeed's LayerSpec: a layer class and its arguments, built only by the processes that run it.

    A class taking ``rngs`` and not given one is built with ``nnx.Rngs(fold_in(key(seed), layer index))``, so
    a layer's initial weights depend only on the seed and its position, never on which process builds it.
    """

    def __init__(self, cls: type, *args, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self, seed: int = 0, index: int = 0) -> nnx.Module:
        kwargs = dict(self.kwargs)
        if "rngs" not in kwargs and "rngs" in inspect.signature(self.cls.__init__).parameters:
            kwargs["rngs"] = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), index))
        return self.cls(*self.args, **kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.cls.__name__})"


def _key(k) -> Any:
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def _paths(tree) -> list[tuple]:
    """Leaf paths of a pytree as plain key tuples (('layers', 0, 'kernel', 'value'))."""
    return [tuple(_key(k) for k in kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class Slot(NamedTuple):
    """Where one canonical leaf lives in the flat buffers."""
    part: int
    offset: int
    shape: tuple[int, ...]


class PipelineModule:
    """Layers cut into `num_stages` (x `virtual_stages`) contiguous parts; see the module docstring.

    layers: nnx modules or LayerSpecs, each called as ``layer(x, keys)``. loss_fn(outputs, batch) ->
    (loss_sum, aux) runs on the last stage (default: jaxpar.step.output_terms, summed cross-entropy).
    partition_method: parameters | uniform | type:REGEX | profile (``example_input`` needed: the compiler's
    flop estimate per layer). activation_checkpoint_interval N > 0: the backward keeps only every N-th layer's
    input inside a stage (jax.checkpoint over runs of N layers); the stage input is always kept.
    """

    def __init__(self, layers: Sequence[nnx.Module | LayerSpec], num_stages: int, loss_fn: LossFn | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0, *,
                 virtual_stages: int = 1, example_input: jax.Array | jax.ShapeDtypeStruct | None = None,
                 seed: int = 0, prefixes: Sequence[tuple] | None = None, canonical: Any = None,
                 verbose: bool = True):
        from jaxpar.step import output_terms

        if virtual_stages < 1 or activation_checkpoint_interval < 0:
            raise ValueError(f"{virtual_stages=} must be >= 1 and {activation_checkpoint_interval=} >= 0")
        self.layers, self.seed = list(layers), seed
        self.num_stages, self.virtual_stages = num_stages, virtual_stages
        self.loss_fn = loss_fn or output_terms
        self.partition_method, self.interval = partition_method, activation_checkpoint_interval
        self.names = [l.cls.__name__ if isinstance(l, LayerSpec) else type(l).__name__ for l in self.layers]
        partition_lib.check_parts(len(self.layers), num_stages * virtual_stages)
        self.graphdefs, self.treedefs, states = [], [], []
        for i, layer in enumerate(self.layers):
            built = nnx.eval_shape(lambda: layer.build(seed, i)) if isinstance(layer, LayerSpec) else layer
            graphdef, state = nnx.split(built)
            self.graphdefs.append(graphdef)
            self.treedefs.append(jax.tree.structure(state))
            states.append(state)
        self.layer_shapes = [[tuple(a.shape) for a in jax.tree.leaves(s)] for s in states]
        self.layer_params = [sum(math.prod(s) for s in shapes) for shapes in self.layer_shapes]
        if canonical is None:  # nn.Sequential-like canonical tree: {layer index: its state}
            canonical = nnx.State({i: s for i, s in enumerate(states) if jax.tree.leaves(s)})
            prefixes = [(i,) for i in range(len(self.layers))]
        self.canonical_treedef = jax.tree.structure(canonical)
        self.canonical_shapes = [tuple(a.shape) for a in jax.tree.leaves(canonical)]
        self._map_to_canonical(canonical, prefixes, states)
        self.example_input = example_input
        self.bounds = partition_lib.partition(
            partition_method, self.num_parts, names=self.names, params=lambda: self.layer_params,
            profile=None if example_input is None else self.layer_costs)
        self._layout()
        if verbose and jax.process_index() == 0:
            print(self.describe())

    @classmethod
    def from_model(cls, model: nnx.Module, num_stages: int, **kwargs) -> "PipelineModule":
        """Cut `model`'s flat layer sequence (``model.layers``); the canonical tree is ``nnx.split(model)``'s."""
        layers = getattr(model, "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no `layers`; a pipeline needs the flat layer sequence "
                             "(models.get(...) models have one, or pass PipelineModule a list of layers).")
        where = {}
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module):
                where.setdefault(id(node), tuple(path))
        _, canonical = nnx.split(model)
        prefixes = [where.get(id(l)) for l in layers]
        return cls(layers, num_stages, prefixes=prefixes, canonical=canonical, **kwargs)

    # -- the partition -------------------------------------------------------------------------------------

    @property
    def num_parts(self) -> int:
        return self.num_stages * self.virtual_stages

    def part_of(self, stage: int, chunk: int = 0) -> int:
        return chunk * self.num_stages + stage

    def part_layers(self, part: int) -> range:
        return range(self.bounds[part], self.bounds[part + 1])

    def describe(self) -> str:
        """The partition as printed at construction: per part, its layers and parameter count."""
        lines = [f"PipelineModule: {len(self.layers)} layers, {sum(self.layer_params):,} params, "
                 f"{self.num_stages} stages x {self.virtual_stages} chunks, partition_method={self.partition_method!r}"]
        for v in range(self.num_parts):
            r = self.part_layers(v)
            s, c = self._place(v)
            where = f"stage {s}" + (f" chunk {c}" if self.virtual_stages > 1 else "")
            lines.append(f"  {where}: layers {r.start}-{r.stop - 1} {sum(self.layer_params[i] for i in r):>12,} params"
                         f"  {' '.join(self.names[i] for i in r)}")
        return "\n".join(lines)

    def layer_costs(self) -> list[float]:
        """Compiler-estimated flops of each layer's forward on `example_input` (1 for a layer it cannot cost)."""
        if getattr(self, "_costs", None) is not None:
            return self._costs
        x, costs = self.example_input, []
        x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        for i in range(len(self.layers)):
            fn = self.layer_fn(i)
            leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in self.layer_shapes[i]]
            compiled = jax.jit(lambda p, a, i=i, fn=fn: fn(p, a, None)).lower(leaves, x).compile()
            analysis = compiled.cost_analysis()
            analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
            costs.append(max(float((analysis or {}).get("flops", 0.0)), 1.0))
            x = jax.eval_shape(lambda p, a, fn=fn: fn(p, a, None), leaves, x)
        self._costs = costs
        return costs

    # -- flat buffers --------------------------------------------------------------------------------------

    def _map_to_canonical(self, canonical, prefixes, states) -> None:
        index = {p: j for j, p in enumerate(_paths(canonical))}
        self.layer_leaves, owner = [], {}
        for i, state in enumerate(states):
            rel = _paths(state)
            if rel and prefixes[i] is None:
                raise ValueError(f"layer {i} ({self.names[i]}) holds parameters but is not part of the model; "
                                 "`layers` must return the model's own submodules.")
            js = [index.get(prefixes[i] + r) for r in rel]
            for r, j in zip(rel, js):
                if j is None or j in owner:
                    raise ValueError(f"parameter {prefixes[i] + r} of layer {i} ({self.names[i]}) is "
                                     f"{'shared with layer %d' % owner[j] if j is not None else 'not in the model'}; "
                                     "tied or foreign weights are not supported by the pipeline.")
                owner[j] = i
            self.layer_leaves.append(js)
        missing = [p for p, j in index.items() if j not in owner]
        if missing:
            raise ValueError(f"model parameters {missing[:3]} belong to no layer of `layers`; every parameter must "
                             "be used by exactly one layer.")

    def _layout(self) -> None:
        self.slots: list[Slot | None] = [None] * len(self.canonical_shapes)
        self.part_sizes = []
        for v in range(self.num_parts):
            offset = 0
            for i in self.part_layers(v):
                for j, shape in zip(self.layer_leaves[i], self.layer_shapes[i]):
                    self.slots[j] = Slot(v, offset, shape)
                    offset += math.prod(shape)
            self.part_sizes.append(offset)
        self.flat_size = max(max(self.part_sizes), 1)

    def _place(self, part: int) -> tuple[int, int]:
        return part % self.num_stages, part // self.num_stages

    def to_flat(self, leaves: Sequence[Any], stages: Sequence[int] | None = None) -> np.ndarray:
        """Canonical leaves (flatten order) -> host array [S, V, P] (only `stages` filled when given)."""
        out = np.zeros((self.num_stages, self.virtual_stages, self.flat_size), np.float32)
        for leaf, slot in zip(leaves, self.slots):
            s, c = self._place(slot.part)
            if stages is None or s in stages:
                out[s, c, slot.offset:slot.offset + math.prod(slot.shape)] = np.asarray(leaf, np.float32).ravel()
        return out

    def from_flat(self, flat: np.ndarray) -> list[np.ndarray]:
        """Host array [S, V, P] -> canonical leaves in flatten order."""
        out = []
        for slot in self.slots:
            s, c = self._place(slot.part)
            out.append(np.asarray(flat[s, c, slot.offset:slot.offset + math.prod(slot.shape)]).reshape(slot.shape))
        return out

    def stage_leaves(self, stage: int) -> dict[int, np.ndarray]:
        """{canonical index: initial value} for the layers of `stage` only (LayerSpecs built here, nowhere else)."""
        out = {}
        for c in range(self.virtual_stages):
            for i in self.part_layers(self.part_of(stage, c)):
                layer = self.layers[i]
                built = layer.build(self.seed, i) if isinstance(layer, LayerSpec) else layer
                out.update(zip(self.layer_leaves[i], jax.tree.leaves(nnx.split(built)[1])))
        return out

    # -- the functions each part runs ----------------------------------------------------------------------

    def layer_fn(self, i: int) -> Callable:
        """``fn(leaves, x, keys) -> y`` for layer i, its parameters given as a list of leaves."""
        graphdef, treedef = self.graphdefs[i], self.treedefs[i]

        def fn(leaves, x, keys):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, list(leaves)))(x, keys)

        return fn

    def part(self, part: int, compute_dtype=None) -> "Part":
        """The part's function over its own leaves, and the map between those leaves and its flat slice."""
        layers = list(self.part_layers(part))
        fns = {i: self.layer_fn(i) for i in layers}
        shapes = [s for i in layers for s in self.layer_shapes[i]]
        first = {i: sum(len(self.layer_shapes[k]) for k in layers if k < i) for i in layers}  # leaf index
        groups = [layers[k:k + self.interval] for k in range(0, len(layers), self.interval)] if self.interval \
            else [layers]

        def run_group(group, leaves, x, keys):
            for i in group:
                own = leaves[first[i]:first[i] + len(self.layer_shapes[i])]
                if compute_dtype is not None:
                    own = [a.astype(compute_dtype) for a in own]
                x = fns[i](own, x, keys)
            return x

        def fn(leaves, x, keys):
            if compute_dtype is not None:
                x = x.astype(compute_dtype)
            for group in groups:
                g = lambda l, a, k, group=group: run_group(group, l, a, k)  # noqa: E731
                x = (jax.checkpoint(g) if self.interval else g)(leaves, x, keys)
            return x.astype(jnp.float32)

        return Part(fn, tuple(shapes), self.part_sizes[part])


class Part(NamedTuple):
    """One virtual stage: ``fn(leaves, x, keys) -> y`` over its parameter leaves, which fill the first ``size``
    floats of its flat buffer in order."""
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]
    size: int

    def unravel(self, flat: jax.Array) -> list[jax.Array]:
        out, offset = [], 0
        for s in self.shapes:
            out.append(flat[offset:offset + math.prod(s)].reshape(s))
            offset += math.prod(s)
        return out

    def ravel(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """The leaves as one vector of ``size`` floats (a gradient to add into the flat buffer's first floats)."""
        return jnp.concatenate([a.ravel() for a in leaves]) if leaves else jnp.zeros((0,), jnp.float32)
