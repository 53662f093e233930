"""Stop and resume: a run stopped (SIGTERM, SIGINT, kill -9, even during a save) and resumed with --resume ends
with parameters and optimizer state BIT-identical to the run that was never stopped."""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxpar.run import checkpoint
from jaxpar.run import trainer
from jaxpar.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_STEPS = 7  # 60 samples / batch 16 = 4 steps per epoch (the 4th padded): stops and resumes cross an epoch
STRATEGIES = {  # kept small: the mlp, few devices
    "single": {},
    "ddp": {"num_devices": 4},
    "dp": {"num_devices": 2},
    "pipeline": {"num_stages": 2, "micro_batches": 2, "num_devices": 4, "zero_stage": 1},  # ZeRO-1: 2 replicas
    "zero": {"zero_stage": 3, "num_devices": 4},
}


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> str:
    """A tiny learnable data set: 60 samples of 12 features, 3 classes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 12)).astype(np.float32)
    y = np.argmax(x[:, :3], -1).astype(np.int32)
    path = str(tmp_path_factory.mktemp("data") / "tiny.npz")
    np.savez(path, x=x, y=y)
    return path


def config(npz: str, strategy: str = "single", **kw) -> Config:
    """Adam with a per-epoch lr decay (StepLR): the resumed optimizer count must drive the schedule."""
    base = dict(strategy=strategy, model="mlp", dataset="npz", data_path=npz, eval_split="", batch_size=16,
                steps=N_STEPS, optimizer="adam", lr=0.01, gamma=0.5, quiet=True)
    return Config(**{**base, **STRATEGIES[strategy], **kw})


def leaves(state) -> list[np.ndarray]:
    return [np.asarray(a) for a in checkpoint.to_host(state)]


def assert_bit_identical(a, b, what: str) -> None:
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: leaf {i} differs"


def signal_at(step: int, signum: int = signal.SIGTERM):
    def on_step(s, metrics):
        if s == step:
            os.kill(os.getpid(), signum)
    return on_step


@pytest.fixture(scope="module")
def uninterrupted(npz, tmp_path_factory):
    """The reference run of each strategy (cached per module); single's also saves every 2 steps, keeping 2."""
    cache = {}

    def get(strategy: str):
        if strategy not in cache:
            kw = {}
            if strategy == "single":
                cache["single_ckpt"] = str(tmp_path_factory.mktemp("every") / "ckpt")
                kw = dict(checkpoint_dir=cache["single_ckpt"], checkpoint_every=2, checkpoint_keep=2)
            cache[strategy] = trainer.run(config(npz, strategy, **kw))["state"]
        return cache[strategy]
    get.cache = cache
    return get


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "single"])  # single: the subprocess tests
def test_stop_by_signal_and_resume_is_bit_identical(strategy, npz, uninterrupted, tmp_path):
    k = random.Random().randint(1, N_STEPS - 1)  # a random step, printed on failure
    signum = signal.SIGTERM if k % 2 else signal.SIGINT
    ckpt = str(tmp_path / "ckpt")
    stopped = trainer.run(config(npz, strategy, checkpoint_dir=ckpt), on_step=signal_at(k, signum))
    assert stopped["stopped"] == signal.Signals(signum).name and stopped["steps"] == k, (k, stopped)
    assert checkpoint.latest_step(ckpt) == k
    full = uninterrupted(strategy)
    assert not np.array_equal(leaves(stopped["state"])[0], leaves(full)[0])  # k steps really differ from N
    resumed = trainer.run(config(npz, strategy, checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from"] == k and resumed["steps"] == N_STEPS
    assert_bit_identical(resumed["state"], full, f"{strategy}, stopped at step {k} by {signum!r}")
    assert checkpoint.latest_step(ckpt) == N_STEPS  # the end of a run is saved too


def test_checkpoint_every_and_keep(uninterrupted):
    uninterrupted("single")  # ran with --checkpoint-every 2 --checkpoint-keep 2
    ckpt = uninterrupted.cache["single_ckpt"]
    steps = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
    assert steps == [6, 7]  # saved at 2, 4, 6 and the end (7); the oldest deleted


def _regression_state(tx, seed: int):
    """A TrainState whose model_state holds RNG streams (stock nnx.Dropout): typed keys and counts."""
    from flax import nnx

    from examples.regression import make_model
    from jaxpar.step import init_state

    return init_state(make_model(12, 8, 3, rngs=nnx.Rngs(params=seed, dropout=seed)), tx)


def _rng_key(state):
    from flax import nnx

    return jax.tree.leaves(nnx.state(state.model_state, nnx.RngKey))[0]


def test_roundtrip_restores_typed_key_and_optimizer_count(npz, tmp_path):
    cfg = config(npz)
    tx = trainer.make_tx(cfg, steps_per_epoch=4)
    state = _regression_state(tx, 7)
    state = state._replace(step=state.step + 5, opt_state=jax.tree.map(lambda a: a + 3, state.opt_state))
    template = _regression_state(tx, 0)
    info = checkpoint.run_info(cfg, state)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), info, resume=False)
    assert ckpt.save(5, state, {"epoch": 1, "sampler": {"epoch": 1, "offset": 16}})
    ckpt.close()
    restored, data = checkpoint.Checkpointer(str(tmp_path / "c"), info, resume=True).restore(template)
    assert jax.dtypes.issubdtype(_rng_key(restored).dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(_rng_key(restored)), jax.random.key_data(_rng_key(state)))
    assert not np.array_equal(jax.random.key_data(_rng_key(template)), jax.random.key_data(_rng_key(restored)))
    assert int(restored.step) == 5 and data == {"epoch": 1, "sampler": {"epoch": 1, "offset": 16}}
    assert_bit_identical(restored, state, "roundtrip")


@pytest.mark.parametrize("which", [0, -1], ids=["first", "last"])
def test_a_state_with_any_non_finite_parameter_is_not_saved(npz, tmp_path, which):
    """train.py's checkpointer writes nothing for a state with an inf in any parameter leaf (the first or the
    last), so the last good checkpoint stays the newest; a finite state saves."""
    cfg = config(npz)
    state = _regression_state(trainer.make_tx(cfg, steps_per_epoch=4), 7)
    flat, tree = jax.tree.flatten(state.params)
    bad = np.array(flat[which])
    bad.flat[-1] = np.inf
    flat[which] = bad
    ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), checkpoint.run_info(cfg, state), resume=False)
    assert not ckpt.save(5, state._replace(params=jax.tree.unflatten(tree, flat)), {"epoch": 0})
    assert ckpt.save(6, state, {"epoch": 0})
    ckpt.close()
    assert checkpoint.all_steps(str(tmp_path / "c")) == [6]


