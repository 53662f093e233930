"""The pipeline equals single-device training: loss, gradients, parameters and optimizer state after 3 steps
(float32, rtol 1e-5), for every schedule over S in {1, 2, 4} x M in {1, 2, 4, 8} on an MLP stack, a few points
on the ConvNet and AlexNet, hybrid data x pipeline (DeepSpeed's figure: 2 x 2, 8 micro-batches) and 2 processes
x 2 devices; the activation buffers measured in the program hold min(S, M) micro-batches on stage 0 under 1F1B
and M under GPipe.

This file is also the worker of the multi-process case: `python tests/test_pipeline.py worker OUT`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
RTOL = 1e-5


def stack_problem():
    """(model, tx, batch): an 8-layer MLP stack with dropout, adam, 16 samples; the same in every process."""
    import optax
    from flax import nnx

    from jaxpar.models.layers import Dropout, Linear, ReLU
    from jaxpar.models.nets import Layered

    class Stack(Layered):
        def __init__(self, rngs):
            self.layers = nnx.List([Linear(6, 16, rngs=rngs), ReLU(), Dropout(0.3, salt=1), Linear(16, 16, rngs=rngs),
                                    ReLU(), Linear(16, 12, rngs=rngs), ReLU(), Linear(12, 5, rngs=rngs)])

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.integers(0, 5, 16).astype(np.int32),
             "idx": np.arange(100, 116, dtype=np.int32)}
    return Stack(nnx.Rngs(0)), optax.adam(1e-2), batch


def image_problem(name: str, batch_size: int):
    import optax

    from jaxpar import models

    rng = np.random.default_rng(1)
    shape = models.input_shape(name)
    batch = {"x": rng.normal(size=(batch_size, *shape)).astype(np.float32),
             "y": rng.integers(0, 10, batch_size).astype(np.int32), "idx": np.arange(batch_size, dtype=np.int32)}
    # SGD, not Adam: Adam's step ~ g / |g| turns rounding-level differences in near-zero gradient entries of the
    # convolutions into full-size steps, so 3 steps drift apart at 1e-3; SGD's step is proportional to g.
    # AlexNet: no momentum (no optimizer state next to its 57M weights).
    tx = optax.sgd(0.01, momentum=0.9 if name == "convnet" else None)
    return random_model(name, rng), tx, batch


def random_model(name: str, rng):
    """Model `name` with numpy-drawn weights U(+-1/sqrt(fan_in)) (AlexNet's 57M in a second, not JAX's eager
    init's many compiles); XLA's convolution, which compiles faster on CPU than im2col."""
    import jax
    from flax import nnx

    from jaxpar import models

    graphdef, state = nnx.split(models.abstract(name, num_classes=10, conv_impl="xla"))
    leaves, treedef = jax.tree.flatten(state)
    bound = lambda s: 1 / np.sqrt(np.prod(s[:-1]) if len(s) > 1 else s[0])  # noqa: E731
    leaves = [rng.uniform(-bound(a.shape), bound(a.shape), a.shape).astype(np.float32) for a in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def reference(model, tx, batch, steps=STEPS):
    """Single-device training on the full batch: per step (loss, gradients), then the final state."""
    import jax

    from jaxpar.step import apply_updates, grad_of_sum, init_state

    graphdef, state = init_state(model, tx)

    @jax.jit
    def step(state, batch):
        (_, aux), grads = grad_of_sum(graphdef, state.params, batch, state.key, state.step)
        grads = jax.tree.map(lambda g: g / aux["count"], grads)
        return apply_updates(tx, state, grads), aux["loss_sum"] / aux["count"], grads

    init, out = state, []
    for _ in range(steps):
        state, loss, grads = step(state, batch)
        out.append((float(loss), grads))
    return init, out, state


def run_pipeline(model, tx, state, batch, num_stages, micro_batches, schedule, virtual_stages=1, data=1,
                 partition_method="parameters", steps=STEPS, checkpoint_interval=0):
    from jaxpar.strategies.pipeline import Pipeline, PipelineModule, pipeline_mesh

    pm = PipelineModule.from_model(model, num_stages, virtual_stages=virtual_stages, verbose=False,
                                   partition_method=partition_method,
                                   activation_checkpoint_interval=checkpoint_interval)
    strategy = Pipeline(pm, tx, mesh=pipeline_mesh(num_stages * data, num_stages), schedule=schedule,
                        micro_batches=micro_batches)
    placed, pb, out = strategy.init(state), strategy.put_batch(batch), []
    for _ in range(steps):
        placed, metrics, flat = strategy.step_with_grads(placed, pb)
        out.append((float(metrics["loss"]), flat))
    return strategy, out, strategy.unplace(placed)


def assert_close(a, b):
    """Every leaf equal to rtol 1e-5, with an absolute floor of 1e-5 x the leaf's largest magnitude (entries
    near zero carry the rounding of sums taken in another order)."""
    import jax

    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL * float(np.abs(y).max(initial=0.0)))


def check_equal(strategy, out, final, ref):
    """Loss and gradients at every step, then params and optimizer state (the canonical trees) after the last."""
    import jax

    init, ref_steps, ref_final = ref
    for (loss, flat), (ref_loss, ref_grads) in zip(out, ref_steps):
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
        norms = np.abs(np.asarray(flat)).reshape(strategy.module.num_stages, -1).sum(1)
        holds = strategy.module.to_flat(jax.tree.leaves(ref_grads)).reshape(len(norms), -1).any(1)
        assert (norms[holds] > 0).all(), norms  # every stage with weights ran its backward passes
        assert_close(strategy.canonical(flat), ref_grads)
    assert_close(final.params, ref_final.params)
    assert_close(final.opt_state, ref_final.opt_state)
    assert int(final.step) == STEPS


@pytest.fixture(scope="module")
def stack():
    model, tx, batch = stack_problem()
    return model, tx, batch, reference(model, tx, batch)


def test_the_sides_differ(stack):
    """What the equivalence combines really differs, so a pipeline dropping a micro-batch, a dropout mask or a
    step's update would fail it (and check_equal asserts on every run that each stage holding weights sends a
    non-zero gradient)."""
    import jax

    from jaxpar.step import init_state, loss_terms

    model, tx, batch, (state, ref_steps, _) = stack
    graphdef, _ = init_state(model, tx)
    grad = jax.jit(lambda b, train: jax.grad(
        lambda p: loss_terms(graphdef, p, b, state.key, state.step, train=train)[0])(state.params), static_argnums=1)
    halves = [jax.tree.leaves(grad({k: v[rows] for k, v in batch.items()}, True)) for rows in (slice(0, 8),
                                                                                                slice(8, 16))]
    assert all(np.abs(x - y).max() > 1e-3 for x, y in zip(*halves))  # micro-batch gradients differ
    no_dropout = jax.tree.leaves(grad(batch, False))
    assert max(np.abs(x - y).max() for x, y in zip(no_dropout, jax.tree.leaves(grad(batch, True)))) > 1e-3
    first, second = (jax.tree.leaves(g) for _, g in ref_steps[:2])
    assert max(np.abs(x - y).max() for x, y in zip(first, second)) > 1e-4  # the steps move the parameters


GRID = [(S, M, sch) for S in (1, 2, 4) for M in (1, 2, 4, 8) for sch in ("gpipe", "1f1b", "interleaved")]


@pytest.mark.parametrize("num_stages,micro_batches,schedule", GRID)
def test_stack_equals_single_device(stack, num_stages, micro_batches, schedule):
    from jaxpar.pipeline import schedule as schedule_lib
    from jaxpar.pipeline.engine import lower

    model, tx, batch, ref = stack
    V = 2 if schedule == "interleaved" else 1
    plan = lower(schedule_lib.make(schedule, num_stages, micro_batches, V))
    same_as_1f1b = np.array_equal(plan.table, lower(schedule_lib.one_f_one_b(num_stages, micro_batches)).table)
    if schedule == "gpipe" and same_as_1f1b:
        return  # S = 1 or M = 1: the same table as 1F1B, so the same program, which the 1f1b case runs
    strategy, out, final = run_pipeline(model, tx, ref[0], batch, num_stages, micro_batches, schedule, V,
                                        partition_method="uniform" if V > 1 else "parameters")
    check_equal(strategy, out, final, ref)
    live = strategy.report()["measured_live_activations"]
    assert live == list(strategy.plan.act_slots)  # the slot plan is tight: every buffer slot gets used
    if V == 1:  # stage 0 keeps its inputs until their backward: 1F1B min(S, M), GPipe M
        assert live[0] == schedule_lib.peak_inflight(strategy.schedule)[0]
        assert live[0] == (micro_batches if schedule == "gpipe" else min(num_stages, micro_batches))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_hybrid_two_data_by_two_stages_eight_micro_batches(stack, schedule):
    """DeepSpeed's tutorial figure: 2-way data parallel x 2-stage pipeline, 8 micro-batches, 4 devices."""
    model, tx, batch, ref = stack
    strategy, out, final = run_pipeline(model, tx, ref[0], batch, 2, 8, schedule, data=2)
    assert dict(strategy.mesh.shape) == {"data": 2, "pipe": 2}
    check_equal(strategy, out, final, ref)


