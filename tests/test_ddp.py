"""DistributedDataParallel equals the single-device reference step, whatever the algorithm, devices, buckets,
overlap, front end, accumulation; the compiled HLO has one reduction per bucket, issued inside the backward.

The problem: a tiny 3-layer MLP with stock nnx.Dropout (per-sample mode), SGD with momentum, 5 steps of a 16-sample
global batch whose last batch has 13 samples (padded with masked rows: on 8 devices, whole devices hold padding only).
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

SIZES = (16, 16, 16, 16, 13)
ALGORITHMS = ("psum", "ring", "reduce_broadcast", "all_to_all")
DEVICES = (1, 2, 4, 8)
CAPS = (0.0, 25.0)  # one leaf per bucket; torch's default 25 MB (one bucket for this model)


def problem():
    """(objective, tx, state, global batches as Rows), seeded: the same in every process (test_multiprocess uses
    it). The model: stock nnx.Dropout between two layers; sample ids are the rows' global positions."""
    import optax
    from flax import nnx

    from jaxpar import Objective, as_rows, init_state
    from jaxpar.models.layers import Linear, ReLU
    from jaxpar.models.nets import Layered

    class Tiny(Layered):
        def __init__(self, rngs):
            self.fc1, self.drop = Linear(12, 20, rngs=rngs), nnx.Dropout(0.3, rngs=rngs)
            self.fc2, self.fc3 = Linear(20, 16, rngs=rngs), Linear(16, 10, rngs=rngs)

        @property
        def layers(self):
            return (self.fc1, ReLU(), self.drop, self.fc2, ReLU(), self.fc3)

    tx = optax.sgd(0.1, momentum=0.9)
    model = Tiny(nnx.Rngs(params=0, dropout=0))
    rng, batches, start = np.random.default_rng(0), [], 0
    for n in SIZES:
        batch = {"x": rng.normal(size=(n, 12)).astype(np.float32), "y": rng.integers(0, 10, n).astype(np.int32)}
        batches.append(as_rows(batch, np.arange(start, start + n)))
        start += n
    return Objective.of(model), tx, init_state(model, tx), batches


def take(rows, index):
    """The rows `index` selects (a slice), from every leaf."""
    import jax

    return jax.tree.map(lambda a: a[index], rows)


def leaves(tree):
    import jax

    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def run_ddp(n: int, rows: slice = slice(None), **options):
    """(DDP instance, placed state) after the steps on `n` devices, feeding `rows` of each global batch."""
    from jaxpar.strategies.ddp import DistributedDataParallel
    from jaxpar.mesh import make_mesh

    objective, tx, state, batches = problem()
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(n), batch_size=max(SIZES), **options)
    placed = ddp.init(state)
    for b in batches:
        placed, metrics = ddp.step(placed, ddp.put_batch(take(b, rows)))
    assert float(metrics["samples"]) == SIZES[-1]  # padding rows never count
    return ddp, placed


def assert_per_device_gradients_differ():
    """The premise: each device's local gradient (of its own rows) differs, so only the reduction agrees them."""
    import jax

    objective, _, state, batches = problem()
    local_grad = jax.jit(lambda r: objective.value_and_grad(state.params, state.model_state, r)[1])
    grads = [leaves(local_grad(take(batches[0], slice(i * 4, (i + 1) * 4)))) for i in range(4)]
    for g, h in itertools.combinations(grads, 2):
        assert max(np.abs(a - b).max() for a, b in zip(g, h)) > 1e-3


@pytest.fixture(scope="module")
def reference():
    """Parameters after the reference steps, once the premises hold: per-device gradients differ, and the
    parameters really move."""
    from jaxpar.step import make_train_step

    assert_per_device_gradients_differ()
    objective, tx, state, batches = problem()
    init = leaves(state.params)
    step = make_train_step(objective, tx)
    for b in batches:
        state, _ = step(state, b)
    out = leaves(state.params)
    assert max(np.abs(a - b).max() for a, b in zip(out, init)) > 1e-2
    return out


