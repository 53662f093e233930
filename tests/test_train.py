"""Smoke and end-to-end tests of train.py: every strategy through the CLI lands on the single-device parameters,
for the built-in models and for a user's own model and loss (examples/)."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import train
from test_step_costs import Traces

# A small run on the embedded synthetic data: 3 steps of an MLP with a last batch of 40 - 32 = 8 samples.
BASE = ["--model", "mlp", "--dataset", "synthetic", "--train-split", "train[:40]", "--eval-split", "test[:50]",
        "--batch-size", "16", "--epochs", "1", "--optimizer", "adam", "--quiet", "--seed", "3"]

STRATEGY_ARGS = {
    "single": [],
    "ddp": ["--allreduce", "ring", "--bucket-cap-mb", "0.05"],
    "ddp-pmap": ["--allreduce", "reduce_broadcast", "--spmd", "pmap", "--no-overlap"],
    "dp": ["--num-devices", "3"],
    "dp-loss-on-device": ["--loss-on-device"],
    "pipeline": ["--num-stages", "2", "--micro-batches", "4", "--num-devices", "4", "--schedule", "1f1b"],
    "pipeline-zero1": ["--num-stages", "2", "--micro-batches", "4", "--num-devices", "4", "--schedule", "1f1b",
                       "--zero-stage", "1"],
    "pipeline-dw": ["--num-stages", "2", "--micro-batches", "4", "--num-devices", "4", "--schedule", "gpipe",
                    "--defer-wgrad"],
    "zero": ["--zero-stage", "3", "--num-devices", "4"],
    "zero-fetch-model": ["--zero-stage", "3", "--num-devices", "3", "--zero-fetch", "model"],
}


@pytest.fixture(scope="module")
def reference():
    return train.main(BASE + ["--strategy", "single"])


class NewPrograms:
    """Counts, per epoch of a train.py run, the programs JAX traced or lowered (each one a new program: compiled,
    or loaded from the compilation cache), keyed by the epoch the sampler was last set to."""

    def __init__(self, monkeypatch):
        from jaxpar.data.sampler import DistributedSampler

        self.epoch, self.counts = None, {}
        set_epoch = DistributedSampler.set_epoch

        def mark(sampler, epoch):
            self.epoch = epoch
            return set_epoch(sampler, epoch)

        monkeypatch.setattr(DistributedSampler, "set_epoch", mark)

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event in Traces.EVENTS:
            self.counts[self.epoch] = self.counts.get(self.epoch, 0) + 1

    def run(self, argv: list) -> dict:
        jax.monitoring.register_event_duration_secs_listener(self)
        try:
            return train.main(argv)
        finally:
            jax.monitoring.unregister_event_duration_listener(self)


# 3 epochs, so that the second one (its full steps, its uneven last batch, its evaluation) repeats shapes the first saw
@pytest.fixture(scope="module")
def reference_3_epochs():
    with pytest.MonkeyPatch.context() as mp:
        programs = NewPrograms(mp)
        out = programs.run(BASE + ["--strategy", "single", "--epochs", "3"])
    return out, programs.counts


def leaves(state):
    return [np.asarray(a) for a in jax.tree.leaves(state.params)]


def test_reference_run_trains_and_reports(reference):
    assert reference["steps"] == 3  # 16 + 16 + 8 samples: the uneven last batch is kept, not dropped
    assert np.isfinite(reference["train_loss"]) and 0.0 <= reference["eval_accuracy"] <= 1.0
    start = train.main(BASE + ["--strategy", "single", "--steps", "1"])
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(start["state"]), leaves(reference["state"])))


@pytest.mark.parametrize("key", [k for k in STRATEGY_ARGS if k != "single"])
def test_every_strategy_matches_single_through_the_cli(key, reference_3_epochs, monkeypatch):
    """Every strategy through train.py lands on single's parameters after 3 epochs, and makes no new program after
    the first: every step, the uneven last batch and the evaluation reuse the first epoch's (a retrace per step, a
    Python number passed where an array belongs, would show here as a count)."""
    reference, new = reference_3_epochs
    assert reference["steps"] == 9 and new.get(0, 0) > 0 and new.get(1, 0) == 0, new  # the count counts
    strategy, programs = key.split("-")[0], NewPrograms(monkeypatch)
    out = programs.run(BASE + ["--strategy", strategy, "--epochs", "3"] + STRATEGY_ARGS[key])
    assert out["steps"] == reference["steps"]
    for got, want in zip(leaves(out["state"]), leaves(reference["state"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert out["eval_accuracy"] == pytest.approx(reference["eval_accuracy"], abs=0.021)
    assert programs.counts.get(0, 0) > 0 and programs.counts.get(1, 0) == 0, programs.counts


def test_defer_wgrad_reaches_the_pipeline_and_its_report():
    """--defer-wgrad: the schedule is the generator's with every W at the flush, and each stage's W's ran as one
    call over the micro-batches' joined rows (the report says so per part)."""
    out = train.main(BASE + ["--strategy"] + ["pipeline", "--report"] + STRATEGY_ARGS["pipeline-dw"])
    assert out["report"]["schedule"] == "gpipe+dw" and out["report"]["wgrad_joined"] == [True, True]
    assert out["report"]["peak_inflight"] == [4, 4]


