"""What a run tells: --metrics-out JSON lines, the --report table, and bench/plot.py's PNGs from those files."""
import json
import os
import sys

import numpy as np
import pytest

from jaxpar.run import report
from jaxpar.run import trainer
from jaxpar.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plot  # noqa: E402  (bench/plot.py)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short runs (single, ddp) with --report and --metrics-out; 2 epochs of 3 steps, eval on x_test."""
    root = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    x, xt = rng.normal(size=(48, 10)).astype(np.float32), rng.normal(size=(20, 10)).astype(np.float32)
    np.savez(root / "d.npz", x=x, y=np.argmax(x[:, :3], -1), x_test=xt, y_test=np.argmax(xt[:, :3], -1))
    out = {}
    for strategy, kw in (("single", {}), ("ddp", {"num_devices": 4})):
        path = str(root / f"{strategy}.jsonl")
        cfg = Config(strategy=strategy, model="mlp", dataset="npz", data_path=str(root / "d.npz"), batch_size=16,
                     epochs=2, optimizer="adam", log_every=2, quiet=True, report=True, metrics_out=path, **kw)
        out[strategy] = (trainer.run(cfg), path)
    out["root"] = str(root)
    return out


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_out_records_every_log_step_and_epoch(runs):
    summary, path = runs["single"]
    recs = read(path)
    assert [r["event"] for r in recs][0] == "start" and recs[-1]["event"] == "summary"
    assert recs[0]["config"]["strategy"] == "single" and recs[0]["step"] == 0
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [2, 4, 6]  # --log-every 2 over 6 steps
    for r in steps:
        assert {"epoch", "loss", "train_loss", "grad_norm", "samples_per_s", "step_time_s"} <= r.keys()
        assert np.isfinite(r["loss"]) and r["train_loss"] > 0 and r["grad_norm"] > 0
    assert np.isfinite(steps[-1]["samples_per_s"]) and steps[-1]["step_time_s"] > 0
    assert steps[0]["samples_per_s"] is None  # before a timed step there is no rate: null, not NaN
    for line in open(path):  # strict JSON (RFC 8259), which JSON.parse and jq read: no NaN or Infinity
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))
    epochs = [r for r in recs if r["event"] == "epoch"]
    assert [(r["epoch"], r["step"]) for r in epochs] == [(0, 3), (1, 6)]
    assert all(0 <= r["eval_accuracy"] <= 1 and np.isfinite(r["eval_loss"]) for r in epochs)
    assert recs[-1]["eval_loss"] == pytest.approx(summary["eval_loss"]) and recs[-1]["steps"] == 6


def test_report_table(runs, capsys):
    summary, _ = runs["single"]
    text = report.table(summary, summary["report"], summary["memory"])
    for row in ("strategy", "devices", "samples/s", "step time", "memory cpu:0"):
        assert row in text
    assert "memory cpu:1" not in text  # devices holding nothing are left out
    ddp, _ = runs["ddp"]
    text = report.table(ddp, ddp["report"], ddp["memory"])
    assert "comm/step, cost model" in text and "comm/step, compiled HLO" in text, text
    assert "all-reduce" in text and "memory cpu:3" in text
    pipe = report.table({"strategy": "pipeline", "steps": 3, "step_time_s": 0.01},
                        {"devices": 4, "bubble_fraction": 0.25, "ticks": 12, "schedule": "1f1b"})
    assert "pipeline bubble  25.0 % of 12 ticks (1f1b)" in pipe