def test_resume_falls_back_past_a_damaged_newest_checkpoint(npz, uninterrupted, tmp_path, capsys):
    """The newest step's files are damaged (a disk that lost them): --resume warns in one line, naming the step,
    sets its folder aside as 5.damaged and goes on from the newest readable one, ending bit-identical to the run
    that was never stopped. Its own step 5 is written again (a QA finding: orbax writes no step at or below its
    newest, and the save of step 5 was dropped in silence, so every resume went back to step 4), and the failed
    read leaves no tracebacks (it printed hundreds: "Event loop is closed")."""
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, checkpoint_dir=ckpt, checkpoint_every=2, checkpoint_keep=3), on_step=signal_at(5))
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [2, 4, 5]
    for root, _, files in os.walk(os.path.join(ckpt, "5", "state")):
        for f in files:  # every array file of step 5 truncated to nothing
            open(os.path.join(root, f), "wb").close()
    capsys.readouterr()
    resumed = trainer.run(config(npz, checkpoint_dir=ckpt, resume=True, checkpoint_every=1, checkpoint_keep=10))
    err = capsys.readouterr().err
    assert "checkpoint step 5" in err and "damaged" in err and "resuming from step 4" in err, err
    assert f"the damaged step 5 is kept as {os.path.join(ckpt, '5.damaged')}" in err, err
    assert len(err.strip().splitlines()) == 2 and "Traceback" not in err, err
    assert resumed["resumed_from"] == 4 and resumed["steps"] == N_STEPS
    assert_bit_identical(resumed["state"], uninterrupted("single"), "resumed from step 4")
    assert sorted(d for d in os.listdir(ckpt) if not d.isdigit()) == ["5.damaged"]
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [2, 4, 5, 6, 7]  # step 5 written anew
    info = checkpoint.run_info(config(npz), resumed["state"])
    again = checkpoint.Checkpointer(ckpt, info, resume=True)
    again.steps = [5]  # step 5 itself reads in full now
    assert int(again.restore(resumed["state"])[0].step) == 5
    again.close()  # a Checkpointer holds the directory's lock until closed: another writer is refused till then
    with pytest.raises(ValueError, match=r"holds a newer step, 7, and checkpoints go in increasing steps \(orbax "
                                         r"wrote nothing for step 3\); pass a step above it"):
        checkpoint.save_checkpoint(ckpt, resumed["state"], step=3)  # the library call said it saved


def test_a_stray_empty_step_folder_is_named_once_without_orbaxs_warnings(npz, tmp_path):
    """An empty numbered folder in --checkpoint-dir (a step whose files never landed) printed orbax's "Metadata file
    does not exist" four or five times before jaxpar's own one-line warning (a QA pass); train.py's stderr now holds
    jaxpar's two lines only."""
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, steps=4, checkpoint_dir=ckpt, checkpoint_every=2))
    os.mkdir(os.path.join(ckpt, "9"))
    out = subprocess.run(cli(npz, ckpt, "--resume"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert "checkpoint step 9" in lines[0] and "resuming from step 4" in lines[0] and len(lines) == 2, lines


def flip_a_byte(step_dir: str) -> None:
    """One bit flipped in the middle of the largest array data file of a saved step (its bytes changed on disk)."""
    data = sorted((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
                   if os.sep + "d" + os.sep in os.path.join(r, f)), key=os.path.getsize)[-1]
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(data, "wb").write(raw)


def test_a_checkpoint_whose_bytes_changed_on_disk_reads_as_damaged(npz, tmp_path, capsys):
    """One byte flipped in the middle of a saved step's largest data file restored without an error, a parameter
    changed (a QA pass): each leaf's CRC-32 is now kept at save and compared at restore, so the newest step reads
    as damaged (named on stderr) and the restore falls back to the step before, unchanged."""
    state = trainer.run(config(npz, steps=2))["state"]
    later = state._replace(step=state.step + 1, params=jax.tree.map(lambda a: a + 1, state.params))
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save_checkpoint(ckpt, state)
    checkpoint.save_checkpoint(ckpt, later)
    flip_a_byte(os.path.join(ckpt, "3"))
    capsys.readouterr()
    got, _ = checkpoint.restore_checkpoint(ckpt, state)
    err = capsys.readouterr().err
    assert "checkpoint step 3" in err and "damaged" in err, err
    assert int(got.step) == 2
    assert_bit_identical(got, state, "the step before the damaged one")


def test_a_resumed_run_writes_its_last_step_again_where_that_step_was_damaged(npz, uninterrupted, tmp_path):
    """Saved at 4 and at the run's end, 7; step 7 damaged. The resumed run goes on from 4 and, its last step not a
    multiple of --checkpoint-every, saves 7 at its end again (it took 7, the damaged step, for saved already, and
    the finished run's state was lost: a later --resume would train 5-7 once more)."""
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, checkpoint_dir=ckpt, checkpoint_every=4))
    assert sorted(d for d in os.listdir(ckpt)) == ["4", "7"]
    for root, _, files in os.walk(os.path.join(ckpt, "7", "state")):
        for f in files:
            open(os.path.join(root, f), "wb").close()
    resumed = trainer.run(config(npz, checkpoint_dir=ckpt, checkpoint_every=4, resume=True))
    assert resumed["resumed_from"] == 4 and sorted(os.listdir(ckpt)) == ["4", "7", "7.damaged"]
    info = checkpoint.run_info(config(npz), resumed["state"])
    state, _ = checkpoint.Checkpointer(ckpt, info, resume=True).restore(resumed["state"])
    assert int(state.step) == N_STEPS
    assert_bit_identical(state, uninterrupted("single"), "the step written again")


