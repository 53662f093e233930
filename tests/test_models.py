"""models/ (jaxpar.models): parameter counts, PyTorch parity both ways (fixtures from make_torch_fixtures.py), the layer
view, stock nnx.Dropout made split-independent by the per-sample objective, and the convolution implementations."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import models
from make_torch_fixtures import ALEXNET_CLASSES, FIXTURES, MLP_SIZES, POOL_SIZES, recipe_state_dict
from jaxpar import Objective, OutputLoss, as_rows, cross_entropy
from jaxpar.models.layers import CONV_CHUNK, AdaptiveAvgPool2d, Conv2d, adaptive_bins

CONVNET_PARAMS = 1_199_882  # pytorch/examples mnist Net
ALEXNET_PARAMS = 57_044_810  # torchvision alexnet(num_classes=10)
TOL = dict(atol=1e-5, rtol=1e-5)
SMALL = {"linear": {}, "mlp": MLP_SIZES, "convnet": {}, "alexnet": dict(num_classes=ALEXNET_CLASSES)}
CLASSIC = tuple(SMALL)  # the tutorial models (the GPT family has tests/test_gpt.py)


@nnx.jit
def _apply(model, x):
    return model(x)


@nnx.jit
def _nll_grads(model, x, y):
    """Gradients of the summed NLL, the loss the fixtures differentiate in torch."""
    def loss(model):
        out = model(x)
        logp = out if isinstance(model, models.ConvNet) else jax.nn.log_softmax(out)
        return -jnp.take_along_axis(logp, y[:, None], axis=1).sum()
    grads = nnx.grad(loss)(model)
    return nnx.merge(nnx.graphdef(model), grads, nnx.state(model, nnx.Not(nnx.Param)))  # a model holding them


def _model(name, **kw):
    """Model `name` with numpy recipe weights: no per-shape compiles of jax.random (seconds on 2 cores)."""
    sd = recipe_state_dict(models.torch_shapes(models.abstract(name, **kw)))
    return models.from_torch_state_dict(name, sd, **kw)


def _eval(model):
    """The model in eval mode (dropout off), as the fixtures were made with torch's model.eval()."""
    model.eval()
    return model


def _load(name):
    fx = dict(np.load(os.path.join(FIXTURES, f"{name}.npz")))
    if "keys" in fx:  # weights too large to commit: regenerate them the way the fixture script did
        shapes = {k: tuple(int(d) for d in s.strip("()").split(",") if d.strip())
                  for k, s in zip(fx["keys"], fx["shapes"])}
        sd = recipe_state_dict(shapes)
    else:
        sd = {k[3:]: v for k, v in fx.items() if k.startswith("sd/")}
    x = fx["x"] if fx["x"].ndim == 2 else fx["x"].transpose(0, 2, 3, 1)  # NCHW -> NHWC
    return fx, sd, jnp.asarray(x)


def test_param_counts():
    assert models.num_params(models.abstract("convnet")) == CONVNET_PARAMS
    assert models.num_params(models.abstract("alexnet", num_classes=10)) == ALEXNET_PARAMS
    assert models.num_params(models.abstract("linear")) == 5 * 2 + 2
    assert models.num_params(models.abstract("mlp", **MLP_SIZES)) == 20 * 32 + 32 + 32 * 10 + 10


@pytest.mark.parametrize("name", CLASSIC)
def test_param_paths_mirror_torch_keys(name):
    """NNX state paths are torch's keys with '/' and kernel for weight (the MLP's Sequential is `layers`)."""
    model = models.abstract(name, **SMALL[name])
    paths = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    prefix = "layers/" if name == "mlp" else ""
    expected = {prefix + k.replace(".weight", ".kernel").replace(".", "/") for k in models.torch_shapes(model)}
    assert paths == expected


