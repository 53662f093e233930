"""GPT-2 (jaxpar.models.gpt): logits and gradients equal the PyTorch twin's (tests/gpt_torch.py, nanoGPT's layout)
and Hugging Face's GPT2LMHeadModel's (tests/fixtures/gpt.npz, from make_gpt_fixture.py), and export gives back
torch's own state dict; every data-parallel strategy equals the single device with dropout on; the CLI's GPT path (text data, tokens/s, bits per byte, MFU, export); bad input.

The tiny model: 2 layers x 32 wide, 4 heads, 64 tokens, sequences of 16.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import gpt

from make_gpt_fixture import CASES, FIXTURE, TINY, C, H, L, T, V  # noqa: E402  (tests/, the fixture's sizes)
GPT2_PARAMS = 124_439_808  # GPT2LMHeadModel("gpt2").num_parameters(): wte counted once (tied)


def tokens(n: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (n, T))


def logits_of(model: gpt.GPT, x: np.ndarray) -> np.ndarray:
    model.eval()
    return np.asarray(model(jnp.asarray(x)))


def scramble(model: gpt.GPT, seed: int) -> gpt.GPT:
    """Weights far from the init (N(0, 0.3), LayerNorm scales 1 + N(0, 0.3)): logits of order 10, every weight
    mattering, so a transposed or misplaced matrix cannot hide under 1e-5."""
    rng = np.random.default_rng(seed)
    for path, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param):
            value = rng.normal(0, 0.3, p.shape).astype(np.float32)
            p.set_value(jnp.asarray(value + (1.0 if path[-1] == "scale" else 0.0)))
    return model


def fixture(case: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(torch's state dict, tokens, torch's logits) of one model in tests/fixtures/gpt.npz (make_gpt_fixture.py)."""
    with np.load(FIXTURE) as f:
        sd = {k[len(case) + 4:]: f[k] for k in f.files if k.startswith(f"{case}/sd/")}
        return sd, f[f"{case}/x"], f[f"{case}/logits"]


# -- PyTorch interop -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_torch_to_jaxpar_logits_equal(case):
    """Hugging Face's GPT2LMHeadModel and the nanoGPT twin (with and without biases, with GPT-2's tanh GELU and
    with nanoGPT's own erf one): their state dicts load, and the logits equal torch's."""
    layout, bias, act = CASES[case]
    sd, x, want = fixture(case)
    fresh = logits_of(gpt.GPT(gpt.GPTConfig(bias=bias, **TINY), rngs=nnx.Rngs(0)), x)
    assert np.abs(fresh - want).max() > 1.0  # the sides differ before the weights travel
    assert gpt.normalize_state_dict(sd)[1] == layout
    model = gpt.from_torch_state_dict(sd, n_head=H, activation_function=act)
    assert model.config == gpt.GPTConfig(bias=bias, activation_function=act, **TINY)  # sizes read off the dict
    assert np.abs(want).max() > 5.0
    np.testing.assert_allclose(logits_of(model, x), want, rtol=1e-5, atol=1e-5)
    other = {"gelu": "gelu_new", "gelu_new": "gelu"}[act]  # the other GELU on the same weights: far beyond 1e-5
    assert np.abs(logits_of(gpt.from_torch_state_dict(sd, n_head=H, activation_function=other), x) - want).max() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_jaxpar_to_torch_state_dict_is_torchs_own(case):
    """Export gives back exactly the state dict torch saved (every key torch's state_dict() has, lm_head.weight
    included; same shapes, same values), so torch loads it strictly and computes the logits checked above. The
    exported weights are jaxpar's: a scrambled model exports different values."""
    layout, bias, act = CASES[case]
    sd, _, _ = fixture(case)
    other = scramble(gpt.GPT(gpt.GPTConfig(bias=bias, **TINY), rngs=nnx.Rngs(0)), seed=2).torch_state_dict(layout)
    assert set(other) == set(sd)
    assert all(np.abs(other[k] - sd[k]).max() > 0.1 for k in sd if not k.endswith(".attn.bias"))
    back = gpt.from_torch_state_dict(sd, n_head=H, activation_function=act).torch_state_dict(layout)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype, k
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_gradients_equal_the_torch_twins():
    """The whole backward (the CPU weight-gradient GEMMs of gpt.matmul included) against torch autograd: the
    gradient of the mean token cross-entropy, read back through the nanoGPT state-dict layout."""
    sd, _, _ = fixture("nanogpt")
    with np.load(FIXTURE) as f:
        x, y, loss = f["grad/x"], f["grad/y"], float(f["grad/loss"])
        want = {k[5:]: f[k] for k in f.files if k.startswith("grad/") and k[5:] in sd}
    model = gpt.from_torch_state_dict(sd, n_head=H)
    objective = jaxpar.Objective.of(model)
    params, rest = objective.split(model)
    (sums, _), grads = jax.jit(objective.value_and_grad)(params, rest, jaxpar.as_rows({"x": x, "y": y}))
    assert float(sums.loss / sums.weight) == pytest.approx(loss, rel=1e-5)
    graphdef = nnx.graphdef(model)
    got = nnx.merge(graphdef, jax.tree.map(lambda g: g / sums.weight, grads), rest).torch_state_dict("nanogpt")
    assert len(want) == 2 + 2 + 12 * L  # wte, wpe, ln_f (2), every block's 12 weights (lm_head is wte, tied)
    for name, g in want.items():
        assert np.abs(g).max() > 1e-4, name  # a gradient that could be wrong
        np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("vmapped", [False, True])