def test_resume_under_another_strategy(npz, uninterrupted, tmp_path):
    """The checkpoint is strategy-agnostic: DDP's is resumed by the single-device step (float32-close)."""
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, "ddp", checkpoint_dir=ckpt), on_step=signal_at(3))
    resumed = trainer.run(config(npz, "single", checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from"] == 3
    for a, b in zip(leaves(resumed["state"]), leaves(uninterrupted("single"))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_resume_to_more_steps_keeps_the_cosine_schedule_only_when_told(npz, tmp_path, capsys):
    """The cosine schedule decays to the run's last step unless --lr-decay-steps is given, so a run of 3 steps
    resumed to 5 trained on another schedule: the note says so and how to keep it; with --lr-decay-steps 5 from the
    start, 3 steps resumed to 5 are bit-identical to 5 uninterrupted steps. Resumed once more, the finished run
    says it has nothing left to train."""
    cosine = dict(lr_schedule="cosine", warmup_steps=1, gamma=Config().gamma)
    whole_run = trainer.run(config(npz, steps=5, lr_decay_steps=5, **cosine))
    whole = whole_run["state"]
    for decay, note in ((None, True), (5, False)):
        ckpt = str(tmp_path / f"ckpt{decay}")
        trainer.run(config(npz, steps=3, lr_decay_steps=decay, checkpoint_dir=ckpt, **cosine))
        capsys.readouterr()
        resumed = trainer.run(config(npz, steps=5, lr_decay_steps=decay, checkpoint_dir=ckpt, resume=True,
                                     **cosine))["state"]
        printed = capsys.readouterr().err  # with the other notes, apart from the run's log
        assert ("the cosine schedule decayed to step 3, now 5" in printed and "--lr-decay-steps 3" in printed) == note
        same = all(np.array_equal(a, b) for a, b in zip(leaves(resumed), leaves(whole)))
        assert same != note, f"--lr-decay-steps {decay}"  # the note's run trained another schedule
    # the note's own advice, followed (the 3-step run resumed with --lr-decay-steps 3): no "will not match" note (a
    # QA finding: it named --lr-decay-steps None -> 3 as a change)
    advice = str(tmp_path / "advice")
    trainer.run(config(npz, steps=3, checkpoint_dir=advice, **cosine))
    capsys.readouterr()
    trainer.run(config(npz, steps=5, lr_decay_steps=3, checkpoint_dir=advice, resume=True, **cosine))
    assert "will not match" not in capsys.readouterr().err
    again = trainer.run(config(npz, steps=5, lr_decay_steps=5, checkpoint_dir=ckpt, resume=True, **cosine))
    assert "the checkpoint is at step 5, and this run ends at step 5: nothing is left to train; raise --steps" in \
        capsys.readouterr().err  # a finished run resumed said nothing
    assert again["steps"] == 5 and all(np.array_equal(a, b) for a, b in zip(leaves(again["state"]), leaves(whole)))
    assert again["epochs"] == whole_run["epochs"] == 2  # 5 steps of 4 a epoch (a QA finding: the resume said 1)


def test_a_run_ended_at_an_epoch_boundary_resumes_into_the_next_epoch(npz, tmp_path):
    """4 steps of 16 are the 60 samples' whole epoch: resumed to 8 steps, the run reported epoch 0 again with
    train_loss NaN (null in --metrics-out) and evaluated it twice (a QA pass). Its epoch records now equal an
    uninterrupted run's, and so do its weights."""
    def epochs(path):
        return [r for r in map(json.loads, open(path)) if r["event"] == "epoch"]

    kw = dict(eval_split="train[:20]", log_every=4)
    whole = trainer.run(config(npz, steps=8, metrics_out=str(tmp_path / "whole.jsonl"), **kw))
    ckpt, parts = str(tmp_path / "ckpt"), str(tmp_path / "parts.jsonl")
    trainer.run(config(npz, steps=4, checkpoint_dir=ckpt, metrics_out=parts, **kw))
    resumed = trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, resume=True, metrics_out=parts, **kw))
    assert [(r["epoch"], r["step"]) for r in epochs(parts)] == [(0, 4), (1, 8)]
    assert epochs(parts) == epochs(str(tmp_path / "whole.jsonl"))
    assert resumed["epochs"] == whole["epochs"] == 2
    assert_bit_identical(resumed["state"], whole["state"], "resumed at the epoch boundary")


def test_a_stop_at_an_epochs_last_step_keeps_that_epochs_record(npz, tmp_path):
    """SIGTERM at step 4, the last of epoch 0: the run saved and stopped before the epoch's evaluation, and the
    resumed run began epoch 1, so epoch 0's record (train loss, evaluation) was lost for good (a QA finding). The
    checkpoint now says its epoch's record is pending and the resumed run writes it first. A save due at an epoch's
    last step (--checkpoint-every 4) waits for the record instead, so a run resumed from it to more steps writes no
    second one. Both equal an uninterrupted run's records."""
    def epochs(path):
        return [r for r in map(json.loads, open(path)) if r["event"] == "epoch"]

    kw = dict(eval_split="train[:20]", log_every=4)
    whole = trainer.run(config(npz, steps=8, metrics_out=str(tmp_path / "whole.jsonl"), **kw))
    want = epochs(str(tmp_path / "whole.jsonl"))
    assert [(r["epoch"], r["step"]) for r in want] == [(0, 4), (1, 8)] and "eval_loss" in want[0]
    ckpt, parts = str(tmp_path / "stopped"), str(tmp_path / "stopped.jsonl")
    stopped = trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, metrics_out=parts, **kw), on_step=signal_at(4))
    assert stopped["stopped"] == "SIGTERM" and stopped["steps"] == 4 and epochs(parts) == []
    resumed = trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, resume=True, metrics_out=parts, **kw))
    assert epochs(parts) == want
    assert_bit_identical(resumed["state"], whole["state"], "stopped at an epoch's last step")
    ckpt, parts = str(tmp_path / "every"), str(tmp_path / "every.jsonl")
    trainer.run(config(npz, steps=4, checkpoint_dir=ckpt, checkpoint_every=4, metrics_out=parts, **kw))
    trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, checkpoint_every=4, resume=True, metrics_out=parts, **kw))
    assert epochs(parts) == want


def test_resumed_runs_leave_one_record_per_step_and_epoch_in_metrics_out(npz, tmp_path):
    """--metrics-out across resumes (a QA finding: records were only appended). A run that crashed at step 5 with
    its last save at step 3 had written steps 4-5 and epoch 0's record (step 4); the resumed run trains them again
    and wrote them twice. A run ended mid-epoch by --steps wrote epoch 0's record at step 2, and a resumed run
    wrote epoch 0's again. Now the later steps' records go when a run resumes, and an epoch's record replaces its
    partial one (marked "partial": a later partial one, or the whole epoch's); a resume with nothing left to train
    keeps it. Either way the file's step and epoch records are an uninterrupted run's."""
    def records(path, event):
        drop = ("samples_per_s", "step_time_s")  # timings differ between runs
        return [{k: v for k, v in r.items() if k not in drop}
                for r in map(json.loads, open(path)) if r["event"] == event]

    def crash_at(step):
        def on_step(s, metrics):
            if s == step:
                raise RuntimeError("crashed")
        return on_step

    kw = dict(eval_split="train[:20]", log_every=1)
    whole = str(tmp_path / "whole.jsonl")
    trainer.run(config(npz, steps=8, metrics_out=whole, **kw))
    want = {e: records(whole, e) for e in ("step", "epoch")}
    assert [(r["epoch"], r["step"], r["partial"]) for r in want["epoch"]] == [(0, 4, False), (1, 8, False)]

    ckpt, parts = str(tmp_path / "crash"), str(tmp_path / "crash.jsonl")
    with pytest.raises(RuntimeError, match="crashed"):
        trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, checkpoint_every=3, metrics_out=parts, **kw),
                    on_step=crash_at(5))
    assert [r["step"] for r in records(parts, "step")] == [1, 2, 3, 4, 5] and len(records(parts, "epoch")) == 1
    trainer.run(config(npz, steps=8, checkpoint_dir=ckpt, checkpoint_every=3, resume=True, metrics_out=parts, **kw))
    assert {e: records(parts, e) for e in ("step", "epoch")} == want

    ckpt, parts = str(tmp_path / "steps"), str(tmp_path / "steps.jsonl")
    for steps, epochs in ((2, [(0, 2, True)]), (3, [(0, 3, True)]), (3, [(0, 3, True)]),
                          (8, [(0, 4, False), (1, 8, False)])):
        trainer.run(config(npz, steps=steps, checkpoint_dir=ckpt, resume=steps > 2, metrics_out=parts, **kw))
        assert [(r["epoch"], r["step"], r["partial"]) for r in records(parts, "epoch")] == epochs, steps
    assert {e: records(parts, e) for e in ("step", "epoch")} == want
    assert sorted(os.listdir(tmp_path)) == ["crash", "crash.jsonl", "steps", "steps.jsonl", "whole.jsonl"]