def test_plot_draws_every_chart(runs, tmp_path, capsys):
    ar = tmp_path / "allreduce.jsonl"
    ar.write_text("".join(json.dumps({"algorithm": a, "bytes": b, "busbw": bw}) + "\n"
                          for a in ("psum", "ring") for b, bw in ((1 << 10, 0.1), (1 << 20, 2.0), (1 << 24, 3.5))))
    out = str(tmp_path / "plots")
    written = plot.main(["--out", out, runs["single"][1], runs["ddp"][1], "--allreduce", str(ar),
                         "--schedule", "1f1b", "--stages", "4", "--micro-batches", "8"])
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["allreduce_busbw.png", "grad_norm.png", "loss.png", "pipeline_1f1b.png", "throughput.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == PNG and os.path.getsize(p) > 5000
    assert plot.run_labels([runs["single"][1], runs["ddp"][1]]) == {runs["single"][1]: "single",
                                                                    runs["ddp"][1]: "ddp"}
    with pytest.raises(ValueError, match="no {'algorithm', 'bytes', 'busbw'} records"):
        plot.plot_busbw([{"x": 1}], str(tmp_path / "x.png"))
    with pytest.raises(SystemExit):  # a pattern that matched nothing (runs/*.jsonl): one line, not a traceback
        plot.main(["--out", out, str(tmp_path / "runs" / "*.jsonl")])
    assert "runs/*.jsonl' is not a file; pass train.py's --metrics-out files" in capsys.readouterr().err


def test_fresh_run_starts_metrics_out_anew_and_resume_appends(runs, tmp_path, capsys):
    """A run without --resume truncates an existing --metrics-out (a note on stderr); --resume's writer appends."""
    path = str(tmp_path / "m.jsonl")
    with open(runs["single"][1]) as f, open(path, "w") as g:
        g.write(f.read())  # an earlier run's records
    cfg = Config(model="mlp", dataset="npz", data_path=os.path.join(runs["root"], "d.npz"), batch_size=16, steps=1,
                 eval_split="", quiet=True, log_every=1, metrics_out=path)
    trainer.run(cfg)
    assert [r["event"] for r in read(path)].count("start") == 1  # appended, this would be 2
    assert f"--metrics-out {path} held an earlier run's records" in capsys.readouterr().err
    w = report.MetricsWriter(path, append=True)
    w.write({"event": "start", "step": 1, "config": {"resume": True}})
    w.close()
    assert [r["event"] for r in read(path)].count("start") == 2 and "held" not in capsys.readouterr().err


def test_a_run_refused_at_its_first_step_leaves_metrics_out_as_it_was(runs, tmp_path, monkeypatch):
    """A refusal raised while the first step is traced (QA: sequence parallelism over an odd length, before it had
    its own check) came after --metrics-out was opened: an earlier run's records were replaced by a start record."""
    from jaxpar.strategies.single import SingleDevice

    path = str(tmp_path / "m.jsonl")
    with open(runs["single"][1]) as f, open(path, "w") as g:
        g.write(f.read())
    before = open(path).read()

    def refuse(self, placed, batch):
        raise ValueError("refused while the step is traced")

    monkeypatch.setattr(SingleDevice, "step", refuse)
    cfg = Config(model="mlp", dataset="npz", data_path=os.path.join(runs["root"], "d.npz"), batch_size=16, steps=1,
                 eval_split="", quiet=True, log_every=1, metrics_out=path)
    with pytest.raises(ValueError, match="refused while the step is traced"):
        trainer.run(cfg)
    assert open(path).read() == before and "start" in before


def test_plot_draws_each_run_of_a_file_apart(runs, tmp_path):
    """A file holding two fresh runs (an older train.py appended them) is two lines and two throughput bars, never
    one spliced curve; a resumed run's records continue the run before it."""
    recs = read(runs["single"][1])
    second = [dict(r, samples_per_s=1.0) if r["event"] == "summary" else r for r in recs]
    resumed = [dict(r, config=dict(r["config"], resume=True)) if r["event"] == "start" else r for r in recs]
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps(r) + "\n" for r in recs + second))
    assert [len(r) for r in plot.split_runs(recs + second)] == [len(recs), len(recs)]
    assert [len(r) for r in plot.split_runs(recs + resumed)] == [2 * len(recs)]
    loaded = plot.load_runs([str(both)])
    assert list(loaded) == ["single run 1/2", "single run 2/2"]
    assert [next(r for r in rs if r["event"] == "summary")["samples_per_s"] for rs in loaded.values()] == [
        recs[-1]["samples_per_s"], 1.0]  # each bar from its own run
    written = plot.main(["--out", str(tmp_path / "p"), str(both)])
    assert sorted(os.path.basename(p) for p in written) == ["grad_norm.png", "loss.png", "throughput.png"]