def assert_replicas_identical(placed, spmd: str):
    """Every device holds the same parameters, bit for bit."""
    import jax

    for a in jax.tree.leaves(placed.params):
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        if spmd == "pmap":
            shards = list(shards[0]) if len(shards) == 1 else [s.reshape(s.shape[1:]) for s in shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(shards[0], s)


def _pairwise_configs():
    """16 runs covering every (algorithm, N) pair and every pair of any two factors (strength-2 covering array).

    JAXPAR_FULL_MATRIX=1 runs the whole cross product (128 compiles: minutes on a laptop core).
    """
    if os.environ.get("JAXPAR_FULL_MATRIX"):
        return list(itertools.product(ALGORITHMS, DEVICES, CAPS, (True, False), ("shard_map", "pmap")))
    return [(ALGORITHMS[a], DEVICES[n], CAPS[(a ^ n) & 1], not ((a >> 1) ^ (n >> 1)) & 1,
             ("shard_map", "pmap")[((a & 1) ^ (n >> 1) ^ (a >> 1)) & 1]) for a in range(4) for n in range(4)]


@pytest.mark.parametrize("allreduce, n, cap, overlap, spmd", _pairwise_configs())
def test_ddp_equals_reference(reference, allreduce, n, cap, overlap, spmd):
    ddp, placed = run_ddp(n, allreduce=allreduce, bucket_cap_mb=cap, overlap=overlap, spmd=spmd)
    assert_replicas_identical(placed, spmd)
    for a, b in zip(leaves(ddp.unplace(placed).params), reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(ddp.plan) == (6 if cap == 0 else 1)


@pytest.mark.parametrize("n, overlap, allreduce", [(2, True, "ring"), (4, False, "psum")])
def test_grad_accumulation_equals_one_big_step(reference, n, overlap, allreduce):
    """K=2 micro-steps per device (no_sync, one reduction) == the reference step on the whole global batch."""
    ddp, placed = run_ddp(n, allreduce=allreduce, bucket_cap_mb=0, overlap=overlap, grad_accum=2)
    assert ddp.put_batch(problem()[3][-1]).mask.shape == (16,)  # 13 rows padded to a multiple of n * K
    for a, b in zip(leaves(ddp.unplace(placed).params), reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_communication_is_close_but_compressed(reference):
    ddp, placed = run_ddp(4, allreduce="ring", bucket_cap_mb=0, grad_comm_dtype="bf16")
    assert_replicas_identical(placed, "shard_map")
    got = leaves(ddp.unplace(placed).params)
    assert max(np.abs(a - b).max() for a, b in zip(got, reference)) > 1e-6  # really sent in bf16
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-3)


def test_put_batch_pads_with_masked_copies_of_a_real_row():
    from jaxpar.strategies.ddp import DistributedDataParallel
    from jaxpar.mesh import make_mesh

    objective, tx, _, batches = problem()
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(4))  # no batch_size: pad to a multiple of 4
    pb = ddp.put_batch(batches[-1])
    w = np.asarray(pb.mask)
    assert w.shape == (16,) and w.sum() == 13 and not w[13:].any()
    x = np.asarray(pb.data["x"])
    assert pb.data["x"].sharding.spec[0] == "data" and (x[13:] == x[0]).all()  # finite: copies of row 0


def _schedule(**options):
    """(bucket plan, entry schedule, HLO text) of the compiled step on 4 devices, one leaf per bucket."""
    from jaxpar.comm import overlap as ddp_overlap

    ddp, placed = run_ddp(4, bucket_cap_mb=0, **options)
    text = ddp.hlo(placed)
    return ddp.plan, ddp_overlap.entry_schedule(text), text


@pytest.mark.parametrize("allreduce", ["psum", "ring"])
def test_hlo_one_reduction_per_bucket_inside_the_backward(allreduce):
    """Overlap on: each bucket is one reduction (psum: one all-reduce; ring: 2(N-1) collective-permutes), plus
    the metrics' all-reduce; the first is issued before the first layer's weight gradient (the backward's last
    one) is computed."""
    from jaxpar.comm.cost import comm_cost, hlo_bytes_per_device
    from jaxpar.comm.overlap import collective_positions, producer_positions

    plan, schedule, text = _schedule(allreduce=allreduce, overlap=True)
    reduce_ops = collective_positions(schedule, ["all-reduce"])
    permutes = collective_positions(schedule, ["collective-permute"])
    if allreduce == "psum":
        assert len(reduce_ops) == len(plan) + 1 and not permutes
    else:
        assert len(permutes) == len(plan) * 2 * (4 - 1) and len(reduce_ops) == 1
        # the ring moves exactly 2(N-1)/N x S per device (chunks padded to N | size), plus the metrics' psum
        modelled = sum(comm_cost("ring", 4, b.nbytes, 4).sent_per_device for b in plan.buckets)
        metrics = 4 * 4  # loss, weight, rows, accuracy: one float32 vector
        assert hlo_bytes_per_device(text, 4) == [modelled + 2 * 3 / 4 * metrics] * 4
    first_layer_grad = producer_positions(schedule, "f32[12,20]")[0]  # fc1.kernel's gradient
    assert min(reduce_ops + permutes) < first_layer_grad


def test_hlo_no_overlap_reduces_after_the_backward():
    from jaxpar.comm.overlap import collective_positions, producer_positions

    plan, schedule, _ = _schedule(allreduce="psum", overlap=False)
    reduce_ops = collective_positions(schedule)
    assert len(reduce_ops) == len(plan) + 1
    assert min(reduce_ops) > producer_positions(schedule, "f32[12,20]")[0]


def test_forward_leaf_order_follows_layers_not_names():
    """Buckets follow the forward pass (`layers`), not the path-sorted flatten order."""
    import jax
    from flax import nnx

    from jaxpar.strategies.ddp import bucket_plan
    from jaxpar.comm.overlap import forward_leaf_order, leaf_names
    from jaxpar.models.layers import Linear, ReLU
    from jaxpar.models.nets import Layered

    class Backwards(Layered):  # 'z_in' sorts after 'a_out' but runs first
        def __init__(self, rngs):
            self.z_in, self.a_out = Linear(3, 4, rngs=rngs), Linear(4, 2, rngs=rngs)

        @property
        def layers(self):
            return (self.z_in, ReLU(), self.a_out)

    model = Backwards(nnx.Rngs(0))
    names = leaf_names(nnx.split(model, nnx.Param, ...)[1])
    order = forward_leaf_order(model)
    assert [names[i] for i in order] == ["z_in.kernel", "z_in.bias", "a_out.kernel", "a_out.bias"]
    plan = bucket_plan(nnx.split(model)[1], 0, order)
    assert [names[b[0]] for b in plan] == ["a_out.bias", "a_out.kernel", "z_in.bias", "z_in.kernel"]
    assert len(jax.tree.leaves(nnx.split(model)[1])) == 4


def test_buckets_of_a_model_are_torchs():
    """Within a layer the leaves follow its definition order (torch's registration order: the weight, then the
    bias), so a Linear's bias is ready before its kernel and joins its bucket. torch 2.13's DDP on
    nn.Sequential(nn.Linear(400, 400), nn.Linear(400, 800)), default cap, reduced [[1.bias, 1.weight], [0.bias,
    0.weight]] (a comm hook after the rebuild); the path-sorted order put 1.kernel (1.25 MiB) alone in the first
    bucket and 1.bias with layer 0."""
    from flax import nnx

    from jaxpar.comm.overlap import forward_leaf_order, leaf_names
    from jaxpar.strategies.ddp import bucket_plan

    model = nnx.Sequential(nnx.Linear(400, 400, rngs=nnx.Rngs(0)), nnx.Linear(400, 800, rngs=nnx.Rngs(1)))
    params = nnx.split(model, nnx.Param, ...)[1]
    names = leaf_names(params)
    plan = bucket_plan(params, None, forward_leaf_order(model))
    assert [[names[i].rsplit(".", 2)[-2:] for i in b] for b in plan] == \
        [[["1", "bias"], ["1", "kernel"]], [["0", "bias"], ["0", "kernel"]]]


def test_gpt_forward_order_is_nanogpts():
    """GPT's `layers` wrap its modules on the fly (Embedding, LMHead): their leaves count where the wrapper runs,
    the tied wte at its first use, so ln_f's gradient is ready first and the embeddings' last, as in torch (the
    path-sorted order put wte and wpe at the end of the forward, first to be reduced)."""
    from flax import nnx

    from jaxpar import models
    from jaxpar.comm.overlap import forward_leaf_order, leaf_names

    from jaxpar.strategies.ddp import bucket_plan

    model = models.get("gpt-nano")
    params = nnx.split(model, nnx.Param, ...)[1]
    names = leaf_names(params)
    order = [names[i] for i in forward_leaf_order(model)]
    assert sorted(order) == sorted(names)
    assert order[:4] == ["wte.embedding", "wpe.embedding", "h.0.ln_1.bias", "h.0.ln_1.scale"]
    assert order[-2:] == ["ln_f.bias", "ln_f.scale"]
    # the order torch 2.13's DDP readies (and, at bucket_cap_mb=0, reduces) tests/gpt_torch.py's gpt-nano twin's
    # gradients, read off a comm hook after the rebuild: a Linear's bias before its weight, a LayerNorm's weight
    # before its bias, wpe before the tied wte (whose gradient the lm head adds to first)
    torch_ready = ["ln_f.weight", "ln_f.bias"]
    for i in (2, 1, 0):
        torch_ready += [f"h.{i}.{k}" for k in ("mlp.c_proj.bias", "mlp.c_proj.weight", "mlp.c_fc.bias",
                                               "mlp.c_fc.weight", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias",
                                               "attn.c_proj.weight", "attn.c_attn.bias", "attn.c_attn.weight",
                                               "ln_1.weight", "ln_1.bias")]
    torch_ready += ["wpe.weight", "wte.weight"]
    torch_name = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
    plan = bucket_plan(params, 0, forward_leaf_order(model))
    assert [[".".join([*names[i].split(".")[:-1], torch_name[names[i].split(".")[-1]]]) for i in b]
            for b in plan] == [[k] for k in torch_ready]


def test_buckets_of_conv_layers_are_torchs():
    """A convolution's (and a norm's) weight gradient is ready before its bias in torch (one backward node yields
    both; a Linear's bias comes first), so the bias and weight of a conv fall in buckets as torch's do. torch
    2.13's DDP on the MNIST Net twin (tests/make_torch_fixtures.py), read off a comm hook after the rebuild: at
    bucket_cap_mb=0.07 (73,400 B) conv2.weight (73,728 B) closes a bucket on its own and conv2.bias joins conv1's;
    the definition order alone made [conv2.bias, conv2.weight], [conv1.bias, conv1.weight]."""
    from flax import nnx

    from jaxpar import models
    from jaxpar.comm.overlap import forward_leaf_order, leaf_names
    from jaxpar.strategies.ddp import bucket_plan

    model = models.get("convnet")
    params = nnx.split(model, nnx.Param, ...)[1]
    names = [n.replace("kernel", "weight") for n in leaf_names(params)]
    order = forward_leaf_order(model)
    buckets = {cap: [[names[i] for i in b] for b in bucket_plan(params, cap, order)] for cap in (0, 0.07, None)}
    assert buckets[0] == [[k] for k in ("fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight", "conv2.weight",
                                        "conv2.bias", "conv1.weight", "conv1.bias")]
    assert buckets[0.07] == [["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"], ["conv2.weight"],
                             ["conv2.bias", "conv1.weight", "conv1.bias"]]
    assert buckets[None] == [["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"],
                             ["conv2.weight", "conv2.bias", "conv1.weight", "conv1.bias"]]


def test_bad_options_name_the_fix():
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, _, _ = problem()
    with pytest.raises(ValueError, match="allreduce='tree' is not known; use one of psum"):
        DistributedDataParallel(objective, tx, allreduce="tree")
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=f"grad_accum={bad} must be an int >= 1"):
            DistributedDataParallel(objective, tx, grad_accum=bad)
    from jaxpar.strategies.pipeline import pipeline_mesh

    with pytest.raises(ValueError, match="runs on a 1-D mesh of axis 'data', got axes \\{'data': 2, 'pipe': 2"):
        DistributedDataParallel(objective, tx, mesh=pipeline_mesh(4, num_stages=2))
    with pytest.raises(ValueError, match="spmd='xmap' is not known"):
        DistributedDataParallel(objective, tx, spmd="xmap")
    for bad in ("no", "off", None, 0.0):  # a QA pass: "no" and "off" ran with the overlap on, printing overlap=on
        with pytest.raises(ValueError, match=f"overlap={bad!r} must be True or False"):
            DistributedDataParallel(objective, tx, overlap=bad)
    ddp = DistributedDataParallel(objective, tx, grad_accum=np.int64(2), overlap=np.False_)  # numpy's take
    assert (ddp.grad_accum, ddp.overlap) == (2, False) and type(ddp.grad_accum) is int


