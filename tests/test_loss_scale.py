"""fp16 loss scaling (jaxpar.loss_scale): the scale follows DeepSpeed's DynamicLossScaler step for step; in float32
the scaled backward gives every strategy bit for bit the unscaled one's parameters (S a power of two); in float16
it keeps gradients that underflow without it, and a gradient overflowing on one leaf skips the update on every
device, shard and replica together, then halves the scale."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import Objective, OutputLoss, as_rows, loss_scale
from jaxpar.loss_scale import LossScaleConfig, loss_scaling
from jaxpar.models import gpt
from jaxpar.objective import Sums
from jaxpar.strategies.pipeline import pipeline_mesh


class DeepSpeedScaler:
    """The oracle: DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py) in plain
    Python, without its logging and its raise at the minimum scale."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


@pytest.mark.parametrize("power,window,hysteresis,consecutive,min_scale", [
    (16, 1000, 2, False, 1.0),  # DeepSpeed's defaults
    (4, 3, 1, False, 1.0),  # torch's GradScaler's kind: every overflow halves
    (5, 2, 3, False, 2.0),  # the floor reached
    (5, 2, 3, True, 1.0),
])
def test_scale_follows_deepspeeds_dynamic_loss_scaler(power, window, hysteresis, consecutive, min_scale):
    cfg = LossScaleConfig(initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                          consecutive_hysteresis=consecutive, min_loss_scale=min_scale)
    oracle = DeepSpeedScaler(2.0 ** power, window, min_scale, hysteresis, consecutive)
    state = loss_scaling(optax.sgd(1.0), cfg).init({"w": jnp.zeros(2)})
    rng = np.random.default_rng(power + window)
    pattern = np.r_[np.ones(6, bool), rng.random(40) < 0.35, np.zeros(7, bool)]  # runs of overflows and of clean
    update = jax.jit(lambda s, o: loss_scale.next_scale(cfg, s, o))
    scales = []
    for overflow in pattern:
        state = update(state, jnp.asarray(overflow))
        oracle.update_scale(bool(overflow))
        scales.append(float(state.scale))
        assert (float(state.scale), int(state.hysteresis)) == (oracle.cur_scale, oracle.cur_hysteresis)
    assert len(set(scales)) > 2  # the pattern moved the scale both ways (or down to its floor)
    if hysteresis == 2 and window == 1000:  # the first overflow only spends the hysteresis; the second halves
        assert scales[:3] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]


@pytest.mark.parametrize("weight,micro_batches,seed", [(12.0, 1, 2.0 ** 12 / 16), (3.0, 1, 2.0 ** 12 / 4),
                                                       (12.0, 4, 2.0 ** 12 / 64), (5.0, 3, 2.0 ** 12 / 16)])
def test_seed_is_the_scale_over_the_weight_of_the_step_per_device(weight, micro_batches, seed):
    """DeepSpeed's scaled backward runs at S times each micro-batch's mean loss divided by
    gradient_accumulation_steps: a summed loss over weight w, one of K micro-batches, is seeded at
    S / 2**round(log2(w K)); the gradient comes back times that seed, and `unscale` divides it out exactly."""
    def fn(x):
        loss = jnp.sum(x * x)
        return loss, (Sums(loss, jnp.float32(weight), jnp.float32(weight), {}),)

    x = jnp.arange(3.0)
    (loss, _), grad, got = loss_scale.value_and_grad(fn, jnp.float32(2.0 ** 12), micro_batches=micro_batches)(x)
    assert float(got) == seed
    np.testing.assert_array_equal(grad, 2 * x * seed)
    np.testing.assert_array_equal(loss_scale.unscale(grad, got), 2 * x)


# ---- every strategy, float32 and float16 -------------------------------------------------------------------