def test_resume_notes_a_new_grad_comm_dtype_and_an_init_torch_it_does_not_read(npz, tmp_path, capsys):
    """Two flags a resumed run took without a word (a QA pass): --grad-comm-dtype bf16 added changes the
    trajectory (2e-4 in the weights after 7 more steps) and is noted as a changed setting; --init-torch is not
    read (the weights are the checkpoint's) and says so -- unless it is the file the checkpoint's run started
    from (the same command line with --resume added)."""
    start = str(tmp_path / "start.npz")
    trainer.run(config(npz, steps=1, export_torch=start))
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, "ddp", steps=3, checkpoint_dir=ckpt, init_torch=start))
    capsys.readouterr()
    trainer.run(config(npz, "ddp", steps=5, checkpoint_dir=ckpt, resume=True, init_torch=start))
    assert "note" not in capsys.readouterr().err
    trainer.run(config(npz, "ddp", steps=6, checkpoint_dir=ckpt, resume=True, grad_comm_dtype="bf16"))
    err = capsys.readouterr().err
    assert "resuming with a changed setting (--grad-comm-dtype was unset, now 'bf16')" in err
    other = str(tmp_path / "other.npz")
    trainer.run(config(npz, steps=2, export_torch=other))
    capsys.readouterr()
    trainer.run(config(npz, "ddp", steps=7, checkpoint_dir=ckpt, resume=True, init_torch=other))
    assert f"note: --init-torch {other!r} is not read: a resumed run takes its weights from the checkpoint (step " \
        f"6); drop --init-torch" in capsys.readouterr().err


def test_the_static_loss_scale_note_counts_this_sessions_steps(npz, tmp_path, capsys):
    """fp16 at a static scale every step overflows: the note counts the skips of this session against its steps,
    and the run's after a resume (a QA finding: "5 of 2 steps overflowed")."""
    ckpt = str(tmp_path / "ckpt")
    fp16 = dict(precision="fp16", loss_scale=2.0 ** 24, checkpoint_dir=ckpt)
    trainer.run(config(npz, steps=3, **fp16))
    assert "note: 3 of 3 steps overflowed at the static --loss-scale" in capsys.readouterr().err
    resumed = trainer.run(config(npz, steps=5, resume=True, **fp16))
    assert resumed["skipped_steps"] == 5
    assert "note: 2 of 2 steps (of this session; 5 of 5 in the run) overflowed" in capsys.readouterr().err


def test_a_resume_with_another_static_loss_scale_runs_at_it_and_says_the_run_changed(npz, tmp_path, capsys):
    """fp16 with the dynamic scaler (S = 2^16), resumed with --loss-scale 128: the resumed steps ran at the
    checkpoint's 65536, silently (a QA pass). They run at 128 now, and the note names the change."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    fp16 = dict(precision="fp16", checkpoint_dir=ckpt, metrics_out=out, log_every=1)
    trainer.run(config(npz, steps=2, **fp16))
    capsys.readouterr()
    trainer.run(config(npz, steps=4, resume=True, loss_scale=128.0, **fp16))
    assert "--loss-scale was 0.0, now 128.0" in capsys.readouterr().err
    used = {r["step"]: r["loss_scale"] for r in map(json.loads, open(out)) if r["event"] == "step"}
    assert used == {1: 65536.0, 2: 65536.0, 3: 128.0, 4: 128.0}


def test_resume_refuses_another_head_count_and_names_the_flags_that_change_the_state(npz, tmp_path):
    """A GPT's head count and GELU show in no leaf's shape, so they are recorded and a resume with another is
    refused (a checkpoint from before the GELU was recorded ran the tanh one); a resume whose state has other
    leaves (clipping adds optimizer state) names the flags that differ."""
    tokens = np.random.default_rng(0).integers(0, 16, (8, 9)).astype(np.int32)
    np.savez(tmp_path / "tokens.npz", x=tokens[:, :-1], y=tokens[:, 1:])
    gpt = dict(model="gpt-nano", dataset="npz", data_path=str(tmp_path / "tokens.npz"), eval_split="", batch_size=4,
               optimizer="sgd", quiet=True, checkpoint_dir=str(tmp_path / "gpt"))
    trainer.run(Config(**gpt, steps=1))  # gpt-nano's 3 heads
    with pytest.raises(ValueError, match="a GPT with 3 heads, not 6: the head count changes what its weights "
                                         "compute; pass --n-head 3 or another --checkpoint-dir"):
        trainer.run(Config(**gpt, steps=2, resume=True, n_head=6))  # 48 wide: every leaf keeps its shape
    with pytest.raises(ValueError, match="a GPT with the gelu_new GELU, not gelu: the GELU changes what its weights "
                                         "compute; pass --activation-function gelu_new or another --checkpoint-dir"):
        trainer.run(Config(**gpt, steps=2, resume=True, activation_function="gelu"))
    assert trainer.run(Config(**gpt, steps=2, resume=True, n_head=3))["resumed_from"] == 1
    saved = {"format": checkpoint.FORMAT, "model": "gpt-nano", "optimizer": "sgd", "n_head": 3, "leaves": {},
             "config": {}, "decay_steps": None}  # a GPT's checkpoint from before the GELU was recorded
    assert checkpoint.check_compatible(saved, {**saved, "activation_function": "gelu_new"}, "d") == []
    with pytest.raises(ValueError, match="a GPT with the gelu_new GELU, not gelu"):
        checkpoint.check_compatible(saved, {**saved, "activation_function": "gelu"}, "d")
    # SGD's default lr became torch's 1e-3 (it was 0.01): a checkpoint of then, resumed at the default, is told
    sgd = {**saved, "model": "mlp", "n_head": None, "config": {"lr": None}}
    notes = checkpoint.check_compatible(sgd, {**sgd, "default_lr": 1e-3}, "d")
    assert notes == ["the default --lr was 0.01, now 0.001 (torch's); pass --lr 0.01 to continue its trajectory"]
    assert checkpoint.check_compatible({**sgd, "default_lr": 1e-3}, {**sgd, "default_lr": 1e-3}, "d") == []
    given = {**sgd, "default_lr": 1e-3, "config": {"lr": 0.01}}  # --lr given on resume: "was None" read as a value
    assert checkpoint.check_compatible({**sgd, "default_lr": 1e-3}, given, "d") == \
        ["--lr was the default (0.001), now 0.01"]
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, steps=2, checkpoint_dir=ckpt))
    with pytest.raises(ValueError, match="holds a checkpoint of model 'mlp' with .*, but this run has .*; pass "
                                         "the flags that differ: --grad-clip was 0.0, now 1.0, or another "
                                         "--checkpoint-dir"):
        trainer.run(config(npz, steps=3, checkpoint_dir=ckpt, resume=True, grad_clip=1.0))


def test_resume_with_data_flags_that_move_the_saved_position_is_refused_naming_them(npz, tmp_path):
    """The sampler's saved offset counts samples of an epoch whose indices the training set's size, shuffling and
    drop_last define: a resume with another of those is refused in one line naming the flag (it was the sampler's
    library message, suggesting set_epoch, which no flag sets); the same flags resume."""
    small = str(tmp_path / "small.npz")
    with np.load(npz) as f:
        np.savez(small, x=f["x"][:48], y=f["y"][:48])
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, steps=2, checkpoint_dir=ckpt))
    dataset = r"num_samples=60, this run has num_samples=48 \(from --dataset / --data-path / --train-split\)"
    for flags, names in (({"data_path": small}, dataset),
                         ({"drop_last": True}, r"drop_last=False, this run has drop_last=True \(from --drop-last\)"),
                         ({"shuffle": False}, r"shuffle=True, this run has shuffle=False \(from --no-shuffle\)")):
        with pytest.raises(ValueError, match=r"^--resume: the checkpoint's data position was taken with " + names +
                           r", so its offset would name other samples; resume with the data flags"):
            trainer.run(config(npz, steps=3, checkpoint_dir=ckpt, resume=True, **flags))
    assert trainer.run(config(npz, steps=3, checkpoint_dir=ckpt, resume=True))["resumed_from"] == 2


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    x = np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)
    x[40] = np.nan  # batch 3 (rows 32..47, no shuffle): step 3's loss is NaN
    path = str(tmp_path / "nan.npz")
    np.savez(path, x=x, y=np.argmax(x[:, :3], -1).astype(np.int32))
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    cfg = config(path, checkpoint_dir=ckpt, checkpoint_every=1, shuffle=False, metrics_out=metrics)
    with pytest.raises(trainer.Diverged, match=r"became nan at step 3 .*last good checkpoint, step 2"):
        trainer.run(cfg)
    assert checkpoint.latest_step(ckpt) == 2
    assert '"event": "diverged"' in open(metrics).read()
    restored, _ = checkpoint.Checkpointer(ckpt, checkpoint.run_info(cfg, _template(cfg)), resume=True).restore(
        _template(cfg))
    assert all(np.isfinite(a).all() for a in leaves(restored)[:4])
    mask = np.ones(64, np.float32)
    mask[32:48] = 0  # step 3's batch all masked out: a mean over no targets, NaN in torch too, named as such
    np.savez(path, x=np.nan_to_num(x), y=np.argmax(x[:, :3], -1).astype(np.int32), mask=mask)
    with pytest.raises(trainer.Diverged, match=r"batch of step 3 \(epoch 0\) has a total loss weight of 0 \(every "
                                               r"row or token masked out\).*last good checkpoint, step 2"):
        trainer.run(config(path, checkpoint_dir=str(tmp_path / "ckpt0"), checkpoint_every=1, shuffle=False))


def test_a_last_step_that_leaves_non_finite_weights_exports_nothing(tmp_path):
    """The loss of a step is computed before its update, and the weights were checked only when saved: a run whose
    last update overflowed (lr 3e38) reported success and exported infinite weights. Now it stops, nothing written."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(32, 5)) * 10).astype(np.float32)
    path = str(tmp_path / "ok.npz")
    np.savez(path, x=x, y=(x[:, 0] > 0).astype(np.int32))
    out = str(tmp_path / "w.npz")
    run = dict(model="linear", dataset="npz", data_path=path, eval_split="", batch_size=16, steps=1, quiet=True,
               optimizer="sgd", export_torch=out)
    trainer.run(Config(**run, lr=0.1))  # the same run at a sane rate exports
    assert os.path.exists(out)
    os.remove(out)
    with pytest.raises(trainer.Diverged, match=r"step 1 left non-finite parameters; nothing exported\. Nothing was "
                                               r"saved \(no --checkpoint-dir\)\. Lower --lr"):
        trainer.run(Config(**run, lr=3e38))
    assert not os.path.exists(out)


