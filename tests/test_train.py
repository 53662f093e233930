"""Smoke and end-to-end tests of train.py: every strategy through the CLI lands on the single-device parameters."""
import json

import jax
import numpy as np
import pytest

import train

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
}


@pytest.fixture(scope="module")
def reference():
    return train.main(BASE + ["--strategy", "single"])


def leaves(state):
    return [np.asarray(a) for a in jax.tree.leaves(state.params)]


def test_reference_run_trains_and_reports(reference):
    assert reference["steps"] == 3  # 16 + 16 + 8 samples: the uneven last batch is kept, not dropped
    assert np.isfinite(reference["train_loss"]) and 0.0 <= reference["eval_accuracy"] <= 1.0
    start = train.main(BASE + ["--strategy", "single", "--steps", "1"])
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(start["state"]), leaves(reference["state"])))


@pytest.mark.parametrize("key", [k for k in STRATEGY_ARGS if k != "single"])
def test_every_strategy_matches_single_through_the_cli(key, reference):
    strategy = key.split("-")[0]
    out = train.main(BASE + ["--strategy", strategy] + STRATEGY_ARGS[key])
    assert out["steps"] == reference["steps"]
    for got, want in zip(leaves(out["state"]), leaves(reference["state"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert out["eval_accuracy"] == pytest.approx(reference["eval_accuracy"], abs=0.021)


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