class TwoLeaves(nnx.Module):
    """y = x @ (1000 a) + x @ b, MSE: `a`'s float16 gradient is 1000 times `b`'s."""

    def __init__(self, rngs: nnx.Rngs, n_in: int = 8, n_out: int = 4, gain: float = 1000.0):
        self.a = nnx.Param(jax.random.normal(rngs.params(), (n_in, n_out)) * 3e-4)
        self.b = nnx.Param(jax.random.normal(rngs.params(), (n_in, n_out)) * 0.3)
        self.gain = gain

    def __call__(self, x):
        return x @ (self.a * self.gain) + x @ self.b


def mse_sum(out, batch):
    err = out.astype(jnp.float32) - batch["y"]
    return jnp.sum(err * err), jnp.asarray(err.shape[0], jnp.float32)


def batches(steps: int = 3, rows: int = 12, big: float = 1.0, same: bool = False, errors=None):
    """`steps` batches of `rows` rows, y = big x[:, :4]; `same`: each batch `rows` copies of one row, so that
    every device's mean loss is the batch's; `errors`: per step, the targets' offset."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps):
        x = rng.normal(size=(1 if same else rows, 8)).astype(np.float32).repeat(rows if same else 1, 0)
        y = x[:, :4] * big + (0.0 if errors is None else errors[i])
        out.append(as_rows({"x": x, "y": y.astype(np.float32)}, np.arange(i * rows, (i + 1) * rows)))
    return out


STRATEGIES = {  # name -> a builder (objective, tx) -> strategy
    "single": lambda o, tx: jaxpar.SingleDevice(o, tx),
    "dp": lambda o, tx: jaxpar.DataParallel(o, tx, device_ids=[0, 1, 2]),
    "dp_loss_on_device": lambda o, tx: jaxpar.DataParallel(o, tx, device_ids=[0, 1], loss_on_device=True),
    "ddp": lambda o, tx: jaxpar.DistributedDataParallel(o, tx, mesh=jaxpar.make_mesh(4), allreduce="ring",
                                                        bucket_cap_mb=0, batch_size=12),
    "zero1": lambda o, tx: jaxpar.ZeroRedundancy(o, tx, stage=1, mesh=jaxpar.make_mesh(4), batch_size=12),
    "zero2": lambda o, tx: jaxpar.ZeroRedundancy(o, tx, stage=2, mesh=jaxpar.make_mesh(4), batch_size=12),
    "zero3": lambda o, tx: jaxpar.ZeroRedundancy(o, tx, stage=3, mesh=jaxpar.make_mesh(4), batch_size=12),
}


def run(name: str, tx, dtype=None, data=None):
    """(initial params, [(params, opt_state, metrics) after each step]) of strategy `name` on TwoLeaves."""
    model = TwoLeaves(nnx.Rngs(0))
    objective = Objective.of(model, OutputLoss(mse_sum), compute_dtype=dtype)
    strategy = STRATEGIES[name](objective, tx)
    state = jaxpar.init_state(model, tx)
    placed, out = strategy.init(state), []
    for b in data or batches():
        placed, metrics = strategy.step(placed, strategy.put_batch(b))
        done = strategy.unplace(placed)
        out.append((leaves(done.params), done.opt_state, {k: float(v) for k, v in metrics.items()}))
    return leaves(state.params), out


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


ADAM = optax.adam(1e-2)


UNEVEN = batches(rows=10)  # 3 + 3 + 3 + 1 real rows on 4 devices: the devices' weights differ


@functools.lru_cache(maxsize=None)
def unscaled(name: str):
    return run(name, ADAM, data=UNEVEN)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_float32_scaled_backward_equals_unscaled(name):
    """The backward at seed S / 2**k (S = 2**12) and the gradient times its inverse: powers of two, so each
    strategy's parameters and Adam moments equal its unscaled run's to float32 rounding (XLA fuses a traced seed
    differently from a constant 1: an ulp here and there, which Adam's moments carry), and the metric reports S.
    A wrong seed or a missing unscale is off by a power of two."""
    init, plain = unscaled(name)
    _, scaled = run(name, loss_scaling(ADAM, initial_scale_power=12), data=UNEVEN)
    assert max(np.abs(a - b).max() for a, b in zip(plain[-1][0], init)) > 1e-3  # the steps move the weights
    for (p0, s0, m0), (p1, s1, m1) in zip(plain, scaled):
        assert m1["loss_scale"] == 2.0 ** 12 and "loss_scale" not in m0
        for a, b in zip(p0 + leaves(s0), p1 + leaves(loss_scale.find(s1).inner)):  # atol: sums of 1e3s cancel
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())


def test_a_missing_unscale_would_be_caught(monkeypatch):
    """The equality above can fail: without the division by the seed the update is not the unscaled one."""
    monkeypatch.setattr(loss_scale, "unscale", lambda grads, seed: grads)
    _, scaled = run("single", loss_scaling(optax.sgd(1e-3), static=2.0 ** 12))
    _, sgd = run("single", optax.sgd(1e-3))
    assert max(np.abs(a - b).max() for a, b in zip(scaled[0][0], sgd[0][0])) > 1e-2


@functools.lru_cache(maxsize=None)
def overflowing(name: str):
    """float16 from S = 2**4, hysteresis 1, each batch 12 copies of one row (every device's mean loss is the
    batch's). At seed 1, the largest float16 gradient of `a` per row: 8.1e4 and 1.4e5 in steps 1-2 (targets off by
    30), 3.4e3 and 2.1e3 in steps 3-4; `b`'s 1000 times less. The backward runs at about 0.75 S per row (S / 16
    for 12 rows): `a` overflows float16 (65504) at S = 16 and 8, then not at 4; `b` never does."""
    tx = loss_scaling(optax.adam(1e-4), initial_scale_power=4, hysteresis=1)  # a's 1000x moves the outputs 0.1
    return run(name, tx, jnp.float16, batches(steps=4, same=True, errors=[30.0, 30.0, 0.5, 0.5]))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_float16_overflow_skips_the_step_everywhere_then_halves_the_scale(name):
    init, steps = overflowing(name)
    scales = [m["loss_scale"] for _, _, m in steps]
    finite = [bool(np.isfinite(m["grad_norm"])) for _, _, m in steps]
    assert scales == [16.0, 8.0, 4.0, 4.0] and finite == [False, False, True, True]
    for params, state, _ in steps[:2]:  # skipped: every leaf unchanged (`b`'s too, whose gradient was finite:
        for a, b in zip(params, init):  # ZeRO's shards of it skip on the global norm), Adam's count unchanged
            np.testing.assert_array_equal(a, b)
        assert int(loss_scale.find(state).inner[0].count) == 0
    assert int(loss_scale.find(steps[-1][1]).inner[0].count) == 2
    _, ref = overflowing("single")
    for a, b, c in zip(steps[-1][0], ref[-1][0], init):  # then the same two updates as the single device's
        assert np.abs(b - c).max() > 1e-4
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_static_scale_skips_an_overflowing_step_and_stays(name):
    """DeepSpeed's fp16 optimizers check every step for an overflow whichever scaler they hold (torch's GradScaler
    skips every inf step): at a static S = 16 the two steps of `overflowing`'s batches that overflow leave every
    leaf and Adam's count where they were (applied, they made the weights NaN), S stays 16, and the two clean
    steps then move the weights as the single device's do."""
    def static(name):
        return run(name, loss_scaling(optax.adam(1e-4), static=16.0), jnp.float16,
                   batches(steps=4, same=True, errors=[30.0, 30.0, 0.5, 0.5]))

    init, steps = static(name)
    assert [m["loss_scale"] for _, _, m in steps] == [16.0] * 4
    assert [bool(np.isfinite(m["grad_norm"])) for _, _, m in steps] == [False, False, True, True]
    for params, state, _ in steps[:2]:
        for a, b in zip(params, init):
            np.testing.assert_array_equal(a, b)
        assert int(loss_scale.find(state).inner[0].count) == 0
    assert int(loss_scale.find(steps[-1][1]).last_overflow) == 1  # steps 0 and 1 overflowed (DeepSpeed's count)
    assert int(loss_scale.find(steps[-1][1]).inner[0].count) == 2
    _, ref = static("single")
    for a, b, c in zip(steps[-1][0], ref[-1][0], init):
        assert np.isfinite(a).all() and np.abs(b - c).max() > 1e-4
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)


