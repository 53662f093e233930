"""jaxpar.models.fused: the fused bias-GELU and qkv bias-split compute the plain formulas' numbers, forward and
backward, in float32 and under bf16 compute (add_wide's float32 sum rounded once, the bias gradient summed in
float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import GPT, GPTConfig, fused
from jaxpar.precision import add_wide


def _plain_gelu(y, b, approximate):
    return jax.nn.gelu(add_wide(y, b).astype(jnp.float32), approximate=approximate).astype(y.dtype)


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bias_gelu_equals_gelu_of_the_bias_add_forward_and_backward(dtype, approximate):
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.normal(size=(3, 5, 16)) * 2, dtype)
    b = jnp.asarray(rng.normal(size=(16,)), dtype)
    g = jnp.asarray(rng.normal(size=(3, 5, 16)), dtype)
    got, vjp = jax.vjp(lambda y, b: fused.bias_gelu(y, b, approximate), y, b)
    want, vjp_want = jax.vjp(lambda y, b: _plain_gelu(y, b, approximate), y, b)
    tol = 1e-6 if dtype == "float32" else 1e-2  # bf16: the same float32 value rounded once; 1 ulp apart at most
    assert got.dtype == want.dtype == jnp.dtype(dtype)
    # the checks can fail: the bias matters, and the gradients are far from 0 and from the cotangent itself
    assert float(jnp.abs(got.astype(jnp.float32) - _plain_gelu(y, 0 * b, approximate).astype(jnp.float32)).max()) > 0.1
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol)
    (dy, db), (dy_want, db_want) = vjp(g), vjp_want(g)
    assert dy.dtype == jnp.dtype(dtype) and db.dtype == jnp.dtype(dtype)
    assert float(jnp.abs(dy.astype(jnp.float32) - g.astype(jnp.float32)).max()) > 0.1
    np.testing.assert_allclose(dy.astype(jnp.float32), dy_want.astype(jnp.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(db.astype(jnp.float32), db_want.astype(jnp.float32), rtol=tol, atol=5 * tol)
    # the bias's gradient sums the rounded 16-bit gradient in float32, as add_wide's transpose does
    np.testing.assert_allclose(db.astype(jnp.float32), jnp.sum(dy.astype(jnp.float32), (0, 1)).astype(dtype)
                               .astype(jnp.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bias_split_heads_equals_the_plain_add_and_split_exactly(dtype):
    rng = np.random.default_rng(1)
    y = jnp.asarray(rng.normal(size=(2, 7, 3 * 12)), dtype)
    b = jnp.asarray(rng.normal(size=(3 * 12,)), dtype)

    def plain(y, b):
        return tuple(a.reshape(2, 7, 4, 3) for a in jnp.split(add_wide(y, b), 3, -1))

    def loss(split, y, b, g):  # each of q, k, v weighted differently: a wrong order in the join shows
        return sum(jnp.sum(a.astype(jnp.float32) * w * (i + 1)) for i, (a, w) in enumerate(zip(split(y, b), g)))

    g = tuple(jnp.asarray(rng.normal(size=(2, 7, 4, 3)), jnp.float32) for _ in range(3))
    got = jax.jit(lambda y, b: fused.bias_split_heads(y, b, 4))(y, b)
    for a, w in zip(got, plain(y, b)):
        np.testing.assert_array_equal(a, w)
    fused_split = lambda y, b: fused.bias_split_heads(y, b, 4)  # noqa: E731
    dy, db = jax.jit(jax.grad(lambda y, b: loss(fused_split, y, b, g), (0, 1)))(y, b)
    dy_w, db_w = jax.grad(lambda y, b: loss(plain, y, b, g), (0, 1))(y, b)
    assert float(jnp.abs(dy_w.astype(jnp.float32)).max()) > 0.5
    np.testing.assert_array_equal(dy, dy_w)
    np.testing.assert_allclose(db.astype(jnp.float32), db_w.astype(jnp.float32), rtol=1e-6)
    per_row = jax.vmap(jax.grad(lambda y, b: loss(fused_split, y[None], b, tuple(a[:1] for a in g)), (0, 1)),
                       (0, None))(y, b)  # per-sample objectives vmap the backward
    np.testing.assert_allclose(per_row[0][0], dy[0], rtol=1e-6)


def test_the_fused_mlp_trains_as_the_plain_one():
    """A GPT with bias_gelu_fusion on and off: the same logits and gradients (float32)."""
    def grads(fusion):
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias_gelu_fusion=fusion)
        model = GPT(cfg, rngs=nnx.Rngs(0))
        for p in jax.tree.leaves(nnx.state(model, nnx.Param)):  # zero-initialised biases would hide a lost bias
            p += 0.1
        idx = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)))
        return nnx.value_and_grad(lambda m: jnp.mean(m(idx).astype(jnp.float32) ** 2))(model)

    (la, ga), (lb, gb) = grads(True), grads(False)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