def _template(cfg):
    from jaxpar import models
    from jaxpar.step import init_state

    return init_state(models.get("mlp", in_features=12, hidden_dim=128, out_features=3), trainer.make_tx(cfg, 4))


def cli(npz: str, ckpt: str, *extra: str) -> list[str]:
    """train.py's command; each step logged where a --metrics-out file is written (the tests wait on it)."""
    log = ["--log-every", "1"] if "--metrics-out" in extra else []
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", "mlp", "--dataset", "npz", "--data-path", npz,
            "--eval-split", "", "--batch-size", "16", "--steps", str(N_STEPS), "--optimizer", "adam", "--lr", "0.01",
            "--gamma", "0.5", "--quiet", "--checkpoint-dir", ckpt, *log, *extra]


PACED = """
import sys, time
from jaxpar.run import report
_tick = report.Clock.tick
def paced(self, samples):  # 0.3 s per step: a signal sent after step k arrives before the run is over
    time.sleep(0.3)
    _tick(self, samples)
report.Clock.tick = paced
from jaxpar import cli as train
train.main()
"""


@pytest.fixture(scope="module")
def paced(tmp_path_factory) -> str:
    """train.py with steps paced to 0.3 s (the tiny model would finish before a signal lands)."""
    path = tmp_path_factory.mktemp("paced") / "paced_train.py"
    path.write_text(PACED)
    return str(path)


def records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # a line still being written has no newline yet
    return [json.loads(line) for line in lines]