def tiny_mse(out, batch):
    loss, weight = mse_sum(out, batch)
    return loss * 1e-9, weight


def test_float16_scaling_keeps_gradients_that_underflow_without_it():
    """A loss times 1e-9: its float16 backward at seed 1 carries ~1e-9, below float16's smallest subnormal (6e-8),
    so unscaled float16 SGD leaves the weights where they were; at S = 2**20 the update is float32's, to float16's
    rounding."""
    model = TwoLeaves(nnx.Rngs(0))
    data = batches(steps=1)
    sgd = optax.sgd(1e6)

    def moved(tx, dtype):
        objective = Objective.of(model, OutputLoss(tiny_mse), compute_dtype=dtype)
        state = jaxpar.init_state(model, tx)
        new, _ = jaxpar.make_train_step(objective, tx)(state, data[0])
        return [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(jax.tree.leaves(new.params),
                                                                      jax.tree.leaves(state.params))]

    fp32, bare, scaled = moved(sgd, None), moved(sgd, jnp.float16), moved(loss_scaling(sgd, static=2.0 ** 20),
                                                                          jnp.float16)
    for f, z, s in zip(fp32, bare, scaled):
        assert f.max() > 1e-3 and np.count_nonzero(z) < z.size // 4
        np.testing.assert_allclose(s, f, rtol=0.02, atol=0.01 * f.max())  # float16's rounding


