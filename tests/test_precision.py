"""--precision bf16: bfloat16 compute, float32 master parameters and optimizer state (what torch AMP does)."""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import Objective, as_rows, models
from jaxpar.config import Config
from jaxpar.optim import make_optimizer
from jaxpar.precision import compute_dtype
from jaxpar.step import init_state, make_train_step
from jaxpar.strategies.base import get_builder

FEATURES, CLASSES, BATCH = 20, 4, 32


def data(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), -1).astype(np.int32)  # a learnable teacher
    return as_rows({"x": x, "y": y})


def mlp():
    return models.get("mlp", seed=0, in_features=FEATURES, hidden_dim=64, out_features=CLASSES)


def train(precision: str, steps: int = 30):
    tx = make_optimizer("adam", 1e-2)
    model = mlp()
    state = init_state(model, tx)
    step = make_train_step(Objective.of(model, compute_dtype=compute_dtype(precision)), tx)
    batches = data(steps * BATCH)
    losses = []
    for i in range(steps):
        batch = jax.tree.map(lambda v: v[i * BATCH:(i + 1) * BATCH], batches)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses), step, batch


def float_dtypes(tree) -> set:
    return {a.dtype for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}


def all_eqns(jaxpr):
    """Every equation of a jaxpr and of those nested in it (jit, shard_map, custom_vjp, vmap rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def dot_eqns(jaxpr):
    """Every dot_general of a jaxpr and of those nested in it."""
    return (eqn for eqn in all_eqns(jaxpr) if eqn.primitive.name == "dot_general")


def dot_operands(jaxpr) -> collections.Counter:
    """How many products of a jaxpr take operands of each dtype pair: what they really compute in. A dot whose
    algorithm names its operands' type (jax.nn.dot_product_attention's backward: a float32 cotangent against bf16
    keys under BF16_BF16_F32, which rounds it to bf16) counts as that type."""
    out = collections.Counter()
    for eqn in dot_eqns(jaxpr):
        algorithm = eqn.params.get("precision")
        if isinstance(algorithm, jax.lax.DotAlgorithmPreset) and algorithm.name.startswith("BF16_BF16_"):
            out[("bfloat16", "bfloat16")] += 1
        else:
            out[tuple(v.aval.dtype.name for v in eqn.invars)] += 1
    return out


def dot_outputs(jaxpr) -> set:
    """The result dtypes of a jaxpr's products: float32 where 16-bit operands accumulate into a float32 result."""
    return {eqn.outvars[0].aval.dtype.name for eqn in dot_eqns(jaxpr)}


def test_bf16_tracks_fp32_and_keeps_float32_master_state():
    s32, l32, _, _ = train("fp32")
    s16, l16, step16, batch = train("bf16")
    # bf16 really computes in bf16: its matmuls (forward and backward) take bf16 operands, its losses are not fp32's
    assert set(dot_operands(jax.make_jaxpr(step16)(s16, batch).jaxpr)) == {("bfloat16", "bfloat16")}
    assert not np.array_equal(l16, l32)
    # ... and still tracks fp32: both learn, and the curves stay close step by step
    assert l32[-5:].mean() < 0.6 * l32[:5].mean() and l16[-5:].mean() < 0.6 * l16[:5].mean()
    np.testing.assert_allclose(l16, l32, atol=0.05, rtol=0.05)
    # master params and optimizer state stay float32
    assert float_dtypes(s16.params) == {jnp.dtype(jnp.float32)}
    assert float_dtypes(s16.opt_state) == {jnp.dtype(jnp.float32)}


@functools.lru_cache(maxsize=None)
def one_step(strategy_name: str, precision: str, **cfg_kw):
    """(params, loss) after one SGD step of `strategy_name` from the same initial state and batch."""
    cfg = Config(strategy=strategy_name, model="mlp", optimizer="sgd", precision=precision, **dict(cfg_kw))
    tx = make_optimizer("sgd", 0.5, momentum=0.0)
    model = mlp()
    state = init_state(model, tx)
    strategy = get_builder(strategy_name)(model, tx, cfg)
    placed, metrics = strategy.step(strategy.init(state), strategy.put_batch(data(BATCH, seed=1)))
    return strategy.unplace(placed).params, float(metrics["loss"])


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name,kw", [("ddp", {}), ("dp", {"num_devices": 2}), ("pipeline", {"num_stages": 2, "micro_batches": 4})])
def test_every_strategy_honours_precision(name, kw):
    """A builder that ignored cfg.precision would give bit-identical fp32 and bf16 runs: each step is deterministic."""
    (ref32, loss32), (ref16, loss16) = one_step("single", "fp32"), one_step("single", "bf16")
    bf16_error = max_diff(ref16, ref32)
    assert bf16_error > 1e-6  # bf16 really changes the reference's step
    (p32, l32), (p16, l16) = one_step(name, "fp32", **kw), one_step(name, "bf16", **kw)
    assert max_diff(p16, p32) > 0.1 * bf16_error  # the flag reached the strategy's compute ...
    assert max_diff(p16, p32) < 10 * bf16_error  # ... as bf16 rounding, not as another computation
    assert abs(l16 - loss16) < 10 * abs(loss16 - loss32) + 1e-4
    assert float_dtypes(p16) == {jnp.dtype(jnp.float32)}  # master params stay float32