# nanoGPT's recipe on top of BASE: clipping that bites (the MLP's gradient norm is ~0.3-0.6) and a warmup +
# cosine learning rate; SGD with momentum, whose updates scale with the clipped gradient (Adam's nearly do not)
RECIPE = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.1", "--grad-clip", "0.05", "--lr-schedule", "cosine",
          "--warmup-steps", "1"]


def norms(path) -> list[float]:
    """Each step's grad_norm from a --metrics-out file written with --log-every 1."""
    return [r["grad_norm"] for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "step"]


@pytest.fixture(scope="module")
def recipe_reference(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("recipe") / "m.jsonl"
    out = train.main(BASE + RECIPE + ["--strategy", "single", "--metrics-out", str(metrics), "--log-every", "1"])
    return {**out, "grad_norms": norms(metrics)}


def test_grad_clip_and_the_cosine_schedule_change_the_run(recipe_reference, tmp_path):
    """Each of the two settings moves the parameters (so the strategies' equality below can fail), and the
    metrics record the learning rate of each update: nanoGPT's lr (it + 1) / (warmup + 1), then the cosine."""
    metrics = tmp_path / "m.jsonl"
    logged = train.main(BASE + RECIPE + ["--strategy", "single", "--metrics-out", str(metrics), "--log-every", "1"])
    lrs = [json.loads(line).get("lr") for line in metrics.read_text().splitlines()]
    np.testing.assert_allclose([lr for lr in lrs if lr is not None], [0.05, 0.1, 0.01 + 0.045], rtol=1e-6)
    assert len(norms(metrics)) == 3 and min(norms(metrics)) > 0.05  # each step's norm, before the clip to 0.05
    # train_loss: the epoch's running mean over its samples (steps of 16, 16 and 8 rows), not over its steps
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"]
    losses, rows = np.array([r["loss"] for r in steps]), np.array([16, 16, 8])
    running = np.cumsum(losses * rows) / np.cumsum(rows)
    assert abs(running[-1] - losses.mean()) > 1e-4
    np.testing.assert_allclose([r["train_loss"] for r in steps], running, rtol=1e-6)
    np.testing.assert_allclose(logged["train_loss"], running[-1], rtol=1e-6)
    unclipped = train.main(BASE + RECIPE + ["--strategy", "single", "--grad-clip", "0"])
    constant = train.main(BASE + RECIPE[:-4] + ["--strategy", "single", "--gamma", "1"])
    for other in (unclipped, constant):  # by 100x the equality's atol at least
        assert max(np.abs(a - b).max() for a, b in zip(leaves(other["state"]), leaves(recipe_reference["state"]))) > 2e-4
    assert all(np.array_equal(a, b) for a, b in zip(leaves(logged["state"]), leaves(recipe_reference["state"])))


@pytest.mark.parametrize("name", ["adamw", "sgd", "adam", "adadelta"])
def test_weight_decay_on_the_matrices_only_is_optaxs_masked_decay(name):
    """decay_params="matrices" (nanoGPT's configure_optimizers, Megatron's groups: no decay on biases and norms)
    equals optax's own masked weight decay, mask ndim >= 2, and differs from decaying every parameter."""
    import optax

    from jaxpar.optim import make_optimizer

    rng = np.random.default_rng(0)
    params = {"kernel": rng.standard_normal((3, 4)), "bias": rng.standard_normal(4), "scale": rng.standard_normal(4),
              "embedding": rng.standard_normal((5, 3))}
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    masked = lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)  # noqa: E731
    want = {"adamw": optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5, mask=masked),
            "sgd": optax.chain(optax.add_decayed_weights(0.5, mask=masked), optax.sgd(1e-2, momentum=0.9)),
            "adam": optax.chain(optax.add_decayed_weights(0.5, mask=masked), optax.adam(1e-2, eps=1e-8)),
            "adadelta": optax.chain(optax.add_decayed_weights(0.5, mask=masked), optax.adadelta(1e-2, 0.9, 1e-6))}
    runs = {}
    for key, tx in (("all", make_optimizer(name, 1e-2, momentum=0.9, weight_decay=0.5)),
                    ("matrices", make_optimizer(name, 1e-2, momentum=0.9, weight_decay=0.5, decay_params="matrices")),
                    ("optax", want[name])):
        p, state = params, tx.init(params)
        for k in range(3):
            grads = jax.tree.map(lambda a, k=k: np.cos(a * (k + 1)), p)
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        runs[key] = p
    for k in params:
        np.testing.assert_array_equal(runs["matrices"][k], runs["optax"][k], err_msg=k)
        if params[k].ndim == 1:  # biases, norms' scales: not decayed
            assert np.abs(runs["all"][k] - runs["matrices"][k]).max() > 1e-6, k
        else:  # weights and embeddings: decayed alike, bit for bit
            np.testing.assert_array_equal(runs["all"][k], runs["matrices"][k], err_msg=k)
    with pytest.raises(ValueError, match="decay_params='some' is not known; use 'all'.*or 'matrices'"):
        make_optimizer(name, 1e-2, decay_params="some")