def test_tensor_parallel_scaled_backward_equals_unscaled():
    """tp on a tiny GPT (dropout on), 2 x 2 devices: the scaled run equals the unscaled one."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (jaxpar.DATA, jaxpar.TENSOR))
    cfg = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1, bias=True)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 16, (6, 9)).astype(np.int32) for _ in range(2)]
    data = [as_rows({"x": s[:, :-1], "y": s[:, 1:]}, np.arange(6 * i, 6 * i + 6)) for i, s in enumerate(seqs)]

    def train(tx):
        model = gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        tp = jaxpar.TensorParallel(model, tx, tensor_parallel=2, mesh=mesh)
        placed = tp.init(jaxpar.init_state(model, tx))
        for b in data:
            placed, metrics = tp.step(placed, tp.put_batch(b))
        return leaves(tp.unplace(placed).params), metrics

    plain, m0 = train(ADAM)
    scaled, m1 = train(loss_scaling(ADAM, initial_scale_power=10))
    assert float(m1["loss_scale"]) == 2.0 ** 10
    assert max(np.abs(a - b).max() for a, b in zip(plain, leaves(jaxpar.init_state(
        gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=1)), ADAM).params))) > 1e-3  # the steps move the weights
    for a, b in zip(plain, scaled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


class Stack(nnx.Module):
    """Four TwoLeaves layers (8 -> 8 -> 8 -> 8 -> 4) in `layers`, for the pipeline to cut; only the last one's `a`
    is amplified, so only the last stage's gradient overflows float16."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([TwoLeaves(rngs, 8, 8, gain=1.0) for _ in range(3)] + [TwoLeaves(rngs, 8, 4)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run_stack(tx, dtype=None, data=None, *, mesh: int = 0, **pipeline):
    """[(params, opt_state, metrics) after each step] of Stack under the pipeline (`pipeline`: its options, `mesh`
    its devices for data x pipeline) or, without options, the single device."""
    model = Stack(nnx.Rngs(0))
    state = jaxpar.init_state(model, tx)
    if pipeline:
        strategy = jaxpar.Pipeline(model, tx, loss_fn=OutputLoss(mse_sum), compute_dtype=dtype,
                                   mesh=pipeline_mesh(mesh, pipeline["num_stages"]) if mesh else None, **pipeline)
    else:
        strategy = jaxpar.SingleDevice(Objective.of(model, OutputLoss(mse_sum), compute_dtype=dtype), tx)
    placed, out = strategy.init(state), []
    for b in data or UNEVEN:
        placed, metrics = strategy.step(placed, strategy.put_batch(b))
        done = strategy.unplace(placed)
        out.append((leaves(done.params), done.opt_state, {k: float(v) for k, v in metrics.items()}))
    return leaves(state.params), out