def test_torchs_constructor_arguments_are_refused_naming_what_to_pass():
    """Every argument of torch 2.13's DistributedDataParallel but bucket_cap_mb (QA: each was refused only as an
    "unexpected keyword argument" that named no replacement) says in one line what jaxpar does instead."""
    import inspect

    from jaxpar.strategies.ddp import TORCH_ONLY, DistributedDataParallel

    objective, tx, _, _ = problem()
    torch_args = {"device_ids", "output_device", "dim", "broadcast_buffers", "init_sync", "process_group",
                  "find_unused_parameters", "check_reduction", "gradient_as_bucket_view", "static_graph",
                  "delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision", "device_mesh",
                  "skip_all_reduce_unused_params", "bucket_cap_mb_list", "batched_grad_copy", "forward_sync_buffers"}
    assert set(TORCH_ONLY) == torch_args
    assert not torch_args & set(inspect.signature(DistributedDataParallel).parameters)
    fixes = {"device_ids": "pass mesh=jaxpar.make_mesh\\(N\\)", "broadcast_buffers": "from replica 0",
             "find_unused_parameters": "zero gradient.*leave it out of wrt", "static_graph": "leave it out",
             "mixed_precision": "compute_dtype=jnp.bfloat16.*grad_comm_dtype='bf16'",
             "bucket_cap_mb_list": "pass bucket_cap_mb=MB"}
    for key, fix in fixes.items():
        with pytest.raises(TypeError, match=f"^DistributedDataParallel\\({key}=True\\) is torch's argument, not an "
                                            f"option of jaxpar's: .*{fix}"):
            DistributedDataParallel(objective, tx, **{key: True})
    for key in torch_args:  # one line each
        with pytest.raises(TypeError, match=f"\\({key}=") as info:
            DistributedDataParallel(objective, tx, **{key: None})
        assert "\n" not in str(info.value)