def test_uneven_batch_is_padded_and_masked_with_activation_checkpoints(stack):
    """13 rows, 2 replicas x 4 micro-batches: padded to 16 with w = 0, the result is the 13-row mean; inside
    each stage the backward keeps only every 2nd layer's input (activation_checkpoint_interval=2)."""
    model, tx, batch, _ = stack
    batch = {k: v[:13] for k, v in batch.items()}
    ref = reference(model, tx, batch)
    strategy, out, final = run_pipeline(model, tx, ref[0], batch, 2, 4, "1f1b", data=2, checkpoint_interval=2)
    assert strategy.put_batch(batch)["x"].shape == (16, 6)
    check_equal(strategy, out, final, ref)


@pytest.mark.parametrize("num_stages,micro_batches,schedule,data", [(2, 4, "interleaved", 1), (2, 8, "1f1b", 2)])
def test_convnet_equals_single_device(num_stages, micro_batches, schedule, data):
    model, tx, batch = image_problem("convnet", 8)
    ref = reference(model, tx, batch)
    V = 2 if schedule == "interleaved" else 1
    strategy, out, final = run_pipeline(model, tx, ref[0], batch, num_stages, micro_batches, schedule, V, data)
    check_equal(strategy, out, final, ref)


def test_alexnet_equals_single_device():
    model, tx, batch = image_problem("alexnet", 4)
    ref = reference(model, tx, batch)
    strategy, out, final = run_pipeline(model, tx, ref[0], batch, 2, 2, "gpipe")
    assert strategy.module.bounds == [0, 19, 22]  # features + classifier.1 (37.7M) | classifier.4 (16.8M), .6
    check_equal(strategy, out, final, ref)


