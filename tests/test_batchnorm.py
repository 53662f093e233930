"""BatchNorm under the strategies: torch's semantics, recorded from torch itself (tests/make_torch_bn_fixture.py).

A model with BatchStat runs in batch mode (jaxpar.objective): under DistributedDataParallel each replica
normalises its rows with its own statistics and the running buffers are replica 0's (torch's
``broadcast_buffers=True``), which is NOT the single-device step on the whole batch -- the fixture holds both,
and they differ. `sync_batch_norm` (torch's SyncBatchNorm) makes DDP equal to the single step again.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import Objective, as_rows
from jaxpar.strategies.ddp import sync_batch_norm

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "batchnorm_ddp.npz")
TX = optax.sgd(0.1, momentum=0.9)


class TorchBatchNorm1d(nnx.Module):
    """torch.nn.BatchNorm1d's arithmetic: biased batch variance to normalise, unbiased for the running update,
    momentum 0.1, eps 1e-5 (nnx.BatchNorm keeps the biased variance, so its buffers differ from torch's)."""

    def __init__(self, n: int):
        self.weight, self.bias = nnx.Param(jnp.ones(n)), nnx.Param(jnp.zeros(n))
        self.running_mean, self.running_var = nnx.BatchStat(jnp.zeros(n)), nnx.BatchStat(jnp.ones(n))
        self.use_running_average = False  # model.eval() sets it

    def __call__(self, x):
        if self.use_running_average:
            mean, var = self.running_mean.get_value(), self.running_var.get_value()
        else:
            mean, var, n = x.mean(0), x.var(0), x.shape[0]
            self.running_mean.set_value(0.9 * self.running_mean.get_value() + 0.1 * mean)
            self.running_var.set_value(0.9 * self.running_var.get_value() + 0.1 * var * n / (n - 1))
        return (x - mean) / jnp.sqrt(var + 1e-5) * self.weight.get_value() + self.bias.get_value()


def torch_twin(fx: dict, prefix: str) -> nnx.Sequential:
    """nn.Sequential(Linear(6, 16), BatchNorm1d(16), ReLU(), Linear(16, 3)) holding the fixture's weights."""
    model = nnx.Sequential(nnx.Linear(6, 16, rngs=nnx.Rngs(0)), TorchBatchNorm1d(16), nnx.relu,
                           nnx.Linear(16, 3, rngs=nnx.Rngs(0)))
    for i in (0, 3):
        model.layers[i].kernel.set_value(jnp.asarray(fx[f"{prefix}/{i}.weight"].T))
        model.layers[i].bias.set_value(jnp.asarray(fx[f"{prefix}/{i}.bias"]))
    bn = model.layers[1]
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(bn, name).set_value(jnp.asarray(fx[f"{prefix}/1.{name}"]))
    return model


def trained(strategy_of, fx: dict) -> nnx.Sequential:
    """The model after the fixture's 3 steps under `strategy_of(objective)`."""
    model = torch_twin(fx, "init")
    objective = Objective.of(model)  # BatchStat: batch mode, chosen from the model
    assert not objective.per_sample
    strategy = strategy_of(objective)
    placed = strategy.init(jaxpar.init_state(model, TX))
    for s in range(3):
        placed, _ = strategy.step(placed, strategy.put_batch({"x": fx[f"x{s}"], "y": fx[f"y{s}"]}))
    state = strategy.unplace(placed)
    return objective.merge(state.params, state.model_state)


def assert_matches(model: nnx.Sequential, fx: dict, prefix: str) -> None:
    for i in (0, 3):
        np.testing.assert_allclose(model.layers[i].kernel.get_value(), fx[f"{prefix}/{i}.weight"].T, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(model.layers[i].bias.get_value(), fx[f"{prefix}/{i}.bias"], rtol=1e-5, atol=1e-6)
    for name in ("weight", "bias", "running_mean", "running_var"):
        np.testing.assert_allclose(getattr(model.layers[1], name).get_value(), fx[f"{prefix}/1.{name}"],
                                   rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def fx() -> dict:
    fx = dict(np.load(FIXTURE))
    # the premise: torch's DDP and single-process runs really differ, in weights and in buffers
    assert np.abs(fx["ddp/0.weight"] - fx["single/0.weight"]).max() > 1e-3
    assert np.abs(fx["ddp/1.running_mean"] - fx["single/1.running_mean"]).max() > 1e-3
    assert np.abs(fx["ddp/1.running_mean"] - fx["rank1/1.running_mean"]).max() > 1e-3  # rank 1's were not kept
    return fx


def test_single_step_equals_torch_on_the_whole_batch(fx):
    assert_matches(trained(lambda o: jaxpar.SingleDevice(o, TX), fx), fx, "single")


@pytest.mark.parametrize("strategy", ["ddp", "dp"])
def test_two_replicas_follow_torch_ddp(fx, strategy):
    """Each replica's own statistics; replica 0's running buffers: torch DDP (gloo, 2 processes), to 1e-5."""
    make = {"ddp": lambda o: jaxpar.DistributedDataParallel(o, TX, mesh=jaxpar.make_mesh(2)),
            "dp": lambda o: jaxpar.DataParallel(o, TX, device_ids=[0, 1])}[strategy]
    assert_matches(trained(make, fx), fx, "ddp")


def bn_model(sync: bool = False) -> nnx.Sequential:
    model = nnx.Sequential(nnx.Linear(6, 16, rngs=nnx.Rngs(0)), nnx.BatchNorm(16, momentum=0.9, rngs=nnx.Rngs(0)),
                           nnx.relu, nnx.Linear(16, 3, rngs=nnx.Rngs(1)))
    return sync_batch_norm(model) if sync else model


def run_bn(strategy, model, batches) -> jaxpar.TrainState:
    placed = strategy.init(jaxpar.init_state(model, TX))
    for b in batches:
        placed, _ = strategy.step(placed, strategy.put_batch(b))
    return strategy.unplace(placed)


def test_sync_batch_norm_makes_ddp_equal_the_single_step():
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal((16, 6)).astype(np.float32) * (1 + s), "y": rng.integers(0, 3, 16)}
               for s in range(3)]
    single = run_bn(jaxpar.SingleDevice(bn_model(), TX), bn_model(), batches)
    local = run_bn(jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(4)), bn_model(), batches)
    synced = run_bn(jaxpar.DistributedDataParallel(bn_model(True), TX, mesh=jaxpar.make_mesh(4)), bn_model(True),
                    batches)
    alone = run_bn(jaxpar.SingleDevice(bn_model(True), TX), bn_model(True), batches)  # one-device axis: identity
    init = jax.tree.leaves(jaxpar.init_state(bn_model(), TX).model_state)
    ref = jax.tree.leaves(single.model_state)
    assert all(np.abs(a - b).max() > 1e-3 for a, b in zip(ref, init))  # running stats really updated
    diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(single)))
    assert diff > 1e-3  # local statistics: torch DDP's semantics, not the single step
    for other in (synced, alone):
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(single)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_sync_batch_norm_makes_zero_equal_the_single_step(stage):
    """The README lists ZeRO beside DDP for sync_batch_norm (the refusal DataParallel and the pipeline give names
    it too): its per-replica shards normalise with the statistics of the whole batch, so it lands on single's."""
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal((16, 6)).astype(np.float32) * (1 + s), "y": rng.integers(0, 3, 16)}
               for s in range(3)]
    single = run_bn(jaxpar.SingleDevice(bn_model(), TX), bn_model(), batches)
    local = run_bn(jaxpar.ZeroRedundancy(bn_model(), TX, stage=stage, mesh=jaxpar.make_mesh(4)), bn_model(), batches)
    diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(single)))
    assert diff > 1e-3  # without the sync: each replica's own statistics, not the single step's
    synced = run_bn(jaxpar.ZeroRedundancy(bn_model(True), TX, stage=stage, mesh=jaxpar.make_mesh(4)),
                    bn_model(True), batches)
    for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(single)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_zero_keeps_replica_0s_buffers_on_every_replica_as_ddp():
    """ZeRO (stage 3) in batch mode (a BatchNorm model, 2 replicas of 8 rows): the running statistics are replica
    0's on every device, DDP's broadcast_buffers -- not each replica's own (they differ: another 8 rows), which would
    leave the copies of a replicated buffer apart."""
    rng = np.random.default_rng(5)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.integers(0, 3, 16)}
    ddp = jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(2))
    want = jax.tree.leaves(nnx.state(run_bn(ddp, bn_model(), [batch]).model_state, nnx.BatchStat))
    own = run_bn(jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(1)), bn_model(),
                 [jax.tree.map(lambda a: a[8:], batch)])  # replica 1's rows alone
    assert max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(nnx.state(own.model_state, nnx.BatchStat)), want)) > 1e-3
    zero = jaxpar.ZeroRedundancy(bn_model(), TX, stage=3, mesh=jaxpar.make_mesh(2))
    placed, _ = zero.step(zero.init(jaxpar.init_state(bn_model(), TX)), zero.put_batch(batch))
    for a, b in zip(jax.tree.leaves(nnx.state(placed.model_state, nnx.BatchStat)), want):
        for shard in a.addressable_shards:
            np.testing.assert_allclose(shard.data, b, rtol=1e-6, atol=1e-7)