def test_cpu_matmuls_have_plain_gradients(vmapped):
    """gpt.matmul / matmul_t (one NN GEMM for the weight gradient, also under vmap) == autodiff of x @ w."""
    rng = np.random.default_rng(0)
    x, w, wt = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 6, 8), (8, 5), (3, 8)))
    for ours, plain, weight in ((gpt.matmul, lambda x, w: x @ w, w), (gpt.matmul_t, lambda x, w: x @ w.T, wt)):
        def loss(fn, x, w):
            out = jax.vmap(lambda row: fn(row, w))(x) if vmapped else fn(x, w)
            return jnp.sum(jnp.sin(out))
        want = jax.grad(lambda x, w: loss(plain, x, w), argnums=(0, 1))(x, weight)
        got = jax.jit(jax.grad(lambda x, w: loss(ours, x, w), argnums=(0, 1)))(x, weight)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_weight_gradients_transpose_their_operand_from_memory(monkeypatch):
    """XLA:CPU fused each LayerNorm's output (and the loss's softmax gradient) into the transposed copy its weight
    gradient reads, re-evaluated in strided order (4.7 ms against 1.5 per copy at gpt-cpu's size): the compiled
    step (XLA:CPU's, also on a machine with a GPU) has no transposing fusion that computes a subtraction, an rsqrt,
    an exponential or a lookup."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the model's CPU path (bench/gpu.sh runs on a GPU)
    cpu = jax.devices("cpu")[0]
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32), rngs=nnx.Rngs(0))
    objective = jaxpar.Objective.of(model)
    params, rest = jax.device_put(objective.split(model), cpu)
    x = np.random.default_rng(1).integers(0, 64, (4, 32)).astype(np.int32)
    rows = jax.device_put(jaxpar.as_rows({"x": x, "y": np.roll(x, -1, 1)}), cpu)
    hlo = jax.jit(objective.value_and_grad).lower(params, rest, rows).compile().as_text()
    bodies = {m.group(1).lstrip("%"): m.group(2) for m in re.finditer(r"^(%?[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo,
                                                                       re.S | re.M)}
    transposing = [bodies.get(c, "") for c in re.findall(r"= \S+ fusion\(.*calls=%?([\w.\-]+)", hlo)]
    transposing = [b for b in transposing if " transpose(" in b]
    recomputing = [b for b in transposing if re.search(r" (subtract|rsqrt|exponential|gather)\(", b)]
    assert len(transposing) >= 2 * 4 and not recomputing, recomputing[:1]  # (the check can fail: 5 before the fix)


@pytest.mark.parametrize("approximate", [True, False])
def test_bias_gelu_is_gelu_of_the_sum_and_keeps_only_the_sum(approximate):
    """gpt.bias_gelu(y, b) == gelu(y + b) with the same gradients (float32; under vmap too); its backward keeps
    y + b and b alone (autodiff of gelu keeps its tanh and more: the GEMM epilogue's form needs one user per op);
    in bf16 b's gradient sums in float32 (bf16 autodiff's does not)."""
    rng = np.random.default_rng(0)
    y, g = (jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32) for _ in range(2))
    b = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    plain = lambda y, b: jax.nn.gelu(y + b, approximate=approximate)  # noqa: E731
    ours = lambda y, b: gpt.bias_gelu(y, b, approximate)  # noqa: E731
    for vmapped in (False, True):
        wrap = (lambda fn: jax.vmap(fn, in_axes=(0, None))) if vmapped else (lambda fn: fn)
        want = jax.value_and_grad(lambda y, b: jnp.sum(wrap(plain)(y, b) * g), argnums=(0, 1))(y, b)
        got = jax.jit(jax.value_and_grad(lambda y, b: jnp.sum(wrap(ours)(y, b) * g), argnums=(0, 1)))(y, b)
        for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)
    kept = lambda fn: [x.shape for x in jax.tree.leaves(jax.vjp(fn, y, b)[1])]  # noqa: E731  the residuals
    assert sorted(kept(ours)) == [(3, 5, 8), (8,)] and len(kept(plain)) > 2

    y16, b16, g16 = (a.astype(jnp.bfloat16) for a in (y * 30, b, g))  # 15 rows: bf16 sums round visibly
    db = jax.grad(lambda b: jnp.sum(gpt.bias_gelu(y16, b, approximate).astype(jnp.float32) * g16))(b16)
    dpre = jax.grad(lambda p: jnp.sum(jax.nn.gelu(p, approximate=approximate).astype(jnp.float32) * g16))(
        y16 + b16)
    exact = jnp.sum(dpre.astype(jnp.float32), axis=(0, 1)).astype(jnp.bfloat16)
    autodiff = jax.grad(lambda b: jnp.sum(jax.nn.gelu(y16 + b, approximate=approximate).astype(jnp.float32)
                                          * g16))(b16)
    assert db.dtype == jnp.bfloat16 and not np.array_equal(np.float32(autodiff), np.float32(exact))
    np.testing.assert_array_equal(np.float32(db), np.float32(exact))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cpu_matmuls_of_16_bit_operands_accumulate_in_float32(dtype):
    """gpt.matmul / matmul_t of 16-bit operands on CPUs, the forward and both gradients: every product asks for a
    float32 result (XLA:CPU then runs YNNPACK's bf16 kernels instead of converting the operands to float32 first)
    and rounds it once: within a 16-bit ulp of the float32 reference, and 16-bit out."""
    from test_precision import dot_outputs

    rng = np.random.default_rng(0)
    x, w, wt = (jnp.asarray(rng.normal(size=s), dtype) for s in ((4, 64, 512), (512, 96), (96, 512)))
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    ulp = float(jnp.finfo(dtype).eps)
    for ours, weight, t in ((gpt.matmul, w, False), (gpt.matmul_t, wt, True)):
        ref = lambda x, w, t=t: f32(x) @ (f32(w).T if t else f32(w))  # noqa: E731
        dy = jnp.asarray(rng.normal(size=ref(x, weight).shape), dtype)

        def both(x, w, dy):
            out, vjp = jax.vjp(ours, x, w)
            return (out, *vjp(dy))

        assert dot_outputs(jax.make_jaxpr(both)(x, weight, dy).jaxpr) == {"float32"}
        want_out, want_vjp = jax.vjp(ref, x, weight)
        for a, b in zip(jax.jit(both)(x, weight, dy), (want_out, *want_vjp(f32(dy)))):
            assert a.dtype == dtype
            b = np.asarray(b, np.float64)
            assert np.max(np.abs(np.asarray(a, np.float64) - b) / (np.abs(b) + 1e-3)) <= ulp


def test_state_dict_variants_load_the_same_weights():
    """GPT2Model's keys (no `transformer.` prefix) with the old causal-mask buffers, and a torch.compile'd
    nanoGPT's `_orig_mod.` keys, load as the plain dicts do."""
    model = scramble(gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0)), seed=3)
    x, want = tokens(), logits_of(model, tokens())
    hf = model.torch_state_dict("hf")
    base = {k.removeprefix("transformer."): v for k, v in hf.items() if k != "lm_head.weight"}
    base.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, T, T), np.float32)) for i in range(L)})
    compiled = {f"_orig_mod.{k}": v for k, v in model.torch_state_dict("nanogpt").items()}
    for sd in (base, compiled):
        np.testing.assert_array_equal(logits_of(gpt.from_torch_state_dict(sd, n_head=H), x), want)


def bad_state_dicts():
    sd = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0)).torch_state_dict("hf")
    untied = {**sd, "lm_head.weight": sd["lm_head.weight"] + 1}
    short = {k: v for k, v in sd.items() if "h.1." not in k or "mlp" not in k}
    nan = np.where(np.arange(V)[:, None] == 3, np.nan, sd["transformer.wte.weight"]).astype(np.float32)
    narrow = {**sd, **{f"transformer.h.{i}.mlp.{k}": np.zeros(shape, np.float32) for i in range(L)
                       for k, shape in (("c_fc.weight", (C, 2 * C)), ("c_fc.bias", (2 * C,)),
                                        ("c_proj.weight", (2 * C, C)))}}
    return [({"fc.weight": np.zeros((2, 2))}, H, "is not a GPT-2 one"),
            ({k: v for k, v in sd.items() if "wpe" not in k}, H, r"'transformer.wpe.weight': 'missing'"),
            ({**sd, "transformer.wte.weight": np.zeros(C, np.float32), "lm_head.weight": np.zeros(C, np.float32)}, H,
             r"needs the 2-D weights.*'transformer.wte.weight': \(32,\)"),
            ({**sd, "transformer.h.x.mlp.c_fc.weight": np.zeros((C, 4 * C), np.float32)}, H,
             "'transformer.h.x.mlp.c_fc.weight' is not a GPT-2 one.*the index an integer"),
            ({**sd, "transformer.wte.weight": nan, "lm_head.weight": nan.copy()}, H,
             "'transformer.wte.weight' holds NaN or infinite values"),
            (narrow, H, r"c_fc.weight has shape \(32, 64\): an MLP 64 wide.*4 x n_embd = 128"),
            ({**sd, "transformer.h.0.attn.c_attn.weight": np.zeros((C, 2 * C))}, H, r"must be \[32, 96\]"),
            (untied, H, "ties them"),
            (sd, None, "pass --n-head"),
            (sd, 5, "does not divide the width"),
            (short, H, "missing"),
            # a QA pass: the bias flag was read off ln_f.bias alone, the layer count off the largest block index
            ({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, H,
             r"missing \['transformer.ln_f.bias'\], unexpected \[\]"),
            ({**sd, "transformer.h.5.ln_1.weight": np.ones(C, np.float32)}, H,
             r"\(2 layers, bias=True\): missing \[\], unexpected \['transformer.h.5.ln_1.weight'\]"),
            # a QA pass: another head's key was named with a `transformer.` prefix the file does not have
            ({**sd, "score.weight": np.zeros((3, C), np.float32)}, H,
             r"missing \[\], unexpected \['score.weight'\]; a GPT-2 state dict .* holds exactly these keys: drop"),
            ({**{k[12:]: v for k, v in sd.items() if k.startswith("transformer.")}, "score.weight": np.zeros((3, C))},
             H, r"missing \[\], unexpected \['score.weight'\]")]


@pytest.mark.parametrize("sd, n_head, message", bad_state_dicts())
def test_bad_state_dict_is_one_line_naming_the_fix(sd, n_head, message):
    with pytest.raises(ValueError, match=message) as e:
        gpt.from_torch_state_dict(sd, n_head=n_head)
    assert "\n" not in str(e.value)


def test_config_name_must_match_the_state_dict():
    sd = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0)).torch_state_dict("hf")
    with pytest.raises(ValueError, match=r"but gpt-nano \(--model\) is 3 x 48"):
        jaxpar.models.from_torch_state_dict("gpt-nano", sd)