@pytest.mark.parametrize("name, decay_params", [("adam", "all"), ("adamw", "all"), ("adamw", "matrices")])
def test_betas_are_torchs_and_reach_train_py_from_the_adam_beta_flags(name, decay_params):
    """make_optimizer(..., betas=) is torch's betas of Adam and AdamW (optax's b1, b2; torch's (0.9, 0.999) by
    default), and train.py's --adam-beta1/--adam-beta2 (Megatron's names) reach it: nanoGPT's beta2 0.95 moves the
    second step's update; a beta outside [0, 1) is refused, and the flags under another optimizer."""
    import optax

    from jaxpar.config import Config
    from jaxpar.optim import make_optimizer
    from jaxpar.run.trainer import make_tx, validate

    p = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    gs = [{"w": np.cos(p["w"])}, {"w": 3 * np.sin(p["w"])}]
    want = {"adam": optax.adam(1e-2, b1=0.8, b2=0.95), "adamw": optax.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=0.01)}

    def second(tx):  # the second update: the averages' decay shows
        state = tx.init(p)
        for g in gs:
            u, state = tx.update(g, state, p)
        return u["w"]

    got = second(make_optimizer(name, 1e-2, decay_params=decay_params, betas=(0.8, 0.95)))
    np.testing.assert_allclose(got, second(want[name]), rtol=1e-6)
    cfg = Config(optimizer=name, lr=1e-2, adam_beta1=0.8, adam_beta2=0.95, weight_decay_params=decay_params)
    np.testing.assert_array_equal(second(make_tx(cfg, 10)), got)
    default = second(make_optimizer(name, 1e-2, decay_params=decay_params))
    np.testing.assert_allclose(default, second(make_optimizer(name, 1e-2, decay_params=decay_params,
                                                              betas=(0.9, 0.999))), rtol=0)
    assert np.abs(got - default).max() > 1e-3 * np.abs(default).max()
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"must each be in \[0, 1\)"):
            make_optimizer(name, 1e-2, betas=(0.9, bad))
        with pytest.raises(ValueError, match=rf"--adam-beta2 {bad} must be in \[0, 1\)"):
            validate(Config(optimizer=name, adam_beta2=bad))
    with pytest.raises(ValueError, match="--adam-beta2 0.95 would be ignored.*--optimizer sgd has no betas"):
        validate(Config(optimizer="sgd", adam_beta2=0.95))


@pytest.mark.parametrize("name, decay_params", [("adam", "all"), ("adamw", "all"), ("adamw", "matrices"),
                                                 ("adadelta", "all")])
