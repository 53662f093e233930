"""DataParallel: torch.chunk scatter, equivalence with the reference step, the tutorial's shape printout."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import Objective, as_rows
from jaxpar.config import Config
from jaxpar.step import init_state, make_train_step
from jaxpar.strategies.data_parallel import DataParallel, build, chunk_sizes

STEPS = 5


class SmallMLP(nnx.Module):
    """Linear-ReLU-[stock nnx.Dropout]-Linear. Dropout makes every compile dearer (the PRNG), so the device-count
    matrix runs without it and one uneven case runs with it."""

    def __init__(self, rngs: nnx.Rngs, dropout: bool = False):
        self.fc1, self.fc2 = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = jax.nn.relu(self.fc1(x))
        return self.fc2(h if self.drop is None else self.drop(h))


class TutorialModel(nnx.Module):
    """The DataParallel tutorial's Model: one Linear(5, 2)."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


TX = optax.sgd(0.1, momentum=0.9)


def setup(model):
    return Objective.of(model), init_state(model, TX)


@pytest.fixture(scope="module")
def mlp():
    """One (objective, state) for the module, so every DataParallel shares the forward/backward compilations."""
    return setup(SmallMLP(nnx.Rngs(params=0, dropout=3)))


@pytest.fixture(scope="module")
def dropout_mlp():
    return setup(SmallMLP(nnx.Rngs(params=0, dropout=3), dropout=True))


@partial(jax.jit, static_argnums=0)
def chunk_grads(objective, params, model_state, rows):
    return objective.value_and_grad(params, model_state, rows)[1]