# -- the model ------------------------------------------------------------------------------------------------


def test_gpt2_size_and_flops_per_token():
    cfg = gpt.GPTConfig.named("gpt2")
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    assert model.num_params(non_embedding=False) == GPT2_PARAMS
    for bias in (True, False):
        c = gpt.GPTConfig(bias=bias, **TINY)
        n = nnx.eval_shape(lambda: gpt.GPT(c, rngs=nnx.Rngs(0))).num_params()
        assert gpt.flops_per_token(c, 8) == 6 * n + 12 * L * C * 8


def test_layers_compose_to_the_model_and_tie_the_embedding():
    model = scramble(gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0)), seed=4)
    layers = model.layers
    assert [type(layer).__name__ for layer in layers] == ["Embedding", "Block", "Block", "LMHead"]
    first, last = nnx.state(layers[0], nnx.Param), nnx.state(layers[-1], nnx.Param)
    assert layers[0].wte is layers[-1].wte is model.wte  # one Param on both ends: the tie
    assert set(first) == {"wte", "wpe"} and set(last) == {"ln_f", "wte"}
    x = jnp.asarray(tokens())
    want = model(x)
    for layer in layers:
        x = layer(x)
    np.testing.assert_array_equal(x, want)


def test_init_follows_nanogpt():
    cfg = gpt.GPTConfig(n_layer=8, n_head=4, n_embd=128, vocab_size=512, block_size=64)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    block = model.h[0]
    std = lambda p: float(np.std(np.asarray(p[...])))  # noqa: E731
    assert std(model.wte.embedding) == pytest.approx(0.02, rel=0.05)
    assert std(block.attn.c_attn.kernel) == pytest.approx(0.02, rel=0.05)
    assert std(block.mlp.c_proj.kernel) == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert std(block.attn.c_proj.kernel) == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert not np.asarray(block.attn.c_attn.bias[...]).any() and (np.asarray(block.ln_1.scale[...]) == 1).all()


def test_sequence_beyond_block_size_and_bad_heads_are_refused():
    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"longer than the model's block_size {T}"):
        model(jnp.zeros((1, T + 1), jnp.int32))
    with pytest.raises(ValueError, match=r"n_head=5 does not divide the width n_embd=32.*--n-head"):
        gpt.GPTConfig(n_head=5, n_embd=32)


@pytest.mark.parametrize("t", [200, 256])
def test_blocked_cpu_attention_equals_one_causal_call(t):
    """On CPUs the queries go in blocks over their key prefixes (4 blocks at T=256, uneven at 200), each with its
    own backward (flash attention's rowsum(do o) for the softmax's): the same values and gradients as one
    jax.nn.dot_product_attention(is_causal=True) differentiated by JAX."""
    q, k, v, dy = (jnp.asarray(np.random.default_rng(i).normal(size=(2, t, 2, 8)), jnp.float32) for i in range(4))
    one = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    value_and_vjp = lambda fn: jax.jit(lambda *a: (fn(*a[:3]), jax.vjp(fn, *a[:3])[1](a[3])))  # noqa: E731
    blocked, whole = value_and_vjp(gpt.causal_attention)(q, k, v, dy), value_and_vjp(one)(q, k, v, dy)
    np.testing.assert_allclose(blocked[0], whole[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(blocked[1], whole[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert t // gpt.CPU_QUERY_BLOCK >= 3  # really blocked
    # bf16: products of bf16 operands accumulated in float32, softmax in float32, as jax's; within bf16's rounding
    # of the float32 result, and no further from it than jax's own bf16 call
    low = [a.astype(jnp.bfloat16) for a in (q, k, v, dy)]
    blocked16, whole16 = value_and_vjp(gpt.causal_attention)(*low), value_and_vjp(one)(*low)
    assert {a.dtype for a in jax.tree.leaves(blocked16)} == {jnp.dtype(jnp.bfloat16)}
    for ours, jaxs, exact in zip(jax.tree.leaves(blocked16), jax.tree.leaves(whole16), jax.tree.leaves(whole)):
        err = np.abs(np.asarray(ours, np.float32) - np.asarray(exact))
        assert err.max() <= 0.05 * np.abs(np.asarray(exact)).max(), err.max()
        assert err.mean() <= 1.5 * np.abs(np.asarray(jaxs, np.float32) - np.asarray(exact)).mean()


def test_blocked_cpu_attention_keeps_the_probabilities_alone_for_its_backward():
    """Its residuals per block: q, k, v, the output and the float32 probabilities; no scores, masks or
    exponentials beside them (autodiff of the softmax keeps more)."""
    from jax.ad_checkpoint import print_saved_residuals
    import contextlib
    import io

    q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(1, 256, 2, 8)), jnp.float32) for i in range(3))
    for fn, most in [(gpt.causal_attention, 4), (lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), 0)]:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            print_saved_residuals(lambda q, k, v: fn(q, k, v).sum(), q, k, v)
        squares = [line for line in printed.getvalue().splitlines()  # [..., queries, keys] residuals
                   if (m := re.search(r"\[(?:\d+,)+(\d+),(\d+)\]", line)) and min(map(int, m.groups())) >= 64]
        if most:
            assert len(squares) == most, printed.getvalue()  # one probability block per query block
        else:
            assert len(squares) > 1, printed.getvalue()  # the check can fail: autodiff keeps more than one


