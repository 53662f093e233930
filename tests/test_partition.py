"""Stage partitions as plain data: DeepSpeed's methods give the expected splits, the balance is optimal, errors
name the numbers; PipelineModule prints its partition, maps every weight once, builds LayerSpecs only where used."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import models
from jaxpar.pipeline import partition
from jaxpar.models.layers import Linear, ReLU
from jaxpar.strategies.pipeline import LayerSpec, PipelineModule, TiedLayerSpec


def brute_bottleneck(weights, parts):
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balanced_is_optimal_and_every_part_holds_a_layer():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        parts = int(rng.integers(1, n + 1))
        weights = [int(w) for w in rng.integers(0, 5, n) * rng.integers(0, 2, n)]  # many zeros, as in real models
        bounds = partition.balanced(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == parts + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:])), (weights, parts, bounds)
        heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert heaviest == brute_bottleneck(weights, parts), (weights, parts, bounds)


def test_deepspeed_uniform_and_greedy_left_balance():
    assert partition.uniform(10, 4) == [0, 3, 6, 8, 10]  # the first L % P parts take one more
    assert partition.uniform(4, 4) == [0, 1, 2, 3, 4]
    assert partition.balanced([4, 0, 4, 0, 1], 2) == [0, 2, 5]  # zero-weight layers join the left part
    assert partition.balanced([1, 1, 1, 1], 1) == [0, 4]


def test_type_regex_and_errors():
    assert partition.type_weights(["Conv2d", "ReLU", "Linear"], "linear|conv") == [1, 0, 1]
    with pytest.raises(ValueError, match=r"type:Attention.*matches none"):
        partition.type_weights(["Conv2d", "ReLU"], "Attention")
    with pytest.raises(ValueError, match=r"num_stages x virtual_stages=5 parts cannot be cut from 3 layers.*at most 3"):
        partition.uniform(3, 5)
    with pytest.raises(ValueError, match="partition_method='blocks' is not known"):
        partition.partition("blocks", 2, names=["A", "B"], params=lambda: [1, 1])


def test_parameters_method_splits_convnet_after_flatten():
    pm = PipelineModule.from_model(models.abstract("convnet"), 2)
    assert pm.bounds == [0, 7, 12]  # convolutions | fc1 (1.18M of the 1.2M weights) on its own
    text = pm.describe()
    assert "stage 0: layers 0-6" in text and "18,816 params" in text and "1,181,066 params" in text
    assert [sum(pm.param_specs[j].size for j in idx) for idx in pm.stage_params] == [18_816, 1_181_066]


def test_alexnet_methods_on_an_abstract_model():
    model = models.abstract("alexnet", num_classes=10)  # shapes only: no 57M weights allocated
    names = [type(l).__name__ for l in models.as_layers(model)]
    assert PipelineModule.from_model(model, 2).bounds == [0, 19, 22]  # layers 0-18 | 19-21: the split
    pm = PipelineModule.from_model(model, 4)
    assert pm.bounds == [0, 16, 19, 21, 22]  # features+pool | classifier.1 | classifier.4 | classifier.6
    pm = PipelineModule.from_model(model, 3, partition_method="type:Linear")
    assert [sum(names[i] == "Linear" for i in range(a, b)) for a, b in zip(pm.bounds, pm.bounds[1:])] == [1, 1, 1]
    pm = PipelineModule.from_model(model, 4, partition_method="uniform")
    assert pm.bounds == partition.uniform(22, 4)
    with pytest.raises(ValueError, match="num_stages x virtual_stages=24 parts cannot be cut from 22 layers"):
        PipelineModule.from_model(model, 12, virtual_stages=2)


def test_profile_balances_compiler_flops_not_parameters():
    model = models.abstract("convnet", conv_impl="xla")
    x = jax.ShapeDtypeStruct((1, 28, 28, 1), np.float32)
    pm = PipelineModule.from_model(model, 2, partition_method="profile", example_input=x)
    costs = pm.layer_costs()
    assert costs[2] > 5 * costs[7]  # conv2 costs more flops than fc1, which holds 64x its weights
    assert pm.bounds == [0, 3, 12]  # conv1, relu, conv2 | the rest: unlike 'parameters' ([0, 7, 12])


def test_each_stage_owns_its_own_leaves_of_the_canonical_tree():
    model = models.get("mlp", in_features=6, hidden_dim=8, out_features=3)
    pm = PipelineModule.from_model(model, 2, partition_method="uniform")
    paths = [tuple(str(k) for k in p) for p in pm.param_paths]
    assert pm.stage_params == [[0, 1], [2, 3]] and pm.tied == {}  # no padding, no copies
    assert paths == [("layers", "0", "bias"), ("layers", "0", "kernel"), ("layers", "2", "bias"),
                     ("layers", "2", "kernel")]
    assert [len(p) for p in pm.parts] == [2, 1]  # one segment per layer ...
    pm = PipelineModule.from_model(model, 2, partition_method="uniform", activation_checkpoint_interval=2)
    assert [[(s.layers.start, s.layers.stop, s.remat) for s in p] for p in pm.parts] == [[(0, 2, True)], [(2, 3, True)]]


class Table(nnx.Module):
    """A layer built from an array (a TiedLayerSpec argument that == cannot compare)."""

    def __init__(self, init, *, rngs=None):
        self.w = nnx.Param(jnp.asarray(init))

    def __call__(self, x):
        return jnp.take(self.w[...], x, axis=0)


def test_layer_specs_tied_specs_and_callables():
    specs = [TiedLayerSpec("embed", nnx.Embed, 10, 4), LayerSpec(Linear, 4, 4), ReLU(), nnx.relu,
             lambda x: 2 * x, TiedLayerSpec("embed", nnx.Embed, 10, 4, forward_fn=lambda m, x: m.attend(x))]
    pm = PipelineModule(specs, 2, partition_method="uniform")
    assert pm.bounds == [0, 3, 6] and pm.names[3:5] == ["relu", "<lambda>"]
    assert pm.tied == {0: [0, 1]} and "tied layers/0/embedding on stages [0, 1]" in pm.describe()
    again = PipelineModule(specs, 2, partition_method="uniform")  # weights depend on (seed, index) only
    for a, b in zip(jax.tree.leaves(nnx.state(pm.model, nnx.Param)), jax.tree.leaves(nnx.state(again.model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    assert sorted(nnx.state(pm.model, nnx.Param)["layers"].keys()) == [0, 1]  # the tied table once, at its first use
    with pytest.raises(TypeError, match="layer 1 is a int"):
        PipelineModule([ReLU(), 3], 1)
    # a later spec of the same key with other arguments would be ignored (the first builds the module): refused
    other = [*specs[:-1], TiedLayerSpec("embed", nnx.Embed, 12, 4, forward_fn=lambda m, x: m.attend(x))]
    with pytest.raises(ValueError, match=r"TiedLayerSpec 'embed' at layer 5 is Embed\(12, 4\), but its first use "
                                         r"\(layer 0\) builds Embed\(10, 4\).*pass the same class and arguments"):
        PipelineModule(other, 2, partition_method="uniform")
    table = np.ones((10, 4), np.float32)  # array arguments compare by value
    tied = lambda t, **kw: TiedLayerSpec("t", Table, t, **kw)  # noqa: E731
    PipelineModule([tied(table), LayerSpec(Linear, 4, 4), tied(table.copy(), forward_fn=lambda m, x: x @ m.w.T)], 1)
    with pytest.raises(ValueError, match="TiedLayerSpec 't' at layer 2 is Table"):
        PipelineModule([tied(table), LayerSpec(Linear, 4, 4), tied(2 * table)], 1)
    with pytest.raises(ValueError, match="PipelineModule got no layers; pass the model's layers"):
        PipelineModule([], 2)