def test_the_clock_leaves_out_two_warm_up_steps_per_batch_size(monkeypatch):
    """samples/s counts no warm-up: the first step of each batch size compiles, and the second ran 2-3x slower
    than the rest with nothing compiled (a review: ConvNet on CPU, 0.81 s against 0.24-0.34 s), which the first
    step's exclusion alone left in short runs' samples/s."""
    from jaxpar.run import report

    now = iter([0.0, 5.0, 6.0, 7.0, 8.0, 20.0, 30.0, 31.0])  # batch 8 x 5 steps (the 2nd slow), batch 2 x 3
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(now))
    clock = report.Clock()
    for samples in (8, 8, 8, 8, 8, 2, 2, 2):
        clock.tick(samples)
    assert clock.steps == 4 and clock.samples == 3 * 8 + 2  # steps 3-5 of batch 8, step 3 of batch 2
    assert clock.total()["step_time_s"] == (1.0 + 1.0 + 1.0 + 1.0) / 4


def test_report_memory_leaves_out_train_pys_own_copies():
    """--report's per-device memory under DDP: device 0 held train.py's initial state and its unplaced final copy
    besides its replica (a review: 3.54 MiB against 1.21 on the other devices, as if DDP had a master). The
    initial state is dropped after init and the memory read before the final copy is made; the model object
    train.py built keeps its type and config but no arrays (its weights stayed on device 0 all run, 1.60 MiB
    against 1.21 here, a whole unsharded model beside each ZeRO-3 shard: a QA finding)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--cpu-devices", "4", "--strategy", "ddp",
                          "--model", "mlp", "--train-split", "train[:128]", "--eval-split", "", "--batch-size", "32",
                          "--steps", "2", "--report", "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    live = {line.split()[1]: float(line.split()[3]) for line in out.stdout.splitlines()
            if line.startswith("memory cpu:")}
    assert len(live) == 4 and live["cpu:0"] == live["cpu:1"] == live["cpu:2"] == live["cpu:3"] > 0, live


def test_summary_line_says_null_where_metrics_out_does():
    """A run of 2 steps has no timed step: --metrics-out writes null, the summary line printed nan (a QA finding)."""
    from jaxpar.run import trainer

    line = trainer.summary_line({"strategy": "single", "steps": 2, "samples_per_s": float("nan"), "time_s": 1.25})
    assert line == "summary: strategy=single steps=2 samples_per_s=null time_s=1.25"


def test_metrics_out_writes_a_non_finite_number_inside_a_list_as_null(tmp_path):
    """Strict JSON lines whatever a record nests: a NaN or inf inside a list (per-device numbers, a dict in a list,
    a numpy scalar) is null like a top-level one, never a crash of the run's writer (json's allow_nan=False)."""
    path = str(tmp_path / "m.jsonl")
    writer = report.MetricsWriter(path)
    writer.begin()
    writer.write({"event": "x", "loss": [1.5, float("nan")], "rows": [{"peak": float("inf")}, {"peak": 2.0}],
                  "numpy": (np.float32("nan"), np.float32(0.5))})
    writer.close()
    with open(path) as f:
        assert json.loads(f.read()) == {"event": "x", "loss": [1.5, None], "rows": [{"peak": None}, {"peak": 2.0}],
                                        "numpy": [None, 0.5]}


def test_report_table_shows_a_device_with_an_allocator_peak_but_no_live_bytes():
    """A device's memory row appears when it holds live bytes or reached an allocator peak: one whose buffers were
    all freed by the time of the report (live 0) still shows its peak; one with neither is left out."""
    mem = [{"device": "gpu:0", "live_bytes": 0, "peak_bytes": 3 * 2**20},
           {"device": "gpu:1", "live_bytes": 0, "peak_bytes": None}]
    text = report.table({"strategy": "single", "steps": 1}, {}, mem)
    assert "memory gpu:0" in text and "allocator peak 3.00 MiB" in text, text
    assert "memory gpu:1" not in text


def test_samples_per_s_and_the_step_time_row_are_the_timed_steps_numbers(monkeypatch):
    """samples_per_s is the timed steps' samples over their seconds (window(): since its last call; total(): the
    run), step_time_s their mean step; --report's step time row shows it in milliseconds."""
    import re

    now = iter([0.0, 1.0, 1.5, 2.0, 2.25])  # batch 8 x 5 steps: two warm-up steps, then 0.5, 0.5, 0.25 s
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(now))
    clock = report.Clock()
    for _ in range(4):
        clock.tick(8)
    assert clock.window() == {"samples_per_s": 16 / 1.0, "step_time_s": 0.5}
    clock.tick(8)
    assert clock.window() == {"samples_per_s": 8 / 0.25, "step_time_s": 0.25}
    total = clock.total()
    assert total == {"samples_per_s": 24 / 1.25, "step_time_s": 1.25 / 3}
    text = report.table({"strategy": "single", "steps": 5, **total}, {})
    assert re.search(r"\nstep time +416\.67 ms\n", text) and re.search(r"\nsamples/s +19\.2\n", text), text