PIPELINES = {  # 10 rows: with 2 replicas x 2 micro-batches, blocks of 3, 3, 3 and 1 real rows
    "1f1b": dict(num_stages=2, micro_batches=2),
    "zbh1": dict(num_stages=2, micro_batches=4, schedule="zbh1"),  # I and W apart
    "interleaved": dict(num_stages=2, micro_batches=2, schedule="interleaved", virtual_stages=2),
    "zbv-recompute": dict(num_stages=2, micro_batches=2, schedule="zbv", virtual_stages=2,
                          activation_checkpoint_interval=1),  # the last chunk on stage 0
    "data2-gpipe": dict(num_stages=2, micro_batches=2, schedule="gpipe", mesh=4),
    "data2-zero1": dict(num_stages=2, micro_batches=2, mesh=4, zero_stage=1),
}


CLIP = 0.05  # below every step's gradient norm in test_pipeline_scaled_backward_equals_unscaled


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_scaled_backward_equals_unscaled(name):
    """The last stage seeds every micro-batch's backward with the step's first micro-batch's seed, every stage's
    gradient carries it and their updates divide it out: the parameters, Adam's moments and the gradient norm equal
    the unscaled pipeline's. Not dividing is off by a power of two; so is seeding each micro-batch from its own
    weight where the weights differ (ZB-H1's micro-batches of 3, 3, 3 and 1 real rows; the replicas' blocks).
    A global-norm clip acts on every step, so the norm the stages feed it must be the unscaled gradient's too (fed
    the scaled one, it clips 4096x harder, and Adam's moments show it)."""
    tx = optax.chain(jaxpar.optim.clip_by_global_norm(CLIP), optax.adam(1e-3))
    init, plain = run_stack(tx, **PIPELINES[name])
    _, scaled = run_stack(loss_scaling(tx, initial_scale_power=12), **PIPELINES[name])
    assert max(np.abs(a - b).max() for a, b in zip(plain[-1][0], init)) > 1e-3  # the steps move the weights
    for (p0, s0, m0), (p1, s1, m1) in zip(plain, scaled):
        assert m1["loss_scale"] == 2.0 ** 12 and "loss_scale" not in m0
        assert m0["grad_norm"] > 2 * CLIP  # the clip acts
        np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-6)
        for a, b in zip(p0 + leaves(s0), p1 + leaves(loss_scale.find(s1).inner)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())


SEEDS = {  # 16 rows, SGD, a static S = 2**12; name -> (builder, the seed: S / 2**round(log2(w K)))
    "single": (lambda o, tx, m: jaxpar.SingleDevice(o, tx), 2.0 ** 12 / 16),  # w 16
    "ddp-accum2": (lambda o, tx, m: jaxpar.DistributedDataParallel(o, tx, mesh=jaxpar.make_mesh(4), grad_accum=2,
                                                                    batch_size=16), 2.0 ** 12 / 4),  # w 2, K 2
    "zero2-accum2": (lambda o, tx, m: jaxpar.ZeroRedundancy(o, tx, stage=2, mesh=jaxpar.make_mesh(4), grad_accum=2,
                                                            batch_size=16), 2.0 ** 12 / 4),
    "pipeline-D2-M4": (lambda o, tx, m: jaxpar.Pipeline(m, tx, loss_fn=OutputLoss(mse_sum), num_stages=2,
                                                        micro_batches=4, mesh=pipeline_mesh(4, 2)),
                       2.0 ** 12 / 8),  # 2 rows a replica per micro-batch, K = 4 micro-batches
}


