"""jaxpar.models.fused: the qkv bias-split computes the plain add and split's numbers, forward and backward, in
float32 and under bf16 compute (add_wide's float32 sum rounded once, the bias gradient summed in float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import GPT, GPTConfig, fused
from jaxpar.precision import add_wide


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


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_gpt_with_the_bias_split_trains_as_with_the_plain_split(dtype, monkeypatch):
    """The whole model: logits and every gradient equal with fused.bias_split_heads and with the plain add and
    split (jnp.split of c_attn's output), float32 and bf16 compute."""
    from jaxpar.models import gpt

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    idx = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)))

    def grads():
        model = GPT(cfg, rngs=nnx.Rngs(0))
        for p in jax.tree.leaves(nnx.state(model, nnx.Param)):  # zero-initialised biases would hide a lost bias
            p += 0.1
        if dtype:  # every weight bf16: the products, the bias adds (add_wide) and the split in bf16
            nnx.update(model, jax.tree.map(lambda a: a.astype(dtype), nnx.state(model, nnx.Param)))
        return nnx.value_and_grad(lambda m: jnp.mean(m(idx).astype(jnp.float32) ** 2))(model)

    fused_loss, fused_grads = grads()

    def plain(attn, x):
        b, t, c = x.shape
        return tuple(a.reshape(b, t, attn.n_head, c // attn.n_head) for a in jnp.split(attn.c_attn(x), 3, -1))

    monkeypatch.setattr(gpt.CausalSelfAttention, "qkv", plain)
    plain_loss, plain_grads = grads()
    np.testing.assert_array_equal(fused_loss, plain_loss)
    qkv_bias = fused_grads["h"][0]["attn"]["c_attn"]["bias"][...]
    assert float(jnp.abs(qkv_bias.astype(jnp.float32)).max()) > 1e-4  # the gradient compared is not 0
    for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-9)
