"""DDP and ZeRO across processes: 2 processes x 2 CPU devices (gloo) == 1 process x 4 devices == one device; a dead rank
stops jaxpar.launch within seconds; the rendezvous environment is read as torchrun / JAX / clusters write it.

This file is also the worker the launched processes run: `python tests/test_multiprocess.py train OUT` (5 DDP
steps on this process's rows, parameters to OUT.rank<r>.npz) or `... hang` (join, then wait in collectives).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_ddp import SIZES, problem, take  # the tiny seeded problem; last batch 13 = 7 + 6 rows on two processes

ROOT = Path(__file__).resolve().parents[1]
SPMD = ("shard_map", "pmap")


def run_ddp(mesh, rank: int = 0, nproc: int = 1, spmd: str = "shard_map", scaled: bool = False,
            checkpoint: str | None = None, skew: bool = False):
    """Parameter leaves after the DDP steps, this process feeding rows rank::nproc (DistributedSampler's);
    `scaled`: behind a loss scaler (2**12), whose seed averages the loss weight over both processes' devices;
    `checkpoint`: saved there by jaxpar.save_checkpoint after 2 batches (every process calls it; a placed state
    spread over the processes is refused), restored into a fresh template and resumed; `skew`: every process but
    0 starts from other weights (an unseeded init), which DDP replaces with process 0's, as torch DDP does."""
    import jax
    import pytest

    import jaxpar
    from jaxpar import loss_scaling
    from jaxpar.strategies.ddp import DistributedDataParallel

    objective, tx, state, batches = problem()
    if scaled:
        tx = loss_scaling(tx, static=2.0 ** 12)
        state = state._replace(opt_state=tx.init(state.params))
    ddp = DistributedDataParallel(objective, tx, mesh=mesh, allreduce="ring", bucket_cap_mb=0, spmd=spmd,
                                  batch_size=max(SIZES))
    if skew and rank:
        state = state._replace(params=jax.tree.map(lambda a: a + 1.0, state.params))
    placed = ddp.init(state)
    for i, b in enumerate(batches):
        if checkpoint and i == 2:
            if nproc > 1:
                with pytest.raises(TypeError, match="is spread over processes .* pass strategy.unplace"):
                    jaxpar.save_checkpoint(checkpoint, placed)
            jaxpar.save_checkpoint(checkpoint, ddp.unplace(placed), data={"batch": i})
            restored, data = jaxpar.restore_checkpoint(checkpoint, problem()[2])
            assert data == {"batch": 2} and int(restored.step) == 2
            placed = ddp.init(restored)
        placed, _ = ddp.step(placed, ddp.put_batch(take(b, slice(rank, None, nproc))))
    return [np.asarray(a) for a in jax.tree.leaves(ddp.unplace(placed).params)]


def worker(mode: str, out: str | None = None) -> None:
    from jaxpar.run import distributed
    from jaxpar.mesh import make_mesh, simulate_cpu_devices

    simulate_cpu_devices(2)
    distributed.initialize()
    import jax

    rank, nproc = jax.process_index(), jax.process_count()
    print(f"pid={os.getpid()} process {rank}/{nproc} devices={jax.device_count()}", flush=True)
    if mode == "hang":  # wait in collectives until killed
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        while True:
            multihost_utils.process_allgather(jnp.ones(4))
            time.sleep(0.2)
    for spmd in SPMD:
        np.savez(f"{out}.{spmd}.rank{rank}.npz", *run_ddp(make_mesh(), rank, nproc, spmd))
    np.savez(f"{out}.scaled.rank{rank}.npz", *run_ddp(make_mesh(), rank, nproc, scaled=True))
    np.savez(f"{out}.resumed.rank{rank}.npz", *run_ddp(make_mesh(), rank, nproc, checkpoint=f"{out}.checkpoints",
                                                                   skew=True))
    for name in CONTRACT:  # a user's models (examples/), this process feeding rows rank::nproc
        np.savez(f"{out}.{name}.rank{rank}.npz", *run_contract(name, make_mesh(), rank, nproc))
    for stage in ZERO_STAGES:
        np.savez(f"{out}.zero{stage}.rank{rank}.npz", *run_zero(stage, make_mesh(), rank, nproc))
    refuse_tensor_groups_across_processes()


def refuse_tensor_groups_across_processes() -> None:
    """Tensor parallelism over all 4 devices would put a tensor group on both processes: one line, before work."""
    import optax
    from flax import nnx

    import jaxpar
    from test_zero import GPT_CFG

    model = jaxpar.GPT(GPT_CFG, rngs=nnx.Rngs(0))
    try:
        jaxpar.TensorParallel(model, optax.sgd(0.1), tensor_parallel=4)
    except ValueError as e:
        assert "devices of processes [0, 1]" in str(e) and "tensor_parallel (--tensor-parallel) at most 2" in str(e), \
            e
    else:
        raise AssertionError("a tensor group across processes was not refused")


CONTRACT = ("regression", "lm")  # tests/test_contract.py's problems: stock NNX models with dropout


def run_contract(name: str, mesh, rank: int = 0, nproc: int = 1):
    import jax

    import jaxpar
    from test_contract import TX, problem

    _, _, batches, objective, state = problem(name)
    ddp = jaxpar.DistributedDataParallel(objective, TX, mesh=mesh, allreduce="ring", batch_size=batches[0].size)
    placed = ddp.init(state)
    for b in batches:
        placed, _ = ddp.step(placed, ddp.put_batch(take(b, slice(rank, None, nproc))))
    return [np.asarray(a) for a in jax.tree.leaves(ddp.unplace(placed).params)]


ZERO_STAGES = (1, 2, 3)  # tests/test_zero.py's GPT (dropout on), 11 rows a step: 6 + 5 on two processes


def run_zero(stage: int, mesh, rank: int, nproc: int, rows=None):
    """ZeRO's parameters and optimizer state after test_zero's steps on this process's rows (`rows` of each
    batch, or rank::nproc). The compiled step must reduce-scatter on jaxpar's ring: across processes over gloo
    XLA:CPU's reduce-scatter is unsafe."""
    import jax

    import jaxpar
    from jaxpar.comm import collectives
    from test_zero import TX, problem

    _, objective, batches, batch_size, state = problem("gpt")
    z = jaxpar.ZeroRedundancy(objective, TX, stage=stage, mesh=mesh, batch_size=batch_size)
    placed = z.init(state)
    for b in batches:
        placed, _ = z.step(placed, z.put_batch(take(b, slice(rank, None, nproc) if rows is None else rows)))
    assert not collectives.native_reduce_scatter_is_safe() and "reduce-scatter(" not in z.hlo(placed)
    out = z.unplace(placed)
    return [np.asarray(a) for a in jax.tree.leaves(out.params) + jax.tree.leaves(out.opt_state)]


def launch(script: str, *args: str) -> subprocess.Popen:
    """python -m jaxpar.launch --nproc-per-node 2 script args..., output (both streams) piped."""
    cmd = [sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", "2", "--term-timeout", "3", script, *args]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reference_leaves():
    import jax

    from jaxpar.step import make_train_step

    objective, tx, state, batches = problem()
    step = make_train_step(objective, tx)
    for b in batches:
        state, _ = step(state, b)
    return [np.asarray(a) for a in jax.tree.leaves(state.params)]


def test_two_processes_equal_one_process_and_one_device(tmp_path, monkeypatch):
    import jax

    from jaxpar.mesh import make_mesh

    proc = launch(__file__, "train", str(tmp_path / "params"))  # both front ends, one launch
    # meanwhile, in this process: every single-process result the two processes' are compared with
    ref = reference_leaves()
    init = [np.asarray(a) for a in jax.tree.leaves(problem()[2].params)]
    assert max(np.abs(a - b).max() for a, b in zip(ref, init)) > 1e-2  # training moves the parameters
    from test_contract import reference

    contract = {name: [np.asarray(a) for a in jax.tree.leaves(reference(name)[0].params)] for name in CONTRACT}
    from jaxpar.comm import collectives
    from test_zero import reference as zero_reference

    ref_state = zero_reference("gpt")[0]  # the single step (its own asserts: dropout on, the weights move)
    want = [np.asarray(a) for a in jax.tree.leaves(ref_state.params) + jax.tree.leaves(ref_state.opt_state)]
    monkeypatch.setattr(collectives, "native_reduce_scatter_is_safe", lambda *a: False)
    # ZeRO on this process's 4 devices fed the same rows on the ring as the two processes
    zero_here = {stage: run_zero(stage, make_mesh(4), 0, 1, rows=np.r_[0:11:2, 1:11:2]) for stage in ZERO_STAGES}
    four = {spmd: run_ddp(make_mesh(4), scaled=True) if spmd == "scaled" else run_ddp(make_mesh(4), spmd=spmd)
            for spmd in (*SPMD, "scaled")}  # "scaled": a loss scaler's seed, one for the 4 devices of both processes
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "[rank 0] " in out and "[rank 1] " in out and "process 1/2 devices=4" in out, out
    for name in CONTRACT:  # the user's models: 2 processes x 2 devices == the single step (test_contract's)
        ranks = [np.load(tmp_path / f"params.{name}.rank{r}.npz") for r in range(2)]
        for i, w in enumerate(contract[name]):
            np.testing.assert_array_equal(ranks[0][f"arr_{i}"], ranks[1][f"arr_{i}"])
            np.testing.assert_allclose(ranks[0][f"arr_{i}"], w, rtol=1e-5, atol=1e-6, err_msg=name)
    for stage in ZERO_STAGES:  # ZeRO across 2 processes x 2 devices: bit for bit this process's 4 devices fed the
        ranks = [np.load(tmp_path / f"params.zero{stage}.rank{r}.npz") for r in range(2)]  # same rows on the ring
        here = zero_here[stage]
        for i, w in enumerate(want):  # and the single step, to Adam's rounding of another summation order
            np.testing.assert_array_equal(ranks[0][f"arr_{i}"], ranks[1][f"arr_{i}"])
            np.testing.assert_array_equal(ranks[0][f"arr_{i}"], here[i], err_msg=f"stage {stage}")
            np.testing.assert_allclose(ranks[0][f"arr_{i}"], w, rtol=1e-5, atol=2e-6, err_msg=f"stage {stage}")
    # jaxpar.save_checkpoint across the processes, restored and resumed, and process 1 started from other weights
    # (replaced by process 0's, with a line saying so): bit for bit the run that went on
    assert "[rank 1] jaxpar: process 1's initial state differs from process 0's" in out, out
    assert "[rank 0] jaxpar: process 0's initial" not in out
    resumed = [np.load(tmp_path / f"params.resumed.rank{r}.npz") for r in range(2)]
    straight = np.load(tmp_path / "params.shard_map.rank0.npz")
    for i in range(len(ref)):
        for r in range(2):
            np.testing.assert_array_equal(resumed[r][f"arr_{i}"], straight[f"arr_{i}"])
    for spmd in (*SPMD, "scaled"):
        ranks = [np.load(tmp_path / f"params.{spmd}.rank{r}.npz") for r in range(2)]
        two = [ranks[0][f"arr_{i}"] for i in range(len(ref))]
        for a, b in zip(two, [ranks[1][f"arr_{i}"] for i in range(len(ref))]):
            np.testing.assert_array_equal(a, b)  # both processes hold the same replica, bit for bit
        for a, b, c in zip(two, four[spmd], ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_train_py_two_processes_equal_one_process_and_one_device(tmp_path):
    """The real data path: train.py under jaxpar.launch (DistributedSampler per rank, a padded last batch). 63
    samples do not divide by the 2 processes: the sampler pads rank 1 with a wrap-around copy of a sample (torch's
    plan), which the loader masks out, so the two processes train on exactly the one process's samples."""
    import train

    common = ["--model", "mlp", "--train-split", "train[:63]", "--eval-split", "", "--batch-size", "24",
              "--optimizer", "sgd", "--quiet"]  # batches 24, 24, 15: per rank 12, 12, 8 (rank 1's last row the
    # masked copy); the 4 devices of one process pad 15 to 16
    ddp = ["--strategy", "ddp", "--allreduce", "ring"]
    proc = launch("train.py", "--cpu-devices", "2", *ddp, *common, "--export-torch", str(tmp_path / "two.npz"))
    train.main([*ddp, "--num-devices", "4", *common, "--export-torch", str(tmp_path / "four.npz")])
    train.main(["--strategy", "single", *common, "--export-torch", str(tmp_path / "one.npz")])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "processes=2" in out, out
    two, four, one = (np.load(tmp_path / f"{n}.npz") for n in ("two", "four", "one"))
    assert sorted(two) == sorted(one) and len(one) == 4
    for k in one:
        np.testing.assert_allclose(two[k], four[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-6)


def test_train_py_pipeline_across_two_processes_takes_a_batch_the_process_count_does_not_divide(tmp_path):
    """Every process of the pipeline reads the whole batch (stage 0 its inputs, the last stage its targets), so a
    batch of 3 on 2 processes is the pipeline's to split into micro-batches: it was refused as not divisible by
    the processes (a QA finding). Equal to the single step on the same 3-row batches."""
    import train

    common = ["--model", "mlp", "--train-split", "train[:12]", "--eval-split", "", "--batch-size", "3",
              "--optimizer", "sgd", "--quiet"]
    proc = launch("train.py", "--cpu-devices", "1", "--strategy", "pipeline", "--num-stages", "2",
                  "--micro-batches", "3", *common, "--export-torch", str(tmp_path / "pipe.npz"))
    train.main(["--strategy", "single", *common, "--export-torch", str(tmp_path / "one.npz")])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "processes=2" in out, out
    pipe, one = np.load(tmp_path / "pipe.npz"), np.load(tmp_path / "one.npz")
    assert sorted(pipe) == sorted(one) and len(one) == 4
    for k in one:
        np.testing.assert_allclose(pipe[k], one[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags,match", [
    ((["--seed", "0"], ["--seed", "1"]), r"the processes were started with different flags: --seed \(this is process "
                                         r"[01], with seed=[01]\); start every process with the same command"),
    ((["--cpu-devices", "1"], ["--cpu-devices", "2"]),
     r"every process must have the same number of devices, but process 0 has 1, process 1 has 2; pass the same "
     r"--cpu-devices")])
def test_processes_started_apart_are_refused_in_one_line(flags, match):
    """Two processes started by hand (torchrun's variables) with a different --seed, or a different device count:
    each says so in one line (exit 2) before any training; they would have trained apart, or failed deep in JAX."""
    from jaxpar.launch import free_port

    port = str(free_port())
    common = ["--strategy", "ddp", "--model", "mlp", "--steps", "1", "--train-split", "train[:16]", "--batch-size",
              "8", "--eval-split", "", "--quiet"]
    procs = [subprocess.Popen([sys.executable, "train.py", *(["--cpu-devices", "1"] if "--seed" in flags[r] else []),
                               *flags[r], *common], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(r), "XLA_FLAGS": ""})
             for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 2, out
        assert re.search(r"train.py: error: " + match, out), out
        assert "summary:" not in out and "Traceback" not in out, out


def test_killing_one_rank_stops_the_launcher(tmp_path):
    proc = launch(__file__, "hang")
    pids, lines, t0 = {}, [], time.monotonic()
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line and time.monotonic() - t0 < 120, "".join(lines)
        lines.append(line)
        if "pid=" in line:
            pids[line.split("]")[0]] = int(line.split("pid=")[1].split()[0])
    time.sleep(1.0)  # both inside their collectives loop
    os.kill(pids["[rank 1"], signal.SIGKILL)
    t_kill = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - t_kill < 30
    with pytest.raises(ProcessLookupError):  # the surviving rank was stopped too
        os.kill(pids["[rank 0"], 0)


def test_a_rank_that_fails_alone_after_joining_ends_the_job_within_seconds(tmp_path):
    """A QA finding: train.py's rank 1 refusing in one line (or raising) after joining the group exited through
    JAX's shutdown barrier, where it waited 300 s for rank 0, itself waiting in the step's collectives for rank 1;
    both then aborted and the launcher blamed rank 0 (SIGABRT). Now the failing rank leaves at once with its own
    status (2 for a refusal), and the launcher stops the other and exits with it."""
    script = tmp_path / "refuse_on_rank_1.py"
    script.write_text("import os, sys\n"
                      "from jaxpar import cli\n"
                      "from jaxpar.run import trainer\n"
                      "real = trainer.run\n"
                      "def run(cfg, **kw):\n"
                      "    if os.environ['RANK'] == '1':\n"
                      "        import jax; jax.devices()  # joined, the backend up: rank 0 trains on alone\n"
                      "        raise ValueError('rank 1 refuses after joining')\n"
                      "    return real(cfg, **kw)\n"
                      "trainer.run = run\n"
                      "cli.main(sys.argv[1:])\n")
    t0 = time.monotonic()
    proc = launch(str(script), "--cpu-devices", "1", "--strategy", "ddp", "--model", "mlp", "--train-split",
                  "train[:64]", "--eval-split", "", "--batch-size", "8", "--steps", "100000", "--optimizer", "sgd")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "[rank 1] train.py: error: rank 1 refuses after joining" in out, out
    assert "jaxpar.launch: a process failed with status 2, a usage error" in out, out
    assert time.monotonic() - t0 < 90, out  # it took 300 s and more


def test_a_refusal_every_rank_reaches_after_joining_is_one_line_from_each(tmp_path):
    """A usage error every rank hits after joining, rank 1 two seconds after rank 0: each prints its one line and
    leaves with status 2. Rank 0 left at once and took the coordination service along; rank 1, on its way to the same
    refusal, died in JAX's C++ with a stack trace instead (QA 50). Now the ranks meet before leaving, rank 0 last."""
    script = tmp_path / "refuse_late.py"
    script.write_text("import os, sys, time\n"
                      "from jaxpar import cli\n"
                      "from jaxpar.run import trainer\n"
                      "def run(cfg, **kw):\n"
                      "    import jax; jax.devices()  # joined, the backend up\n"
                      "    time.sleep(2.0 if os.environ['RANK'] == '1' else 0.0)\n"
                      "    raise ValueError('every rank refuses after joining')\n"
                      "trainer.run = run\n"
                      "cli.main(sys.argv[1:])\n")
    proc = launch(str(script), "--cpu-devices", "1", "--strategy", "ddp", "--model", "mlp", "--train-split",
                  "train[:64]", "--eval-split", "", "--batch-size", "8", "--steps", "1", "--optimizer", "sgd")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    for rank in (0, 1):
        assert f"[rank {rank}] train.py: error: every rank refuses after joining" in out, out
    assert "Terminating process" not in out and "stack trace" not in out, out


def test_drop_last_over_more_processes_than_samples_names_the_processes():
    """1 sample over 2 processes with --drop-last: the sampler leaves each rank nothing, whatever the batch size;
    the refusal said to lower --batch-size (a QA finding) and now names the process count."""
    proc = launch("train.py", "--cpu-devices", "1", "--strategy", "ddp", "--model", "linear", "--train-split",
                  "train[:1]", "--eval-split", "test[:3]", "--batch-size", "2", "--quiet", "--drop-last")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "--drop-last with 1 samples over 2 processes leaves each process none" in out, out
    assert "lower the batch size" not in out, out


def test_processes_that_load_different_data_are_refused(tmp_path):
    """--data-path may differ between processes (each node mounts its files), its contents may not: a shorter copy
    on rank 1 gave it fewer steps, and both ranks then hung in mismatched collectives without a word (a QA
    finding). Now every rank refuses in one line, naming the sizes."""
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_bytes(b"def f(x):\n    return x\n" * 250)
    short.write_bytes(b"def f(x):\n    return x\n" * 125)
    script = tmp_path / "short_on_rank_1.py"
    script.write_text("import os, sys\n"
                      "from jaxpar import cli\n"
                      f"argv = sys.argv[1:] + (['--data-path', {str(short)!r}] if os.environ['RANK'] == '1' else [])\n"
                      "cli.main(argv)\n")
    proc = launch(str(script), "--cpu-devices", "1", "--strategy", "ddp", "--model", "gpt-nano", "--dataset", "text",
                  "--seq-len", "32", "--batch-size", "8", "--epochs", "1", "--eval-split", "", "--optimizer", "sgd",
                  "--data-path", str(long))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "[rank 0] train.py: error: the processes loaded different data (train: 170, 85 samples" in out, out


def test_launcher_restarts_with_resume_and_reports_failure(tmp_path):
    """--max-restarts: the group restarts once (no checkpoint yet, so no --resume); without restarts the status
    comes back. Appending --resume once a checkpoint exists: test_launcher_environment_and_resume and
    test_checkpoint's two-process restart."""
    script = tmp_path / "flaky.py"
    script.write_text("import os, sys\n"
                      "if os.environ['RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "print('args', sys.argv[1:], 'world', os.environ['WORLD_SIZE'])\n")
    run = [sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", "2"]
    ok = subprocess.run(run + ["--max-restarts", "1", str(script), "--x"], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "[rank 1] args ['--x'] world 2" in ok.stdout and "restarting all 2" in ok.stderr  # rank 1 ran again
    failed = subprocess.run(run + [str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3 and "stopped all" in failed.stderr
    assert re.search(r"jaxpar.launch: rank 1 \(pid \d+\) exited with status 3; stopped all", failed.stderr)
    script.write_text("import os, signal, time\n"  # a rank killed by a signal is named, with the signal
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)\n")
    killed = subprocess.run(run + [str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert killed.returncode == 137, killed.stderr
    assert re.search(r"jaxpar.launch: rank 1 \(pid \d+\) was killed by SIGKILL; stopped all", killed.stderr)


def test_allreduce_bench_across_processes():
    """bench/allreduce.py --processes 2 starts itself under jaxpar.launch; every algorithm's result equals psum's."""
    cmd = [sys.executable, "bench/allreduce.py", "--processes", "2", "--devices", "2", "--sizes", "0.01",
           "--reps", "1", "--no-alexnet", "--plot", ""]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all-reduce on 4 devices in 2 process(es)" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("[rank 0]")]
    errors = {row[3]: row[-1] for row in rows if len(row) > 3 and row[2].endswith("MB")}  # size, algorithm, .., err
    assert set(errors) == {"psum", "ring", "reduce_broadcast", "all_to_all", "floor"}, proc.stdout
    assert errors.pop("floor") == "-"
    assert all(float(e) < 1e-6 for e in errors.values()), errors


def test_rendezvous_from_environment():
    from jaxpar.run.distributed import Rendezvous, detect

    torch_env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}
    assert detect(torch_env) == Rendezvous("torch", "10.0.0.1:29500", 8, 5)
    no_rank = {**torch_env, "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    del no_rank["RANK"]
    # node 1 x 4 per node + local 1; 4 processes on the node and nothing chose their GPUs: each takes its own
    assert detect(no_rank) == Rendezvous("torch", "10.0.0.1:29500", 8, 5, [1])
    for chosen in ("CUDA_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        assert detect({**no_rank, chosen: "3"}).local_device_ids is None  # the environment's choice stands
    assert detect({**torch_env, "LOCAL_WORLD_SIZE": "1"}).local_device_ids is None  # one process per node
    assert detect({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}) == \
        Rendezvous("jax", "h:1234", 2, 1)
    assert detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == Rendezvous("slurm")
    assert detect({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == Rendezvous("ompi")
    assert detect({}) is None and detect({**torch_env, "WORLD_SIZE": "1", "RANK": "0"}) is None
    with pytest.raises(ValueError, match="RANK=8 must be in"):
        detect({**torch_env, "RANK": "8"})
    with pytest.raises(ValueError, match="needs MASTER_PORT"):
        detect({k: v for k, v in torch_env.items() if k != "MASTER_PORT"})


def test_initialize_gives_each_local_process_its_own_gpu(monkeypatch):
    """jax.distributed.initialize without local_device_ids gives every process of a node every GPU (a QA pass
    found jaxpar.launch --nproc-per-node 2 would have two processes on each GPU); initialize passes LOCAL_RANK's."""
    import jax

    from jaxpar.run import distributed

    seen = {}
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # the CPU collectives' setting: not this test's
    distributed.initialize(env=env)
    assert seen["local_device_ids"] == [1] and seen["process_id"] == 1 and seen["num_processes"] == 2


def test_launcher_environment_and_resume(tmp_path, monkeypatch):
    import jaxpar.run.checkpoint
    from jaxpar.launch import command, parser, rank_env

    args = parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--master-port", "1",
                                "train.py", "--strategy", "ddp"])
    env = rank_env(args, local_rank=2, restart=0)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("6", "8", "2", "1")
    assert command(args, restart=0)[-2:] == ["--strategy", "ddp"]
    assert command(args, restart=1)[-2:] == ["--strategy", "ddp"]  # nothing to resume from: start over
    ck = ["train.py", "--checkpoint-dir", str(tmp_path)]
    args = parser().parse_args(["--nproc-per-node", "2"] + ck)
    assert "--resume" not in command(args, restart=1)  # the folder holds no complete checkpoint yet
    monkeypatch.setattr(jaxpar.run.checkpoint, "latest_step", lambda d: 4 if d == str(tmp_path) else None)
    assert command(args, restart=1)[-1] == "--resume" and "--resume" not in command(args, restart=0)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)


def test_a_tensor_group_across_processes_is_refused_with_a_fix_that_runs():
    """2 processes x 1 device under --strategy tp --tensor-parallel 2: one line naming the processes and a fix that
    train.py takes (it advised --tensor-parallel 1, which --strategy tp refuses, and listed raw device ids)."""
    proc = launch("train.py", "--cpu-devices", "1", "--strategy", "tp", "--tensor-parallel", "2", "--n-head", "2",
                  "--model", "gpt-nano", "--dataset", "text", "--seq-len", "32", "--steps", "1", "--quiet")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert ("tensor_parallel=2 (--tensor-parallel) puts a tensor group on devices of processes [0, 1]; keep each "
            "group within one process (Megatron keeps tensor parallelism within a node): use at least 2 devices a "
            "process (--cpu-devices 2 on CPUs), or data parallelism (--strategy ddp).") in out, out


def test_launcher_sets_local_world_size_to_this_nodes_processes():
    """LOCAL_WORLD_SIZE is this node's process count (torchrun's), not the world's: with one process per node on
    two nodes it is 1, and the rendezvous leaves the GPUs to JAX (every GPU of its node); with 4 per node it is 4,
    and local rank 2 takes GPU 2."""
    from jaxpar.launch import parser, rank_env
    from jaxpar.run.distributed import detect

    for nproc, ids in (("1", None), ("4", [2])):
        args = parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", nproc, "--master-port",
                                    "1", "train.py"])
        env = rank_env(args, local_rank=int(nproc) // 2, restart=0)
        assert env["LOCAL_WORLD_SIZE"] == nproc and env["WORLD_SIZE"] == str(2 * int(nproc))
        assert detect(env).local_device_ids == ids, nproc


def test_a_jax_world_of_one_process_is_a_single_process():
    """JAX's own variables naming one process (JAX_NUM_PROCESSES=1) are a single process, as WORLD_SIZE=1 is:
    no rendezvous, so jax.distributed is never started for it."""
    from jaxpar.run.distributed import detect

    jax_env = {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
    assert detect(jax_env) is None
    assert detect({**jax_env, "JAX_NUM_PROCESSES": "2"}).num_processes == 2