def batches(batch_size: int, steps: int = STEPS, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [as_rows({"x": rng.normal(size=(batch_size, 5)).astype(np.float32),
                     "y": rng.integers(0, 3, batch_size).astype(np.int32)},
                    np.arange(i * batch_size, (i + 1) * batch_size)) for i in range(steps)]


# [len(c) for c in torch.arange(B).chunk(N)], recorded with torch 2.13 (torch is not a test dependency)
TORCH_CHUNK = {
    (30, 8): [4, 4, 4, 4, 4, 4, 4, 2], (10, 5): [2, 2, 2, 2, 2], (10, 8): [2, 2, 2, 2, 2], (100, 3): [34, 34, 32],
    (5, 8): [1, 1, 1, 1, 1], (7, 7): [1] * 7, (1, 4): [1], (31, 4): [8, 8, 8, 7], (64, 8): [8] * 8, (17, 1): [17],
    (9, 6): [2, 2, 2, 2, 1], (13, 5): [3, 3, 3, 3, 1],
}


@pytest.mark.parametrize("batch_size,n", sorted(TORCH_CHUNK))
def test_chunk_sizes_follow_torch_chunk(batch_size, n):
    assert chunk_sizes(batch_size, n) == TORCH_CHUNK[batch_size, n]


def test_chunk_sizes_rule():
    """torch.chunk: every chunk ceil(B/N) rows but the last, which is smaller; at most N chunks, all non-empty."""
    for b in range(1, 70):
        for n in range(1, 10):
            sizes, size = chunk_sizes(b, n), -(-b // n)
            assert sum(sizes) == b and len(sizes) <= n and set(sizes[:-1]) <= {size} and 0 < sizes[-1] <= size


def test_chunk_sizes_tutorial_cases():
    assert chunk_sizes(30, 8) == [4, 4, 4, 4, 4, 4, 4, 2]
    assert chunk_sizes(10, 5) == [2, 2, 2, 2, 2]
    assert chunk_sizes(10, 8) == [2, 2, 2, 2, 2]  # five chunks: three devices idle
    assert chunk_sizes(30, 3) == [10, 10, 10]
    with pytest.raises(ValueError, match="batch_size=0"):
        chunk_sizes(0, 8)


def test_bad_devices_are_named():
    model = TutorialModel(nnx.Rngs(0))
    with pytest.raises(ValueError, match="device_ids=\\[0, 9\\]"):
        DataParallel(model, TX, device_ids=[0, 9])
    with pytest.raises(ValueError, match="output_device=8"):
        DataParallel(model, TX, output_device=8)
    with pytest.raises(ValueError, match="distinct"):
        DataParallel(model, TX, device_ids=[1, 1])
    with pytest.raises(ValueError, match="device_ids=\\[\\] names no device; pass at least one index"):
        DataParallel(model, TX, device_ids=[])  # QA: TypeError '<=' not supported between int and NoneType


def test_torchs_dim_is_refused_naming_the_leading_axis():
    """torch's DataParallel(module, device_ids, output_device, dim): a port's dim= (QA: refused only as an
    "unexpected keyword argument", which named no replacement) says the batch is split along axis 0."""
    model = TutorialModel(nnx.Rngs(0))
    for dim in (0, 1):
        with pytest.raises(TypeError, match=f"DataParallel\\(dim={dim}\\) is torch's argument.*leading axis.*"
                                            "move the batch axis to 0"):
            DataParallel(model, TX, dim=dim)


def test_gathering_outputs_needs_a_loss_on_outputs():
    model = TutorialModel(nnx.Rngs(0))

    def loss(model, batch):
        return jnp.sum(model(batch["x"])), batch["x"].shape[0]

    # the refusal names the strategy and both fixes (it said only "this needs ... OutputLoss", a QA finding: a loss
    # that reads the model twice or its attributes cannot be an OutputLoss, but runs with loss_on_device=True)
    with pytest.raises(ValueError, match=r"DataParallel gathers the replicas' outputs .*OutputLoss.*, or "
                                         r"loss_on_device=True"):
        DataParallel(model, TX, loss_fn=loss)
    DataParallel(model, TX, loss_fn=loss, loss_on_device=True)  # each device runs its own loss: any form
    # ... but the "In Model" lines print the outputs' shape, which such a loss never shows: refused before any
    # work (it failed inside the first step, a QA finding)
    with pytest.raises(ValueError, match=r"print_shapes prints each replica's output shape, which a "
                                         r"loss\(model, batch\) never hands the strategy"):
        DataParallel(model, TX, loss_fn=loss, loss_on_device=True, print_shapes=True)


_REFERENCE = {}


def reference_step(objective):
    """The reference step of one objective, jitted once for the whole module."""
    return _REFERENCE.setdefault(objective, make_train_step(objective, TX))


def run_both(objective, state, data, **dp_kwargs):
    """(DataParallel's state and last metrics, the reference's) after one step per batch of `data`."""
    ref_step, ref = reference_step(objective), state
    dp = DataParallel(objective, TX, **dp_kwargs)
    placed = dp.init(state)
    for batch in data:
        ref, ref_metrics = ref_step(ref, batch)
        placed, metrics = dp.step(placed, dp.put_batch(batch))
    return dp, dp.unplace(placed), metrics, ref, ref_metrics


def assert_same_training(out, metrics, ref, ref_metrics, state, batch_size):
    assert not np.allclose(jax.tree.leaves(out.params)[0], jax.tree.leaves(state.params)[0])  # it trained
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves((out.params, out.opt_state)), jax.tree.leaves((ref.params, ref.opt_state))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(out.step) == int(ref.step)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    assert float(metrics["samples"]) == batch_size
    np.testing.assert_allclose(metrics["accuracy"], ref_metrics["accuracy"], rtol=1e-6)


def assert_chunks_differ(objective, state, batch, n):
    """The chunks pull the params different ways, so only a correct reduction gives the reference."""
    sizes = chunk_sizes(batch.size, n)
    starts = np.cumsum([0] + sizes[:-1])
    grads = [chunk_grads(objective, state.params, state.model_state, jax.tree.map(lambda a: a[s:s + m], batch))
             for s, m in zip(starts, sizes)]
    flat = [np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)]) for t in grads]
    assert all(not np.allclose(flat[0], f, rtol=1e-3) for f in flat[1:])


# N in {1, 2, 3, 4, 8}; uneven chunks (7 on 2, 10 on 3, 14 on 4, 30 on 8); a batch smaller than the device count
CASES = [(1, 4), (2, 7), (3, 10), (4, 14), (8, 30), (4, 3)]