def test_batch_mode_refuses_padding_and_sync_bn_refuses_dp_and_the_pipeline():
    ddp = jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(4))
    rows = as_rows({"x": np.zeros((14, 6), np.float32), "y": np.zeros(14, np.int32)})
    with pytest.raises(ValueError, match="2 padding rows would reach a loss that sees whole shards.*--drop-last"):
        ddp.put_batch(rows)
    with pytest.raises(ValueError, match="per_sample=True, but Sequential holds BatchStat"):
        Objective.of(bn_model(), per_sample=True)
    dp = jaxpar.DataParallel(bn_model(True), TX, device_ids=[0, 1])
    with pytest.raises(ValueError, match="SyncBatchNorm needs DistributedDataParallel"):
        dp.init(jaxpar.init_state(bn_model(True), TX))
    pipe = jaxpar.Pipeline(bn_model(True), TX, num_stages=2, micro_batches=2)  # it failed inside flax's BatchNorm
    with pytest.raises(ValueError, match="which the pipeline's stages cannot bind.*SyncBatchNorm needs Distributed"):
        pipe.init(jaxpar.init_state(bn_model(True), TX))


def test_a_model_keeping_an_rngs_is_not_taken_for_synchronised_batch_norm():
    """A QA finding: a model that keeps an nnx.Rngs with a default stream (noise drawn in __call__) was refused by
    dp and the pipeline as "synchronised BatchNorm": Rngs answers any attribute, axis_name too, with that stream.
    Now both train it, equal to the single step (per-sample noise keyed by the row, whatever the split)."""

    class Noise(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs

        def __call__(self, x):
            return x + 0.1 * jax.random.normal(self.rngs(), x.shape)

    def make():
        r = nnx.Rngs(0)
        return nnx.Sequential(nnx.Linear(6, 8, rngs=r), Noise(nnx.Rngs(1)), nnx.relu, nnx.Linear(8, 3, rngs=r))

    assert getattr(nnx.Rngs(1), "axis_name", None) is not None  # the check can fail: the stream answers
    batch = {"x": np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32),
             "y": np.arange(8, dtype=np.int32) % 3}

    def trained(strategy):
        placed = strategy.init(jaxpar.init_state(make(), TX))
        for _ in range(2):
            placed, _ = strategy.step(placed, strategy.put_batch(batch))
        return jax.tree.leaves(strategy.unplace(placed).params)

    want = trained(jaxpar.SingleDevice(make(), TX))
    for strategy in (jaxpar.DataParallel(make(), TX, device_ids=[0, 1]),
                     jaxpar.Pipeline(make(), TX, num_stages=2, micro_batches=2)):
        for a, b in zip(trained(strategy), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ddp_broadcasts_the_buffers_not_the_frozen_weights():
    """torch's broadcast_buffers=True sends replica 0's buffers (BatchNorm's running statistics) every step, not
    the parameters: a frozen weight (left out of wrt) starts equal on every replica and stays so. The compiled
    step all-reduces the trained weights' gradients, the statistics and the metrics, and nothing of the frozen
    Linear and BatchNorm scale (6 x 16 + 16 + 2 x 16 floats), which it all-reduced every step before. A frozen
    weight that the forward assigns is still replica 0's on every replica (never drifting apart)."""
    from jaxpar.comm import cost

    wrt = nnx.All(nnx.Param, nnx.PathContains(3))  # only the head: the first Linear and BatchNorm's scale frozen
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.integers(0, 3, 16)} for _ in range(2)]
    state = jaxpar.init_state(bn_model(), TX, wrt=wrt)
    ddp = jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(2), wrt=wrt)
    single = jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(1), wrt=wrt)
    placed, alone = ddp.init(state), single.init(state)
    for b in batches:
        placed, _ = ddp.step(placed, ddp.put_batch(b))
        alone, _ = single.step(alone, single.put_batch(b))
    frozen = jax.tree.leaves(nnx.state(state.model_state, nnx.Param))
    assert sum(a.size for a in frozen) == 6 * 16 + 16 + 2 * 16
    for a, b in zip(jax.tree.leaves(nnx.state(placed.model_state, nnx.Param)), frozen):
        assert all(np.array_equal(s.data, b) for s in a.addressable_shards)  # on both replicas, unchanged
    stats = [a for a in jax.tree.leaves(nnx.state(ddp.unplace(placed).model_state, nnx.BatchStat))]
    moved = [a for a in jax.tree.leaves(nnx.state(single.unplace(alone).model_state, nnx.BatchStat))]
    assert max(float(np.abs(a - b).max()) for a, b in zip(stats, moved)) > 1e-3  # replica 0's rows only
    sent = sum(c.nbytes for c in cost.hlo_collectives(ddp.hlo(placed)) if c.kind == "all-reduce")
    assert 4 * (3 * 16 + 3 + 2 * 16) <= sent < 4 * (3 * 16 + 3 + 2 * 16 + 16)  # gradients, statistics, metrics

    class Running(nnx.Module):  # a frozen nnx.Param that the forward assigns: still replica 0's on every replica
        def __init__(self):
            self.lin, self.mean = nnx.Linear(6, 3, rngs=nnx.Rngs(0)), nnx.Param(jnp.zeros(3))

        def __call__(self, x):
            y = self.lin(x)
            self.mean[...] = y.mean(0)
            return y

    only_lin = nnx.All(nnx.Param, nnx.PathContains("lin"))
    state = jaxpar.init_state(Running(), TX, wrt=only_lin)
    means = []
    for n, batch in ((2, batches[0]), (1, jax.tree.map(lambda a: a[:8], batches[0]))):  # replica 0's 8 rows alone
        ddp = jaxpar.DistributedDataParallel(Running(), TX, mesh=jaxpar.make_mesh(n), wrt=only_lin, per_sample=False)
        placed, _ = ddp.step(ddp.init(state), ddp.put_batch(batch))
        means.append([np.asarray(s.data) for s in placed.model_state["mean"].get_value().addressable_shards])
    assert np.abs(means[1][0]).max() > 1e-3
    for m in means[0]:
        np.testing.assert_array_equal(m, means[1][0])