def test_a_plan_that_leaves_a_leaf_out_or_names_a_stranger_is_refused():
    """make_ddp_step(plan=...) trained a leaf in no bucket unreduced, each replica with its own gradient, without a
    word; a leaf index past the end failed with a bare IndexError under overlap (QA 51). Both are refused at trace
    time in one line; a complete plan of the user's trains."""
    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import make_ddp_step, place_rows, replicate

    objective, tx, state, batches = problem()
    n_leaves = len(leaves(state.params))
    mesh = make_mesh(2)
    placed, rows = replicate(state, mesh, "shard_map"), place_rows(take(batches[0], slice(0, 8)), mesh)
    cases = [([list(range(n_leaves - 1))], rf"leaves \[{n_leaves - 1}\] in no bucket"),
             ([list(range(n_leaves)), [0]], r"leaves \[0\] in two buckets"),
             ([list(range(n_leaves + 1))], rf"names {n_leaves}, not a leaf index 0..{n_leaves - 1}")]
    for plan, match in cases:
        for overlap in (True, False):
            step = make_ddp_step(objective, tx, mesh, plan=plan, overlap=overlap)
            with pytest.raises(ValueError, match=match + ".*jaxpar.plan_buckets"):
                step(replicate(state, mesh, "shard_map"), rows)
    whole = make_ddp_step(objective, tx, mesh, plan=[list(range(n_leaves))[::-1]], overlap=True)
    assert np.isfinite(float(whole(placed, rows)[1]["loss"]))