def test_an_embedding_fixed_at_float32_is_refused_under_16_bit_compute():
    """Flax's nnx.Embed sets its dtype to its table's (float32) when built: under compute_dtype=bf16 its lookups,
    and every layer after them, would compute in float32 while the run says bf16. Refused in one line, naming the
    module and the fix; with the fix every product of the step takes bf16 operands (float32 ones before it)."""
    from flax import nnx

    class Tagger(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Embed(10, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)])

        def __call__(self, x):
            return self.layers[1](self.layers[0](x))

    model = Tagger(nnx.Rngs(0))
    batch = as_rows({"x": np.arange(12, dtype=np.int32).reshape(4, 3) % 10, "y": np.zeros((4, 3), np.int32)})
    tx = make_optimizer("sgd", 0.1)
    state = init_state(model, tx)
    fixed_at_32 = Objective.of(model)  # as it computes today: float32 from the lookup on, whatever is cast
    assert set(dot_operands(jax.make_jaxpr(make_train_step(fixed_at_32.replace(compute_dtype=jnp.bfloat16), tx))(
        state, batch).jaxpr)) == {("float32", "float32")}
    with pytest.raises(ValueError, match=r"compute_dtype=bfloat16, but Tagger.layers\[0\] is an nnx.Embed with "
                                         r"dtype=float32 .* set `layers\[0\].dtype = None` after building it"):
        Objective.of(model, compute_dtype=jnp.bfloat16)
    model.layers[0].dtype = jnp.bfloat16  # pinned to bf16: float16 compute would promote it to float32
    with pytest.raises(ValueError, match=r"Tagger.layers\[0\] is an nnx.Embed with dtype=bfloat16"):
        Objective.of(model, compute_dtype=jnp.float16)
    model.layers[0].dtype = None
    step = make_train_step(Objective.of(model, compute_dtype=jnp.bfloat16), tx)
    assert set(dot_operands(jax.make_jaxpr(step)(state, batch).jaxpr)) == {("bfloat16", "bfloat16")}
    assert float_dtypes(step(state, batch)[0].params) == {jnp.dtype(jnp.float32)}


def test_a_pipeline_built_before_its_embedding_was_fixed_computes_in_16_bits():
    """A PipelineModule cuts its stages when it is built; an Embed fixed after that (as the refusal says) must reach
    the stages too: the layer after it sees bf16 inputs, where it saw float32 before the pipeline re-cut them."""
    import optax
    from flax import nnx

    from jaxpar import LayerSpec, Pipeline, PipelineModule, init_state

    seen = []

    class Probe(nnx.Module):  # records the dtype its input has when traced
        def __init__(self, d, rngs):
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            seen.append(x.dtype)
            return self.lin(x)

    seq = np.random.default_rng(0).integers(0, 16, (8, 5)).astype(np.int32)
    batch = {"x": seq[:, :-1], "y": seq[:, 1:]}
    tx = optax.sgd(0.1)
    module = PipelineModule([LayerSpec(nnx.Embed, 16, 8), LayerSpec(Probe, 8), LayerSpec(nnx.Linear, 8, 16)],
                            num_stages=2)
    with pytest.raises(ValueError, match=r"Layers.layers\[0\] is an nnx.Embed with dtype=float32"):
        Pipeline(module, tx, micro_batches=2, compute_dtype=jnp.bfloat16)
    module.model.layers[0].dtype = None
    s = Pipeline(module, tx, micro_batches=2, compute_dtype=jnp.bfloat16)
    seen.clear()
    placed, metrics = s.step(s.init(init_state(module.model, tx)), s.put_batch(batch))
    assert seen and set(seen) == {jnp.dtype(jnp.bfloat16)} and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("name,shape,dtype", [("mlp", (8, 784), jnp.bfloat16), ("mlp", (8, 784), jnp.float16),
                                              ("convnet", (4, 28, 28, 1), jnp.bfloat16)])
def test_the_tutorial_models_sum_16_bit_gradients_in_float32(name, shape, dtype):
    """Their biases are added in float32 (jaxpar.precision.add_wide), so the bias gradients, sums over the batch
    (and the image), accumulate in float32; the ConvNet's LogSoftmax runs in float32 as under torch autocast.
    Before, the step summed 16-bit numbers (the MLP's three bias gradients, the ConvNet's four and its softmax)."""
    from jaxpar.strategies.single import SingleDevice

    model = models.get(name, seed=0)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=shape).astype(np.float32), "y": rng.integers(0, 10, shape[0]).astype(np.int32)}
    s = SingleDevice(model, make_optimizer("sgd", 0.1), compute_dtype=dtype)
    state, rows = s.init(init_state(model, s.tx)), s.put_batch(batch)
    jaxpr = jax.make_jaxpr(s._step)(state, rows).jaxpr
    low = jnp.dtype(dtype).name
    assert dot_operands(jaxpr)[(low, low)] > 0
    assert [e.primitive.name for e in all_eqns(jaxpr) if e.primitive.name in ("reduce_sum", "scatter-add")
            and e.invars[0].aval.dtype.itemsize < 4] == []


def test_the_gradient_norm_of_16_bit_leaves_is_summed_and_returned_in_float32():
    """step.squared_norm (every strategy's grad_norm and clip) squares and sums 16-bit gradients in float32: 1,001
    bfloat16 threes give 9,009 exactly, which bfloat16 (8 significant bits) cannot hold (it rounds to 9,024)."""
    from jaxpar.step import grad_norm, squared_norm

    leaves = {"a": jnp.full((1001,), 3.0, jnp.bfloat16), "b": jnp.zeros((3,), jnp.float16)}
    assert float(jnp.asarray(9009.0, jnp.bfloat16)) != 9009.0  # the comparison below can fail
    got = squared_norm(leaves)
    assert got.dtype == jnp.float32 and float(got) == 9009.0
    assert grad_norm(leaves).dtype == jnp.float32 and float(grad_norm(leaves)) == pytest.approx(9009.0 ** 0.5)