def test_memory_fields_flatten_the_held_memory_for_metrics_out():
    """--metrics-out's summary gets the held memory as flat byte counts: the measured params, gradients, optimizer
    state and their total, the model state, and the ZeRO paper's total and formula beside them (not the measured
    total again); a report without held memory gives none."""
    held = {"params": 100, "gradients": 50, "optimizer": 200, "total": 350, "model_state": 7, "num_params": 25,
            "paper": {"total": 400, "formula": "(2 + 2 + K) Psi / N"}}
    assert report.memory_fields({"held_memory": held}) == {
        "memory_params_bytes": 100, "memory_gradients_bytes": 50, "memory_optimizer_bytes": 200,
        "memory_held_bytes": 350, "memory_model_state_bytes": 7, "memory_paper_bytes": 400,
        "memory_paper_formula": "(2 + 2 + K) Psi / N"}
    assert report.memory_fields({"devices": 4}) == {}


def test_a_resumed_writer_rewrites_its_file_atomically_without_later_steps_or_a_torn_line(tmp_path):
    """A resumed writer (resumed_at: its checkpoint's step) drops an earlier run's records of later steps and a last
    line cut short by a kill (which the next record was appended onto: two unreadable lines), keeps other lines as
    they were, and replaces the file in one os.replace: its permissions kept, no temporary file left."""
    path = tmp_path / "m.jsonl"
    lines = [json.dumps(r) + "\n" for r in (
        {"event": "start", "step": 0}, {"event": "step", "step": 2, "epoch": 0},
        {"event": "epoch", "epoch": 0, "step": 2, "partial": True}, {"event": "summary", "steps": 2},
        {"event": "start", "step": 2}, {"event": "step", "step": 4, "epoch": 0})]
    path.write_text("".join(lines) + "not json, kept\n" + '{"event": "step", "st')
    os.chmod(path, 0o640)
    writer = report.MetricsWriter(str(path), append=True, resumed_at=2)
    writer.write({"event": "start", "step": 2})
    writer.begin()
    writer.write({"event": "epoch", "epoch": 0, "step": 3, "partial": False})
    writer.close()
    # the partial record of epoch 0 goes when its whole record is written, step 4's and the torn line at begin()
    assert path.read_text().splitlines() == [line.rstrip("\n") for line in lines[:2] + lines[3:5]] + [
        "not json, kept", '{"event": "start", "step": 2}',
        '{"event": "epoch", "epoch": 0, "step": 3, "partial": false}']
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o640) and os.listdir(tmp_path) == ["m.jsonl"]