@pytest.mark.parametrize("name", list(SEEDS))
def test_each_strategy_seeds_at_the_scale_over_the_weight_of_its_step(name, monkeypatch):
    """With the division by the seed taken out, one SGD step moves every weight by exactly seed times the unscaled
    step's move: the seed is S / 2**round(log2(w K)), w the loss weight per device of a micro-batch and K the
    micro-batches of the step (DeepSpeed divides each micro-batch's loss by gradient_accumulation_steps)."""
    from jaxpar.pipeline import optimizer as pipe_opt

    build, seed = SEEDS[name]
    data = batches(steps=1, rows=16)[0]

    def moved(tx):
        model = Stack(nnx.Rngs(0))
        state = jaxpar.init_state(model, tx)
        strategy = build(Objective.of(model, OutputLoss(mse_sum)), tx, model)
        placed, _ = strategy.step(strategy.init(state), strategy.put_batch(data))
        return [np.asarray(a) - np.asarray(b) for a, b in zip(leaves(strategy.unplace(placed).params),
                                                               leaves(state.params))]

    plain = moved(optax.sgd(1.0))  # a large step: the differences keep their digits
    monkeypatch.setattr(loss_scale, "unscale", lambda grads, seed: grads)
    monkeypatch.setattr(pipe_opt, "mean_scale", lambda vec, needs_norm: (
        1.0 / vec[1], {"global_norm": jnp.sqrt(vec[-2]) / vec[1]} if needs_norm else {}))
    kept = moved(loss_scaling(optax.sgd(1.0), static=2.0 ** 12))
    for a, b in zip(plain, kept):
        big = np.abs(a) > 1e-3 * np.abs(a).max()
        np.testing.assert_allclose(b[big] / a[big], seed, rtol=1e-4)


@pytest.mark.parametrize("name", ["1f1b", "zbh1", "data2-zero1"])
def test_pipeline_float16_overflow_skips_every_stage_as_the_single_device(name):
    """float16, as `overflowing`: the pipeline's stages skip the same steps as the single device (on the global norm,
    every leaf of every stage unchanged, Adam's count too), halve the scale alike, then take its updates."""
    tx = loss_scaling(optax.adam(1e-4), initial_scale_power=4, hysteresis=1)
    data = batches(steps=4, same=True, errors=[30.0, 30.0, 0.5, 0.5])
    init, ref = run_stack(tx, jnp.float16, data)
    _, steps = run_stack(tx, jnp.float16, data, **PIPELINES[name])
    for run_ in (ref, steps):
        assert [m["loss_scale"] for _, _, m in run_] == [16.0, 8.0, 4.0, 4.0]
        assert [bool(np.isfinite(m["grad_norm"])) for _, _, m in run_] == [False, False, True, True]
    for params, state, _ in steps[:2]:
        for a, b in zip(params, init):
            np.testing.assert_array_equal(a, b)
        assert int(loss_scale.find(state).inner[0].count) == 0
    assert int(loss_scale.find(steps[-1][1]).inner[0].count) == 2
    for a, b, c in zip(steps[-1][0], ref[-1][0], init):
        assert np.abs(b - c).max() > 1e-5
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)