def test_one_value_per_channel_in_training_is_refused_as_torch_does():
    """torch's F.batch_norm refuses, in training, an input with one value per channel ("Expected more than 1 value
    per channel when training"): its batch variance is 0 and the layer outputs its bias alone. jaxpar trained on it
    silently: a one-row batch, DataParallel's chunk of 1 (10 rows on 4 devices: 3, 3, 3, 1, as torch's scatter
    cuts them), DDP's shard of 1, a pipeline micro-batch of 1. Rows enough, a one-row image (many values per
    channel), evaluation and synchronised BatchNorm (it counts the global batch) still run."""
    rng = np.random.default_rng(0)
    batch = lambda n: {"x": rng.standard_normal((n, 6)).astype(np.float32), "y": rng.integers(0, 3, n)}  # noqa
    refused = "BatchNorm got an input of shape \\(1, 16\\) in training: one value per channel.*at least 2 rows"
    cases = [(jaxpar.SingleDevice(bn_model(), TX), batch(1)),
             (jaxpar.DataParallel(bn_model(), TX, device_ids=[0, 1, 2, 3]), batch(10)),
             (jaxpar.DistributedDataParallel(bn_model(), TX, mesh=jaxpar.make_mesh(4)), batch(4)),
             (jaxpar.Pipeline(bn_model(), TX, num_stages=2, micro_batches=4), batch(4))]
    for strategy, b in cases:
        placed = strategy.init(jaxpar.init_state(bn_model(), TX))
        with pytest.raises(ValueError, match=refused):
            strategy.step(placed, strategy.put_batch(b))
    for strategy, b in [(jaxpar.SingleDevice(bn_model(), TX), batch(2)),
                        (jaxpar.DataParallel(bn_model(), TX, device_ids=[0, 1, 2, 3]), batch(8)),
                        (jaxpar.DistributedDataParallel(bn_model(True), TX, mesh=jaxpar.make_mesh(4)), batch(4))]:
        placed, m = strategy.step(strategy.init(jaxpar.init_state(bn_model(strategy.name == "ddp"), TX)),
                                  strategy.put_batch(b))
        assert np.isfinite(float(m["loss"]))
    from jaxpar.step import make_eval_step

    state = jaxpar.init_state(bn_model(), TX)
    sums = make_eval_step(Objective.of(bn_model()))(state.params, state.model_state, as_rows(batch(1)))
    assert float(sums.weight) == 1.0 and np.isfinite(float(sums.loss))
    conv = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
                          lambda x: x.mean((1, 2)))
    image = {"x": rng.standard_normal((1, 5, 5, 3)).astype(np.float32), "y": np.array([1])}
    strategy = jaxpar.SingleDevice(conv, TX)
    _, m = strategy.step(strategy.init(jaxpar.init_state(conv, TX)), strategy.put_batch(image))
    assert np.isfinite(float(m["loss"]))


def test_the_bare_reference_step_refuses_a_synced_model_in_one_line():
    """jaxpar.make_train_step runs the model outside any mesh, so sync_batch_norm's pmean over DATA raised JAX's
    "NameError: unbound axis name: data" from inside the trace (a QA finding); now one line naming the axis and the
    strategies that give it. The unsynced model steps, and evaluation (running statistics, no pmean) runs either."""
    model = bn_model(True)
    objective, state = jaxpar.Objective.of(model), jaxpar.init_state(model, TX)
    rows = jaxpar.as_rows({"x": np.ones((4, 6), np.float32), "y": np.zeros(4, np.int32)})
    with pytest.raises(ValueError, match=r"^the model reduces over the mesh axis 'data' \(jaxpar.sync_batch_norm's "
                                         r"statistics, .*jaxpar.SingleDevice\(model, tx\) on one device") as e:
        jaxpar.make_train_step(objective, TX)(state, rows)
    assert "\n" not in str(e.value)
    jaxpar.make_eval_step(objective)(state.params, state.model_state, rows)
    plain = bn_model()
    jaxpar.make_train_step(jaxpar.Objective.of(plain), TX)(jaxpar.init_state(plain, TX), rows)
