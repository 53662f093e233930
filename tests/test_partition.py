"""Stage partitions as plain data: DeepSpeed's methods give the expected splits, the balance is optimal, errors
name the numbers; PipelineModule prints its partition, maps every weight once, builds LayerSpecs only where used."""
from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar import models
from jaxpar.pipeline import partition
from jaxpar.strategies.pipeline import LayerSpec, PipelineModule
from jaxpar.models.layers import Linear, ReLU


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


def test_parameters_method_splits_convnet_after_flatten(capsys):
    pm = PipelineModule.from_model(models.abstract("convnet"), 2)
    assert pm.bounds == [0, 7, 12]  # convolutions | fc1 (1.18M of the 1.2M weights) on its own
    out = capsys.readouterr().out
    assert "stage 0: layers 0-6" in out and "18,816 params" in out and "1,181,066 params" in out
    assert pm.part_sizes == [18_816, 1_181_066] and pm.flat_size == 1_181_066


def test_alexnet_methods_on_an_abstract_model():
    model = models.abstract("alexnet", num_classes=10)  # shapes only: no 57M weights allocated
    names = [type(l).__name__ for l in models.as_layers(model)]
    pm = PipelineModule.from_model(model, 4, verbose=False)
    assert pm.bounds == [0, 16, 19, 21, 22]  # features+pool | classifier.1 | classifier.4 | classifier.6
    pm = PipelineModule.from_model(model, 3, partition_method="type:Linear", verbose=False)
    assert [sum(names[i] == "Linear" for i in pm.part_layers(v)) for v in range(3)] == [1, 1, 1]
    pm = PipelineModule.from_model(model, 4, partition_method="uniform", verbose=False)
    assert pm.bounds == partition.uniform(22, 4)
    with pytest.raises(ValueError, match="num_stages x virtual_stages=24 parts cannot be cut from 22 layers"):
        PipelineModule.from_model(model, 12, virtual_stages=2, verbose=False)


def test_profile_balances_compiler_flops_not_parameters():
    model = models.abstract("convnet", conv_impl="xla")
    x = jax.ShapeDtypeStruct((1, 28, 28, 1), np.float32)
    pm = PipelineModule.from_model(model, 2, partition_method="profile", example_input=x, verbose=False)
    costs = pm.layer_costs()
    assert costs[2] > 5 * costs[7]  # conv2 costs more flops than fc1, which holds 64x its weights
    assert pm.bounds == [0, 3, 12]  # conv1, relu, conv2 | the rest: unlike 'parameters' ([0, 7, 12])


def test_flat_layout_round_trips_the_canonical_tree():
    model = models.get("mlp", in_features=6, hidden_dim=8, out_features=3)
    pm = PipelineModule.from_model(model, 2, partition_method="uniform", verbose=False)
    leaves = jax.tree.leaves(nnx.split(model)[1])
    flat = pm.to_flat(leaves)
    assert flat.shape == (2, 1, max(pm.part_sizes))
    assert all(np.array_equal(a, b) for a, b in zip(pm.from_flat(flat), leaves))
    assert not np.array_equal(flat[0], flat[1])


class Tagged(Linear):
    built: list = []

    def __init__(self, tag: int, *, rngs: nnx.Rngs):
        super().__init__(4, 4, rngs=rngs)
        if not isinstance(self.kernel[...], jax.core.Tracer):  # not nnx.eval_shape's abstract build
            Tagged.built.append(tag)


def test_layer_specs_build_only_the_stages_layers():
    Tagged.built.clear()
    specs = [LayerSpec(Tagged, i) if i % 2 == 0 else LayerSpec(ReLU) for i in range(8)]
    pm = PipelineModule(specs, 2, partition_method="type:Tagged", verbose=False)
    assert Tagged.built == [] and pm.bounds == [0, 4, 8]  # partitioned from shapes alone
    leaves = pm.stage_leaves(1)
    assert Tagged.built == [4, 6]  # stage 1 built its own two layers, nothing else
    again = PipelineModule(specs, 2, partition_method="type:Tagged", verbose=False).stage_leaves(1)
    assert all(np.array_equal(leaves[j], again[j]) for j in leaves)  # weights depend on (seed, index) only
    canonical = jax.tree.unflatten(pm.canonical_treedef, range(pm.canonical_treedef.num_leaves))
    assert sorted(canonical.keys()) == [0, 2, 4, 6]  # {layer index: its state}