def test_bucket_caps_torch_accepts_and_those_it_does_not():
    """bucket_cap_mb=None is torch's default (25 MiB, the first bucket 1), float('inf') one bucket; a string or a
    bool is refused in one line (QA 51: OverflowError for inf, TypeError for None and '25')."""
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, state, _ = problem()
    assert "cap 25 MiB, first 1 MiB" in DistributedDataParallel(objective, tx, bucket_cap_mb=None).describe()
    ddp = DistributedDataParallel(objective, tx, bucket_cap_mb=float("inf"))
    ddp.init(state)
    assert len(ddp.plan) == 1 and "cap unlimited, first unlimited" in ddp.describe()
    for bad in ("25", True):
        with pytest.raises(ValueError, match=r"bucket_cap_mb=.* must be a number of MiB >= 0"):
            DistributedDataParallel(objective, tx, bucket_cap_mb=bad)


def test_build_from_config():
    import optax
    from flax import nnx

    from jaxpar import models
    from jaxpar.config import Config
    from jaxpar.strategies.base import get_builder

    model = models.get("mlp", in_features=12, hidden_dim=8, out_features=10)
    cfg = Config(strategy="ddp", num_devices=2, allreduce="ring", bucket_cap_mb=0, overlap=False, batch_size=6)
    ddp = get_builder("ddp")(model, optax.sgd(0.1), cfg)
    assert (ddp.mesh.size, ddp.allreduce, ddp.overlap, ddp.share) == (2, "ring", False, 6)
    assert ddp.leaf_order == [1, 0, 3, 2]  # layers/0 then layers/2, each its kernel then its bias (as defined)