def test_a_sequence_whose_attention_scores_cannot_fit_is_refused_before_anything_is_built(monkeypatch):
    """The CPU blocks' score count (rows lo:hi against keys 0:hi), and train.py's floor on it: every device the
    step runs in lockstep holds its heads' scores of one sequence in one layer; beyond the host's memory, one
    line. The pipeline's stages and single count one device; tensor parallelism splits the heads."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the check is XLA:CPU's (bench/gpu.sh runs it on a GPU)
    from jaxpar.config import Config
    from jaxpar.models import gpt_ops
    from jaxpar.run import trainer

    assert gpt_ops.cpu_score_count(100) == 100 * 100  # one block: the whole square
    assert gpt_ops.cpu_score_count(256) == 64 * (64 + 128 + 192 + 256)  # 4 blocks of 64 rows
    nano = gpt.GPTConfig.named("gpt-nano")  # 3 heads
    scores = gpt_ops.cpu_score_count(1000)
    for cfg, floor in [(Config(strategy="single"), 3 * scores * 4),
                       (Config(strategy="pipeline", num_devices=2), 3 * scores * 4),
                       (Config(strategy="ddp", num_devices=2, batch_size=16), 2 * 3 * scores * 4),
                       (Config(strategy="ddp", num_devices=4, batch_size=2), 2 * 3 * scores * 4),  # 2 rows: 2 busy
                       (Config(strategy="tp", num_devices=3, tensor_parallel=3), 3 * 1 * scores * 4)]:
        trainer.check_attention_fits(nano, 1000, cfg, memory=floor)  # fits exactly
        with pytest.raises(ValueError, match=r"^--seq-len 1000: .* GiB .*beyond this machine's .*lower --seq-len"):
            trainer.check_attention_fits(nano, 1000, cfg, memory=floor - 1)


def test_attention_uses_cudnn_only_on_gpus_for_half_precision(monkeypatch):
    from types import SimpleNamespace

    from jaxpar.models import gpt_ops

    supported = gpt_ops.cudnn_attention_supported
    here = jax.default_backend() == "gpu" and supported()
    assert gpt.attention_impl("auto", jnp.bfloat16, 64) == ("cudnn" if here else "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpt_ops, "cudnn_attention_supported", lambda: True)
    assert gpt.attention_impl("auto", jnp.bfloat16, 64) == "cudnn"
    assert gpt.attention_impl("auto", jnp.float32, 64) == "xla"
    assert gpt.attention_impl("auto", jnp.bfloat16, 100) == "xla"  # cuDNN takes head sizes in multiples of 8
    assert gpt.attention_impl("xla", jnp.bfloat16, 64) == "xla"
    assert gpt.attention_impl("cudnn", jnp.float16, 64) == "cudnn"
    with pytest.raises(ValueError, match=r"attention='cudnn' needs bf16 or fp16 .*here float32.*attention=.auto."):
        gpt.attention_impl("cudnn", jnp.float32, 64)
    monkeypatch.setattr(gpt_ops, "cudnn_attention_supported", lambda: False)  # a V100, a T4, a ROCm GPU
    assert gpt.attention_impl("auto", jnp.bfloat16, 64) == "xla"
    with pytest.raises(ValueError, match="compute capability >= 8.0"):
        gpt.attention_impl("cudnn", jnp.bfloat16, 64)
    gpu = lambda cc: SimpleNamespace(platform="gpu", compute_capability=cc)  # noqa: E731
    assert supported(gpu("9.0")) and supported(gpu("8.0"))
    assert not supported(gpu("7.5")) and not supported(gpu("gfx90a")) and not supported(SimpleNamespace(platform="cpu"))


def test_explicit_attention_equals_the_fused_call():
    """The explicit attention (taken when attention dropout is on) computes what jax.nn.dot_product_attention does:
    with a rate of 1e-9 its mask keeps everything."""
    x = jnp.asarray(tokens())
    model = scramble(gpt.GPT(gpt.GPTConfig(dropout=0.5, **TINY), rngs=nnx.Rngs(params=0, dropout=0)), seed=5)
    model.eval()
    fused = model(x)
    for block in model.h:
        block.attn.attn_dropout.rate, block.attn.attn_dropout.deterministic = 1e-9, False
    np.testing.assert_allclose(model(x), fused, rtol=1e-5, atol=1e-5)
    for block in model.h:
        block.attn.attn_dropout.rate = 0.5
    assert np.abs(np.asarray(model(x)) - np.asarray(fused)).max() > 0.1  # and really drops at 0.5


def test_bf16_compute_keeps_float32_master_weights():
    """bf16 compute: every product of the step (forward and backward: the embeddings on, attention, the tied head)
    takes bf16 operands, the master weights stay float32, the loss moves by bf16's rounding."""
    from test_precision import dot_operands

    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    batch = {"x": tokens(4), "y": tokens(4, seed=9)}
    losses = {}
    for dtype in (None, jnp.bfloat16):
        s = jaxpar.SingleDevice(model, optax.sgd(0.1), compute_dtype=dtype)
        state, rows = s.init(jaxpar.init_state(model, s.tx)), s.put_batch(batch)
        name = "float32" if dtype is None else "bfloat16"
        assert set(dot_operands(jax.make_jaxpr(s._step)(state, rows).jaxpr)) == {(name, name)}
        placed, metrics = s.step(state, rows)
        assert {a.dtype for a in jax.tree.leaves(s.unplace(placed).params)} == {jnp.dtype(jnp.float32)}
        losses[dtype] = float(metrics["loss"])
    assert losses[None] != losses[jnp.bfloat16]
    assert losses[jnp.bfloat16] == pytest.approx(losses[None], rel=2e-2)


def test_fp16_trains_on_cpus_too():
    """float16 compute with the loss scaler: jax's attention asks for float16 x float16 -> float32 products, which
    XLA:CPU refuses; on CPUs the GPT's attention runs in float32 between float16 projections."""
    from test_precision import dot_operands

    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    batch = {"x": tokens(4), "y": tokens(4, seed=9)}
    tx = jaxpar.loss_scaling(optax.sgd(0.1), static=2.0 ** 8)
    losses = {}
    for dtype in (None, jnp.float16):
        s = jaxpar.SingleDevice(model, tx, compute_dtype=dtype)
        state, rows = s.init(jaxpar.init_state(model, tx)), s.put_batch(batch)
        dots = dot_operands(jax.make_jaxpr(s._step)(state, rows).jaxpr)
        placed, metrics = s.step(state, rows)
        losses[dtype] = float(metrics["loss"])
    assert dots[("float16", "float16")] > dots[("float32", "float32")] > 0  # the projections in fp16, attention not
    assert np.isfinite(losses[jnp.float16]) and losses[jnp.float16] != losses[None]
    assert losses[jnp.float16] == pytest.approx(losses[None], rel=2e-2)


def sums_16_bit(jaxpr) -> list[str]:
    """The sums of a jaxpr (reduce_sum, scatter-add; nested jaxprs too) that add 16-bit numbers."""
    from test_precision import all_eqns

    return [f"{e.primitive.name}({e.invars[0].aval.dtype.name})" for e in all_eqns(jaxpr)
            if e.primitive.name in ("reduce_sum", "scatter-add") and e.invars[0].aval.dtype.itemsize < 4]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("per_sample", [True, False])
def test_16_bit_steps_sum_gradients_in_float32(dtype, per_sample):
    """Under 16-bit compute the step's sums over the tokens (the biases' and the positions' gradients, the token
    table's scatter-add) run in float32, as torch autocast's kernels accumulate: JAX would sum the transposes of a
    16-bit broadcast and lookup in 16 bits (19 such sums in this step before jaxpar.precision.add_wide/take_wide)."""
    from test_precision import dot_operands

    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    s = jaxpar.SingleDevice(model, optax.sgd(0.1), compute_dtype=dtype, per_sample=per_sample)
    state, rows = s.init(jaxpar.init_state(model, s.tx)), s.put_batch({"x": tokens(4), "y": tokens(4, seed=9)})
    jaxpr = jax.make_jaxpr(s._step)(state, rows).jaxpr
    name = jnp.dtype(dtype).name
    assert dot_operands(jaxpr)[(name, name)] > 0  # the step really computes in 16 bits
    assert sums_16_bit(jaxpr) == []