def test_eps_is_torchs_denominator_term(name, decay_params):
    """make_optimizer(..., eps=) is torch's eps of Adam, AdamW (either parameter group rule) and Adadelta (optax's
    with the same eps), moves the update where gradients are small, and reaches train.py's optimizer from --eps;
    SGD has none, and an eps that is no finite float32 above zero (or not a number) is refused."""
    import optax

    from jaxpar.config import Config
    from jaxpar.optim import make_optimizer
    from jaxpar.run.trainer import make_tx

    p = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    g = {"w": np.float32(1e-4) * np.cos(p["w"])}
    want = {"adam": optax.adam(1e-2, eps=1e-3), "adamw": optax.adamw(1e-2, eps=1e-3, weight_decay=0.01),
            "adadelta": optax.adadelta(1e-2, rho=0.9, eps=1e-3)}[name]
    cfg = Config(optimizer=name, lr=1e-2, eps=1e-3, weight_decay_params=decay_params)
    out = {k: tx.update(g, tx.init(p), p)[0]["w"] for k, tx in (
        ("got", make_optimizer(name, 1e-2, eps=np.float32(1e-3), decay_params=decay_params)), ("want", want),
        ("default", make_optimizer(name, 1e-2, decay_params=decay_params)), ("train.py", make_tx(cfg, 10)))}
    np.testing.assert_allclose(out["got"], out["want"], rtol=1e-6)  # the matrices rule: masked decay, same numbers
    np.testing.assert_array_equal(out["train.py"], out["got"])
    assert np.abs(out["got"] - out["default"]).max() > 1e-4 * np.abs(out["default"]).max()
    for bad in (0.0, -1e-8, True, float("inf"), 1e-50, "1e-3", np.ones(2)):
        with pytest.raises(ValueError, match=r"eps=.* must be a finite number of at least 1.18e-38"):
            make_optimizer(name, 1e-2, eps=bad)
    with pytest.raises(ValueError, match="eps=1e-08 is not an optimizer setting of sgd"):
        make_optimizer("sgd", 1e-2, eps=1e-8)


@pytest.mark.parametrize("name", ["adam", "adamw", "adadelta"])
def test_eps_at_float32s_smallest_normal_is_taken_and_just_below_it_refused(name):
    """The bound is inclusive, as the message says ("at least 1.18e-38"): eps = float32's smallest normal number
    is taken by make_optimizer and by train.py's --eps check, and gives finite updates; the next float32 below it
    (a subnormal) is refused. A strict bound (QA62 mutant) refused the very value the message names."""
    from jaxpar.config import Config
    from jaxpar.optim import EPS_MIN, eps_ok, make_optimizer
    from jaxpar.run.trainer import make_tx

    tiny = float(np.finfo(np.float32).tiny)
    below = float(np.nextafter(np.float32(tiny), np.float32(0)))
    assert EPS_MIN == tiny and 0 < below < tiny  # premise: the two sides of the bound
    p = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    for tx in (make_optimizer(name, 1e-2, eps=tiny), make_tx(Config(optimizer=name, lr=1e-2, eps=tiny), 10)):
        assert np.isfinite(np.asarray(tx.update(p, tx.init(p), p)[0]["w"])).all()
    assert eps_ok(tiny) and not eps_ok(below)
    with pytest.raises(ValueError, match=r"must be a finite number of at least 1.18e-38"):
        make_optimizer(name, 1e-2, eps=below)


def test_sgd_nesterov_is_torchs():
    """make_optimizer("sgd", nesterov=True) against torch.optim.SGD's update, written out here from its documented
    algorithm (weight decay into the gradient, buffer b = m b + g, the step along g + m b), and apart from plain
    momentum; nesterov without a momentum is refused, as torch refuses it."""
    import optax

    from jaxpar.optim import make_optimizer

    rng = np.random.default_rng(0)
    p0 = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    lr, m, wd = 0.1, 0.9, 0.01
    grad = lambda p, k: jax.tree.map(lambda a: np.cos(a * (k + 1)).astype(np.float32), p)  # noqa: E731
    runs = {}
    for nesterov in (True, False):
        tx, p = make_optimizer("sgd", lr, momentum=m, weight_decay=wd, nesterov=nesterov), p0
        state = tx.init(p)
        for k in range(4):
            updates, state = tx.update(grad(p, k), state, p)
            p = optax.apply_updates(p, updates)
        runs[nesterov] = p
    p, buf = {k: v.astype(np.float64) for k, v in p0.items()}, None  # torch's SGD, by its documented algorithm
    for k in range(4):
        g = {n: np.cos(p[n].astype(np.float32) * (k + 1)).astype(np.float64) + wd * p[n] for n in p}
        buf = g if buf is None else {n: m * buf[n] + g[n] for n in p}
        p = {n: p[n] - lr * (g[n] + m * buf[n]) for n in p}
    for n in p:
        np.testing.assert_allclose(runs[True][n], p[n], rtol=1e-5, atol=1e-6, err_msg=n)
        assert np.abs(runs[False][n] - p[n]).max() > 1e-3, n  # plain momentum takes another path
    with pytest.raises(ValueError, match="nesterov=True needs SGD with a momentum > 0.*momentum=0"):
        make_optimizer("sgd", lr, nesterov=True)