def test_buffers_of_replica_0_keep_their_dtype():
    """A buffer the forward assigns comes from replica 0 by a psum of it and zeros; a bool buffer came back int32
    from DDP, ZeRO and the pipeline's data replicas (QA), so its checkpoint no longer restored into the model's
    template. Every dtype and value now equals SingleDevice's (the pipeline at one micro-batch: each micro-batch's
    forward assigns the buffers, as DeepSpeed's does)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.strategies.pipeline import pipeline_mesh

    class Buffer(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.flag, self.count = Buffer(jnp.array(False)), Buffer(jnp.array(250, jnp.uint8))

        def __call__(self, x):
            self.flag[...] = jnp.logical_not(self.flag[...])
            self.count[...] = self.count[...] + 1
            return self.lin(x)

    def loss(outputs, batch):
        return jnp.sum((outputs - batch["y"]) ** 2), outputs.size

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
    tx = optax.sgd(0.1)
    builders = {
        "single": lambda m: jaxpar.SingleDevice(m, tx, loss_fn=jaxpar.OutputLoss(loss), per_sample=False),
        "ddp": lambda m: jaxpar.DistributedDataParallel(m, tx, loss_fn=jaxpar.OutputLoss(loss), per_sample=False,
                                                        mesh=jaxpar.make_mesh(4)),
        "zero3": lambda m: jaxpar.ZeroRedundancy(m, tx, loss_fn=jaxpar.OutputLoss(loss), per_sample=False, stage=3),
        "pipeline": lambda m: jaxpar.Pipeline(m, tx, loss_fn=jaxpar.OutputLoss(loss), per_sample=False,
                                              num_stages=2, micro_batches=1, mesh=pipeline_mesh(4, num_stages=2)),
    }
    got = {}
    for name, build in builders.items():
        r = nnx.Rngs(0)
        model = nnx.Sequential(Counting(r), nnx.relu, Counting(r))
        strategy = build(model)
        placed, _ = strategy.step(strategy.init(jaxpar.init_state(model, tx)), strategy.put_batch(batch))
        buffers = strategy.unplace(placed).model_state["layers"][0]
        got[name] = {k: (str(buffers[k][...].dtype), buffers[k][...].tolist()) for k in ("flag", "count")}
    assert got["single"] == {"flag": ("bool", True), "count": ("uint8", 251)}
    assert all(g == got["single"] for g in got.values()), got


def test_a_batch_size_the_devices_do_not_divide_pads_every_batch_to_one_rounded_shape(reference):
    """batch_size=13 on 4 devices x grad_accum 2: the share is rounded UP to a multiple of 8 (16 rows), so the
    13-row batch and a short one get the same padded shape (one compile) and the steps still equal the reference.
    A share left at 13 (QA62 mutant) padded the 13-row batch to 13 rows, which 4 devices cannot split."""
    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, state, batches = problem()
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(4), batch_size=13, grad_accum=2)
    assert ddp.share == 16
    assert ddp.put_batch(take(batches[-1], slice(0, 5))).mask.shape == (16,)  # a short batch: the same shape
    placed = ddp.init(state)
    for b in batches:
        placed, metrics = ddp.step(placed, ddp.put_batch(b))
    assert float(metrics["samples"]) == SIZES[-1]
    for a, b in zip(leaves(ddp.unplace(placed).params), reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("allreduce", ["psum", "ring"])
def test_bf16_communication_rounds_each_bucket_to_bfloat16_not_float16(allreduce):
    """grad_comm_dtype="bf16" (torch's bf16_compress_hook) sends every bucket as bfloat16: 1 + 2^-9 on each of 4
    devices is exact in float16 (and its sums too: 4 + 2^-7), but bfloat16 (8 significant bits) rounds it to 1,
    so the reduced bucket is exactly 4.0. float16 communication (QA62 mutant) kept 4.0078125."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxpar.mesh import DATA, make_mesh
    from jaxpar.strategies.ddp import COMM_DTYPES, make_reduce

    mesh = make_mesh(4)
    x = np.full((4, 3), 1 + 2.0 ** -9, np.float32)  # one row of the bucket per device
    run = lambda dtype: np.asarray(jax.jit(jax.shard_map(  # noqa: E731
        make_reduce(allreduce, dtype), mesh=mesh, in_specs=P(DATA), out_specs=P(DATA), check_vma=False))(x))
    exact = run(COMM_DTYPES["fp32"])
    np.testing.assert_array_equal(exact, np.full((4, 3), 4 + 2.0 ** -7, np.float32))  # premise: fp32 keeps it
    got = run(COMM_DTYPES["bf16"])
    assert got.dtype == np.float32  # cast back after the collective
    np.testing.assert_array_equal(got, np.full((4, 3), 4.0, np.float32))


@pytest.mark.parametrize("allreduce", ["ring", "psum"])
def test_report_models_bf16_communication_at_two_bytes_a_word(allreduce):
    """report()'s modelled traffic follows grad_comm_dtype: bf16 buckets are sent as 2-byte words, so the modelled
    bytes per device are exactly half of fp32's (same plan, same algorithm, same step count). Modelling bf16 at 4
    bytes (QA62 mutant) reported fp32's traffic for a compressed run."""
    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, state, _ = problem()
    reports = {}
    for comm in ("fp32", "bf16"):
        ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(4), allreduce=allreduce, bucket_cap_mb=0,
                                      grad_comm_dtype=comm, batch_size=16)
        reports[comm] = ddp.report(ddp.init(state))
    fp32, bf16 = reports["fp32"], reports["bf16"]
    assert fp32["buckets"] == bf16["buckets"] == 6 and fp32["grad_comm_dtype"] == "fp32"
    assert fp32["model_steps_per_step"] == bf16["model_steps_per_step"] > 0
    assert fp32["model_bytes_sent_per_device"] > 0
    assert 2 * bf16["model_bytes_sent_per_device"] == fp32["model_bytes_sent_per_device"]