def test_tensor_parallel_16_bit_steps_sum_gradients_in_float32():
    """The same under Megatron tensor parallelism (column / row Linears, the vocabulary-parallel lookup), with
    sequence parallelism (its positions and reduce-scattered lookups)."""
    from jax.sharding import Mesh

    from jaxpar.mesh import DATA, TENSOR
    from jaxpar.strategies.tensor import TensorParallel

    for sp in (False, True):
        model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
        mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), (DATA, TENSOR))
        s = TensorParallel(model, optax.sgd(0.1), tensor_parallel=2, mesh=mesh, sequence_parallel=sp,
                           compute_dtype=jnp.bfloat16)
        placed = s.init(jaxpar.init_state(model, s.tx))
        rows = s.put_batch({"x": tokens(4), "y": tokens(4, seed=9)})
        placed, _ = s.step(placed, rows)  # compiles the step
        jaxpr = jax.make_jaxpr(s._step)(placed, rows).jaxpr
        assert sums_16_bit(jaxpr) == [], sp


def test_bf16_bias_and_embedding_gradients_err_no_more_than_the_kernels():
    """One bf16 step against float32's on real text: every gradient (the parameters' change under SGD at lr 1)
    differs from float32's by bf16's rounding of the activations, about 0.5 %; the biases' and embeddings', which
    JAX would sum over the 1,024 tokens in bf16, erred 2-10 % before (c_attn's bias 10 %, wte 5 %)."""
    from jaxpar.data import text

    model = gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=2, n_embd=64),
                    rngs=nnx.Rngs(0))
    batch = text.load("train", None, seq_len=128, seed=0).batch(np.arange(8))
    state0 = jaxpar.init_state(model, optax.sgd(1.0))
    change = {}
    for dtype in (None, jnp.bfloat16):
        s = jaxpar.SingleDevice(model, optax.sgd(1.0), compute_dtype=dtype)
        placed, _ = s.step(s.init(state0), s.put_batch(batch))
        after = s.unplace(placed).params
        change[dtype] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after,
                                     state0.params)
    err = {jax.tree_util.keystr(path): np.linalg.norm(b - a) / np.linalg.norm(a)
           for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(change[None]),
                                   jax.tree.leaves(change[jnp.bfloat16]))}
    kernels = max(e for k, e in err.items() if "kernel" in k)
    assert 1e-3 < kernels < 1e-2  # bf16 really rounds, by about its unit
    sums = {k: e for k, e in err.items() if "bias" in k or "embedding" in k}
    assert len(sums) == 2 * 6 + 1 + 2  # per block: ln_1, c_attn, c_proj, ln_2, c_fc, c_proj biases; ln_f; wte, wpe
    assert max(sums.values()) <= 1.5 * kernels, sorted(sums.items(), key=lambda kv: -kv[1])[:3]


# -- every data-parallel strategy equals the single device, dropout on ----------------------------------------

STEPS = 3
STRATEGIES = {
    "dp": lambda model, tx: jaxpar.DataParallel(model, tx, device_ids=[0, 1]),
    "dp_loss_on_device": lambda model, tx: jaxpar.DataParallel(model, tx, device_ids=[0, 1], loss_on_device=True),
    "ddp_psum_2": lambda model, tx: jaxpar.DistributedDataParallel(model, tx, mesh=jaxpar.make_mesh(2)),
    "ddp_ring_4_buckets": lambda model, tx: jaxpar.DistributedDataParallel(
        model, tx, mesh=jaxpar.make_mesh(4), allreduce="ring", bucket_cap_mb=0.001, overlap=True),
    # ZB-V: the embedding and the tied head are both chunks of stage 0, one copy of wte taking both gradients
    "pipeline_zbv": lambda model, tx: jaxpar.Pipeline(model, tx, num_stages=2, micro_batches=2, schedule="zbv",
                                                      virtual_stages=2),
}


def dropout_problem():
    """(model, tx, batch): a tiny GPT with dropout 0.1 everywhere, SGD, 8 sequences of random tokens."""
    model = gpt.GPT(gpt.GPTConfig(dropout=0.1, **TINY), rngs=nnx.Rngs(params=0, dropout=1))
    rng = np.random.default_rng(0)
    seq = rng.integers(0, V, (8, T + 1)).astype(np.int32)
    return model, optax.sgd(0.5), {"x": seq[:, :-1], "y": seq[:, 1:]}


def run_strategy(make, steps: int = STEPS):
    model, tx, batch = dropout_problem()
    s = make(model, tx)
    placed = s.init(jaxpar.init_state(model, tx))
    losses = []
    for _ in range(steps):
        placed, metrics = s.step(placed, s.put_batch(batch))
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return [np.asarray(a) for a in jax.tree.leaves(s.unplace(placed).params)], losses


