"""bench/gpt_profile.py on a CPU: its "qkv as three products" and "GELU by autodiff" variants compute what the
model computes, and its XLA flag sweep reports a flag this jaxlib lacks in one line and goes on."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import models
from jaxpar.models import gpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpt_profile  # noqa: E402  (bench/gpt_profile.py)


def nano_with_biases() -> nnx.Module:
    """gpt-nano, float32, its c_attn biases random (zero ones, the init, would hide a wrong slice of them)."""
    model = models.get("gpt-nano", seed=0, vocab_size=64, block_size=16, dropout=0.0)
    rng = np.random.default_rng(1)
    for block in model.h:
        block.attn.c_attn.bias[...] = jnp.asarray(rng.normal(0, 0.5, block.attn.c_attn.bias.shape), jnp.float32)
    return model


def loss_grads_and_jaxpr(model, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return *jax.jit(jax.value_and_grad(loss))(params), str(jax.make_jaxpr(loss)(params))


def test_qkv_as_three_products_has_the_fused_products_loss_and_gradients(monkeypatch):
    model = nano_with_biases()
    tokens = np.random.default_rng(0).integers(0, 64, (2, 17), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, grads, jaxpr = loss_grads_and_jaxpr(model, x, y)
    monkeypatch.setattr(gpt.CausalSelfAttention, "qkv", gpt_profile.qkv_three_products)
    loss3, grads3, jaxpr3 = loss_grads_and_jaxpr(model, x, y)
    # the variant ran: two more products per layer, no split
    assert jaxpr3.count("dot_general") == jaxpr.count("dot_general") + 2 * len(model.h), "the patch did not take"
    np.testing.assert_allclose(loss3, loss, rtol=1e-6)
    for (path, g), g3 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads3)):
        np.testing.assert_allclose(g3, g, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))

    # 16-bit compute: the bias added in float32 (add_wide) as c_attn adds it, q k v in the compute dtype
    attn = model.h[0].attn
    graphdef, params, rest = nnx.split(attn, nnx.Param, ...)
    low = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), rest)
    x_BxTxC = jnp.asarray(np.random.default_rng(2).normal(size=(2, 16, 48)), jnp.bfloat16)
    monkeypatch.undo()
    fused = low.qkv(x_BxTxC)
    three = gpt_profile.qkv_three_products(low, x_BxTxC)
    for a, b in zip(three, fused):
        assert a.dtype == b.dtype == jnp.bfloat16 and a.shape == b.shape == (2, 16, 3, 16)
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2, atol=1e-2)


def test_gelu_by_autodiff_is_the_mlp_before_bias_gelu(monkeypatch):
    """The variant "GELU by autodiff" (the MLP as it was before models.gpt_ops.bias_gelu) has the model's loss and
    gradients (float32), and the model's MLP runs bias_gelu while the variant's does not."""
    model = nano_with_biases()
    for block in model.h:  # c_fc's bias random too
        block.mlp.c_fc.bias[...] = jnp.asarray(np.random.default_rng(3).normal(0, 0.5, block.mlp.c_fc.bias.shape))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 17), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, grads, jaxpr = loss_grads_and_jaxpr(model, x, y)
    monkeypatch.setattr(gpt.MLP, "__call__", gpt_profile.mlp_autodiff_gelu)
    loss7, grads7, jaxpr7 = loss_grads_and_jaxpr(model, x, y)
    assert "name=bias_gelu" in jaxpr and "name=bias_gelu" not in jaxpr7, "the patch did not take"
    np.testing.assert_allclose(loss7, loss, rtol=1e-6)
    for (path, g), g7 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads7)):
        np.testing.assert_allclose(g7, g, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_flag_sweep_reports_an_unknown_flag_and_goes_on(capsys):
    """Under --sweep-variant 3 (per_sample=False, 16-bit adds): the processes run that variant, as the header, which
    reads their own record, says."""
    gpt_profile.main(["--model", "gpt-nano", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1",
                      "--trace-steps", "0", "--xla-flag-sets=--xla_no_such_flag=true", "--sweep-variant", "3"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["--xla_no_such_flag=true"][0] == "FAILED: unknown flag on this jaxlib: --xla_no_such_flag=true"
    assert float(rows["(none: the baseline)"][0].replace(",", "")) > 0  # the baseline ran, in the same sweep
    assert f"bf16, {gpt_profile.VARIANTS[2]}, jax " in out
    assert gpt_profile.failure(1, "Traceback ...\nValueError: boom\n") == "FAILED (exit status 1): ValueError: boom"


@pytest.mark.parametrize("argv, message", [
    (["--xla-flag-sets", "default", "--sweep-variant", "8"], "--sweep-variant 8: give a number from 1 to 7"),
    (["--sweep-variant", "2"], "--sweep-variant belongs to the flag sweep: give --xla-flag-sets too")])
def test_sweep_variant_is_checked_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpt_profile.parse(argv)
    assert message in capsys.readouterr().err