def test_report_says_when_the_compiled_step_widened_bf16_communication():
    """psum under grad_comm_dtype='bf16': jaxpar's program all-reduces bfloat16 (its StableHLO), but XLA:CPU compiles
    the all-reduce in f32, so the compiled count is twice the model's with nothing in the report saying why (a known
    gap of the last notes). The report now says so; the ring, whose collective-permutes send bf16's bits (u16), gets no
    note."""
    import re

    from jaxpar.comm import cost
    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, state, batches = problem()
    got = {}
    for allreduce in ("psum", "ring"):
        ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(4), allreduce=allreduce, bucket_cap_mb=0,
                                      grad_comm_dtype="bf16", batch_size=16)
        placed, _ = ddp.step(ddp.init(state), ddp.put_batch(batches[0]))
        asked = re.findall(r"stablehlo\.all_reduce.*?\) : \(tensor<\d+x(\w+)>\)",
                           ddp._step.lower(placed, ddp._batch_spec).as_text(), re.S)
        got[allreduce] = (ddp.report(placed), cost.hlo_collectives(ddp.hlo(placed)), asked)
    psum, ops, asked = got["psum"]
    assert "bf16" in asked  # premise: jaxpar's program all-reduces bf16 ...
    assert {c.dtype for c in ops if c.kind == "all-reduce"} == {"f32"}  # ... and XLA:CPU compiled it in f32
    assert psum["hlo_bytes_sent_per_device"] > 1.9 * psum["model_bytes_sent_per_device"]
    assert "note" in psum and "f32" in psum["note"] and "bf16" in psum["note"]
    ring, ring_ops, _ = got["ring"]
    assert any(c.dtype == "u16" for c in ring_ops) and "note" not in ring  # bf16's bits, as they are sent


def test_report_models_each_buckets_own_dtype_as_the_compiled_step_sends_it():
    """bf16 parameters: their gradients go out at 2 bytes a word, with or without grad_comm_dtype='bf16'; the
    model assumed 4-byte words, so it reported half what the step sends under bf16 communication and 1176
    against 1164 bytes without (a QA pass). The model now equals the compiled step's bytes less the metrics' psum."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.comm import cost

    def make(dtype):
        return nnx.Sequential(nnx.Linear(3, 64, param_dtype=dtype, rngs=nnx.Rngs(0)), nnx.tanh,
                              nnx.Linear(64, 2, param_dtype=dtype, rngs=nnx.Rngs(1)))

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    loss, tx, sent = jaxpar.OutputLoss(jaxpar.mse), optax.sgd(0.1), {}
    for dtype in (jnp.float32, jnp.bfloat16):
        for comm in (None, "bf16"):
            ddp = jaxpar.DistributedDataParallel(make(dtype), tx, loss_fn=loss, mesh=jaxpar.make_mesh(4),
                                                 allreduce="ring", bucket_cap_mb=0, grad_comm_dtype=comm)
            placed, _ = ddp.step(ddp.init(jaxpar.init_state(make(dtype), tx)), ddp.put_batch(batch))
            r = ddp.report(placed)
            compiled = r["hlo_bytes_sent_per_device"] - cost.ring_bytes("all-reduce", 4, 12)  # the metrics' 3 floats
            assert r["model_bytes_sent_per_device"] == compiled, (jnp.dtype(dtype).name, comm)
            sent[jnp.dtype(dtype).name, comm] = compiled
    assert sent["float32", None] == 2 * sent["bfloat16", None] == 2 * sent["bfloat16", "bf16"] > 0


@pytest.mark.parametrize("allreduce", ["reduce_broadcast", "all_to_all", "ring"])
def test_the_reports_cost_model_counts_the_busiest_device_as_the_compiled_count_does(allreduce):
    """report()'s model bytes counted a non-root device (reduce_broadcast's root sends N - 1 times as much), its
    compiled-HLO bytes the busiest one: 264 against 1,876 bytes on 8 devices (a QA pass). Both are the busiest
    device's now: equal but for the metrics' own small psum."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.comm import cost

    def make():
        return nnx.Sequential(nnx.Linear(3, 16, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(16, 2, rngs=nnx.Rngs(1)))

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    ddp = jaxpar.DistributedDataParallel(make(), optax.sgd(0.1), loss_fn=jaxpar.OutputLoss(jaxpar.mse),
                                         mesh=jaxpar.make_mesh(4), allreduce=allreduce, bucket_cap_mb=0)
    placed, _ = ddp.step(ddp.init(jaxpar.init_state(make(), optax.sgd(0.1))), ddp.put_batch(batch))
    r = ddp.report(placed)
    assert r["model_bytes_sent_per_device"] > 0
    assert r["model_bytes_sent_per_device"] == r["hlo_bytes_sent_per_device"] - cost.ring_bytes("all-reduce", 4, 12)


def test_a_batch_larger_than_batch_size_is_refused_in_one_process_and_across_processes(monkeypatch):
    """batch_size fixes every step's shape: a batch above its share was padded to a second shape without a word
    in one process (a second compile, a batch larger than declared), and refused across processes only; there a
    missing batch_size read 'its share None of batch_size=None'. One rule and one line each (jaxpar.batch.
    padded_size), before any work (the processes are simulated: the check runs first)."""
    import jax

    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, _, batches = problem()
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(4), batch_size=8)
    with pytest.raises(ValueError, match=r"^DistributedDataParallel\.put_batch got a batch of 16 rows, more than "
                                         r"the 8 that batch_size=8 pads every batch to .*; pass at most 8 rows, or "
                                         r"build the strategy with batch_size=16 or more \(--batch-size\)\.$"):
        ddp.put_batch(batches[0])
    assert ddp.put_batch(take(batches[0], slice(0, 8))).mask.shape == (8,)
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # this process: all 8 devices, as rank 0 of 2
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(8), batch_size=13)
    assert ddp.share == 8
    assert ddp.put_batch(take(batches[0], slice(0, 8))).mask.shape == (8,)  # 8 rows: within the share
    with pytest.raises(ValueError, match=r"^DistributedDataParallel\.put_batch got a batch of 9 rows on this process, "
                                         r"more than the 8 that its share of batch_size=13 over 2 processes pads every "
                                         r"batch to .*; pass at most 8 rows on each process, or build the strategy "
                                         r"with batch_size=18 or more"):
        ddp.put_batch(take(batches[0], slice(0, 9)))
    with pytest.raises(ValueError, match=r"^DistributedDataParallel\.put_batch across 2 processes needs batch_size= "
                                         r".*; pass the global batch size as batch_size= \(--batch-size\)\.$"):
        DistributedDataParallel(objective, tx, mesh=make_mesh(8)).put_batch(batches[0])