@pytest.mark.parametrize("strategy,power", [("ddp", 20), ("pipeline", 21)])
def test_train_py_fp16_skips_overflowing_steps_and_stops_at_the_minimum_scale(tmp_path, strategy, power, capsys):
    """--precision fp16 on ddp (4 devices x 8 rows: seed S / 8) and on the pipeline (2 stages x 2 replicas, 4
    micro-batches of 4 rows a replica: S / 16, as DeepSpeed divides by the micro-batches; so from twice the S):
    from 2**power the steps overflow and halve the scale (hysteresis 1) until
    the backward fits, and after 3 clean steps it doubles again (window 3); the skipped steps are counted, logged as
    overflow events at DeepSpeed's scales, and their losses left out.
    With --min-loss-scale at the start the first overflow stops the run, in one line (DeepSpeed raises there)."""
    import json

    from jaxpar.config import Config
    from jaxpar.run import trainer

    common = dict(strategy=strategy, num_devices=4, model="mlp", dataset="synthetic", train_split="train[:256]",
                  eval_split="", batch_size=32, optimizer="adam", precision="fp16", quiet=True,
                  initial_scale_power=power, hysteresis=1, loss_scale_window=3, lr_schedule="cosine", warmup_steps=4)
    out = tmp_path / "m.jsonl"
    summary = trainer.run(Config(**common, steps=10, log_every=1, metrics_out=str(out)))
    events = [json.loads(line) for line in out.read_text().splitlines()]
    overflows = [e for e in events if e["event"] == "overflow"]
    assert 0 < summary["skipped_steps"] == len(overflows) < 8
    # a skipped step advances no schedule (Adam's count stays): the k-th applied step ran at the schedule's lr(k)
    lr_at, clean = trainer.learning_rate(Config(**common, steps=10), 8, 10), [e for e in events if e["event"] == "step"]
    np.testing.assert_allclose([e["lr"] for e in clean], [float(lr_at(k)) for k in range(len(clean))], rtol=1e-6)
    assert [e["lr"] for e in clean] != [float(lr_at(e["step"] - 1)) for e in clean]  # the step count would differ
    oracle, at = DeepSpeedScaler(2.0 ** power, 3, 1.0, 1, False), {}  # the scale each step ran at, by DeepSpeed
    for step in range(1, 11):
        at[step] = oracle.cur_scale
        oracle.update_scale(step in {e["step"] for e in overflows})
    assert [e["loss_scale"] for e in overflows] == [at[e["step"]] for e in overflows]
    assert all(e["loss_scale"] == at[e["step"]] for e in events if e["event"] == "step")  # the clean steps' too
    assert [e["step"] for e in overflows[:3]] == [1, 2, 3]  # the descent from 2**20, then (window 3) growth
    logged = {e["step"] for e in events if e["event"] == "step"}
    assert logged.isdisjoint(e["step"] for e in overflows) and len(logged) == 10 - len(overflows)
    assert all(np.isfinite(a).all() for a in leaves(summary["state"].params))
    capsys.readouterr()
    dynamic_only = ("initial_scale_power", "hysteresis", "loss_scale_window")  # a static scale refuses them
    static = trainer.run(Config(**{**{k: v for k, v in common.items() if k not in dynamic_only},
                                   "loss_scale": 2.0 ** 40, "warmup_steps": 0}, steps=3))  # all overflow
    assert static["skipped_steps"] == 3  # skipped, not applied (they left NaN weights, and a message blaming --lr)
    assert "3 of 3 steps overflowed at the static --loss-scale 1.09951e+12 and were skipped" in capsys.readouterr().err
    assert all(np.isfinite(a).all() for a in leaves(static["state"].params))
    stop = re.escape(f"overflowed at step 1 at the minimum loss scale {2.0 ** power:g}")
    with pytest.raises(trainer.Diverged, match=stop):
        trainer.run(Config(**{**common, "min_loss_scale": 2.0 ** power, "warmup_steps": 0}, steps=2))


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_scale": 1e39}, "loss_scale=1e+39 must be 0 (dynamic) or a scale > 0 that float32 holds"),
    ({"loss_scale": 128.0, "hysteresis": 1, "min_loss_scale": 4.0},
     "hysteresis=1, min_loss_scale=4.0 set(s) the dynamic scaler, but loss_scale=128.0 is a fixed scale")])