def test_warmup_cosine_is_nanogpts_get_lr():
    """jaxpar.optim.warmup_cosine against nanoGPT's get_lr (train.py), written out here from its definition."""
    import math

    from jaxpar.optim import warmup_cosine

    lr, min_lr, warmup, decay = 6e-4, 6e-5, 20, 100

    def get_lr(it):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        if it > decay:
            return min_lr
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (lr - min_lr)

    its = np.arange(130)
    np.testing.assert_allclose(np.asarray(jax.vmap(warmup_cosine(lr, warmup, decay, min_lr))(its)),
                               [get_lr(i) for i in its], rtol=2e-6)
    with pytest.raises(ValueError, match="warmup_steps=100 must be >= 0 and below decay_steps=100"):
        warmup_cosine(lr, 100, 100, min_lr)


@pytest.mark.parametrize("key", [k for k in STRATEGY_ARGS if k != "single"])
def test_grad_clip_and_cosine_schedule_match_single_under_every_strategy(key, recipe_reference, tmp_path):
    """--grad-clip clips by the norm over ALL of the gradients, whichever devices or stages hold them (ZeRO's
    shards, the pipeline's stages are fed it), and the schedule counts optimizer steps alike; each step's
    recorded grad_norm is single's."""
    metrics = tmp_path / "m.jsonl"
    out = train.main(BASE + RECIPE + ["--strategy", key.split("-")[0]] + STRATEGY_ARGS[key]
                     + ["--metrics-out", str(metrics), "--log-every", "1"])
    for got, want in zip(leaves(out["state"]), leaves(recipe_reference["state"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(norms(metrics), recipe_reference["grad_norms"], rtol=1e-5)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_activation_checkpointing_through_the_cli(strategy, reference, monkeypatch):
    """--activation-checkpoint-interval outside the pipeline: the MLP's nn.Sequential layers (Linear, ReLU,
    Linear: modules and a function) in segments recomputed in the backward (the flag reaches the model: its
    segments run), the reference's parameters."""
    from jaxpar import recompute

    calls, run_segments = [], recompute.run_segments
    monkeypatch.setattr(recompute, "run_segments", lambda *a: calls.append(a[2]) or run_segments(*a))
    out = train.main(BASE + ["--strategy", strategy, "--activation-checkpoint-interval", "2"])
    assert calls and set(calls) == {2}
    for got, want in zip(leaves(out["state"]), leaves(reference["state"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_metrics_out_and_torch_export_round_trip(tmp_path, reference):
    metrics, exported = tmp_path / "m.jsonl", tmp_path / "w.npz"
    out = train.main(BASE + ["--metrics-out", str(metrics), "--export-torch", str(exported), "--log-every", "1"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "step" in r][:3] == [1, 2, 3]
    assert any("eval_accuracy" in r for r in records)
    with np.load(exported) as f:
        assert sorted(f.files) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # nn.Sequential's keys
    again = train.main(BASE + ["--init-torch", str(exported), "--steps", "1", "--lr", "1e-30"])
    for got, want in zip(leaves(again["state"]), leaves(out["state"])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_cpu_devices_too_late_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(BASE + ["--cpu-devices", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--cpu-devices 3" in err and "8 CPU devices" in err and len(err.splitlines()) == 1


def test_sgd_defaults_to_torchs_momentum_zero():
    from jaxpar.config import Config
    from jaxpar.optim import make_optimizer

    assert Config().momentum == 0.0
    state = make_optimizer("sgd", 0.1).init({"w": np.zeros(3, np.float32)})
    assert not [a for a in jax.tree.leaves(state) if np.shape(a) == (3,)]  # no momentum buffer, as torch's SGD


def test_init_torch_reads_the_sizes_off_the_state_dict(tmp_path):
    """An MLP whose hidden size is not the CLI's default: the state dict decides (torch's keys and shapes)."""
    rng = np.random.default_rng(0)
    sd = {"0.weight": rng.normal(size=(64, 784)).astype(np.float32), "0.bias": np.zeros(64, np.float32),
          "2.weight": rng.normal(size=(10, 64)).astype(np.float32) * 0.01, "2.bias": np.zeros(10, np.float32)}
    np.savez(tmp_path / "sd.npz", **sd)
    out = train.main(BASE + ["--strategy", "single", "--init-torch", str(tmp_path / "sd.npz"), "--steps", "1"])
    assert [a.shape for a in leaves(out["state"])] == [(64,), (784, 64), (10,), (64, 10)]


def test_conv_impl_reaches_every_convolution():
    """--conv-impl sets each Conv2d of the built-in CNNs; without it they resolve to the backend's default."""
    from jaxpar import models
    from jaxpar.config import Config
    from jaxpar.data import datasets
    from jaxpar.run.trainer import make_model

    data = datasets.load("synthetic", "train[:8]", model="convnet")
    impls = lambda m: [c.impl for _, c in nnx.iter_graph(m) if isinstance(c, models.Conv2d)]  # noqa: E731
    assert impls(make_model(Config(model="convnet"), data)) == [None, None]
    assert impls(make_model(Config(model="convnet", conv_impl="im2col"), data)) == ["im2col", "im2col"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER = {
    "regression": ["--model", "examples/regression.py:make_model", "--model-kwargs",
                   '{"in_features": 8, "hidden": 16, "out_features": 2, "dropout": 0.2}', "--loss", "mse"],
    "lm": ["--model", "examples.lm:TinyLM", "--model-kwargs",
           '{"vocab": 32, "dim": 16, "heads": 2, "depth": 1, "max_len": 8, "attention_dropout": 0.0}',
           "--loss", "cross_entropy"],
}


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    from examples import lm, regression

    root = tmp_path_factory.mktemp("user")
    np.savez(root / "regression.npz", **regression.make_data(n=40, n_test=16))
    np.savez(root / "lm.npz", **lm.make_data(n=40, seq_len=8, vocab=32, n_test=8))
    return root


def user_run(name: str, data, *extra: str) -> dict:
    argv = USER[name] + ["--dataset", "npz", "--data-path", str(data / f"{name}.npz"), "--batch-size", "16",
                         "--epochs", "1", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--quiet"]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the paths and module names above are the repo's, as a user types them there
    try:
        return train.main(argv + list(extra))
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("name", USER)
def test_a_users_model_and_loss_train_under_every_strategy(name, user_data):
    """`--model FILE.py:NAME` / `MODULE:NAME` and `--loss`: the examples train, evaluate on their test split, and
    DDP / DP land on the single-device parameters (dropout on, an uneven last batch of 8)."""
    ref = user_run(name, user_data, "--strategy", "single")
    assert ref["steps"] == 3 and np.isfinite(ref["train_loss"]) and np.isfinite(ref["eval_loss"])
    others = [["--strategy", "ddp", "--num-devices", "4"]]
    if name == "lm":  # the LM's compiles are the dear ones: DP and the device counts are tests/test_contract.py's
        assert 0.0 <= ref["eval_accuracy"] <= 1.0  # cross_entropy's metric, over the unmasked tokens
    else:
        start = user_run(name, user_data, "--strategy", "single", "--steps", "1")
        assert not all(np.array_equal(a, b) for a, b in zip(leaves(start["state"]), leaves(ref["state"])))
        others.append(["--strategy", "dp", "--num-devices", "3"])
    for extra in others:
        out = user_run(name, user_data, *extra)
        for got, want in zip(leaves(out["state"]), leaves(ref["state"])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_a_dataset_without_a_test_split_skips_evaluation(user_data, tmp_path):
    from examples import regression

    data = regression.make_data(n=32)
    np.savez(tmp_path / "regression.npz", x=data["x"], y=data["y"])  # no x_test / y_test
    out = user_run("regression", tmp_path, "--strategy", "single")
    assert out["steps"] == 2 and not [k for k in out if k.startswith("eval_")]


def test_whole_shard_losses_refuse_the_samplers_wrap_around_copies(monkeypatch, tmp_path):
    """63 samples on 2 processes: the sampler pads rank 1 with a copy, which the loader masks out of a per-sample
    loss; a loss over whole shards (BatchNorm's statistics) would see it, so train.py refuses before any work."""
    from jaxpar.config import Config
    from jaxpar.run import trainer

    x = np.random.default_rng(0).normal(size=(63, 5)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    cfg = Config(strategy="ddp", model="mlp", dataset="npz", data_path=str(tmp_path / "d.npz"), eval_split="",
                 batch_size=16, steps=1, quiet=True, per_sample="off")  # ddp: single runs in one process
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # rank 0 of 2: 32 samples, batches of 8
    from jaxpar.run import distributed

    monkeypatch.setattr(distributed, "check_same_config", lambda cfg: None)  # no second process to compare with
    monkeypatch.setattr(distributed, "check_same_data", lambda **sizes: None)
    with pytest.raises(ValueError, match="63 samples do not divide by the 2 processes: the sampler pads with 1 "
                                         "wrap-around copies, which would reach the batch statistics; pass "
                                         "--drop-last"):
        trainer.run(cfg)


def test_each_epochs_train_loss_is_the_running_mean_of_its_own_steps(tmp_path):
    """--epochs 2 (steps of 16, 16 and 8 rows an epoch): the step records' train_loss and the epoch record's are the
    running mean over the samples of that epoch alone, starting over at the second epoch's first step (the first
    epoch's losses carried on would make it another number)."""
    metrics = tmp_path / "m.jsonl"
    out = train.main(BASE + ["--strategy", "single", "--epochs", "2", "--metrics-out", str(metrics), "--log-every",
                             "1"])
    records = list(map(json.loads, metrics.read_text().splitlines()))
    steps = [r for r in records if r.get("event") == "step"]
    epochs = [r for r in records if r.get("event") == "epoch"]
    assert [r["epoch"] for r in steps] == [0, 0, 0, 1, 1, 1] and len(epochs) == 2
    rows = np.array([16, 16, 8])
    for e in range(2):
        losses = np.array([r["loss"] for r in steps[3 * e:3 * e + 3]])
        running = np.cumsum(losses * rows) / np.cumsum(rows)
        np.testing.assert_allclose([r["train_loss"] for r in steps[3 * e:3 * e + 3]], running, rtol=1e-6)
        np.testing.assert_allclose(epochs[e]["train_loss"], running[-1], rtol=1e-6)
    assert abs(steps[3]["train_loss"] - steps[3]["loss"]) < 1e-6 * abs(steps[3]["loss"])
    assert abs(steps[0]["loss"] - steps[3]["loss"]) > 1e-4  # the epochs' losses differ: a carried sum would show
    np.testing.assert_allclose(out["train_loss"], epochs[-1]["train_loss"], rtol=1e-6)


def test_a_run_stopped_by_steps_mid_epoch_and_resumed_keeps_one_epoch_record_per_epoch(tmp_path):
    """--steps 2 of an epoch of 3, then --resume to --epochs 2: the stopped run's record of epoch 0 (its train loss
    over 2 steps, evaluated at step 2) stayed in --metrics-out beside the resumed run's record of the whole epoch,
    two "epoch" records of epoch 0 (a QA finding). The stopped run's record is now marked "partial" and the whole
    epoch's replaces it: the file's epoch and step records are an uninterrupted run's."""
    def records(path, event):
        keys = ("epoch", "step", "partial", "loss", "train_loss", "eval_loss", "eval_accuracy", "grad_norm", "lr")
        return [{k: r[k] for k in keys if k in r} for r in map(json.loads, path.read_text().splitlines())
                if r.get("event") == event]

    run = BASE + ["--strategy", "single", "--epochs", "2", "--log-every", "1"]
    whole = tmp_path / "whole.jsonl"
    train.main(run + ["--metrics-out", str(whole)])
    assert [(r["epoch"], r["step"], r["partial"]) for r in records(whole, "epoch")] == [(0, 3, False), (1, 6, False)]
    parts, ckpt = tmp_path / "parts.jsonl", str(tmp_path / "ckpt")
    stopped = train.main(run + ["--metrics-out", str(parts), "--checkpoint-dir", ckpt, "--steps", "2"])
    partial = records(parts, "epoch")
    assert [(r["epoch"], r["step"], r["partial"]) for r in partial] == [(0, 2, True)]  # marked, not an epoch's end
    assert partial[0]["eval_loss"] == pytest.approx(stopped["eval_loss"])
    resumed = train.main(run + ["--metrics-out", str(parts), "--checkpoint-dir", ckpt, "--resume"])
    assert records(parts, "epoch") == records(whole, "epoch")  # one per epoch, the whole epoch's numbers
    assert records(parts, "step") == records(whole, "step")
    assert resumed["eval_loss"] == records(parts, "epoch")[-1]["eval_loss"]


def test_drop_last_drops_the_short_batch_from_the_epochs_and_their_learning_rates(tmp_path):
    """40 samples in batches of 16 with --drop-last: 2 steps an epoch (the 8 left over dropped, as torch's
    DataLoader(drop_last=True)), so --epochs 2 is 4 updates, and the per-epoch StepLR decays after the second;
    without it, 3 steps an epoch. Counting the dropped batch made 3 epochs of 2 and decayed a step late."""
    lrs = {}
    for flags in (["--drop-last"], []):
        metrics = tmp_path / f"m{len(flags)}.jsonl"
        out = train.main(BASE + ["--strategy", "single", "--epochs", "2", "--gamma", "0.5", "--metrics-out",
                                 str(metrics), "--log-every", "1", *flags])
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"]
        lrs[bool(flags)] = [r["lr"] for r in steps]
        assert out["steps"] == len(steps) and [r["epoch"] for r in steps] == (
            [0, 0, 1, 1] if flags else [0, 0, 0, 1, 1, 1])
    lr = lrs[True][0]
    np.testing.assert_allclose(lrs[True], [lr, lr, lr / 2, lr / 2], rtol=1e-6)
    np.testing.assert_allclose(lrs[False], [lr] * 3 + [lr / 2] * 3, rtol=1e-6)


@pytest.mark.parametrize("key", ["ddp", "zero", "pipeline"])
def test_a_batch_size_beyond_the_dataset_pads_to_the_data_not_to_the_batch_size(key, monkeypatch):
    """--batch-size 2**40 on 5 samples: every strategy trains on batches of the 5 (single's and torch's DataLoader's
    batch), equal to single. The strategies pad each batch to their share of the batch size; given the flag's
    value, ddp, zero and the pipeline tried to pad 5 rows to 2**40 (8 TiB of indices) before any step ran."""
    from jaxpar.batch import pad_rows

    widest = []
    monkeypatch.setattr("jaxpar.batch.pad_rows", lambda rows, n: widest.append(n) or pad_rows(rows, n))
    for module in ("ddp", "zero", "pipeline"):
        monkeypatch.setattr(f"jaxpar.strategies.{module}.pad_rows", lambda rows, n: widest.append(n) or
                            pad_rows(rows, n))
    tiny = BASE[:4] + ["--train-split", "train[:5]"] + BASE[6:8] + ["--batch-size", str(2 ** 40)] + BASE[10:]
    assert tiny.count("--batch-size") == 1 and "train[:5]" in tiny
    want = train.main(tiny + ["--strategy", "single", "--epochs", "2"])
    out = train.main(tiny + ["--strategy", key, "--epochs", "2"] + STRATEGY_ARGS[key])
    assert out["steps"] == want["steps"] == 2
    # the 5 rows padded to what the devices (x micro-batches) divide; the pipeline's evaluation pads test[:50] to 56
    assert 8 in widest and max(widest) <= 56, widest
    for got, ref in zip(leaves(out["state"]), leaves(want["state"])):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)


def test_an_eval_set_with_no_weight_reports_nan_not_a_perfect_loss():
    """Every held-out target masked out: the mean is 0/0, NaN (null in --metrics-out) as jaxpar.evaluate and torch's
    mean over no targets give, not eval_loss 0 (a QA finding: the weight was floored at 1e-30)."""
    import types

    from jaxpar.objective import Sums
    from jaxpar.run import trainer

    data = type("Data", (), {"__len__": lambda self: 4, "batch": lambda self, idx: {"x": np.zeros((len(idx), 2))}})()
    state = types.SimpleNamespace(params=None, model_state=None)

    def sums(loss, weight, correct):
        return lambda params, model_state, rows: Sums(np.float32(loss), np.float32(weight), np.float32(4),
                                                      {"accuracy": np.float32(correct)})

    out = trainer.evaluate(sums(0, 0, 0), state, data, 4)
    assert np.isnan(out["eval_loss"]) and np.isnan(out["eval_accuracy"])
    assert trainer.evaluate(sums(6, 3, 1.5), state, data, 4) == {"eval_loss": 2.0, "eval_accuracy": 0.5}
