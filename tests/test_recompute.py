"""Activation checkpointing outside the pipeline (jaxpar.recompute): the model's `layers` in N-layer segments
that keep only their input and run again in the backward. With dropout on, every whole-model strategy that takes
it gives the parameters of the single step that keeps every activation; the compiled step holds less. Megatron's
selective recompute (GPTConfig.recompute_granularity="selective", the core attention) likewise, in every strategy
the pipeline included."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import gpt
from jaxpar.recompute import recompute_call

CFG = dict(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64)
TX = optax.sgd(0.5)
STEPS = 3


def problem(dropout=0.1, granularity=None):
    model = gpt.GPT(gpt.GPTConfig(dropout=dropout, recompute_granularity=granularity, **CFG),
                    rngs=nnx.Rngs(params=0, dropout=1))
    seq = np.random.default_rng(0).integers(0, CFG["vocab_size"], (8, CFG["block_size"] + 1)).astype(np.int32)
    return model, {"x": seq[:, :-1], "y": seq[:, 1:]}


def run(make, interval: int):
    """(parameters, each step's loss) after STEPS steps of the strategy `make(objective)`."""
    model, batch = problem()
    objective = jaxpar.Objective.of(model, activation_checkpoint_interval=interval)
    s = make(objective)
    placed, losses = s.init(jaxpar.init_state(model, TX)), []
    for _ in range(STEPS):
        placed, metrics = s.step(placed, s.put_batch(batch))
        losses.append(float(metrics["loss"]))
    return [np.asarray(a) for a in jax.tree.leaves(s.unplace(placed).params)], losses


@pytest.fixture(scope="module")
def kept():
    """The single step keeping every activation; the premises: dropout is on, and the weights move."""
    model, batch = problem()
    objective, state = jaxpar.Objective.of(model), jaxpar.init_state(model, TX)
    evaluated = jax.jit(lambda r: objective.sums(state.params, state.model_state, r, train=False)[0])(
        jaxpar.as_rows(batch))
    params, losses = run(lambda o: jaxpar.SingleDevice(o, TX), 0)
    assert abs(losses[0] - float(evaluated.loss / evaluated.weight)) > 1e-3
    assert max(float(np.abs(a - b).max()) for a, b in zip(params, jax.tree.leaves(state.params))) > 1e-2
    return params, losses


STRATEGIES = {
    "single-1": (lambda o: jaxpar.SingleDevice(o, TX), 1),
    "single-2": (lambda o: jaxpar.SingleDevice(o, TX), 2),
    "dp": (lambda o: jaxpar.DataParallel(o, TX, device_ids=[0, 1]), 1),
    "ddp-ring-buckets": (lambda o: jaxpar.DistributedDataParallel(o, TX, mesh=jaxpar.make_mesh(4), allreduce="ring",
                                                                  bucket_cap_mb=0.001), 2),
    "zero-2": (lambda o: jaxpar.ZeroRedundancy(o, TX, stage=2, mesh=jaxpar.make_mesh(2)), 1),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_recompute_equals_keeping_every_activation(kept, name):
    make, interval = STRATEGIES[name]
    params, losses = run(make, interval)
    np.testing.assert_allclose(losses, kept[1], rtol=1e-5)
    for a, b in zip(params, kept[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_recompute_under_tensor_parallelism_with_sequence_parallel(kept):
    """Megatron's full recompute: the segments' f/g collectives (here SP's all-gathers and reduce-scatters) run
    again in the backward, inside the tensor group."""
    from jaxpar.strategies.tensor import TensorParallel

    model, batch = problem()
    tp = TensorParallel(model, TX, tensor_parallel=2, sequence_parallel=True, mesh=jax.sharding.Mesh(
        np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor")), activation_checkpoint_interval=1)
    placed = tp.init(jaxpar.init_state(problem()[0], TX))
    for _ in range(STEPS):
        placed, _ = tp.step(placed, tp.put_batch(batch))
    for a, b in zip(jax.tree.leaves(tp.unplace(placed).params), kept[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_recompute_frees_the_activations():
    """The compiled single step's temporaries (activations and scratch) shrink: the recomputation is really
    apart from the forward (XLA:CPU merges jax.checkpoint's back into it, and keeps every residual)."""
    cfg = dict(CFG, n_layer=4, n_embd=64, block_size=64)
    model = gpt.GPT(gpt.GPTConfig(dropout=0.1, **cfg), rngs=nnx.Rngs(params=0, dropout=1))
    seq = np.random.default_rng(0).integers(0, cfg["vocab_size"], (8, cfg["block_size"])).astype(np.int32)
    rows, state = jaxpar.as_rows({"x": seq, "y": seq}), jaxpar.init_state(model, TX)
    temp = {}
    for interval in (0, 1):
        objective = jaxpar.Objective.of(model, activation_checkpoint_interval=interval)
        compiled = jaxpar.make_train_step(objective, TX).lower(state, rows).compile()
        temp[interval] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[1] < 0.75 * temp[0], temp


SELECTIVE = {  # the GPT's core attention recomputed (ZeRO-3 nests it in its re-gathers; ddp: tests/test_gpt.py's CLI)
    "single": lambda m: jaxpar.SingleDevice(m, TX),
    "zero-3": lambda m: jaxpar.ZeroRedundancy(m, TX, stage=3, mesh=jaxpar.make_mesh(2)),
    "tp-sequence-parallel": lambda m: jaxpar.TensorParallel(m, TX, tensor_parallel=2, sequence_parallel=True,
                                                            mesh=jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(
                                                                2, 2), ("data", "tensor"))),
    "pipeline-zbh1": lambda m: jaxpar.Pipeline(m, TX, num_stages=2, micro_batches=2, schedule="zbh1"),
    "pipeline-1f1b-full-too": lambda m: jaxpar.Pipeline(m, TX, num_stages=2, micro_batches=4,
                                                        activation_checkpoint_interval=1),
}


@pytest.mark.parametrize("name", list(SELECTIVE))
def test_selective_recompute_equals_keeping_every_activation(kept, name, monkeypatch):
    from jaxpar.models import gpt as gpt_module

    calls = []
    monkeypatch.setattr(gpt_module, "recompute_call", lambda *a: calls.append(1) or recompute_call(*a))
    model, batch = problem(granularity="selective")
    s = SELECTIVE[name](model)
    placed = s.init(jaxpar.init_state(model, TX))
    losses = []
    for _ in range(STEPS):
        placed, metrics = s.step(placed, s.put_batch(batch))
        losses.append(float(metrics["loss"]))
    assert calls  # the core attention went through the recompute
    np.testing.assert_allclose(losses, kept[1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s.unplace(placed).params), kept[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_selective_recompute_keeps_no_attention_weights():
    """What the backward keeps of the model: nothing from inside the core attention (the T x T weights, their
    dropout mask; without dropout the query blocks' weights) under selective recompute, several arrays per layer
    without it; and the compiled step's temporaries shrink."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    cfg = dict(CFG, n_layer=4, n_head=4, block_size=128)
    seq = np.random.default_rng(0).integers(0, cfg["vocab_size"], (8, cfg["block_size"])).astype(np.int32)
    square, temp = {}, {}
    for granularity in (None, "selective"):
        for dropout in (0.1, 0.0):
            model = gpt.GPT(gpt.GPTConfig(dropout=dropout, recompute_granularity=granularity, **cfg),
                            rngs=nnx.Rngs(params=0, dropout=1))
            graphdef, state = nnx.split(model)
            with contextlib.redirect_stdout(io.StringIO()) as printed:  # one line per residual: "f32[8,4,128,128] ..."
                print_saved_residuals(lambda s: nnx.merge(graphdef, s)(seq).sum(), state)
            square[granularity, dropout] = sum(  # kept inside the core attention: weights, masks, query blocks
                any(f in line for f in ("causal_attention", "_attend", "_blocked_fwd", "_causal_probs"))
                or ",4,128,128]" in line
                for line in printed.getvalue().splitlines())
        rows, state = jaxpar.as_rows({"x": seq, "y": seq}), jaxpar.init_state(model, TX)
        compiled = jaxpar.make_train_step(jaxpar.Objective.of(model), TX).lower(state, rows).compile()
        temp[granularity] = compiled.memory_analysis().temp_size_in_bytes
    assert square[None, 0.1] >= 2 * 4 and square[None, 0.0] >= 2 * 4, square  # in every layer
    assert square["selective", 0.1] == square["selective", 0.0] == 0, square
    assert temp["selective"] < 0.75 * temp[None], temp  # dropout 0 (the last compiled): 0.64x measured


def test_selective_recompute_refusals():
    with pytest.raises(ValueError, match=r"recompute_granularity='full' is not known; use 'selective'.*"
                                         r"activation_checkpoint_interval=N"):
        gpt.GPTConfig(recompute_granularity="full")


def test_refusals():
    with pytest.raises(ValueError, match=r"needs Linear's flat `layers`.*or use 0"):
        jaxpar.Objective.of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), activation_checkpoint_interval=1)
    with pytest.raises(ValueError, match=r"activation_checkpoint_interval=-1 must be an int >= 0"):
        jaxpar.Objective.of(problem()[0], activation_checkpoint_interval=-1)
    with pytest.raises(ValueError, match=r"activation_checkpoint_interval=True must be an int >= 0"):  # taken as 1 (QA)
        jaxpar.Objective.of(problem()[0], activation_checkpoint_interval=True)
    with pytest.raises(ValueError, match=r"ZeRO stage 3 .* use stage 1 or 2"):
        jaxpar.ZeroRedundancy(problem()[0], TX, stage=3, mesh=jaxpar.make_mesh(2), activation_checkpoint_interval=1)
    model = problem()[0]
    jaxpar.Objective.of(model, activation_checkpoint_interval=1)
    assert type(model) is gpt.GPT  # the user's model is left as it is


class Penalised(nnx.Module):
    """A layer whose forward sows a penalty on its activations (an auxiliary loss, which the loss pops), and keeps
    their running mean in a plain nnx.Variable that feeds its output, with a call counter beside it."""

    def __init__(self, n_in: int, n_out: int, seed: int, buffers: bool):
        self.lin = nnx.Linear(n_in, n_out, rngs=nnx.Rngs(seed))
        self.buffers = buffers  # without them the forward changes nothing row by row (per_sample=True takes it)
        self.mean = nnx.Variable(jnp.zeros((n_out,)))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        h = jnp.tanh(self.lin(x) - self.mean[...])
        if self.buffers:
            self.mean[...] = 0.9 * self.mean[...] + 0.1 * jax.lax.stop_gradient(h).mean(0)
            self.calls[...] += 1
        self.sow(nnx.Intermediate, "penalty", jnp.sum(h ** 2))
        return h


def penalised_model(buffers: bool = True) -> nnx.Module:
    return nnx.Sequential(Penalised(6, 16, 0, buffers), Penalised(16, 8, 1, buffers),
                          nnx.Linear(8, 3, rngs=nnx.Rngs(2)))


def penalised_loss(model, batch, weight=0.1):
    out = model(batch["x"])
    penalty = sum(jax.tree.leaves(nnx.pop(model, nnx.Intermediate)))  # the sown values, taken off the model
    return jnp.sum((out - batch["y"]) ** 2) + weight * penalty, batch["y"].size


def penalised_batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 6)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
            for _ in range(2)]


def train_penalised(make, buffers: bool = True):
    """(parameters, the rest of the model state) after two steps of `make(model)`."""
    model = penalised_model(buffers)
    s = make(model)
    placed = s.init(jaxpar.init_state(model, optax.sgd(0.1)))
    for batch in penalised_batches():
        placed, _ = s.step(placed, s.put_batch(batch))
    out = s.unplace(placed)
    return [np.asarray(a) for a in jax.tree.leaves(out.params)], [np.asarray(a) for a in jax.tree.leaves(
        out.model_state)]


SOW_OUTSIDE_CAPTURE = "ignore:Using 'Module.sow\\(\\)' outside of 'nnx.capture\\(\\)' is deprecated"  # flax 0.12


@pytest.mark.filterwarnings(SOW_OUTSIDE_CAPTURE)
def test_recompute_keeps_what_the_forward_sows_and_the_users_own_variables():
    """Recomputed segments (interval 1 and 2) give what the forward changes besides RNG and BatchStat as the plain
    call does: values sown as nnx.Intermediate reach the loss (and its gradient), a plain nnx.Variable's running
    mean and a counter advance (both were dropped, silently)."""
    tx = optax.sgd(0.1)
    single = lambda interval, loss=penalised_loss: lambda m: jaxpar.SingleDevice(  # noqa: E731
        m, tx, loss_fn=loss, per_sample=False, activation_checkpoint_interval=interval)
    params, state = train_penalised(single(0))
    no_penalty, _ = train_penalised(single(0, functools.partial(penalised_loss, weight=0.0)))
    assert max(float(np.abs(a - b).max()) for a, b in zip(params, no_penalty)) > 1e-3  # the penalty matters
    assert [int(a) for a in state if a.ndim == 0] == [2, 2]  # each Penalised ran once a step
    for interval in (1, 2):
        got_params, got_state = train_penalised(single(interval))
        for a, b in zip(got_params + got_state, params + state):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"interval {interval}")


@pytest.mark.parametrize("per_sample", [True, False])
def test_recompute_and_zero3_fetch_pass_a_sequentials_tuples_on_as_arguments(per_sample):
    """nnx.Sequential hands a layer's tuple output to the next layer as *args (the pipeline does too): where
    activation checkpointing and ZeRO-3's per-layer fetch run the layers themselves, they do the same, and train
    as the single step does (they refused such a model, asking for __call__ to be rewritten)."""
    from test_pipeline import mixed  # Tokens -> (h, tokens) -> Gate(h, tokens) -> ...; dropout in Tokens

    tx = optax.sgd(0.1)

    def trained(make):
        model, loss, batch = mixed()
        if not per_sample:  # whole shards draw their own dropout masks, which change with the device count
            model.layers[0].drop.rate = 0.0
        s = make(jaxpar.Objective.of(model, loss, per_sample=per_sample))
        placed = s.init(jaxpar.init_state(model, tx))
        for _ in range(STEPS):
            placed, _ = s.step(placed, s.put_batch(batch))
        return [np.asarray(a) for a in jax.tree.leaves(s.unplace(placed).params)]

    model, _, _ = mixed()
    start = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    want = trained(lambda o: jaxpar.SingleDevice(o, tx))
    assert max(float(np.abs(a - b).max()) for a, b in zip(want, start)) > 1e-3  # the weights move
    for make in (lambda o: jaxpar.SingleDevice(o.replace(activation_checkpoint_interval=2), tx),
                 lambda o: jaxpar.ZeroRedundancy(o, tx, stage=3, mesh=jaxpar.make_mesh(2))):
        for a, b in zip(trained(make), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class PairIn(nnx.Module):
    """A first layer that takes a (hidden, scale) pair as ONE argument, as nnx.Sequential gives it the model's input."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, pair):
        h, scale = pair
        return self.fc(h) * scale


def test_recompute_gives_the_first_layer_a_tuple_input_whole():
    # (QA59) only a LATER layer spreads an earlier one's tuple over its arguments (nnx.Sequential's convention)
    model = nnx.Sequential(PairIn(nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    x = (jnp.arange(12, dtype=jnp.float32).reshape(3, 4), jnp.float32(2.0))
    want = model(x)
    np.testing.assert_allclose(jaxpar.recompute.checkpointed(model, 1)(x), want, rtol=1e-6)


def test_each_interval_of_one_model_class_recomputes_its_own_segments():
    # (QA59) the recomputing class is made per (class, interval): a later interval is not the first one's
    r = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(4, 4, rngs=r), nnx.relu, nnx.Linear(4, 4, rngs=r))
    segments = {}
    for interval in (1, 3):
        graphdef, state = nnx.split(jaxpar.recompute.checkpointed(model, interval))
        jaxpr = jax.make_jaxpr(lambda st, x, g=graphdef: nnx.merge(g, st)(x))(state, jnp.ones((2, 4)))
        segments[interval] = str(jaxpr).count("custom_vjp_call")
    assert segments == {1: 3, 3: 1}


class Buffer(nnx.Variable):
    """A constant of the user's own kind: read by the forward, never written, not trained."""


class Projected(nnx.Module):
    def __init__(self, rngs):
        self.w = Buffer(jax.random.normal(rngs.params(), (4, 4)))
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x @ self.w[...])


def test_a_constant_variable_the_forward_only_reads_trains_per_sample_under_recompute():
    """Recomputed segments passed every non-weight variable back as a new value, so a constant buffer read as
    replaced and per-sample mode refused the model ("changed its non-RNG state", a QA pass); now only what the
    call changed comes back, and the step equals the plain one."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(4, 4)).astype(np.float32), "y": rng.normal(size=(4, 2)).astype(np.float32)}
    make = lambda: nnx.Sequential(Projected(nnx.Rngs(0)), nnx.relu, nnx.Linear(4, 2, rngs=nnx.Rngs(1)))  # noqa: E731
    out = {}
    for interval in (0, 1):
        s = jaxpar.SingleDevice(make(), TX, loss_fn=jaxpar.OutputLoss(jaxpar.mse),
                                activation_checkpoint_interval=interval)
        placed = s.init(jaxpar.init_state(make(), TX))
        for _ in range(2):
            placed, _ = s.step(placed, s.put_batch(batch))
        out[interval] = s.unplace(placed)
    assert s.objective.per_sample
    moved = jax.tree.leaves(out[0].params)[0] - jax.tree.leaves(jaxpar.init_state(make(), TX).params)[0]
    assert float(jnp.abs(moved).max()) > 1e-3
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(out[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