def test_a_config_that_float32_or_a_static_scale_cannot_honour_is_refused(kwargs, message):
    """A static scale above float32's largest (it would be inf: every step skipped, the run's loss NaN), or the
    dynamic scaler's settings beside a static scale (read by nothing), are refused in one line; a static scale at
    float32's largest, and one alone, are taken."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LossScaleConfig(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        loss_scaling(optax.sgd(0.1), **{("static" if k == "loss_scale" else k): v for k, v in kwargs.items()})
    assert LossScaleConfig(loss_scale=float(np.finfo(np.float32).max)).loss_scale > 3e38
    assert not LossScaleConfig(loss_scale=128.0).dynamic


def test_pipeline_scaled_sgd_step_divides_the_seed_out(name="1f1b"):
    """(QA59) With plain SGD -- no clip, no Adam, which are blind to a constant factor -- a static scale's step equals
    the unscaled step: every stage's update (ZeRO-1's too) divides the seed out, else the step is seed times longer."""
    init, plain = run_stack(optax.sgd(1e-3), data=UNEVEN[:1], **PIPELINES[name])
    _, scaled = run_stack(loss_scaling(optax.sgd(1e-3), static=2.0 ** 12), data=UNEVEN[:1], **PIPELINES[name])
    assert max(np.abs(a - b).max() for a, b in zip(plain[0][0], init)) > 1e-4  # the step moves the weights
    for a, b in zip(plain[0][0], scaled[0][0]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())


@pytest.mark.parametrize("name", ["single", "dp", "ddp", "zero1", "zero3"])
@pytest.mark.parametrize("tx, where", [
    (optax.chain(optax.scale_by_adam(), loss_scaling(optax.sgd(1e-3))), "opt_state[1]"),  # Adam's moments went NaN
    (optax.chain(loss_scaling(optax.adam(1e-3)), optax.add_decayed_weights(0.1)), "opt_state[0]"),  # decay moved
    (optax.MultiSteps(loss_scaling(optax.adam(1e-3)), 2).gradient_transformation(), "opt_state.inner_opt_state")])
def test_a_loss_scaler_inside_the_optimizer_is_refused_at_init(name, tx, where):
    """A scaler around part of the optimizer skips only that part: the transforms outside it ran on a skipped step's
    inf gradients (Adam ahead of it kept NaN moments for good; weight decay after it moved the weights of a step
    reported as skipped). Refused in one line at the strategy's init, before any step, naming where it sits."""
    model = TwoLeaves(nnx.Rngs(0))
    strategy = STRATEGIES[name](Objective.of(model, OutputLoss(mse_sum), compute_dtype=jnp.float16), tx)
    with pytest.raises(ValueError, match=re.escape(f"wraps only part of the optimizer (its state is {where})")):
        strategy.init(jaxpar.init_state(model, tx))
    with pytest.raises(ValueError, match="jaxpar.loss_scaling\\(optax.chain\\(...\\)\\), outermost"):
        loss_scale.wraps(tx, {"w": jnp.zeros(3)})  # the pipeline's and ZeRO's check at construction


@pytest.mark.parametrize("kwargs, message", [
    ({"initial_scale_power": 2.5}, "initial_scale_power=2.5 must be a whole number"),  # 2**2.5: no power of two
    ({"loss_scale_window": 2.5}, "loss_scale_window=2.5 must be a whole number"),
    ({"hysteresis": True}, "hysteresis=True must be a whole number"),
    ({"consecutive_hysteresis": "no"}, "consecutive_hysteresis='no' must be True or False")])  # 'no' read as True
def test_a_setting_of_the_wrong_kind_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LossScaleConfig(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        loss_scaling(optax.sgd(0.1), **kwargs)
    assert LossScaleConfig(initial_scale_power=np.int64(12), hysteresis=1.0).initial_scale_power == 12


def test_torch_grad_scalers_names_are_refused_naming_deepspeeds():
    """torch.amp.GradScaler(init_scale=, growth_factor=, growth_interval=) written against jaxpar.loss_scaling got
    Python's "unexpected keyword argument"; now one line names each and what jaxpar takes instead."""
    with pytest.raises(ValueError, match=re.escape("init_scale=0, growth_factor=1.0: torch.amp.GradScaler's")) as e:
        loss_scaling(optax.sgd(0.1), init_scale=0, growth_factor=1.0)
    assert "initial_scale_power=p" in str(e.value) and "scale_factor is 2" in str(e.value)
    with pytest.raises(ValueError, match="loss_scale_window=N for growth_interval"):
        loss_scaling(optax.sgd(0.1), growth_interval=2000)