@pytest.fixture(scope="module")
def single():
    """The single-device parameters and losses after the steps, once the premises hold: the two halves of the batch
    give different gradients (so only a correct reduction agrees them), dropout changes the loss, the weights move.
    (The halves' gradients are taken without dropout: the same premise at a quarter of the compile time.)"""
    model, tx, batch = dropout_problem()
    plain = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(params=0, dropout=1))
    objective, state = jaxpar.Objective.of(plain), jaxpar.init_state(plain, tx)
    grad = jax.jit(lambda rows: objective.value_and_grad(state.params, state.model_state, rows)[1])
    halves = [jax.tree.leaves(grad(jaxpar.as_rows(jax.tree.map(lambda a: a[i * 4:(i + 1) * 4], batch),
                                                  offset=4 * i))) for i in range(2)]
    assert max(float(np.abs(a - b).max()) for a, b in zip(*halves)) > 1e-3
    params, losses = run_strategy(lambda m, tx: jaxpar.SingleDevice(m, tx))
    evaluated = jax.jit(lambda rows: objective.sums(state.params, state.model_state, rows, train=False)[0])(
        jaxpar.as_rows(batch))  # the same initial weights, dropout off
    assert abs(losses[0][0] - float(evaluated.loss / evaluated.weight)) > 1e-3  # dropout is really on
    assert max(float(np.abs(a - b).max()) for a, b in zip(params, jax.tree.leaves(state.params))) > 1e-2
    return params, losses


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_equals_single_device_with_dropout(single, name):
    params, losses = run_strategy(STRATEGIES[name])
    np.testing.assert_allclose(losses, single[1], rtol=1e-5)
    for a, b in zip(params, single[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pipeline_keeps_the_tied_embedding_identical_on_both_stages(single):
    """Embedding on stage 0, head on stage 1, one wte: the engine sums its two gradients (DeepSpeed's
    ReduceTiedGrads), so both copies stay bit-identical and take single's update. The premise: each stage's
    use of wte contributes its own, different gradient (without the sum the copies would part)."""
    from jaxpar.strategies.pipeline import Pipeline

    model, tx, batch = dropout_problem()
    plain = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(params=0, dropout=1))  # the premise: no dropout needed
    objective, state = jaxpar.Objective.of(plain), jaxpar.init_state(plain, tx)
    rows = jaxpar.as_rows(batch)
    grad = lambda: jax.jit(lambda r: objective.value_and_grad(state.params, state.model_state, r)[1])(  # noqa
        rows)["wte"]["embedding"]
    both = np.asarray(grad()[...])
    head_call = gpt.LMHead.__call__
    gpt.LMHead.__call__ = lambda self, x: self.ln_f(x) @ jax.lax.stop_gradient(self.wte.embedding[...]).T
    try:
        embedding_only = np.asarray(grad()[...])  # the head's use cut off: stage 0's share alone
    finally:
        gpt.LMHead.__call__ = head_call
    assert np.abs(embedding_only).max() > 1e-3 and np.abs(both - embedding_only).max() > 1e-3

    pipe = Pipeline(model, tx, num_stages=2, micro_batches=2)
    (j, stages), = pipe.module.tied.items()
    assert pipe.module.param_paths[j] == ("wte", "embedding") and stages == [0, 1]
    placed = pipe.init(jaxpar.init_state(model, tx))  # the same weights as `state` (same seeds)
    for _ in range(STEPS):
        placed, metrics = pipe.step(placed, pipe.put_batch(batch))
    copies = [np.asarray(placed.params[s][pipe.module.stage_params[s].index(j)].addressable_data(0)) for s in stages]
    np.testing.assert_array_equal(copies[0], copies[1])
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    start = np.asarray(state.params["wte"]["embedding"][...])
    want = single[0][names.index("['wte']['embedding'].value")]
    np.testing.assert_allclose(copies[0] - start, want - start, rtol=1e-5, atol=1e-6)
    assert float(metrics["loss"]) == pytest.approx(single[1][-1][0], rel=1e-5)
    for a, b in zip(jax.tree.leaves(pipe.unplace(placed).params), single[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- the CLI --------------------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.py"
    path.write_bytes(b"".join(f"def f{i}(x):\n    return x + {i}\n\n".encode() for i in range(400)))
    return str(path)


def test_train_gpt_on_text_reports_tokens_bits_per_byte_and_exports(corpus, tmp_path, capsys):
    from jaxpar import cli

    out = str(tmp_path / "gpt.npz")
    summary = cli.main(["--model", "gpt-nano", "--dataset", "text", "--data-path", corpus, "--seq-len", "16",
                        "--batch-size", "8", "--steps", "3", "--optimizer", "adamw", "--lr", "1e-2",
                        "--eval-split", "test[:8]", "--eval-batch-size", "8", "--export-torch", out,
                        "--torch-layout", "nanogpt", "--peak-tflops", "1.0", "--report", "--quiet"])
    printed = capsys.readouterr().out
    assert re.search(r"tokens_per_s=\S+ mfu=\S+", printed) and "MFU" in printed
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 16)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * gpt.flops_per_token(
        gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16), 16) / 1e12)
    assert summary["eval_bits_per_byte"] == pytest.approx(summary["eval_loss"] / math.log(2))
    assert 0 < summary["unigram_bits_per_byte"] < 8
    model = gpt.GPT(gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16), rngs=nnx.Rngs(0))
    nnx.update(model, summary["state"].params)
    with np.load(out) as f:
        sd = dict(f)
    third = {k for k in sd if k.startswith("transformer.h.2.")}  # gpt-nano has 3 layers, the fixture's twin 2
    assert len(third) == 12 and set(sd) - third == set(fixture("nanogpt")[0])  # the nanoGPT twin's own keys
    x = np.random.default_rng(0).integers(0, 256, (2, 16))
    exported = gpt.from_torch_state_dict(sd, n_head=3)
    np.testing.assert_array_equal(logits_of(exported, x), logits_of(model, x))
    from jaxpar.run import weights

    assert weights.read(out)[1]["n_head"] == 3  # the file records the head count, which no weight's shape shows


def test_label_smoothing_trains_the_smoothed_loss_and_reports_bits_of_the_nll(corpus):
    """--label-smoothing 0.1: the loss trained and reported is torch's smoothed one, while bits per byte are the
    held-out targets' own -log p (eval_nll), below the smoothed loss's."""
    from jaxpar import cli

    summary = cli.main(["--model", "gpt-nano", "--dataset", "text", "--data-path", corpus, "--seq-len", "16",
                        "--batch-size", "8", "--steps", "2", "--eval-split", "test[:8]", "--eval-batch-size", "8",
                        "--label-smoothing", "0.1", "--quiet"])
    assert summary["eval_loss"] - summary["eval_nll"] > 0.01  # smoothing adds e x (mean -log p - nll)
    assert summary["eval_bits_per_byte"] == pytest.approx(summary["eval_nll"] / math.log(2))


RECIPE = {  # nanoGPT's recipe (clipping, warmup + cosine) under Megatron's strategies: single's parameters
    "tp": ["--strategy", "tp", "--tensor-parallel", "2", "--num-devices", "2", "--sequence-parallel"],
    "tp-zero1": ["--strategy", "tp", "--tensor-parallel", "2", "--num-devices", "4", "--zero-stage", "1"],
    "3-D": ["--strategy", "pipeline", "--num-stages", "2", "--tensor-parallel", "2", "--num-devices", "4",
            "--micro-batches", "2"],
}


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory):
    """(flags, single's clipped parameters), once for the module; the premise: without the clip they differ."""
    from jaxpar import cli

    path = tmp_path_factory.mktemp("clip") / "corpus.py"
    path.write_bytes(b"".join(f"def f{i}(x):\n    return x + {i}\n\n".encode() for i in range(400)))
    base = ["--model", "gpt-nano", "--n-head", "4", "--dataset", "text", "--data-path", str(path), "--seq-len",
            "16", "--batch-size", "8", "--steps", "3", "--eval-split", "", "--optimizer", "sgd", "--momentum", "0.9",
            "--lr", "0.5", "--lr-schedule", "cosine", "--warmup-steps", "1", "--quiet"]
    single = cli.main(base + ["--grad-clip", "0.5"])
    free = cli.main(base)
    a, b = (jax.tree.leaves(s["state"].params) for s in (single, free))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 1e-3  # the clip bites
    return base + ["--grad-clip", "0.5"], a


@pytest.mark.parametrize("key", RECIPE)
def test_grad_clip_and_cosine_schedule_under_tensor_parallelism(key, clip_runs):
    """--grad-clip under TP and 3-D takes the norm over every slice and stage, each replicated leaf once: the
    clipped parameters equal single's. SGD with momentum, whose updates scale with the clipped gradient."""
    from jaxpar import cli

    flags, a = clip_runs
    c = jax.tree.leaves(cli.main(flags + RECIPE[key])["state"].params)
    for x, y in zip(c, a):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)


DECAY = {  # the optimizer sees a stage's subtree, TP's slices (ZeRO's flat shards: tests/test_zero.py)
    "pipeline": ["--strategy", "pipeline", "--num-stages", "2", "--micro-batches", "2", "--num-devices", "2"],
    "tp": ["--strategy", "tp", "--tensor-parallel", "2", "--num-devices", "2"],
    "tp-zero1": ["--strategy", "tp", "--tensor-parallel", "2", "--num-devices", "4", "--zero-stage", "1"],
}