@pytest.mark.parametrize("loss_on_device", [False, True])
@pytest.mark.parametrize("n,batch_size", CASES)
def test_dp_matches_reference_step(mlp, n, batch_size, loss_on_device):
    objective, state = mlp
    data = batches(batch_size)
    if n > 1:
        assert_chunks_differ(objective, state, data[0], n)
    dp, out, metrics, ref, ref_metrics = run_both(objective, state, data, device_ids=list(range(n)),
                                                  loss_on_device=loss_on_device)
    assert_same_training(out, metrics, ref, ref_metrics, state, batch_size)
    assert int(out.step) == STEPS
    assert {d for leaf in jax.tree.leaves(out.params) for d in leaf.devices()} == {dp.master}


@pytest.mark.parametrize("loss_on_device", [False, True])
def test_dp_with_dropout_matches_reference_step(dropout_mlp, loss_on_device):
    """Stock nnx.Dropout in per-sample mode: each chunk draws its rows' masks from their ids, as the reference."""
    objective, state = dropout_mlp
    data = batches(14)
    loss = jax.jit(lambda rows, train: objective.sums(state.params, state.model_state, rows, train=train)[0].loss,
                   static_argnums=1)
    assert not np.allclose(loss(data[0], True), loss(data[0], False))  # it drops
    assert_chunks_differ(objective, state, data[0], 4)
    _, out, metrics, ref, ref_metrics = run_both(objective, state, data, device_ids=[0, 1, 2, 3],
                                                 loss_on_device=loss_on_device)
    assert_same_training(out, metrics, ref, ref_metrics, state, 14)


def test_output_device_other_than_master(mlp):
    objective, state = mlp
    dp = DataParallel(objective, TX, device_ids=[0, 1, 2], output_device=1)
    ref_step, ref, placed = reference_step(objective), state, dp.init(state)
    for batch in batches(10, steps=2):
        ref, _ = ref_step(ref, batch)
        placed, metrics = dp.step(placed, dp.put_batch(batch))
    assert metrics["loss"].devices() == {jax.devices()[1]}
    for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    default = DataParallel(objective, TX, device_ids=[2, 3])  # torch's output_device defaults to device_ids[0]
    assert default.out_device == default.master == jax.devices()[2]


# The tutorial: RandomDataset(5, 100), batch 30 -> batches of 30, 30, 30, 10; each replica prints its chunk.
TUTORIAL_REPLICAS = {
    2: [[15, 15]] * 3 + [[5, 5]],
    3: [[10, 10, 10]] * 3 + [[4, 4, 2]],
    8: [[4] * 7 + [2]] * 3 + [[2] * 5],
}


@pytest.mark.parametrize("n", sorted(TUTORIAL_REPLICAS))
def test_print_shapes_like_the_tutorial(n, capsys):
    objective, state = setup(TutorialModel(nnx.Rngs(0)))
    dp = DataParallel(objective, TX, device_ids=list(range(n)), print_shapes=True)
    placed = dp.init(state)
    data = np.random.default_rng(0).normal(size=(100, 5)).astype(np.float32)
    capsys.readouterr()
    for start in range(0, 100, 30):
        x = data[start:start + 30]
        batch = as_rows({"x": x, "y": np.zeros(len(x), np.int32)}, np.arange(start, start + len(x)))
        placed, _ = dp.step(placed, dp.put_batch(batch))
    lines = capsys.readouterr().out.splitlines()

    expected = []
    for replicas in TUTORIAL_REPLICAS[n]:
        expected += [f"\tIn Model: input size ({b}, 5) output size ({b}, 2)" for b in replicas]
        expected.append(f"Outside: input size ({sum(replicas)}, 5) output size ({sum(replicas)}, 2)")
    assert lines == expected


def test_build_from_config(mlp, capsys):
    objective, state = mlp
    model = objective.merge(state.params, state.model_state)
    dp = build(model, TX, Config(strategy="dp", num_devices=3, loss_on_device=True, print_shapes=True))
    assert [d.id for d in dp.devices] == [0, 1, 2] and dp.loss_on_device
    assert "DataParallel over 3 devices" in dp.describe() and "scalars gathered" in dp.describe()
    dp.step(dp.init(state), dp.put_batch(batches(10, steps=1)[0]))
    # loss_on_device: replicas still print the model's output; the master receives one loss per replica
    assert capsys.readouterr().out.splitlines()[-1] == "Outside: input size (10, 5) output size (3,)"