def test_each_process_pads_to_its_share_of_the_global_batch_rounded_up(monkeypatch):
    """A process's share of batch_size is ceil(batch_size / processes) rounded up to its devices x grad_accum
    (jaxpar.batch.share_of): 17 rows over 2 processes of 8 devices is 9 rows each, padded to 16. Rounding the
    division down (8, already a multiple of 8) would refuse a 9-row share that the global batch needs."""
    import jax

    from jaxpar.mesh import make_mesh
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, _, batches = problem()
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # this process: all 8 devices, as rank 0 of 2
    ddp = DistributedDataParallel(objective, tx, mesh=make_mesh(8), batch_size=17)
    assert ddp.share == 16
    assert ddp.put_batch(take(batches[0], slice(0, 9))).mask.shape == (16,)


def test_forward_leaf_order_keeps_a_layers_dicts_and_tuples_in_their_order_and_every_leaf():
    """Within a layer, a dict's modules come in insertion order (not key order) and a tuple's in its own order,
    after each other in the order the layer set them; a leaf no layer holds (`extra`) follows at the end, so the
    order still names every leaf once; a sublayer that refers back to its layer (a cycle in the graph) is
    walked once."""
    import jax
    from flax import nnx

    from jaxpar.comm.overlap import forward_leaf_order, leaf_names

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.heads = nnx.data({"z": nnx.Linear(2, 2, rngs=rngs), "a": nnx.Linear(2, 2, rngs=rngs)})
            self.pair = nnx.data((nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 2, rngs=rngs)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.block = Block(rngs)
            self.extra = nnx.Param(jax.numpy.zeros(3))

        @property
        def layers(self):
            return (self.block,)

    model = Net(nnx.Rngs(0))
    model.block.pair[0].owner = model.block  # a cycle inside the layer
    names = leaf_names(nnx.split(model, nnx.Param, ...)[1])
    assert [names[i] for i in forward_leaf_order(model)] == [
        "block.heads.z.kernel", "block.heads.z.bias", "block.heads.a.kernel", "block.heads.a.bias",
        "block.pair.0.kernel", "block.pair.0.bias", "block.pair.1.kernel", "block.pair.1.bias", "extra"]


def test_an_objective_carries_the_models_own_leaf_order_to_ddp_and_zero():
    """nnx.merge rebuilds a module with its attributes sorted by name (a Linear's bias before its kernel), so the
    forward order read off the merged model is not torch's; Objective.of reads it off the model itself, and DDP and
    ZeRO built from that Objective bucket and partition as they do built from the model."""
    import optax
    from flax import nnx

    from jaxpar import DistributedDataParallel, Objective, ZeroRedundancy, init_state
    from jaxpar.comm.overlap import forward_leaf_order
    from jaxpar.mesh import make_mesh

    model = nnx.Sequential(nnx.Linear(400, 400, rngs=nnx.Rngs(0)), nnx.Linear(400, 800, rngs=nnx.Rngs(1)))
    tx = optax.sgd(0.1)
    objective, state = Objective.of(model), init_state(model, tx)
    merged = forward_leaf_order(objective.merge(state.params, state.model_state))
    assert merged != forward_leaf_order(model) == list(objective.leaf_order)  # the premise: merge loses the order
    built = DistributedDataParallel(model, tx, mesh=make_mesh(2))
    given = DistributedDataParallel(objective, tx, mesh=make_mesh(2))
    built.init(state), given.init(state)
    assert [list(b) for b in given.plan] == [list(b) for b in built.plan]
    assert len(built.plan) == 2  # each layer's kernel and bias together, as torch's DDP buckets them
    zeros = [ZeroRedundancy(m, tx, stage=2, mesh=make_mesh(2)) for m in (model, objective)]
    for z in zeros:
        z.init(state)
    assert zeros[0].plan == zeros[1].plan