def test_layer_specs_train_like_the_model_they_build(stack):
    """A PipelineModule of LayerSpecs, each stage's layers built where they live (init_fresh), trains exactly
    like a model holding the same layers built whole; its canonical tree is {layer index: layer state}."""
    import jax
    import optax
    from flax import nnx

    from jaxpar.strategies.pipeline import LayerSpec, Pipeline, PipelineModule, pipeline_mesh
    from jaxpar.models.layers import Dropout, Linear, ReLU
    from jaxpar.models.nets import Layered

    _, _, batch, _ = stack
    specs = [LayerSpec(Linear, 6, 16), LayerSpec(ReLU), LayerSpec(Dropout, 0.3, salt=1), LayerSpec(Linear, 16, 12),
             LayerSpec(ReLU), LayerSpec(Linear, 12, 5)]

    class Whole(Layered):
        def __init__(self):
            self.layers = nnx.List([spec.build(seed=7, index=i) for i, spec in enumerate(specs)])

    tx = optax.sgd(0.1, momentum=0.9)
    strategy = Pipeline(PipelineModule(specs, 2, seed=7, verbose=False), tx, mesh=pipeline_mesh(2, 2),
                        schedule="1f1b", micro_batches=4)
    placed, pb = strategy.init_fresh(seed=0), strategy.put_batch(batch)
    _, ref_steps, ref_final = reference(Whole(), tx, batch)
    for loss, _ in ref_steps:
        placed, metrics = strategy.step(placed, pb)
        np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=RTOL)
    final = strategy.unplace(placed)
    assert sorted(final.params.keys()) == [0, 3, 5]
    assert_close(jax.tree.leaves(final.params), jax.tree.leaves(ref_final.params))