@pytest.fixture(scope="module")
def decay_runs(tmp_path_factory):
    """(flags, single's parameters with the decay on the matrices only); the premise: decaying every parameter
    gives others (the LayerNorms and biases decay there)."""
    from jaxpar import cli

    path = tmp_path_factory.mktemp("decay") / "corpus.py"
    path.write_bytes(b"".join(f"def f{i}(x):\n    return x + {i}\n\n".encode() for i in range(400)))
    base = ["--model", "gpt-nano", "--n-head", "4", "--dataset", "text", "--data-path", str(path), "--seq-len", "16",
            "--batch-size", "8", "--steps", "3", "--eval-split", "", "--optimizer", "sgd", "--momentum", "0.9", "--lr",
            "0.5", "--weight-decay", "0.5", "--quiet"]  # SGD: Adam would turn rounding into sign flips
    matrices = cli.main(base + ["--weight-decay-params", "matrices"])
    every = cli.main(base)
    a, b = (jax.tree.leaves(s["state"].params) for s in (matrices, every))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 1e-3
    return base + ["--weight-decay-params", "matrices"], a


@pytest.mark.parametrize("key", DECAY)
def test_weight_decay_on_the_matrices_only_through_the_cli(key, decay_runs):
    """--weight-decay-params matrices (nanoGPT's and Megatron's groups) gives single's parameters under the
    strategies whose optimizer sees something else than the whole tree."""
    from jaxpar import cli

    flags, want = decay_runs
    got = jax.tree.leaves(cli.main(flags + DECAY[key])["state"].params)
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)


def test_selective_recompute_through_the_cli(corpus, monkeypatch):
    """--recompute-granularity selective (dropout on, ddp on 2 devices): each block's core attention goes through
    the recompute, and the parameters are those of the run that keeps the attention weights."""
    from jaxpar import cli

    base = ["--model", "gpt-nano", "--dataset", "text", "--data-path", corpus, "--seq-len", "16", "--batch-size",
            "8", "--steps", "2", "--eval-split", "", "--dropout", "0.1", "--strategy", "ddp", "--num-devices", "2",
            "--quiet"]
    kept = cli.main(base)
    calls, recompute_call = [], gpt.recompute_call
    monkeypatch.setattr(gpt, "recompute_call", lambda *a: calls.append(1) or recompute_call(*a))
    selective = cli.main(base + ["--recompute-granularity", "selective"])
    assert len(calls) >= 3  # gpt-nano's 3 blocks, traced at least once
    for x, y in zip(jax.tree.leaves(selective["state"].params), jax.tree.leaves(kept["state"].params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)


def test_cli_gpt_model_from_init_torch_and_npz_tokens(tmp_path, corpus):
    from jaxpar.config import Config
    from jaxpar.data import datasets
    from jaxpar.run import trainer

    nano = gpt.GPTConfig.named("gpt-nano", vocab_size=V, block_size=T)
    model = scramble(gpt.GPT(nano, rngs=nnx.Rngs(0)), seed=6)
    np.savez(tmp_path / "sd.npz", **model.torch_state_dict("hf"))
    seq = np.random.default_rng(0).integers(0, 50, (10, 13)).astype(np.int32)
    np.savez(tmp_path / "tok.npz", x=seq[:, :-1], y=seq[:, 1:])
    data = datasets.load("npz", "train", data_path=str(tmp_path / "tok.npz"), model=None)
    fresh = trainer.gpt_model(Config(model="gpt-micro", dataset="npz", dropout=0.1), data)
    assert (fresh.config.vocab_size, fresh.config.block_size, fresh.config.dropout) == (50, 12, 0.1)
    cfg = Config(model="gpt-nano", dataset="npz", init_torch=str(tmp_path / "sd.npz"))
    loaded = trainer.gpt_model(cfg, data)  # heads from the name, sizes from the state dict
    np.testing.assert_array_equal(logits_of(loaded, tokens()), logits_of(model, tokens()))
    with pytest.raises(ValueError, match=r"3 layers x 48 wide, but gpt-micro \(--model\) is 4 x 128"):
        trainer.gpt_model(cfg.replace(model="gpt-micro"), data)
    long = datasets.load("text", "train", data_path=corpus, seq_len=T + 1)
    with pytest.raises(ValueError, match=f"--seq-len {T + 1} is beyond the block size {T}"):
        trainer.gpt_model(cfg.replace(dataset="text"), long)
    seq = np.random.default_rng(0).integers(0, 50, (4, T + 2)).astype(np.int32)  # npz: the file's length, no flag
    np.savez(tmp_path / "long.npz", x=seq[:, :-1], y=seq[:, 1:])
    long = datasets.load("npz", "train", data_path=str(tmp_path / "long.npz"), model=None)
    with pytest.raises(ValueError, match=f"holds sequences of {T + 1} tokens, beyond the block size {T}.*write the "
                                         f"file's x and y as \\[N, T\\] with T <= {T}"):
        trainer.gpt_model(cfg, long)


@pytest.mark.parametrize("flags, message", [
    (["--n-head", "5"], "n_head=5 does not divide the width n_embd=48"),
    (["--dropout", "1.5"], r"--dropout 1.5 must be in \[0, 1\)"),
    (["--torch-layout", "keras"], "--torch-layout 'keras' is not known"),
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--weight-decay-params", "matrices", "--optimizer", "sgd"], "--optimizer sgd runs with no weight decay; "
                                                                  "pass --weight-decay"),
    (["--weight-decay-params", "some"], "--weight-decay-params 'some' is not known; use one of: all, matrices"),
    (["--sample", "10", "--dataset", "synthetic"], "--sample 10 prints bytes a GPT generates.*--dataset synthetic"),
    (["--sample", "10", "--sample-top-k", "-3"], r"--sample-top-k -3 must be >= 1 \(256 or more: every byte"),
    (["--recompute-granularity", "full"], "--recompute-granularity 'full' is not known; use selective.*"
                                          "--activation-checkpoint-interval N"),
    (["--recompute-granularity", "selective", "--activation-checkpoint-interval", "1"],
     "full recompute already reruns the attention of each segment; use one of the two"),
    (["--recompute-granularity", "selective", "--model", "mlp"], "--model mlp is not one of jaxpar's GPTs.*"
                                                                 "use --activation-checkpoint-interval N"),
])
def test_cli_refuses_bad_gpt_flags_before_work(flags, message, capsys):
    from jaxpar import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "gpt-nano", "--dataset", "text", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1


def test_peak_table_reads_the_device_name():
    from types import SimpleNamespace

    from jaxpar.run import flops

    gpu = lambda kind: SimpleNamespace(platform="gpu", device_kind=kind)  # noqa: E731
    assert flops.peak_tflops(gpu("NVIDIA H100 80GB HBM3")) == 989.0
    assert flops.peak_tflops(gpu("NVIDIA H100 PCIe")) == 756.0
    assert flops.peak_tflops(gpu("NVIDIA A100-SXM4-40GB")) == 312.0
    assert flops.peak_tflops(gpu("NVIDIA L4")) == 121.0 and flops.peak_tflops(gpu("NVIDIA L40S")) == 362.0
    assert flops.peak_tflops(gpu("NVIDIA A10G")) is None  # not in the table: pass --peak-tflops
    assert flops.peak_tflops(jax.devices("cpu")[0]) is None
    got = flops.utilisation(1000.0, 1e9, devices=2, peak=1.0)
    assert got == {"tokens_per_s": 1000.0, "model_tflops": 1.0, "peak_tflops": 1.0, "mfu": 0.5}