@pytest.mark.parametrize("name", CLASSIC)
def test_torch_parity_both_ways(name):
    fx, sd, x = _load(name)
    assert list(sd) == list(models.torch_shapes(models.abstract(name, **SMALL[name])))  # torch's keys, order
    model = _eval(models.from_torch_state_dict(name, sd))  # sizes read off the state dict
    assert not np.allclose(_apply(model, x[::-1]), fx["out"], **TOL)  # the comparison below can fail
    np.testing.assert_allclose(_apply(model, x), fx["out"], **TOL)
    grads = models.to_torch_state_dict(_nll_grads(model, x, jnp.asarray(fx["y"])))
    fx_grads = {k[5:]: v for k, v in fx.items() if k.startswith("grad/")}
    assert fx_grads
    for key, g in fx_grads.items():  # float32 sums of thousands of terms: atol relative to the tensor's scale
        np.testing.assert_allclose(grads[key], g, atol=1e-5 * np.abs(g).max(), rtol=1e-5, err_msg=key)
    back = models.to_torch_state_dict(model)
    assert list(back) == list(sd)
    for key in sd:
        assert back[key].shape == sd[key].shape and np.array_equal(back[key], sd[key]), key
    # saved from torch's wrappers (DDP's `module.`, torch.compile's `_orig_mod.`, either order): the same weights
    for prefix in ("module.", "_orig_mod.module.", "module._orig_mod."):
        wrapped = models.from_torch_state_dict(name, {prefix + k: v for k, v in sd.items()})
        assert all(np.array_equal(v, sd[k]) for k, v in models.to_torch_state_dict(wrapped).items()), prefix