def test_report_and_errors(stack):
    import optax

    from jaxpar.strategies.pipeline import Pipeline, PipelineModule, pipeline_mesh

    model, tx, batch, _ = stack
    with pytest.raises(ValueError, match=r"num_devices=3 must be a multiple of num_stages=2"):
        pipeline_mesh(3, 2)
    with pytest.raises(ValueError, match=r"num_stages x virtual_stages=9 parts cannot be cut from 8 layers"):
        PipelineModule.from_model(model, 9, verbose=False)
    pm = PipelineModule.from_model(model, 2, verbose=False)
    with pytest.raises(ValueError, match="virtual_stages=2 needs model chunks"):
        Pipeline(PipelineModule.from_model(model, 2, virtual_stages=2, verbose=False), tx,
                 mesh=pipeline_mesh(2, 2), schedule="1f1b")
    with pytest.raises(ValueError, match="not elementwise"):
        Pipeline(pm, optax.adafactor(1e-3, min_dim_size_to_factor=4), mesh=pipeline_mesh(2, 2))
    strategy = Pipeline(pm, tx, mesh=pipeline_mesh(4, 2), schedule="1f1b", micro_batches=4)
    assert "2 stages x 2 data replicas, schedule 1f1b (4 micro-batches)" in strategy.describe()
    report = strategy.report()
    assert report["bubble_fraction"] == pytest.approx(1 / 5)  # (S-1) / (M+S-1)
    assert report["peak_inflight"] == [2, 1] and "stage 1: layers" in report["partition"]


# -- 2 processes x 2 devices: the pipe axis crosses the process boundary ---------------------------------------

MP_CASES = [(4, 1), (2, 2)]  # (stages, data replicas) over 4 devices; PIPE is the outer mesh axis


def worker(out: str) -> None:
    from jaxpar.run import distributed
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(2)
    distributed.initialize()
    import jax

    from jaxpar.step import init_state

    rank, nproc = jax.process_index(), jax.process_count()
    model, tx, batch = stack_problem()
    _, state = init_state(model, tx)
    results = {}
    for S, D in MP_CASES:
        from jaxpar.strategies.pipeline import Pipeline, PipelineModule, pipeline_mesh

        mesh = pipeline_mesh(4, S)
        assert {d.process_index for d in mesh.devices[0, :]} == {0, 1}  # one replica's stages span both processes
        strategy = Pipeline(PipelineModule.from_model(model, S, verbose=False), tx, mesh=mesh, micro_batches=4)
        placed = strategy.init(state)
        pb = strategy.put_batch({k: v[rank::nproc] for k, v in batch.items()})  # DistributedSampler's rows
        for i in range(STEPS):
            placed, metrics = strategy.step(placed, pb)
            results[f"loss_{S}_{i}"] = float(metrics["loss"])
        for i, a in enumerate(jax.tree.leaves(strategy.unplace(placed).params)):
            results[f"param_{S}_{i}"] = np.asarray(a)
    np.savez(f"{out}.rank{rank}.npz", **results)
    print(f"process {rank}/{nproc} devices={jax.device_count()} done", flush=True)


def test_two_processes_pipe_across_the_process_boundary(tmp_path, stack):
    import jax

    model, tx, batch, (_, ref_steps, ref_final) = stack
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", "2", "--term-timeout", "3", __file__,
           "worker", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "process 1/2 devices=4 done" in proc.stdout, proc.stdout
    ref_leaves = jax.tree.leaves(ref_final.params)
    for rank in range(2):
        got = np.load(tmp_path / f"out.rank{rank}.npz")
        for S, _ in MP_CASES:
            np.testing.assert_allclose([got[f"loss_{S}_{i}"] for i in range(STEPS)], [l for l, _ in ref_steps],
                                       rtol=RTOL)
            for i, a in enumerate(ref_leaves):
                np.testing.assert_allclose(got[f"param_{S}_{i}"], np.asarray(a), rtol=RTOL, atol=1e-6)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[2])