def test_npz_tokens_of_the_eval_split_size_the_vocabulary_too(tmp_path):
    """The vocabulary was the training split's largest id + 1: a larger id in the eval split gave eval_loss NaN
    beside a normal accuracy, exit 0. Both splits size it now."""
    from jaxpar.config import Config
    from jaxpar.run import trainer

    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (12, 8))
    xt = rng.integers(0, 10, (4, 8))
    xt[:, 3] = 13
    np.savez(tmp_path / "tok.npz", x=x, y=np.roll(x, -1, 1), x_test=xt, y_test=np.roll(xt, -1, 1))
    out = trainer.run(Config(model="gpt-nano", dataset="npz", data_path=str(tmp_path / "tok.npz"), batch_size=4,
                             steps=2, eval_batch_size=4, quiet=True))
    assert np.isfinite(out["eval_loss"])


def test_a_language_models_evaluation_batch_defaults_to_its_training_batch():
    """--eval-batch-size's 1000 (torch's MNIST example) for GPT-2 at 1024 tokens is ~100 GB of logits in one call
    (a QA pass): a GPT or text data evaluates in the training batch, as nanoGPT's estimate_loss does; the
    classifiers keep 1000, and the flag wins."""
    from jaxpar.config import Config
    from jaxpar.run.trainer import eval_batch_size

    assert eval_batch_size(Config(model="gpt2", batch_size=16)) == 16
    assert eval_batch_size(Config(model=f"{__name__}:nothing", dataset="text", batch_size=8)) == 8
    assert eval_batch_size(Config(model="convnet", batch_size=64)) == 1000
    assert eval_batch_size(Config(model="gpt2", batch_size=16, eval_batch_size=4)) == 4


def test_profile_partition_of_a_gpt_through_the_cli(corpus):
    """--partition-method profile on a GPT costs its layers on one window of token ids (it built a 1024-long float
    input from the image default and was refused for every GPT, a QA finding), and trains."""
    from jaxpar import cli

    out = cli.main(["--model", "gpt-nano", "--dataset", "text", "--data-path", corpus, "--seq-len", "16",
                    "--batch-size", "8", "--steps", "1", "--eval-split", "", "--strategy", "pipeline",
                    "--num-devices", "2", "--partition-method", "profile", "--quiet"])
    assert np.isfinite(out["train_loss"]) and out["strategy"] == "pipeline"


def test_a_ddp_wrapped_state_dict_loads_as_the_plain_one():
    """torch DDP keeps the model as `.module`: a state dict saved from the wrapper (model.state_dict(), not
    model.module's) has every key under `module.`; torch.compile on top of DDP gives `_orig_mod.module.`, DDP of a
    compiled model `module._orig_mod.`: each loads (in either layout) to the plain dict's weights."""
    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    want = model.torch_state_dict("hf")
    for prefix, layout in (("module.", "hf"), ("_orig_mod.module.", "nanogpt"), ("module._orig_mod.", "nanogpt"),
                           ("module._orig_mod.", "hf")):
        sd = {f"{prefix}{k}": v for k, v in model.torch_state_dict(layout).items()}
        got = gpt.from_torch_state_dict(sd, n_head=H).torch_state_dict("hf")
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{prefix} {layout} {key}")



def test_two_keys_of_one_weight_are_refused_not_one_dropped():
    """A state dict holding a weight twice -- under its own key and a DDP wrapper's `module.` one, or under
    GPT2LMHeadModel's `transformer.` key and GPT2Model's bare one -- is refused in one line naming both keys, as torch's
    load_state_dict(strict=True) refuses the second as unexpected; the last one read used to win without a word."""
    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    sd = model.torch_state_dict("hf")
    zeros = np.zeros_like(sd["transformer.h.0.ln_1.weight"])
    for extra in ("h.0.ln_1.weight", "module.transformer.h.0.ln_1.weight"):
        with pytest.raises(ValueError, match=f"keys 'transformer.h.0.ln_1.weight' and '{re.escape(extra)}' both "
                                             "name the weight 'transformer.h.0.ln_1.weight'") as e:
            gpt.from_torch_state_dict({**sd, extra: zeros}, n_head=H)
        assert "\n" not in str(e.value)
    mlp = jaxpar.to_torch_state_dict(jaxpar.get_model("mlp", in_features=3, hidden_dim=4, out_features=2))
    with pytest.raises(ValueError, match="keys '0.weight' and 'module.0.weight' both name the weight '0.weight'"):
        jaxpar.from_torch_state_dict("mlp", {**mlp, "module.0.weight": np.zeros_like(mlp["0.weight"])})


def test_an_exported_state_dict_is_writable_and_not_the_models_memory():
    """to_torch_state_dict gives arrays of their own: it gave np.asarray views of JAX's CPU buffers (every GPT
    weight but nanoGPT's transposed ones, every bias of the tutorial models), read-only, so torch.from_numpy warned,
    and a torch tensor made from one and updated in place (load_state_dict(assign=True), then a step) changed the
    jaxpar model's weights under JAX."""
    model = gpt.GPT(gpt.GPTConfig(**TINY), rngs=nnx.Rngs(0))
    mlp = jaxpar.get_model("mlp", in_features=3, hidden_dim=4, out_features=2)
    before = (np.array(model.ln_f.bias[...]), np.array(mlp.layers[0].bias[...]))
    for sd, key in ((model.torch_state_dict("hf"), "transformer.ln_f.bias"),
                    (model.torch_state_dict("nanogpt"), "transformer.ln_f.bias"),
                    (jaxpar.to_torch_state_dict(mlp), "0.bias")):
        assert all(v.flags.writeable for v in sd.values()), [k for k, v in sd.items() if not v.flags.writeable]
        sd[key] += 100.0  # what a torch tensor sharing the array's memory does in place
    np.testing.assert_array_equal(model.ln_f.bias[...], before[0])
    np.testing.assert_array_equal(mlp.layers[0].bias[...], before[1])

def test_cudnn_attention_takes_head_sizes_up_to_128(monkeypatch):
    """cuDNN's fused attention takes head sizes that are multiples of 8 up to 128 inclusive: 128 (a 1024-wide GPT
    of 8 heads) runs it under 'auto' and may be asked for; 136 falls back to XLA, or is refused when asked for."""
    from jaxpar.models import gpt_ops

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpt_ops, "cudnn_attention_supported", lambda: True)
    assert gpt.attention_impl("auto", jnp.bfloat16, 128) == "cudnn"
    assert gpt.attention_impl("cudnn", jnp.float16, 128) == "cudnn"
    assert gpt.attention_impl("auto", jnp.bfloat16, 136) == "xla"
    with pytest.raises(ValueError, match="multiple of 8 up to 128.*head size 136"):
        gpt.attention_impl("cudnn", jnp.bfloat16, 136)


def test_a_dropout_of_one_is_refused():
    """GPTConfig's dropout is a probability in [0, 1): 1.0 would drop every activation (a model that only outputs
    its biases) and is refused in one line, as 1.5 is; 0 and just under 1 are taken."""
    for rate in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"dropout=.* must be in \[0, 1\)") as e:
            gpt.GPTConfig(dropout=rate, **TINY)
        assert "\n" not in str(e.value)
    assert gpt.GPTConfig(dropout=0.0, **TINY).dropout == 0.0 and gpt.GPTConfig(dropout=0.99, **TINY).dropout == 0.99