@pytest.mark.parametrize("hw", POOL_SIZES)
def test_adaptive_avg_pool_matches_torch(hw):
    fx = np.load(os.path.join(FIXTURES, "alexnet.npz"))
    x = fx[f"pool_x/{hw[0]}x{hw[1]}"].transpose(0, 2, 3, 1)
    out = AdaptiveAvgPool2d(6)(jnp.asarray(x)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(out, fx[f"pool_out/{hw[0]}x{hw[1]}"], **TOL)


def test_adaptive_bins_rule():
    assert adaptive_bins(1, 6) == [(0, 1)] * 6  # replicate
    assert adaptive_bins(8, 6) == [(0, 2), (1, 3), (2, 4), (4, 6), (5, 7), (6, 8)]  # overlapping
    assert adaptive_bins(12, 6) == [(2 * i, 2 * i + 2) for i in range(6)]


@pytest.mark.parametrize("name", CLASSIC)
def test_layers_compose_to_model(name):
    kw = {**SMALL[name], **({"dropout": 0.5} if name == "alexnet" else {})}
    model = _model(name, **kw)
    x = jax.random.normal(jax.random.key(1), (3, *models.input_shape(name, **kw)))
    layers = models.as_layers(model)
    assert all(a is b for a, b in zip(layers, models.as_layers(model)))  # the same layer objects each time
    assert len(layers) == {"linear": 1, "mlp": 3, "convnet": 12, "alexnet": 22}[name]

    @nnx.jit
    def composed(model, x):
        for layer in models.as_layers(model):
            x = layer(x)
        return x

    # the same RNG streams in the same state for both: each call starts from a clone
    train, fold_train = _apply(nnx.clone(model), x), composed(nnx.clone(model), x)
    evaluated, fold_eval = _apply(_eval(nnx.clone(model)), x), composed(_eval(nnx.clone(model)), x)
    np.testing.assert_array_equal(fold_train, train)
    np.testing.assert_array_equal(fold_eval, evaluated)
    has_dropout = any(isinstance(layer, nnx.Dropout) for layer in layers)
    assert has_dropout == (name in ("convnet", "alexnet"))
    assert np.array_equal(train, evaluated) != has_dropout  # dropout on in training only


def _outputs(objective, state, x, ids):
    """The training forward's outputs, compiled (op by op, the per-sample convnet took 9-21 s in CI)."""
    rows = as_rows({"x": x, "y": np.zeros(len(x), np.int32)}, ids)
    return jax.jit(lambda p, s, r: objective.outputs(p, s, r)[0])(state[0], state[1], rows)


def test_stock_dropout_is_split_invariant():
    """The per-sample objective: every row's masks come from its own id, so any split of the batch gives the
    whole batch's outputs, and other ids give other masks."""
    model = _model("convnet")
    objective = Objective.of(model, OutputLoss(cross_entropy))
    state = objective.split(model)
    x = jax.random.normal(jax.random.key(2), (6, 28, 28, 1))
    ids = np.arange(10, 16)
    whole = _outputs(objective, state, x, ids)
    assert not np.allclose(whole, _outputs(objective, state, x, ids + 100)), "the masks must depend on the ids"
    for bounds in ((0, 3, 6), (0, 2, 4, 6)):
        parts = [_outputs(objective, state, x[a:b], ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        np.testing.assert_allclose(jnp.concatenate(parts), whole, atol=1e-6, rtol=1e-6)


def test_stock_dropout_masks_per_sample_and_per_layer():
    class TwoDrops(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Dropout(0.25, rngs=rngs), nnx.Dropout(0.25, rngs=rngs)

        def __call__(self, x):
            return jnp.stack([self.a(x), self.b(x)], axis=1)

    model = TwoDrops(nnx.Rngs(0))
    objective = Objective.of(model, OutputLoss(cross_entropy))
    masks = np.asarray(_outputs(objective, objective.split(model), jnp.ones((6, 4000)), np.arange(6)))
    assert set(np.unique(masks).tolist()) == {0.0, float(np.float32(1 / 0.75))}
    assert abs(float((masks > 0).mean()) - 0.75) < 0.01
    assert not np.array_equal(masks[0, 0], masks[1, 0])  # per-sample masks
    assert not np.array_equal(masks[:, 0], masks[:, 1])  # each layer its own stream


@pytest.mark.parametrize("b,cin,cout,k,stride,pad,hw", [
    (2, 3, 8, 11, 4, 2, 23), (2, 4, 6, 5, 1, 2, 9), (2, 3, 4, 3, 2, 1, 9), (CONV_CHUNK * 2 + 3, 2, 3, 3, 1, 0, 6)])
def test_conv_impls_agree(b, cin, cout, k, stride, pad, hw):
    assert models.default_conv_impl() == "chunked"  # tests run on CPU
    x = jax.random.normal(jax.random.key(3), (b, hw, hw, cin))
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((k, k, cin, cout), np.float32) / np.sqrt(k * k * cin)  # outputs O(1)
    bias = rng.standard_normal(cout, np.float32)
    convs = {}
    for impl in models.CONV_IMPLS:
        convs[impl] = nnx.eval_shape(lambda: Conv2d(cin, cout, k, stride, pad, rngs=nnx.Rngs(0), impl=impl))
        convs[impl].kernel.set_value(jnp.asarray(kernel))
        convs[impl].bias.set_value(jnp.asarray(bias))

    def loss(conv, x):
        return jnp.sum(jnp.sin(conv(x)))

    @nnx.jit
    def run(convs, x):
        return {impl: (conv(x), *nnx.grad(loss, argnums=(0, 1))(conv, x)) for impl, conv in convs.items()}

    results = run(convs, x)
    y1, gc1, gx1 = results["xla"]
    assert y1.shape == (b, (hw + 2 * pad - k) // stride + 1, (hw + 2 * pad - k) // stride + 1, cout)
    assert float(jnp.abs(y1).max()) > 0.1 and float(jnp.abs(gx1).max()) > 0.01
    for impl in ("im2col", "chunked"):
        y2, gc2, gx2 = results[impl]
        np.testing.assert_allclose(y1, y2, **TOL)
        np.testing.assert_allclose(gx1, gx2, **TOL)
        np.testing.assert_allclose(gc1.kernel[...], gc2.kernel[...], **TOL)
        np.testing.assert_allclose(gc1.bias[...], gc2.bias[...], **TOL)


def test_bad_state_dicts_name_the_key():
    sd = models.to_torch_state_dict(_model("mlp", **MLP_SIZES))
    with pytest.raises(ValueError, match=r"'2.bias'.*\(3,\), expected \(10,\)"):
        models.from_torch_state_dict("mlp", {**sd, "2.bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"missing keys \['0.bias'\]"):
        models.from_torch_state_dict("mlp", {k: v for k, v in sd.items() if k != "0.bias"})
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        models.from_torch_state_dict("mlp", {**sd, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'fc1.weight'.*\(128, 100\), expected \(128, 9216\)"):
        convnet_sd = models.torch_shapes(models.abstract("convnet"))
        models.from_torch_state_dict("convnet", {k: np.zeros((128, 100) if k == "fc1.weight" else s)
                                                 for k, s in convnet_sd.items()})


def test_state_dicts_of_non_float_or_non_finite_values_are_refused_naming_the_key():
    """A QA pass loaded an mlp whose bias held a NaN (outputs NaN; train.py then blamed the learning rate), an
    int64 state dict (outputs of 358,307 against 0.196), bools and complex numbers (the imaginary part dropped with a
    numpy warning), all cast to float32 in silence; GPT refused NaN only. Now every model refuses them by key; float
    dtypes other than float32 (and torch's bfloat16 tensors, which numpy lacks) still load."""
    sd = models.to_torch_state_dict(_model("mlp", **MLP_SIZES))
    bad = [({**sd, "0.bias": np.where(np.arange(len(sd["0.bias"])) == 3, np.nan, sd["0.bias"])},
            "'0.bias' holds NaN or infinite values"),
           ({**sd, "2.weight": np.full_like(sd["2.weight"], np.inf)}, "'2.weight' holds NaN or infinite"),
           ({**sd, "0.weight": (sd["0.weight"] * 1e4).astype(np.int64)}, "'0.weight' holds int64 values.*floating"),
           ({**sd, "0.bias": sd["0.bias"] > 0}, "'0.bias' holds bool values"),
           ({**sd, "2.bias": sd["2.bias"].astype(np.complex64)}, "'2.bias' holds complex64 values")]
    for state_dict, message in bad:
        with pytest.raises(ValueError, match=message):
            models.from_torch_state_dict("mlp", state_dict)
    gpt_sd = models.to_torch_state_dict(models.gpt.GPT(models.gpt.GPTConfig(vocab_size=16, block_size=4, n_layer=1,
                                                                             n_head=2, n_embd=8), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="'transformer.wpe.weight' holds int32 values"):
        models.gpt.from_torch_state_dict({**gpt_sd, "transformer.wpe.weight":
                                          gpt_sd["transformer.wpe.weight"].astype(np.int32)}, n_head=2)
    half = models.from_torch_state_dict("mlp", {k: v.astype(np.float16) for k, v in sd.items()})
    assert np.isfinite(np.asarray(half.layers[0].kernel[...])).all()


def test_registry_and_input_shapes():
    with pytest.raises(ValueError, match="use one of"):
        models.get("resnet")
    assert models.input_shape("linear") == (5,)
    assert models.input_shape("mlp", in_features=20) == (20,)
    assert models.input_shape("convnet") == models.input_shape("convnet", image_size=28) == (28, 28, 1)
    with pytest.raises(ValueError, match="must be 28"):
        models.input_shape("convnet", image_size=32)
    assert models.input_shape("alexnet") == (64, 64, 3)
    assert models.input_shape("alexnet", image_size=224) == (224, 224, 3)
    with pytest.raises(ValueError, match="63"):
        models.input_shape("alexnet", image_size=32)
    out = jax.eval_shape(lambda x: models.get("alexnet")(x), jax.ShapeDtypeStruct((1, 63, 63, 3), jnp.float32))
    assert out.shape == (1, 10)


def test_fresh_layers_draw_torchs_default_init_bounds():
    """A fresh Conv2d and Linear draw their weights and biases from torch's default init, U(-1/sqrt(fan_in),
    +1/sqrt(fan_in)) (kaiming_uniform(a=sqrt(5))), with fan_in = in_channels x kernel height x kernel width for a
    convolution (a non-square kernel here, so each factor shows): the draws reach the bound and stay inside it."""
    from jaxpar.models.layers import Linear

    rngs = nnx.Rngs(0)
    for layer, fan_in in ((Conv2d(3, 16, (5, 4), rngs=rngs), 3 * 5 * 4), (Linear(40, 300, rngs=rngs), 40)):
        bound = 1 / np.sqrt(fan_in)
        kernel, bias = np.abs(np.asarray(layer.kernel[...])), np.abs(np.asarray(layer.bias[...]))
        assert 0.95 * bound < kernel.max() <= bound and bias.max() <= bound, (type(layer).__name__, kernel.max())


def test_dropout_rates_are_torchs():
    """pytorch/examples' mnist Net drops 0.25 after its convolutions and 0.5 before fc2; torchvision's AlexNet 0.5
    before each of its first two classifier Linears (its default)."""
    convnet = models.abstract("convnet")
    assert (convnet.dropout1.rate, convnet.dropout2.rate) == (0.25, 0.5)
    layers = models.as_layers(convnet)
    assert layers.index(convnet.dropout1) < layers.index(convnet.fc1) < layers.index(convnet.dropout2)
    alexnet = models.abstract("alexnet")
    assert [layer.rate for layer in alexnet.classifier if isinstance(layer, nnx.Dropout)] == [0.5, 0.5]