def wait_for(predicate, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited with {proc.returncode} before the signal: {proc.communicate()[0]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_sigterm_to_a_real_process_then_resume(npz, paced, uninterrupted, tmp_path):
    """SIGTERM or SIGINT from outside at a random moment: exit status 0, then --resume ends bit-identical."""
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    k = random.Random().randint(1, N_STEPS - 2)
    signum = random.choice([signal.SIGTERM, signal.SIGINT])
    proc = subprocess.Popen([sys.executable, paced] + cli(npz, ckpt, "--metrics-out", metrics,
                                                          "--checkpoint-every", "2")[2:],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: any(r.get("step", 0) >= k for r in records(metrics) if r["event"] == "step"), proc)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    stop = checkpoint.latest_step(ckpt)
    assert f"{signum.name} at step" in out and k <= stop < N_STEPS, (k, stop, out)
    resumed = trainer.run(config(npz, checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from"] == stop
    assert_bit_identical(resumed["state"], uninterrupted("single"), f"{signum.name} at step {stop}")


KILL_DURING_SAVE = """
import os, signal, sys
from orbax.checkpoint._src.path import atomicity
async def killed_before_rename(self, *args, **kwargs):  # every byte of the step is written; the rename is not
    if os.path.basename(str(self._final_path)) == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)
    return await original(self, *args, **kwargs)
original = atomicity.AtomicRenameTemporaryPath.finalize
atomicity.AtomicRenameTemporaryPath.finalize = killed_before_rename
from jaxpar import cli as train
train.main(sys.argv[2:])
"""


def test_kill_9_during_a_save_loses_nothing(npz, uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = cli(npz, ckpt, "--checkpoint-every", "2")[2:]
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, "4", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert any(d.startswith("4.orbax-checkpoint-tmp") for d in os.listdir(ckpt)), os.listdir(ckpt)  # died mid-save
    assert checkpoint.latest_step(ckpt) == 2  # the half-written step 4 is not a checkpoint
    resumed = trainer.run(config(npz, checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from"] == 2
    assert_bit_identical(resumed["state"], uninterrupted("single"), "kill -9 during the save of step 4")
    assert not any("tmp" in d for d in os.listdir(ckpt))  # the next run cleaned the leftovers


def worker(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's child process with RANK=`rank`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} child of {launcher_pid}")


def test_two_processes_kill_9_restart_then_sigterm_then_resume(npz, paced, tmp_path):
    """2 processes (DDP, 2 CPU devices each) under jaxpar.launch: kill -9 of rank 1 at a random step -> the
    launcher restarts both with --resume; SIGTERM to rank 1 alone -> both agree on a step, save together, exit 0;
    a last --resume finishes. The parameters are bit-identical to an uninterrupted 2-process run."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --cpu-devices 2 per process instead

    def launch(ckpt: str, *extra: str, restarts: int = 0) -> subprocess.Popen:
        argv = [sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", "2", "--max-restarts", str(restarts),
                "--term-timeout", "2", paced] + cli(npz, ckpt, "--cpu-devices", "2", "--strategy", "ddp", *extra)[2:]
        return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(proc: subprocess.Popen) -> str:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        return out

    ref, ckpt, metrics = str(tmp_path / "ref"), str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    finish(launch(ref))
    rng = random.Random()
    k = rng.randint(3, 4)
    proc = launch(ckpt, "--checkpoint-every", "2", "--metrics-out", metrics, restarts=1)
    wait_for(lambda: any(r.get("step", 0) >= k for r in records(metrics) if r["event"] == "step"), proc)
    os.kill(worker(proc.pid, 1), signal.SIGKILL)
    starts = lambda: [r for r in records(metrics) if r["event"] == "start"]  # noqa: E731
    wait_for(lambda: len(starts()) == 2, proc)  # the restarted group (rank 0 appends to the same file)
    resumed = starts()[1]["step"]
    assert 2 <= resumed <= k and resumed % 2 == 0, (k, resumed)
    k2 = rng.randint(resumed + 1, N_STEPS - 2)  # two steps of margin: the ranks agree on the stop a step later
    after = lambda: records(metrics)[records(metrics).index(starts()[1]):]  # noqa: E731
    wait_for(lambda: any(r.get("step", 0) >= k2 for r in after() if r["event"] == "step"), proc)
    os.kill(worker(proc.pid, 1), signal.SIGTERM)  # one process only: the other must stop at the same step
    out = finish(proc)
    stop = checkpoint.latest_step(ckpt)
    assert "restarting all 2" in out and "SIGTERM at step" in out and k2 <= stop < N_STEPS, (k, k2, stop, out)
    assert [r["step"] for r in records(metrics) if r["event"] == "stopped"] == [stop]
    finish(launch(ckpt, "--resume"))

    cfg = config(npz, "ddp")
    template = _template(cfg)
    info = checkpoint.run_info(cfg, template)
    a, _ = checkpoint.Checkpointer(ref, info, resume=True).restore(template)
    b, _ = checkpoint.Checkpointer(ckpt, info, resume=True).restore(template)
    assert checkpoint.latest_step(ref) == checkpoint.latest_step(ckpt) == N_STEPS
    assert_bit_identical(b, a, f"2 processes: kill -9 at {k}, resumed at {resumed}, SIGTERM at {stop}")


def _tiny_gpt():
    from flax import nnx

    import jaxpar
    return jaxpar.GPT(jaxpar.GPTConfig(vocab_size=24, block_size=6, n_layer=1, n_head=2, n_embd=16, dropout=0.2),
                      rngs=nnx.Rngs(params=0, dropout=1))


def test_library_save_and_restore_resume_bit_identically_under_any_strategy(tmp_path, capsys):
    """`jaxpar.save_checkpoint(dir, strategy.unplace(placed))` in research code, then `restore_checkpoint` into a
    fresh template: DDP resumed from step 2 ends bit-identical to the run that went on (the dropout stream's key
    included), and the same checkpoint resumed under ZeRO-2 equals it to rounding. The data record comes back;
    bad input (a placed or mismatched state, a step that exists, a non-finite state) is refused in one line.
    ZeRO-3 checks its layers against the model on the first batch: a restored state of numpy arrays failed that
    check (both sides advanced the same RNG counts in place), so restore gives jax arrays, as init_state does."""
    import optax

    import jaxpar
    tx = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 24, (8, 7)).astype(np.int32) for _ in range(4)]
    batches = [jaxpar.as_rows({"x": t[:, :-1], "y": t[:, 1:]}, np.arange(8 * i, 8 * i + 8)) for i, t in
               enumerate(tokens)]
    ddp = jaxpar.DistributedDataParallel(_tiny_gpt(), tx, mesh=jaxpar.make_mesh(4))
    placed = ddp.init(jaxpar.init_state(_tiny_gpt(), tx))
    for b in batches[:2]:
        placed = ddp.step(placed, ddp.put_batch(b))[0]
    at2 = ddp.unplace(placed)
    d = str(tmp_path / "ck")
    assert jaxpar.save_checkpoint(d, at2, data={"epoch": 0, "next": 2}) == 2
    for b in batches[2:]:
        placed = ddp.step(placed, ddp.put_batch(b))[0]
    straight = ddp.unplace(placed)
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
               zip(jax.tree.leaves(straight.params), jax.tree.leaves(at2.params))) > 1e-3  # the steps moved it

    template = jaxpar.init_state(_tiny_gpt(), tx)
    state, data = jaxpar.restore_checkpoint(d, template)
    assert data == {"epoch": 0, "next": 2} and int(state.step) == 2
    for name, strategy in (("ddp", jaxpar.DistributedDataParallel(_tiny_gpt(), tx, mesh=jaxpar.make_mesh(4))),
                           ("zero2", jaxpar.ZeroRedundancy(_tiny_gpt(), tx, stage=2, mesh=jaxpar.make_mesh(4))),
                           ("zero3", jaxpar.ZeroRedundancy(_tiny_gpt(), tx, stage=3, mesh=jaxpar.make_mesh(4)))):
        resumed = strategy.init(state)
        for b in batches[data["next"]:]:
            resumed = strategy.step(resumed, strategy.put_batch(b))[0]
        out = strategy.unplace(resumed)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(straight)):
            a, b = (jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                    for x in (a, b))
            if name == "ddp":
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:  # atol 1e-5: AdamW magnifies the key bias's rounding-noise gradient (README, "Why they match")
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match=r"already holds step 2; pass another step"):
        jaxpar.save_checkpoint(d, at2)
    assert jaxpar.save_checkpoint(d, straight, keep=1) == 4 and checkpoint.all_steps(d) == [4]  # keep: the newest
    with pytest.raises(ValueError, match=r"has no complete step 2 \(it has \[4\]\)"):
        jaxpar.restore_checkpoint(d, template, step=2)
    with pytest.raises(TypeError, match=r"not a jaxpar.TrainState; pass strategy.unplace\(placed\)"):
        jaxpar.save_checkpoint(d, placed._asdict() if hasattr(placed, "_asdict") else {"params": 1})
    other = jaxpar.init_state(_tiny_gpt(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"holds .*opt_state.* but the template has absent; build the template"):
        jaxpar.restore_checkpoint(d, other)
    nan = straight._replace(params=jax.tree.map(lambda a: a * np.nan, straight.params))
    with pytest.raises(ValueError, match=r"is not finite .* step 9 is not saved"):
        jaxpar.save_checkpoint(d, nan, step=9)
    assert checkpoint.all_steps(d) == [4]
    info = {"model": "gpt-micro", "n_head": None, "leaves": {}, "config": {}, "decay_steps": None}
    with pytest.raises(ValueError, match="a state that jaxpar.save_checkpoint wrote, not a train.py run"):
        checkpoint.check_compatible(checkpoint.read_meta(d, 4), info, d)


def test_a_placed_state_split_over_devices_is_refused_by_save_and_init(tmp_path):
    """TensorParallel's placed state is a TrainState of the model's shapes whose qkv columns are reordered across
    the ranks, ZeRO's holds shards: saved as the model, or placed again, it would be another model (a QA finding:
    logits 0.086 off after a restore). Both refuse a state split over devices; a replicated one (DDP's) is the
    model and saves as it (the premise: TP's placed weights really differ from the model's)."""
    import optax

    import jaxpar
    tx = optax.adam(1e-3)
    model = _tiny_gpt()
    state = jaxpar.init_state(model, tx)
    tp = jaxpar.TensorParallel(_tiny_gpt(), tx, tensor_parallel=2)
    placed = tp.init(state)
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(state.params))]
    assert max(moved) > 1e-3  # its layout is not the model's
    zero = jaxpar.ZeroRedundancy(_tiny_gpt(), tx, stage=3, mesh=jaxpar.make_mesh(2))
    for name, strategy, p in (("tp", tp, placed), ("zero3", zero, zero.init(state))):
        with pytest.raises(TypeError, match=r"save_checkpoint: state\.params.* is split over devices .*pass "
                                            r"strategy\.unplace\(placed\)"):
            jaxpar.save_checkpoint(str(tmp_path / name), p)
        with pytest.raises(ValueError, match=r"state\.params.* is split over devices: a strategy's placed state"
                                             r".*pass strategy\.unplace\(placed\)"):
            strategy.init(p)
    ddp = jaxpar.DistributedDataParallel(_tiny_gpt(), tx, mesh=jaxpar.make_mesh(2))
    assert jaxpar.save_checkpoint(str(tmp_path / "ddp"), ddp.init(state)) == 0  # replicated: the model itself
    restored, _ = jaxpar.restore_checkpoint(str(tmp_path / "ddp"), state)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _lock_refusal(what: str, directory: str, holder: int, fix: str, head: str = "") -> str:
    """The whole one-line refusal, as a pattern."""
    lock = os.path.join(directory, ".jaxpar.lock")
    return "^" + re.escape(f"{head}{what} '{directory}' is in use by another run ({holder}@{socket.gethostname()} "
                           f"holds its lock '{lock}'): one directory takes one writing run at a time, since two "
                           "runs writing at once can leave a step that lists as complete but holds truncated data; "
                           f"{fix}.") + "$"


def test_a_second_writer_of_a_checkpoint_dir_is_refused_until_the_first_closes(npz, tmp_path, monkeypatch):
    """Two runs writing one --checkpoint-dir at once could leave a step that orbax lists as complete but holds
    truncated data (a QA finding). The first writer holds a lock (flock on D/.jaxpar.lock, its pid@host) from its
    first save until close(): a second Checkpointer, and save_checkpoint, are refused in one line naming it. A fresh
    folder is not created at construction (both constructions pass; the second run's first save is refused);
    the lock file is no step for all_steps, latest_step or orbax, and close() removes it. flock's locks belong to
    an open file, so a second Checkpointer of the same process conflicts as another process's would. Without
    fcntl (Windows) nothing is locked, silently."""
    cfg = config(npz)
    state = _regression_state(trainer.make_tx(cfg, steps_per_epoch=4), 7)
    info, d = checkpoint.run_info(cfg, state), str(tmp_path / "ckpt")
    first = checkpoint.Checkpointer(d, info, resume=False)
    second = checkpoint.Checkpointer(d, info, resume=False)
    assert not os.path.exists(d)  # construction writes nothing in a folder that does not exist yet
    assert first.save(5, state, {"epoch": 0})
    lock = os.path.join(d, ".jaxpar.lock")
    assert open(lock).read() == f"{os.getpid()}@{socket.gethostname()}\n"
    fix = "stop that run, or pass another --checkpoint-dir"
    with pytest.raises(ValueError, match=_lock_refusal("--checkpoint-dir", d, os.getpid(), fix)):
        second.save(6, state, {"epoch": 0})
    with pytest.raises(ValueError, match=_lock_refusal("--checkpoint-dir", d, os.getpid(), fix)):
        checkpoint.Checkpointer(d, info, resume=True)  # an existing folder: refused at construction
    with pytest.raises(ValueError, match=_lock_refusal("save_checkpoint:", d, os.getpid(),
                                                       "stop that run, or pass another directory")):
        checkpoint.save_checkpoint(d, state, step=9)
    first.close()
    assert sorted(os.listdir(d)) == ["5"]  # the lock file went with the lock
    second.close()
    resumed = checkpoint.Checkpointer(d, info, resume=True)  # after close(), the next run takes the folder
    assert os.path.exists(lock) and int(resumed.restore(state)[0].step) == int(state.step)
    assert checkpoint.all_steps(d) == [5] and checkpoint.latest_step(d) == 5  # the lock file is no step
    manager = checkpoint._manager(d, read_only=True)
    assert manager.all_steps() == [5] and manager.latest_step() == 5
    manager.close()
    assert resumed.save(6, state, {"epoch": 0})
    resumed.close()
    open(lock, "w").write("1@a-run-that-died\n")  # a stale file (its holder killed): no lock, and no step
    assert checkpoint.save_checkpoint(d, state, step=7) == 7  # the one-shot library calls read and write past it
    assert int(checkpoint.restore_checkpoint(d, state)[0].step) == int(state.step)
    assert checkpoint.all_steps(d) == [7, 6, 5] and not os.path.exists(lock)
    monkeypatch.setattr(checkpoint, "fcntl", None)  # Windows: no lock, and nothing breaks
    os.mkdir(tmp_path / "unlocked")  # an existing folder, which would be locked at construction
    unlocked = [checkpoint.Checkpointer(str(tmp_path / "unlocked"), info, resume=False) for _ in range(2)]
    assert unlocked[0].save(8, state, {"epoch": 0})
    for c in unlocked:
        c.close()
    assert os.listdir(tmp_path / "unlocked") == ["8"]


HOLD = """
import json, sys, time
from jaxpar.run import checkpoint
held = checkpoint.Checkpointer(sys.argv[1], json.load(open(sys.argv[2])), resume=True)
print("held", flush=True)
time.sleep(600)
"""


def test_a_resume_while_another_process_holds_the_dir_is_refused_until_that_process_dies(npz, tmp_path):
    """A --resume started while another run still writes the folder is refused before any training: train.py
    exits 2 with one line naming the holder's pid@host and the fix, and writes no step. A holder killed with
    SIGKILL (its close() never runs) leaves its lock file but no lock: the OS drops it, and a resume goes on."""
    ckpt = str(tmp_path / "ckpt")
    trainer.run(config(npz, steps=2, checkpoint_dir=ckpt))
    cfg = config(npz, steps=4)
    info = checkpoint.run_info(cfg, _template(cfg))
    (tmp_path / "info.json").write_text(json.dumps(info))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, ckpt, str(tmp_path / "info.json")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout.readline() == "held\n", holder.communicate()[0]
        refusal = _lock_refusal("--checkpoint-dir", ckpt, holder.pid, "stop that run, or pass another --checkpoint-dir")
        with pytest.raises(ValueError, match=refusal):
            checkpoint.Checkpointer(ckpt, info, resume=True)
        out = subprocess.run(cli(npz, ckpt, "--resume"), capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        assert re.match(_lock_refusal("--checkpoint-dir", ckpt, holder.pid, "stop that run, or pass another "
                                      "--checkpoint-dir", head="train.py: error: "), out.stderr.strip()), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and checkpoint.all_steps(ckpt) == [2]
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(os.path.join(ckpt, ".jaxpar.lock"))  # left behind, unlocked
    resumed = trainer.run(config(npz, steps=4, checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert sorted(os.listdir(ckpt)) == ["2", "4"]


def test_a_checkpointers_steps_carry_their_crc32_and_a_stale_lock_file_is_overwritten(npz, tmp_path, capsys):
    """A Checkpointer's save keeps each leaf's CRC-32 in the meta, as save_checkpoint does: a byte flipped in its
    newest step reads as damaged and the restore falls back to the step before. A lock file left by a killed run
    with a longer name than this one's is taken over and truncated: it then names this process alone (a second
    writer's refusal reads the holder from it)."""
    cfg = config(npz, steps=2)
    state = trainer.run(cfg)["state"]
    later = state._replace(step=state.step + 1, params=jax.tree.map(lambda a: a + 1, state.params))
    info, d = checkpoint.run_info(cfg, state), str(tmp_path / "ckpt")
    os.makedirs(d)
    lock = os.path.join(d, ".jaxpar.lock")
    open(lock, "w").write("1@a-run-that-died-on-a-host-with-a-long-name.example.org\n")
    ckpt = checkpoint.Checkpointer(d, info, resume=False)  # an existing folder: locked at construction
    assert open(lock).read() == f"{os.getpid()}@{socket.gethostname()}\n"
    assert ckpt.save(int(state.step), state, {"epoch": 0}) and ckpt.save(int(later.step), later, {"epoch": 0})
    ckpt.close()
    flip_a_byte(os.path.join(d, str(int(later.step))))
    capsys.readouterr()
    got, _ = checkpoint.restore_checkpoint(d, state)
    err = capsys.readouterr().err
    assert f"checkpoint step {int(later.step)}" in err and "damaged" in err, err
    assert int(got.step) == int(state.step)
    assert_bit_identical(got, state, "the step before the damaged one")


def test_a_refused_construction_lets_go_of_the_lock_and_a_lock_file_unlinked_under_it_is_not_held(npz, tmp_path,
                                                                                                  monkeypatch):
    """A Checkpointer whose checks refuse the folder (checkpoints there, no --resume) releases the lock it took at
    construction at once, while the refused object is still alive (the exception holds it): the next run takes
    the folder. And a lock file removed between this process's open and its flock (its holder releasing) is not
    held: the lock is taken again on the file now at the path, so a second writer is still refused."""
    cfg = config(npz)
    state = _regression_state(trainer.make_tx(cfg, steps_per_epoch=4), 7)
    info, d = checkpoint.run_info(cfg, state), str(tmp_path / "ckpt")
    ckpt = checkpoint.Checkpointer(d, info, resume=False)
    assert ckpt.save(5, state, {"epoch": 0})
    ckpt.close()
    with pytest.raises(ValueError, match="already holds checkpoints up to step 5; pass --resume") as refused:
        checkpoint.Checkpointer(d, info, resume=False)
    resumed = checkpoint.Checkpointer(d, info, resume=True)
    resumed.close()
    del refused
    real, lock = checkpoint.fcntl, os.path.join(d, ".jaxpar.lock")

    class Racing:  # the holder before us removes the file after our open, before our flock
        LOCK_EX, LOCK_NB, raced = real.LOCK_EX, real.LOCK_NB, []

        def flock(self, fd, how):
            if not self.raced:
                self.raced.append(os.fstat(fd).st_ino)
                os.remove(lock)
            return real.flock(fd, how)

    monkeypatch.setattr(checkpoint, "fcntl", Racing())
    first = checkpoint.Checkpointer(d, info, resume=True)
    monkeypatch.setattr(checkpoint, "fcntl", real)
    assert os.path.exists(lock) and open(lock).read() == f"{os.getpid()}@{socket.gethostname()}\n"
    with pytest.raises(ValueError, match=_lock_refusal("--checkpoint-dir", d, os.getpid(),
                                                       "stop that run, or pass another --checkpoint-dir")):
        checkpoint.Checkpointer(d, info, resume=True)
    first.close()


def test_a_placed_state_an_earlier_step_consumed_is_not_saved(tmp_path):
    """QA: save_checkpoint of a DDP placed state that a step had consumed (its buffers donated) raised JAX's
    "Array has been deleted"; it is named in one line, and nothing is written."""
    import optax
    from flax import nnx

    import jaxpar

    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1)))
    ddp = jaxpar.DistributedDataParallel(model, optax.sgd(0.1), mesh=jaxpar.make_mesh(2))
    placed = ddp.init(jaxpar.init_state(model, ddp.tx))
    ddp.step(placed, ddp.put_batch({"x": np.ones((4, 4), np.float32), "y": np.zeros(4, np.int32)}))
    with pytest.raises(ValueError, match="^save_checkpoint got a placed state that an earlier step consumed .*pass "
                                         "the state the last step returned"):
        jaxpar.save_checkpoint(str(tmp_path / "ckpt"), placed)
    assert not (tmp_path / "ckpt").exists()
