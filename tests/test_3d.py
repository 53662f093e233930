"""3-D parallelism -- data x pipeline x Megatron tensor -- equals the single-device step: a tiny GPT-2
(jaxpar.models.gpt, dropout on, tied wte) trained 3 steps with Adam by `Pipeline(..., tensor_parallel=T)` on
D x S x T = 2 x 2 x 2 (all 8 simulated devices, 1F1B) and 1 x 2 x 2 (interleaved, 2 chunks per stage) has the
single step's parameters and optimizer state at float32 rtol 1e-5. First the comparison is shown able to fail:
the parameters moved, and the same split without the qkv column re-order differs. The compiled stage functions
hold Megatron's all-reduces (two per block each way, within the tensor groups only), the devices follow
Megatron's order, the tied wte is split by vocabulary rows on both stages that hold it (Megatron's
VocabParallelEmbedding, its gradient summed across the stages slice by slice), and bad combinations are refused
with one line before any work. With Megatron's sequence parallelism (activations between stages split by tokens
over `tensor`) 1F1B and ZB-V equal the single step, and the loss runs on vocabulary-split logits throughout. Across
2 processes x 4 devices (2 x 2 x 2, a stage per process: activations and the tied wte's row slices move by gloo),
1F1B, interleaved and 1F1B with sequence parallelism equal the single step too.

This file is also the worker of the two-process case: `python tests/test_3d.py worker OUT`.
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.mesh import DATA, PIPE, TENSOR
from jaxpar.pipeline.stage import split_float
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.strategies.pipeline import Pipeline, pipeline_mesh
from jaxpar.strategies.tensor import Layout, tensor_all_reduces

import two_processes  # noqa: E402  (tests/)

FAST = {"xla_backend_optimization_level": 0}  # both sides: these models run in ms, compiling is the cost
CFG = dict(vocab_size=24, block_size=6, n_layer=2, n_head=4, n_embd=16, dropout=0.2)
# Adam's eps well above the float32 noise of gradients that are 0 in exact arithmetic (the k bias: softmax ignores
# it): with eps=1e-8 any summation order turns their ~1e-11 into +-lr updates, whatever the strategy
TX = optax.adam(1e-2, eps=1e-4)
STEPS, ROWS, RTOL, ATOL = 3, 8, 1e-5, 1e-6
LOSS = jaxpar.OutputLoss(jaxpar.cross_entropy)


def model(**kw) -> GPT:
    return GPT(GPTConfig(**{**CFG, **kw}), rngs=nnx.Rngs(params=0, dropout=1))


@functools.lru_cache(maxsize=None)
def batch():
    x = np.random.default_rng(0).integers(0, CFG["vocab_size"], (ROWS, CFG["block_size"] + 1)).astype(np.int32)
    return {"x": x[:, :-1], "y": x[:, 1:]}


@functools.lru_cache(maxsize=None)
def reference():
    """(initial state, the state after STEPS single-device steps, the last step's metrics)."""
    objective, state = jaxpar.Objective.of(model(), LOSS), jaxpar.init_state(model(), TX)
    step = jax.jit(lambda s, rows: jaxpar.train_step(objective, TX, s, rows), compiler_options=FAST)
    out = state
    for _ in range(STEPS):
        out, metrics = step(out, jaxpar.as_rows(batch()))
    return state, out, metrics


@functools.lru_cache(maxsize=None)
def run(D: int, S: int, T: int, schedule: str = "1f1b", canonical_qkv: bool = False, sequence_parallel=False,
        zero_stage: int = 0, zero_reduce: str = "reduce_scatter", defer_wgrad: bool = False):
    """(pipeline, its state after STEPS steps as the canonical TrainState, the last placed state and batch, the
    last step's metrics)."""
    pipe = Pipeline(model(), TX, loss_fn=LOSS, num_stages=S, micro_batches=2, schedule=schedule,
                    virtual_stages=2 if schedule in ("interleaved", "zbv") else 1, tensor_parallel=T,
                    sequence_parallel=sequence_parallel, mesh=pipeline_mesh(D * S * T, S, T), compiler_options=FAST,
                    zero_stage=zero_stage, zero_reduce=zero_reduce, defer_wgrad=defer_wgrad)
    if canonical_qkv:  # the same split, each rank taking columns as they come: q of some heads, k of others
        pipe.module.tensor_layouts = [Layout(lay.axis) for lay in pipe.module.tensor_layouts]
    placed = pipe.init(reference()[0])
    for _ in range(STEPS):
        placed, metrics = pipe.step(placed, batched := pipe.put_batch(batch()))
    assert float(metrics["samples"]) == ROWS
    return pipe, pipe.unplace(placed), placed, batched, metrics


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_comparison_can_fail():
    """The steps move the weights far beyond the tolerance, and a wrong layout (no qkv re-order) lands elsewhere."""
    state, ref, _ = reference()
    assert max_diff(state.params, ref.params) > 1e-3
    _, wrong, _, _, _ = run(2, 2, 2, canonical_qkv=True)  # the compiled functions are those of the right layout
    assert max_diff(wrong.params, ref.params) > 1e-4


@pytest.mark.parametrize("D,S,T,schedule", [(2, 2, 2, "1f1b"), (1, 2, 2, "interleaved")])
def test_3d_equals_the_single_step(D, S, T, schedule):
    pipe, out, placed, _, metrics = run(D, S, T, schedule)
    _, ref, single = reference()
    assert_equal(out.params, ref.params)
    assert_equal(out.opt_state, ref.opt_state)
    for name in ("loss", "accuracy", "grad_norm"):  # the last stage's loss on vocabulary-split logits
        np.testing.assert_allclose(metrics[name], single[name], rtol=RTOL, err_msg=name)
    assert "logits split by vocabulary into the loss" in pipe.describe()
    split = next(a for a in placed.params[0] if not a.sharding.is_fully_replicated)
    assert {s.data.shape for s in split.addressable_shards} != {split.shape}  # each rank holds a slice
    mod = pipe.module  # the tied wte, on the first and last stage: Megatron's vocabulary rows, V / T per rank
    j = mod.param_paths.index(("wte", "embedding"))
    assert sorted(mod.tied[j]) == [0, S - 1]
    for s in (0, S - 1):
        wte = placed.params[s][mod.stage_params[s].index(j)]
        assert {a.data.shape for a in wte.addressable_shards} == {(CFG["vocab_size"] // T, CFG["n_embd"])}
    assert f"D x S x T = {D} x {S} x {T}" in pipe.describe()
    assert pipe.report()["tensor_parallel"] == T


class Doubled(GPT):
    """A GPT whose __call__ is NOT its layers in turn: the logits doubled."""

    def __call__(self, idx_BxT):
        return 2 * super().__call__(idx_BxT)


def test_3d_checks_that_the_layers_are_the_model():
    """The pipeline runs the model's `layers`, not its __call__; under 3-D too it checks on the first batch that
    the two agree, on the objective's unsplit model (jaxpar's GPT passes: the tests above), and refuses one where
    they do not."""
    bad = Doubled(GPTConfig(**CFG), rngs=nnx.Rngs(params=0, dropout=1))
    assert max_diff(bad(jnp.asarray(batch()["x"])), model()(jnp.asarray(batch()["x"]))) > 1e-2  # really differ
    pipe = Pipeline(bad, TX, loss_fn=LOSS, num_stages=2, micro_batches=2, tensor_parallel=2,
                    mesh=pipeline_mesh(4, 2, 2), compiler_options=FAST)
    pipe.init(jaxpar.init_state(bad, TX))
    with pytest.raises(ValueError, match=r"`layers` one after another instead of Doubled.__call__, but the two "
                                         r"differ \(outputs differ by up to"):
        pipe.put_batch(batch())


@pytest.mark.parametrize("D,S,T,schedule", [(2, 2, 2, "1f1b"), (1, 2, 2, "zbv")])
def test_3d_sequence_parallel_equals_the_single_step(D, S, T, schedule):
    """Megatron's sequence parallelism inside the 3-D pipeline: between the split regions, and across the stage
    boundaries, each tensor rank holds its tokens (stage 0's output is sent as [rows / D, tokens / T, C] a device);
    the replicated leaves' gradients (LayerNorms, wpe, row biases) are summed over `tensor`. With dropout on, the
    parameters, optimizer state, loss and accuracy equal the single step's."""
    pipe, out, placed, batched, metrics = run(D, S, T, schedule, sequence_parallel=True)
    _, ref, single = reference()
    assert_equal(out.params, ref.params)
    assert_equal(out.opt_state, ref.opt_state)
    for name in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(metrics[name], single[name], rtol=RTOL, err_msg=name)
    assert "sequence parallel" in pipe.describe()
    fns, engine = pipe._last[1].fns[0], pipe.engine
    params = [placed.params[0][i] for i in engine._stage_pos(0, fns.pidx)]
    state = [placed.model_state[0][i] for i in engine._stage_pos(0, fns.sidx, state=True)]
    y = fns.forward(params, state, None, batched.stages[0][0], pipe.transport.put(jnp.int32(0), 0))[0]
    rows = ROWS // 2  # a micro-batch
    assert y.shape == (rows, CFG["block_size"], CFG["n_embd"])
    assert {a.data.shape for a in y.addressable_shards} == {(rows // D, CFG["block_size"] // T, CFG["n_embd"])}


def test_3d_with_deferred_weight_gradients_equals_the_single_step():
    """defer_wgrad under D x S x T = 2 x 2 x 2 with sequence parallelism: each device's W's at the flush in one
    call over its micro-batches' rows joined (its slices of the weights, its tokens of the activations), equal to
    the single step."""
    pipe, out, _, _, metrics = run(2, 2, 2, "1f1b", sequence_parallel=True, defer_wgrad=True)
    _, ref, single = reference()
    assert_equal(out.params, ref.params)
    assert_equal(out.opt_state, ref.opt_state)
    np.testing.assert_allclose(metrics["loss"], single["loss"], rtol=RTOL)
    assert pipe.report()["wgrad_joined"] == [True, True] and pipe.schedule.name == "1f1b+dw"


@pytest.mark.parametrize("sequence_parallel,reduce", [(False, "reduce_scatter"), (True, "reduce_scatter"),
                                                      (True, "all_reduce")])
def test_3d_with_zero_1_equals_the_single_step(sequence_parallel, reduce):
    """Data x pipeline x tensor with ZeRO-1 (Megatron's distributed optimizer under PP and TP): on each tensor
    rank, its slices of a stage's weights are one flat vector and each Adam moment is split over the D replicas,
    [T, D S] on the stage's (data, tensor) mesh; each replica's block of the gradient is reduce-scattered to it
    (the tied wte's slices summed across the two stages first) or cut from the all-reduced gradient; the
    parameters, the canonical optimizer state and the metrics (the gradient norm too) equal the single step's."""
    D, S, T = 2, 2, 2
    pipe, out, placed, _, metrics = run(D, S, T, sequence_parallel=sequence_parallel, zero_stage=1,
                                        zero_reduce=reduce)
    assert pipe.engine.scatter == (reduce == "reduce_scatter") and len(pipe.module.tied) == 1
    _, ref, single = reference()
    assert_equal(out.params, ref.params)
    assert_equal(out.opt_state, ref.opt_state)
    for name in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(metrics[name], single[name], rtol=RTOL, err_msg=name)
    for s in range(S):
        zero = pipe.engine.zero[s]
        mod = pipe.module
        whole = sum(int(np.prod(mod.param_specs[j].shape)) for j in mod.stage_params[s])
        local = sum(int(np.prod(info.shape)) for info in zero.plan.leaves)
        assert local < whole  # the plan covers one tensor rank's slices
        mu = placed.opt_state[s][0].mu["shard"]
        assert mu.shape == (T, D * zero.plan.shard_size) and zero.plan.shard_size == -(-local // D)
        assert mu.sharding.spec == jax.sharding.PartitionSpec("tensor", "data")
        assert {b.data.shape for b in mu.addressable_shards} == {(1, zero.plan.shard_size)}
    assert "ZeRO-1" in pipe.describe()
    assert max_diff(ref.opt_state, reference()[0].opt_state) > 1e-3  # moments far from zero: placing them can fail
    assert_equal(pipe.unplace(pipe.init(ref)).opt_state, ref.opt_state)  # the canonical state round trips


@pytest.mark.parametrize("frozen,zero_stage", [("attn wte", 1)])
def test_3d_frozen_split_weights_stay_split_and_the_rest_equals_single(frozen, zero_stage):
    """A fine-tune freezing split weights (wrt= leaving out the attention: qkv columns re-ordered per rank, the
    output projection by rows; and the tied wte, split by vocabulary rows on the first and last stage) under
    D x S x T = 2 x 2 x 2 with ZeRO-1: each stage holds its frozen weights split over its tensor ranks, as the
    trained ones, before and after the steps (ZeRO-1's update passes them through split); the rest equals the
    single step after 3 steps, dropout on; the frozen ones come back whole, in canonical order, unchanged;
    --report counts a device's slices. (A review found them refused, and a frozen tied weight was refused too.)"""
    from jaxpar.pipeline import memory

    wrt = nnx.All(nnx.Param, nnx.Not(nnx.Any(*[nnx.PathContains(p) for p in frozen.split()])))
    state = jaxpar.init_state(model(), TX, wrt)
    objective = jaxpar.Objective.of(model(), LOSS, wrt=wrt)
    step = jax.jit(lambda s, rows: jaxpar.train_step(objective, TX, s, rows), compiler_options=FAST)
    ref = state
    for _ in range(STEPS):
        ref, single = step(ref, jaxpar.as_rows(batch()))
    assert max_diff(ref.params, state.params) > 1e-3
    pipe = Pipeline(model(), TX, loss_fn=LOSS, num_stages=2, micro_batches=2, tensor_parallel=2, wrt=wrt,
                    mesh=pipeline_mesh(8, 2, 2), compiler_options=FAST, zero_stage=zero_stage)
    placed = pipe.init(state)
    wte = pipe.module.state_paths.index(("wte", "embedding"))
    assert [wte in idx for idx in pipe.module.stage_state] == [True, True]  # a copy on each stage

    def split(placed):  # every stage's 2-D frozen weights, each device holding half
        leaves = [a for s in placed.model_state for a in placed.model_state[s] if np.ndim(a) == 2]
        return leaves and all(2 * sh.data.size == a.size for a in leaves for sh in a.addressable_shards)

    assert split(placed)
    for _ in range(STEPS):
        placed, metrics = pipe.step(placed, pipe.put_batch(batch()))
    assert split(placed)
    out = pipe.unplace(placed)
    assert_equal(out.params, ref.params)
    assert_equal(out.opt_state, ref.opt_state)
    np.testing.assert_allclose(metrics["loss"], single["loss"], rtol=RTOL)
    floats = lambda s: [a for a in jax.tree.leaves(s) if jnp.issubdtype(a.dtype, jnp.floating)]  # noqa: E731
    assert floats(out.model_state)
    for a, b in zip(floats(out.model_state), floats(state.model_state)):
        np.testing.assert_array_equal(a, b)
    for s, row in enumerate(memory.table(pipe, pipe._last[0])):
        held = sum(a.addressable_shards[0].data.nbytes for a in placed.model_state[s]
                   if jnp.issubdtype(a.dtype, jnp.floating))
        assert held > 0 and row["model_state_mib"] * 2 ** 20 == pytest.approx(held)
    assert "model state" in pipe.report(placed)["stage_memory_mib"]


def test_report_estimates_each_stage_per_device():
    """--report's memory per stage under 3-D: a device's weights are its slices (equal to the placed shards'
    bytes), and sequence parallelism shrinks the activations a micro-batch keeps."""
    from jaxpar.pipeline import memory

    pipe, _, placed, _, _ = run(2, 2, 2)
    rows = memory.table(pipe, pipe._last[0])
    for s, row in enumerate(rows):
        held = sum(a.addressable_shards[0].data.nbytes for a in placed.params[s])
        whole = sum(a.nbytes for a in placed.params[s])
        assert row["params_mib"] * 2 ** 20 == pytest.approx(held) and held < whole
    sp = run(2, 2, 2, sequence_parallel=True)[0]
    sp_rows = memory.table(sp, sp._last[0])
    for name in ("store", "recompute"):
        assert sum(r[f"act_{name}_mib"] for r in sp_rows) < sum(r[f"act_{name}_mib"] for r in rows)
    assert "stage 1: weights" in pipe.report()["stage_memory_mib"]


def test_devices_follow_megatrons_order():
    """Tensor ranks adjacent, then data, then pipeline: device s*D*T + d*T + t."""
    mesh = pipeline_mesh(8, 2, 2)
    assert mesh.axis_names == (DATA, PIPE, TENSOR)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert all(ids[d, s, t] == s * 4 + d * 2 + t for d in range(2) for s in range(2) for t in range(2))


def test_stage_functions_hold_megatrons_all_reduces():
    """Stage 0 (the embedding and block 0): its forward all-reduces twice per block within the tensor groups (g
    after the attention and after the MLP) and once for the vocabulary-parallel embedding (its g), its backward
    twice per block (f's transpose) -- and nothing else over TENSOR."""
    pipe, _, placed, batched, _ = run(2, 2, 2)
    plan, engine = pipe._last[1], pipe.engine
    fns = plan.fns[0]
    assert fns.first and not fns.last
    blocks = sum(name == "Block" for name in pipe.module.names[pipe.module.bounds[0]:pipe.module.bounds[1]])
    params = [placed.params[0][i] for i in engine._stage_pos(0, fns.pidx)]
    state = [placed.model_state[0][i] for i in engine._stage_pos(0, fns.sidx, state=True)]
    data, m = batched.stages[0][0], pipe.transport.put(jnp.int32(0), 0)
    mesh = pipe.transport.meshes[0]
    forward = tensor_all_reduces(fns.forward.lower(params, state, None, data, m).compile().as_text(), mesh)
    y, saved, _ = fns.forward(params, state, None, data, m)
    dy = split_float(y)[0]  # the output's gradient, as the next stage sends it
    acc = fns.zeros(params)  # the accumulator the step's first backward adds to
    backward = tensor_all_reduces(fns.backward.lower(acc, params, state, None, data, saved, dy).compile().as_text(),
                                  mesh)
    assert blocks >= 1
    assert forward == (2 * blocks + 1, 0)  # and the vocabulary-parallel embedding's g
    assert backward == (0, 2 * blocks)


def test_bad_combinations_are_named():
    with pytest.raises(ValueError, match=r"num_devices=6 must be a multiple of num_stages x tensor_parallel = 2 x 2"):
        pipeline_mesh(6, 2, 2)
    with pytest.raises(ValueError, match="has 4 heads, which --tensor-parallel 8 does not split evenly"):
        Pipeline(model(), TX, loss_fn=LOSS, num_stages=1, tensor_parallel=8, mesh=pipeline_mesh(8, 1, 8))
    mlp = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(1)))
    with pytest.raises(ValueError, match="Sequential has no module that tensor parallelism can split"):
        Pipeline(mlp, TX, loss_fn=jaxpar.OutputLoss(jaxpar.mse), num_stages=2, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"must have a 'tensor' axis of tensor_parallel=2"):
        Pipeline(model(), TX, loss_fn=LOSS, num_stages=2, tensor_parallel=2, mesh=pipeline_mesh(4, 2))
    with pytest.raises(ValueError, match=r"tensor_parallel=0 must be an int >= 1"):
        Pipeline(model(), TX, loss_fn=LOSS, num_stages=2, tensor_parallel=0)
    with pytest.raises(ValueError, match=r"sequence_parallel splits the tokens over the tensor ranks, but "
                                         r"tensor_parallel=1"):
        Pipeline(model(), TX, loss_fn=LOSS, num_stages=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"--sequence-parallel needs the embedding split by vocabulary rows, but "
                                         r"wte.embedding: vocabulary 25 is not a multiple of 2"):
        Pipeline(model(vocab_size=25), TX, loss_fn=LOSS, num_stages=2, tensor_parallel=2, sequence_parallel=True)


def test_a_device_count_past_the_devices_present_is_refused_not_cut():
    """pipeline_mesh(16, 2, 2) on 8 devices built an 8-device mesh in silence (half the data replicas asked for), 0
    an empty mesh and -4 one of 4 devices (a slice from the end); Pipeline(num_stages=2, tensor_parallel=8) with no
    mesh on 8 devices was told num_devices=8 is no multiple of 2 x 8. Each is refused in one line now."""
    n = jax.device_count()
    for devices in (2 * n, 0, -4, True, 2.0):
        with pytest.raises(ValueError, match=rf"pipeline_mesh\(devices={devices!r}\): a device count is an int "
                                             rf"between 1 and the {n} devices present"):
            pipeline_mesh(devices, 2, 2)
        with pytest.raises(ValueError, match=rf"pipeline_mesh\(devices={devices!r}\)"):
            pipeline_mesh(devices, 2)
    assert dict(pipeline_mesh(np.int64(4), 2, 2).shape) == {DATA: 1, PIPE: 2, TENSOR: 2}
    with pytest.raises(ValueError, match=rf"num_stages x tensor_parallel = 2 x {n} needs {2 * n} devices, but {n} "
                                         r"are present"):
        Pipeline(model(n_head=n), TX, loss_fn=LOSS, num_stages=2, tensor_parallel=n)


# the schedules the two-process case runs, D x S x T = 2 x 2 x 2 (the last with sequence parallelism and ZeRO-1)
ACROSS = ("1f1b", "interleaved", "1f1b-sp")


def worker(out: str) -> None:
    """One of 2 processes x 4 devices: each schedule of ACROSS trained STEPS steps on 2 x 2 x 2 (stage 0 in process
    0, stage 1 in process 1); saves the canonical state it unplaces."""
    import faulthandler
    import signal

    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run import distributed

    faulthandler.dump_traceback_later(420, exit=True)  # a stuck rank prints every thread's stack; the test waits 600
    faulthandler.register(signal.SIGTERM, chain=True)
    simulate_cpu_devices(4)
    distributed.initialize()
    rank = jax.process_index()
    for schedule in ACROSS:
        pipe = Pipeline(model(), TX, loss_fn=LOSS, num_stages=2, micro_batches=2, schedule=schedule.split("-")[0],
                        virtual_stages=2 if schedule == "interleaved" else 1, tensor_parallel=2,
                        sequence_parallel=schedule.endswith("-sp"), mesh=pipeline_mesh(None, 2, 2),
                        compiler_options=FAST, zero_stage=int(schedule.endswith("-sp")))
        placed = pipe.init(jaxpar.init_state(model(), TX))  # reference()'s initial state, without its steps
        for _ in range(STEPS):
            placed, metrics = pipe.step(placed, pipe.put_batch(batch()))
        print(f"process {rank}/{jax.process_count()} {schedule}: {pipe.describe()}", flush=True)
        got = pipe.unplace(placed)
        np.savez(f"{out}.{schedule}.rank{rank}.npz", *map(np.asarray, jax.tree.leaves((got.params, got.opt_state))))


def test_3d_across_two_processes_equals_the_single_step(tmp_path):
    """2 processes x 4 devices, D x S x T = 2 x 2 x 2: the stages' activations (replicated over `tensor`, split
    over `data`; with sequence parallelism split over both) and the tied wte's gradient cross processes; both
    processes unplace the single step's state."""
    proc = two_processes.start(__file__, str(tmp_path / "state"))
    state, ref, _ = reference()  # meanwhile, in this process
    assert max_diff(state.params, ref.params) > 1e-3  # the steps moved the weights: the comparison can fail
    out = two_processes.finish(proc)
    for schedule in ACROSS:
        assert (f"process 1/2 {schedule}: 8 devices (2 processes), mesh {{'data': 2, 'pipe': 2, 'tensor': 2}}"
                in out), out
        assert "logits split by vocabulary into the loss (parallel_output)" in out
        line = next(line for line in out.splitlines() if f"process 1/2 {schedule}: " in line)
        assert ("sequence parallel" in line) == schedule.endswith("-sp") == ("ZeRO-1" in line), line
        ranks = [np.load(tmp_path / f"state.{schedule}.rank{r}.npz") for r in range(2)]
        for k, want in enumerate(jax.tree.leaves((ref.params, ref.opt_state))):
            np.testing.assert_array_equal(ranks[0][f"arr_{k}"], ranks[1][f"arr_{k}"])  # both unplace the same
            np.testing.assert_allclose(ranks[0][f"arr_{k}"], np.asarray(want), rtol=RTOL, atol=ATOL,
                                       err_msg=f"{schedule}, leaf {k}")


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2])


def test_a_mask_that_chooses_by_size_is_refused_where_tensor_ranks_see_slices():
    """3-D without ZeRO: each tensor rank updates its slices, so a mask decided by a leaf's size decays the
    whole kernel of 1,024 entries (mlp c_fc, 16 x 64) on one device and not its 512-entry slice: refused, naming
    the slices. TensorParallel refuses it too (its optimizer must also run on ZeRO's flat pieces)."""
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda a: a.size > 600, p))
    with pytest.raises(ValueError, match="chooses by a parameter's shape: .* on a tensor-parallel rank's slices"):
        Pipeline(model(), tx, loss_fn=LOSS, num_stages=2, micro_batches=2, tensor_parallel=2,
                 mesh=pipeline_mesh(4, 2, 2), compiler_options=FAST)
    with pytest.raises(ValueError, match="chooses by a parameter's shape"):
        jaxpar.TensorParallel(model(), tx, loss_fn=LOSS, tensor_parallel=2)
    ndim = optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
    Pipeline(model(), ndim, loss_fn=LOSS, num_stages=2, micro_batches=2, tensor_parallel=2,
             mesh=pipeline_mesh(4, 2, 2), compiler_options=FAST)  # slices keep their ndim: the same choice
