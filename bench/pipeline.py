"""Pipeline benchmarks: jaxpar's engine against torch.distributed.pipelining across processes, against one device,
and its bubble. Tables print in Markdown; run `uptime` before and after (the machine may be shared).

    python bench/pipeline.py --processes 2               # AlexNet 64x64, batch 64, 4 micro-batches, 2 stages
    python bench/pipeline.py --processes 2 --threads 2   # ... each rank on 2 threads (torch's) / 2 cores (XLA's)
    python bench/pipeline.py --processes 2 --model stack --batch 256 --micro-batches 8 --pin   # the stack, a core each
    python bench/pipeline.py --stack                     # 16 x Linear(512), 2 simulated devices, S=2, M=8, batch 256
                                                         # (and the engine against hand-written twins)
    python bench/pipeline.py --one-stage                 # S=1, M=1 against the single-device step
    python bench/pipeline.py --zb                        # ZB-H1 and ZB-V vs 1F1B at S=4, M=8: analysis, executed

--processes: jaxpar's Pipeline in 2 processes x 1 CPU device (python -m jaxpar.launch, gloo) and torch's
Schedule1F1B / ScheduleGPipe (--schedules zbh1: ScheduleInterleavedZeroBubble, the paper's ZB1P) in 2 processes
(gloo; bench/pipeline_torch.py), the same layer split (jaxpar's 'parameters' partition: layers 0-18 | 19-21), batch
size and micro-batches, SGD with momentum, plus each framework's own single-process step. Each framework
initialises its own weights and draws its own random batch of those shapes (the kernels' speed does not depend on
the values; bench/gpt.py, which compares first losses, loads jaxpar's weights into torch). `--model stack`: the 16 x
Linear(512) stack of --stack instead (split 0-15 | 16-30), with the bound 1.5 x T_single / (1 - bubble) beside it
(--schedules 1f1b,1f1b+dw: also jaxpar's 1F1B with every W at the flush, Pipeline(defer_wgrad=True), against the
same torch 1F1B);
with --pin each stage has a core of its own, the bound's premise. --threads 1 (the default) implies --pin: XLA:CPU
has no per-process thread limit (its pool takes every visible core), so one thread per rank is held by pinning
both frameworks' ranks, each to a core of its own (until 2026-11-27 only torch's ranks were held to one thread,
jaxpar's ran two; a QA finding). Every run is compiled and warmed up first (2
steps, never timed); then rounds of --steps steps alternate between the runs (jaxpar 1F1B, torch 1F1B, jaxpar GPipe,
...), so load from elsewhere hits them alike, and the best round counts. samples/s = batch x steps / the slowest
rank's wall time; samples per CPU-second divides by the CPU time of all the run's processes (every thread); CPU
s/step is per stage (rank).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=0, help="jaxpar vs torch pipelining in this many processes")
    p.add_argument("--stack", action="store_true", help="the 16 x Linear(512) stack on 2 simulated devices")
    p.add_argument("--one-stage", action="store_true", help="S=1, M=1 against the single-device step")
    p.add_argument("--zb", action="store_true", help="ZB-H1 and ZB-V vs 1F1B at S=4, M=8")
    p.add_argument("--schedules", default="1f1b,gpipe", help="comma separated (--processes): 1f1b, gpipe, zbh1; "
                   "NAME+dw: jaxpar's NAME with every W at the flush (defer_wgrad), against torch's NAME")
    p.add_argument("--batch", type=int, default=64, help="--processes, and --one-stage's AlexNet: the batch "
                   "(--stack, --zb and --one-stage's stack: 256)")
    p.add_argument("--micro-batches", type=int, default=4, help="--processes: the micro-batches")
    p.add_argument("--image", type=int, default=64, help="AlexNet image side")
    p.add_argument("--model", default="alexnet", choices=("alexnet", "stack"), help="--processes: the model")
    p.add_argument("--threads", type=int, default=1, help="threads per pipeline process (torch's; 1 pins every rank "
                   "of both frameworks to a core, XLA:CPU having no thread limit)")
    p.add_argument("--pin", action="store_true", help="pin pipeline rank r to core r (one core per stage)")
    p.add_argument("--single-threads", type=int, default=os.cpu_count(), help="threads of the single-process runs")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best counts")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ctl", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- jaxpar workers (one group of processes per role, serving rounds from control files) -------------------

def problem(args, model_name: str):
    """(model, loss, optimizer, batch): "alexnet" on args.image-sized images, or "stack" (stack_model)."""
    import numpy as np
    import optax

    import jaxpar
    from jaxpar import models

    stack = model_name == "stack"
    model = stack_model() if stack else models.get("alexnet", num_classes=10)
    rng = np.random.default_rng(0)
    shape = (args.batch, 512) if stack else (args.batch, args.image, args.image, 3)
    batch = {"x": rng.normal(size=shape).astype(np.float32), "y": rng.integers(0, 10, args.batch).astype(np.int32)}
    tx = optax.sgd(0.01, momentum=0.9)
    return model, jaxpar.OutputLoss(jaxpar.cross_entropy), tx, batch


def jaxpar_worker(args) -> None:
    """jaxpar-pipeline: one rank of jaxpar.launch, 1 CPU device; jaxpar-single: the single-device step."""
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator
    from jaxpar.run import distributed

    # XLA:CPU has no thread limit: its pool takes every visible core, so the thread counts the header reports for
    # both frameworks are held here by the cores a process may run on (before XLA sizes its pool); only torch's
    # were before (a QA finding)
    cores = sorted(os.sched_getaffinity(0))
    if args.worker == "jaxpar-pipeline":
        rank = int(os.environ.get("RANK", "0"))
        if args.pin:  # a core of its own, as torch's pinned ranks
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
        elif args.threads < len(cores):
            os.sched_setaffinity(0, {cores[(rank * args.threads + i) % len(cores)] for i in range(args.threads)})
    elif args.single_threads < len(cores):
        os.sched_setaffinity(0, set(cores[:args.single_threads]))
    simulate_cpu_devices(1)
    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    distributed.initialize()
    import jax
    import jax.numpy as jnp

    import jaxpar
    from jaxpar.strategies.pipeline import Pipeline, pipeline_mesh
    from pipeline_torch import rounds

    model, loss, tx, batch = problem(args, args.model)
    state, rank = jaxpar.init_state(model, tx), jax.process_index()
    if args.worker == "jaxpar-single":
        strategies = {"single": jaxpar.SingleDevice(model, tx, loss_fn=loss)}
    else:
        strategies = {name: Pipeline(model, tx, loss_fn=loss, num_stages=jax.process_count(),
                                     micro_batches=args.micro_batches, schedule=name, batch_size=args.batch,
                                     mesh=pipeline_mesh(None, jax.process_count()))  # NAME+dw: deferred W's
                      for name in args.schedules.split(",")}
    runs = {}
    for name, strategy in strategies.items():
        placed, pb = strategy.init(state), strategy.put_batch(batch)
        for _ in range(2):  # compile and warm up: never timed
            placed, metrics = strategy.step(placed, pb)
        jax.block_until_ready((placed, metrics))
        runs[name] = [strategy, placed, pb]

    def sync():  # all ranks start a round together (a 4-byte sum over processes)
        if args.worker != "jaxpar-single":
            jax.block_until_ready(next(iter(strategies.values())).transport.all_processes_sum(jnp.zeros(1)))

    def run_round(name):
        strategy, placed, pb = runs[name]
        sync()
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            placed, metrics = strategy.step(placed, pb)
        jax.block_until_ready((placed, metrics))
        sync()
        runs[name][1] = placed
        return time.perf_counter() - t, time.process_time() - cpu

    rounds(args.ctl, args.worker, rank, run_round)


# ---- --processes: the driver ---------------------------------------------------------------------------------

CROSS_SCHEDULES = ("1f1b", "gpipe", "zbh1")  # torch: Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble


def base(name: str) -> str:
    """The schedule a --schedules name runs on both sides: NAME+dw is jaxpar's NAME with its W's deferred."""
    return name.removesuffix("+dw")


def _exited(p):
    """A worker's exit status, or None while it runs (a Popen, or a multiprocessing Process)."""
    return p.poll() if hasattr(p, "poll") else p.exitcode

def wait_ready(ctl: str, group: str, ranks: int, procs, timeout: float = 1800) -> None:
    t = time.time()
    while not all(os.path.exists(os.path.join(ctl, f"ready.{group}.rank{r}")) for r in range(ranks)):
        for p in procs:
            if p is not None and _exited(p) is not None:
                raise RuntimeError(f"{group} exited with status {_exited(p)} before it was ready")
        if time.time() - t > timeout:
            raise RuntimeError(f"{group} not ready after {timeout} s")
        time.sleep(0.05)


def cross_process(args) -> None:
    import pipeline_torch

    from jaxpar import models
    from jaxpar.pipeline.module import PipelineModule

    n = args.processes
    if args.threads == 1 and not args.pin:  # the only way to hold XLA:CPU to one core: it has no thread limit
        print("--threads 1: every rank of both frameworks pinned to a core of its own (--pin); XLA:CPU has no "
              "per-process thread limit", flush=True)
        args.pin = True
    model = stack_model() if args.model == "stack" else models.abstract("alexnet", num_classes=10)
    bounds = PipelineModule.from_model(model, n).bounds
    ctl = tempfile.mkdtemp(prefix="jaxpar-bench-")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # XLA's flags as they are: XLA:CPU has no per-process thread limit
    common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("schedules", "batch", "micro_batches", "image", "steps", "model", "threads", "single_threads")]
    common += ["--pin"] if args.pin else []
    me = os.path.abspath(__file__)
    jax_pipe = subprocess.Popen([sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", str(n), me,
                                 "--worker", "jaxpar-pipeline", "--ctl", ctl, *common], cwd=ROOT, env=env)
    jax_single = subprocess.Popen([sys.executable, me, "--worker", "jaxpar-single", "--ctl", ctl, *common], cwd=ROOT,
                                  env=env)
    targs = {"model": args.model, "bounds": bounds, "batch": args.batch, "image": args.image,
             "micro_batches": args.micro_batches, "steps": args.steps,
             "schedules": list(dict.fromkeys(map(base, args.schedules.split(",")))),
             "threads": args.threads, "single_threads": args.single_threads, "pin": args.pin}
    torch_pipe, torch_single = pipeline_torch.start(ctl, targs, n)
    try:
        results = run_rounds(args, ctl, n, jax_pipe, jax_single, torch_pipe.processes, torch_single.processes)
    finally:  # stop every worker, also after an error (the torch ranks are not daemons)
        pipeline_torch.write(os.path.join(ctl, "stop"), "stop")
        for p in (jax_pipe, jax_single):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        for ctx in (torch_pipe, torch_single):
            for proc in ctx.processes:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
        shutil.rmtree(ctl, ignore_errors=True)  # the control files of this run
    report_cross(args, results, bounds)


def run_rounds(args, ctl: str, n: int, jax_pipe, jax_single, torch_pipe: list, torch_single: list):
    """Wait until every worker is warmed up, then alternate the timed rounds: {run: [per-rank timings]}."""
    import pipeline_torch

    for group, ranks, procs in (("jaxpar-pipeline", n, [jax_pipe]), ("jaxpar-single", 1, [jax_single]),
                                ("torch", n, torch_pipe), ("torch-single", 1, torch_single)):
        wait_ready(ctl, group, ranks, procs)
    plan, peers = [], set()  # torch's run of each base schedule once, after jaxpar's first run of it
    for s in args.schedules.split(","):
        plan.append((f"jaxpar {s}", "jaxpar-pipeline", s, n))
        if base(s) not in peers:
            peers.add(base(s))
            plan.append((f"torch {base(s)}", "torch", base(s), n))
    plan += [("jaxpar single", "jaxpar-single", "single", 1), ("torch single", "torch-single", "single", 1)]
    counters = {g: 0 for _, g, _, _ in plan}
    results = {name: [] for name, *_ in plan}
    for _ in range(args.rounds):
        for name, group, run, ranks in plan:
            k = counters[group]
            pipeline_torch.write(os.path.join(ctl, f"go.{group}.{k}"), run)
            got = [json.loads(pipeline_torch.wait_for(os.path.join(ctl, f"done.{group}.{k}.rank{r}")))
                   for r in range(ranks)]
            counters[group] += 1
            results[name].append(got)
            print(f"  {name}: {args.batch * args.steps / max(g['wall'] for g in got):.1f} samples/s", flush=True)
    return results


def report_cross(args, results: dict, bounds: list) -> None:
    samples = args.batch * args.steps
    best = {name: min(rs, key=lambda got: max(g["wall"] for g in got)) for name, rs in results.items()}
    speed = {name: samples / max(g["wall"] for g in got) for name, got in best.items()}
    per_cpu = {name: samples / sum(g["cpu"] for g in got) for name, got in best.items()}
    what = "16 x Linear(512) + ReLU" if args.model == "stack" else f"AlexNet {args.image}x{args.image}"
    print(f"\n{what}, batch {args.batch}, {args.micro_batches} micro-batches, "
          f"{args.processes} processes x {args.threads} thread(s){', pinned to one core each' if args.pin else ''} "
          f"(single: 1 process x {args.single_threads}); "
          f"split layers {bounds}; best of {args.rounds} alternating rounds of {args.steps} steps\n")
    print("| run | samples/s | vs torch | vs own single | samples/CPU-s | vs torch | CPU s/step per stage |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in results:
        fw, kind = name.split(" ", 1)
        peer = f"torch {base(kind)}"
        single = f"{fw} single"
        cpu = " / ".join(f"{g['cpu'] / args.steps:.3f}" for g in best[name])
        print(f"| {name} | {speed[name]:.1f} | {speed[name] / speed[peer]:.2f}x | {speed[name] / speed[single]:.2f}x "
              f"| {per_cpu[name]:.1f} | {per_cpu[name] / per_cpu[peer]:.2f}x | {cpu} |")
    spread = {n: statistics.median(samples / max(g["wall"] for g in got) for got in rs) for n, rs in results.items()}
    print("\nmedian samples/s over rounds: " + ", ".join(f"{n} {v:.1f}" for n, v in spread.items()))
    if args.model == "stack":  # the --stack bound, T_single the jaxpar single-process step (stored activations)
        from jaxpar.pipeline import analysis, generators

        t1 = samples / speed["jaxpar single"] / args.steps
        print(f"\nThe bound 1.5 x T_single / (1 - bubble), T_single {t1 * 1e3:.1f} ms (jaxpar single):\n")
        print("| schedule | bubble (F=I=W, B=2) | jaxpar ms/step | bound ms | within |")
        print("|---|---:|---:|---:|---|")
        for name in args.schedules.split(","):
            bubble = analysis.bubble_fraction(generators.make(name, args.processes, args.micro_batches),
                                              analysis.COSTS)
            t, bound = samples / speed[f"jaxpar {name}"] / args.steps, 1.5 * t1 / (1 - bubble)
            print(f"| {name} | {bubble:.3f} | {t * 1e3:.1f} | {bound * 1e3:.1f} | {'yes' if t <= bound else 'NO'} |")


# ---- in-process modes: the stack, one stage, zero bubble ---------------------------------------------------

def stack_model(width: int = 512, depth: int = 16, classes: int = 10):
    from flax import nnx

    r = nnx.Rngs(0)
    layers = []
    for i in range(depth):
        layers.append(nnx.Linear(width, width if i < depth - 1 else classes, rngs=r))
        if i < depth - 1:
            layers.append(nnx.relu)
    return nnx.Sequential(*layers)


def timed_rounds(runs: dict, steps: int, n_rounds: int) -> dict:
    """{name: best seconds per step} over alternating rounds; every run warmed up (2 steps) first."""
    import jax

    state = {}
    for name, (strategy, state0, batch) in runs.items():
        placed, pb = strategy.init(state0), strategy.put_batch(batch)
        for _ in range(2):
            placed, m = strategy.step(placed, pb)
        jax.block_until_ready((placed, m))
        state[name] = [placed, pb]
    best = {name: float("inf") for name in runs}
    for _ in range(n_rounds):
        for name, (strategy, _, _) in runs.items():
            placed, pb = state[name]
            t = time.perf_counter()
            for _ in range(steps):
                placed, m = strategy.step(placed, pb)
            jax.block_until_ready((placed, m))
            best[name] = min(best[name], (time.perf_counter() - t) / steps)
            state[name][0] = placed
    return best


def in_process(args) -> None:
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator

    simulate_cpu_devices(4 if args.zb else 2)
    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    import numpy as np
    import optax

    import jaxpar
    from jaxpar.pipeline import analysis
    from jaxpar.strategies.pipeline import Pipeline, pipeline_mesh

    rng = np.random.default_rng(0)
    loss, tx = jaxpar.OutputLoss(jaxpar.cross_entropy), optax.sgd(0.01, momentum=0.9)
    stack = stack_model()
    sbatch = {"x": rng.normal(size=(256, 512)).astype(np.float32), "y": rng.integers(0, 10, 256).astype(np.int32)}
    if args.stack or args.zb:
        S, M = (4, 8) if args.zb else (2, 8)
        state = jaxpar.init_state(stack, tx)
        runs = {"single": (jaxpar.SingleDevice(stack, tx, loss_fn=loss), state, sbatch)}
        for schedule in ("1f1b", "zbh1", "zbv") if args.zb else ("gpipe", "1f1b", "zbh1"):
            # stored and recomputed; --stack also each schedule with its W's deferred to the flush (stored)
            for ck, dw in ((0, False),) if args.zb else ((0, False), (1, False), (0, True)):
                runs[f"{schedule} ckpt {ck}{' dw' * dw}"] = (
                    Pipeline(stack, tx, loss_fn=loss, num_stages=S, micro_batches=M, schedule=schedule,
                             activation_checkpoint_interval=ck, virtual_stages=2 if schedule == "zbv" else 1,
                             defer_wgrad=dw, mesh=pipeline_mesh(S, S)), state, sbatch)
        best = timed_rounds(runs, args.steps, args.rounds)
        t1 = best.pop("single")
        print(f"\n16 x Linear(512) + ReLU, batch 256, S={S}, M={M} on {S} simulated CPU devices; one device "
              f"{t1 * 1e3:.1f} ms/step; best of {args.rounds} alternating rounds of {args.steps} steps\n")
        print("| schedule | policy | bubble (grid) | bubble (F=I=W, B=2) | ms/step | vs one device | bound | "
              "within |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for name, t in best.items():
            pipe = runs[name][0]
            bubble = analysis.bubble_fraction(pipe.schedule, analysis.COSTS)
            factor = 4 / 3 if pipe.module.interval else 1.0
            bound = 1.5 * t1 / (1 - bubble) * factor
            print(f"| {pipe.schedule.name} | {'recompute' if factor > 1 else 'store'} | "
                  f"{analysis.bubble_fraction(pipe.schedule):.3f} | {bubble:.3f} | {t * 1e3:.1f} | {t / t1:.2f}x | "
                  f"{bound * 1e3:.1f} | {'yes' if t <= bound else 'NO'} |")
        if args.zb:
            executed(runs, S, M)
        else:
            micro_batch_rates(stack, sbatch, M, args.rounds)
            two_devices_at_once(sbatch, M, args.rounds)
            hand_written_twin(runs, sbatch, M, args.rounds)
    if args.one_stage:
        model, loss_a, tx_a, batch = problem(args, "alexnet")
        runs = {}
        for label, (m, b) in {"alexnet": (model, batch), "stack": (stack, sbatch)}.items():
            state = jaxpar.init_state(m, tx_a)
            runs[f"{label} single"] = (jaxpar.SingleDevice(m, tx_a, loss_fn=loss_a), state, b)
            runs[f"{label} S=1 M=1"] = (Pipeline(m, tx_a, loss_fn=loss_a, num_stages=1, micro_batches=1,
                                                 mesh=pipeline_mesh(1, 1)), state, b)
        best = timed_rounds(runs, args.steps, args.rounds)
        print(f"\nOne stage, one micro-batch vs the single-device step (best of {args.rounds} alternating rounds)\n")
        print("| model | single ms/step | pipeline S=1 M=1 ms/step | ratio |")
        print("|---|---:|---:|---:|")
        for label in ("alexnet", "stack"):
            a, b = best[f"{label} single"], best[f"{label} S=1 M=1"]
            print(f"| {label} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |")


def micro_batch_rates(stack, batch: dict, M: int, n_rounds: int) -> None:
    """What a pipeline stage's micro-batches cost the GEMMs: forward + backward of the whole stack on one device
    (no optimizer), on the whole batch and on its M micro-batches one after another, jaxpar (XLA:CPU) and torch
    eager at 2 threads, alternating. The bound above allows 1.5x for this; a ratio beyond it is the kernels'."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x))))
    n = batch["x"].shape[0]
    whole, parts = jnp.asarray(batch["x"]), [jnp.asarray(batch["x"][i:i + n // M]) for i in range(0, n, n // M)]
    runs = {"jaxpar whole": lambda: jax.block_until_ready(grad(params, whole)),
            "jaxpar micro": lambda: jax.block_until_ready([grad(params, x) for x in parts])}
    try:
        import torch

        torch.set_num_threads(2)
        layers = []
        for i in range(16):  # stack_model's shapes (timing only: torch's own initial weights)
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()] if i < 15 else [torch.nn.Linear(512, 10)]
        net = torch.nn.Sequential(*layers)
        tw, tparts = torch.from_numpy(batch["x"]), [torch.from_numpy(batch["x"][i:i + n // M]) for i in
                                                     range(0, n, n // M)]

        def fb(xs):  # each backward into fresh gradients, as jaxpar's grad returns them (no accumulation)
            for x in xs:
                net.zero_grad(set_to_none=True)
                net(x).sum().backward()

        runs.update({"torch whole": lambda: fb([tw]), "torch micro": lambda: fb(tparts)})
    except ImportError:
        pass
    for run in runs.values():
        run(), run()
    best = {k: float("inf") for k in runs}
    for _ in range(max(n_rounds, 3)):
        for k, run in runs.items():
            t = time.perf_counter()
            for _ in range(5):
                run()
            best[k] = min(best[k], (time.perf_counter() - t) / 5)
    print(f"\nForward + backward on one device (2 threads, no optimizer): the whole batch of {n} against its {M} "
          f"micro-batches of {n // M} rows in turn\n")
    print("| framework | whole batch ms | micro-batches ms | micro / whole |")
    print("|---|---:|---:|---:|")
    for fw in ("jaxpar", "torch"):
        if f"{fw} whole" in best:
            a, b = best[f"{fw} whole"], best[f"{fw} micro"]
            print(f"| {fw} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x |")


def two_devices_at_once(batch: dict, M: int, n_rounds: int) -> None:
    """Whether two simulated CPU devices in one process add compute: each stage's work (forward + backward of 8 x
    Linear(512) + ReLU on one 32-row micro-batch, no optimizer) on one device, the two stages' work one after the
    other on one device, and each stage's on its own device at once (a pipeline's steady state without the
    pipeline). With a core per device, "at once" would take half of "in turn"."""
    import jax
    import jax.numpy as jnp

    def chain(ws, x):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.sum(x)

    grad = jax.jit(jax.grad(chain))
    d0, d1 = jax.devices()[:2]
    rows = batch["x"].shape[0] // M
    w = [jax.random.normal(jax.random.key(i), (512, 512)) / 512 ** 0.5 for i in range(8)]
    x = jnp.asarray(batch["x"][:rows])
    on0, on1 = jax.device_put((w, x), d0), jax.device_put((w, x), d1)
    runs = {"one stage, one device": lambda: [grad(*on0) for _ in range(M)],
            "both stages in turn, one device": lambda: [grad(*on0) for _ in range(2 * M)],
            "both stages at once, a device each": lambda: [(grad(*on0), grad(*on1)) for _ in range(M)]}
    for run in runs.values():
        jax.block_until_ready(run())
    best = {k: float("inf") for k in runs}
    for _ in range(max(n_rounds, 5)):
        for k, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run())
            best[k] = min(best[k], time.perf_counter() - t)
    flops = 3 * 2 * rows * 512 * 512 * 8 * M  # forward + backward (dx and dW), per stage
    print(f"\nTwo simulated devices sharing the cores: {M} micro-batches of {rows} rows through each stage's 8 x "
          "Linear(512) + ReLU, forward + backward, no optimizer (best of alternating rounds)\n")
    print("| run | ms | GFLOP/s, all devices |")
    print("|---|---:|---:|")
    for k, t in best.items():
        n = 1 if k.startswith("one") else 2
        print(f"| {k} | {t * 1e3:.1f} | {n * flops / t / 1e9:.0f} |")
    ratio = best["both stages in turn, one device"] / best["both stages at once, a device each"]
    print(f"\nThe second device's speed-up: {ratio:.2f}x (2x with a core per device; 1x or less means the two "
          "devices only share the same cores)")


def hand_written_twin(runs: dict, batch: dict, M: int, n_rounds: int) -> None:
    """Where the engine's own time goes: the --stack step of 1F1B against twins written by hand in plain JAX -- the
    same layers, weights, batch and SGD, the same dispatch order (F0 F1 B0 F2 B1 ..., the last stage's forward and
    backward in one program) -- for both of the engine's stored executions: each micro-batch's backward adding its
    weight gradient to the stage's accumulator (1F1B as DeepSpeed and torch run it), and every W deferred to the
    flush, each stage's W's as one product over its micro-batches' rows (defer_wgrad). The twins' stage programs are
    written for this model (no per-sample vmap, each ReLU's mask read off its output, no per-part structure, the
    update inside the last program); each is checked equal to its engine run after one step, then all are timed in
    alternating rounds with the one-device step, which sets their bounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxpar.pipeline import analysis

    single, state0, _ = runs["single"]
    pipe = runs["1f1b ckpt 0"][0]
    d0, d1 = (pipe.transport.devices[s][0] for s in range(2))
    rows, tx, n = batch["x"].shape[0] // M, pipe.engine.tx, batch["x"].shape[0]
    lin = [layer for layer in single.objective.merge(state0.params, state0.model_state).layers
           if hasattr(layer, "kernel")]
    half = len(lin) // 2
    xs = [jax.device_put(batch["x"][m * rows:(m + 1) * rows], d0) for m in range(M)]
    ys = [jax.device_put(batch["y"][m * rows:(m + 1) * rows], d1) for m in range(M)]

    def forward(ps, x, last):  # -> output, each layer's input (its W's residual)
        ins = []
        for k, (w, b) in enumerate(ps):
            ins.append(x)
            x = x @ w + b
            x = x if last and k == len(ps) - 1 else jax.nn.relu(x)
        return x, ins

    def back(ps, ins, out, dy, last):  # -> dx, each layer's output cotangent (its W's other operand)
        outs, cots = ins[1:] + [out], []
        for k in reversed(range(len(ps))):
            dy = dy if last and k == len(ps) - 1 else dy * (outs[k] > 0)
            cots.append(dy)
            dy = dy @ ps[k][0].T
        return dy, cots[::-1]

    def last_fb(ps, x, y):  # the last stage's forward and input gradient, from d(summed cross-entropy)/dz
        z, ins = forward(ps, x, True)
        dx, cots = back(ps, ins, z, jax.nn.softmax(z) - jax.nn.one_hot(y, z.shape[-1]), True)
        return dx, ins, cots

    def grads_of(inss, cotss):  # each layer's weight gradient over the micro-batches' rows joined
        cat = [(jnp.concatenate([i[k] for i in inss]), jnp.concatenate([c[k] for c in cotss]))
               for k in range(len(inss[0]))]
        return [(i.T @ c, c.sum(0)) for i, c in cat]

    def update(ps, opt, grads):
        updates, opt = tx.update([(w / n, b / n) for w, b in grads], opt, ps)
        return optax.apply_updates(ps, updates), opt

    def add(acc, ins, cots):  # acc + this micro-batch's weight gradient (acc None: the step's first)
        g = grads_of([ins], [cots])
        return g if acc is None else [(a + w, c + b) for (a, c), (w, b) in zip(acc, g)]

    f0 = jax.jit(lambda ps, x: forward(ps, x, False))
    i0 = jax.jit(lambda ps, ins, out, dy: back(ps, ins, out, dy, False))
    fi1 = jax.jit(last_fb)
    b0 = jax.jit(lambda acc, ps, ins, out, dy: add(acc, ins, back(ps, ins, out, dy, False)[1]))
    fb1 = jax.jit(lambda acc, ps, x, y: (lambda dx, ins, cots: (add(acc, ins, cots), dx))(*last_fb(ps, x, y)))
    w_update = jax.jit(lambda ps, opt, inss, cotss: update(ps, opt, grads_of(inss, cotss)), donate_argnums=(0, 1))
    acc_update = jax.jit(update, donate_argnums=(0, 1, 2))

    def make_twin(deferred: bool):
        params = [jax.device_put([(np.array(k.get_value()), np.array(b.get_value())) for k, b in
                                  ((layer.kernel, layer.bias) for layer in part)], d)
                  for part, d in ((lin[:half], d0), (lin[half:], d1))]
        opts = [jax.device_put(tx.init(p), d) for p, d in zip(params, (d0, d1))]

        def step():
            st0, st1, act, grad, acc = {}, {}, {}, {}, [None, None]

            def fwd0(m):
                out, ins = f0(params[0], xs[m])
                st0[m], act[m] = (ins, out), jax.device_put(out, d1)

            def last(m):
                if deferred:
                    dx, ins, cots = fi1(params[1], act.pop(m), ys[m])
                    st1[m] = (ins, cots)
                else:
                    acc[1], dx = fb1(acc[1], params[1], act.pop(m), ys[m])
                grad[m] = jax.device_put(dx, d0)

            def back0(m):
                ins, out = st0[m]
                if deferred:
                    st0[m] = (ins, i0(params[0], ins, out, grad.pop(m))[1])
                else:
                    acc[0] = b0(acc[0], params[0], ins, out, grad.pop(m))
                    del st0[m]

            fwd0(0)
            for m in range(M):
                if m + 1 < M:
                    fwd0(m + 1)
                last(m)
                back0(m)
            for s, st in ((0, st0), (1, st1)):
                if deferred:
                    params[s], opts[s] = w_update(params[s], opts[s], [st[m][0] for m in range(M)],
                                                  [st[m][1] for m in range(M)])
                else:
                    params[s], opts[s] = acc_update(params[s], opts[s], acc[s])
            return params

        return step, params

    def weights_of(engine_pipe, placed):
        merged = single.objective.merge(*(lambda u: (u.params, u.model_state))(engine_pipe.unplace(placed)))
        return [(layer.kernel.get_value(), layer.bias.get_value()) for layer in merged.layers
                if hasattr(layer, "kernel")]

    timings, bounds = {}, {}
    for name, deferred in (("1f1b ckpt 0", False), ("1f1b ckpt 0 dw", True)):
        engine_pipe = runs[name][0]
        twin, params = make_twin(deferred)
        before = jax.device_get(params)
        twin_params = jax.device_get(twin())  # one step of each from the same state: the twin computes the engine's
        box = [engine_pipe.init(state0)]
        pb = engine_pipe.put_batch(batch)
        box[0] = engine_pipe.step(box[0], pb)[0]
        gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                  zip(jax.tree.leaves(twin_params[0] + twin_params[1]), jax.tree.leaves(weights_of(engine_pipe,
                                                                                                  box[0]))))
        moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                    zip(jax.tree.leaves(twin_params), jax.tree.leaves(before)))
        assert gap < 1e-5 < moved, f"the {name} twin's first step differs from the engine's by {gap} (moved {moved})"

        def engine(p=engine_pipe, box=box, pb=pb):
            box[0], metrics = p.step(box[0], pb)
            return box[0], metrics

        label = engine_pipe.schedule.name
        timings[f"hand-written twin, {label}"], timings[f"jaxpar {label}"] = twin, engine
        bubble = analysis.bubble_fraction(engine_pipe.schedule, analysis.COSTS)
        bounds[f"hand-written twin, {label}"] = bounds[f"jaxpar {label}"] = 1.5 / (1 - bubble)
    sbox = [single.init(state0)]
    spb = single.put_batch(batch)

    def one():
        sbox[0], metrics = single.step(sbox[0], spb)
        return sbox[0], metrics

    timings["one device"] = one
    for run in timings.values():
        jax.block_until_ready(run()), jax.block_until_ready(run())
    best = {k: (float("inf"), 0.0) for k in timings}
    for _ in range(max(n_rounds, 5)):
        for k, run in timings.items():
            t, c = time.perf_counter(), time.process_time()
            for _ in range(5):
                out = run()
            jax.block_until_ready(out)
            wall, cpu = (time.perf_counter() - t) / 5, (time.process_time() - c) / 5
            if wall < best[k][0]:
                best[k] = (wall, cpu)
    t1 = best["one device"][0]
    print("\nThe engine against hand-written twins of its two stored 1F1B executions (same model, weights, batch, SGD, "
          f"dispatch order; best of alternating rounds of 5 steps; one device {t1 * 1e3:.1f} ms/step in the same "
          "rounds sets the bounds)\n")
    print("| run | ms/step | CPU ms/step (all threads) | cores busy | bound | step / bound |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, (wall, cpu) in best.items():
        bound = f"{bounds[k] * t1 * 1e3:.1f} | {wall / (bounds[k] * t1):.2f}x" if k in bounds else "| "
        print(f"| {k} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {cpu / wall:.2f} | {bound} |")
    for label in ("1f1b", "1f1b+dw"):
        print(f"\njaxpar / twin, {label}: {best[f'jaxpar {label}'][0] / best[f'hand-written twin, {label}'][0]:.2f}x",
              end="")
    print()


def executed(runs: dict, S: int, M: int) -> None:
    """The executed ticks: every action timed alone (blocking after it), per stage and op; the schedule replayed
    with those durations (analysis.simulate)."""
    import jax

    from jaxpar.pipeline import analysis

    print("\n| schedule | executed bubble (trace, F=I=W, B=2) | measured ms per action (stage 0: F / B or I / W) | "
          "bubble with measured durations |")
    print("|---|---:|---|---:|")
    for name, (pipe, state, batch) in runs.items():
        if name == "single":
            continue
        durations: dict = {}

        def timer(a, out, last=[time.perf_counter()]):  # noqa: B006  (the previous action's end)
            jax.block_until_ready(out)
            now = time.perf_counter()
            durations.setdefault((a.stage, a.op), []).append(now - last[0])
            last[0] = now

        placed, pb = pipe.init(state), pipe.put_batch(batch)
        placed, _ = pipe.step(placed, pb)
        pipe.engine.timer = timer
        for _ in range(3):
            timer.__defaults__[0][0] = time.perf_counter()
            placed, m = pipe.step(placed, pb)
        pipe.engine.timer = None
        grid = [[None] * S for _ in range(pipe.schedule.num_ticks)]
        for t, a in pipe.engine.trace:
            grid[t][a.stage] = a
        from jaxpar.pipeline import schedule as sch

        trace = sch.Schedule("executed", S, M, pipe.schedule.virtual_stages, tuple(map(tuple, grid)),
                             backward=pipe.schedule.backward, placement=pipe.schedule.placement)
        med = {k: sorted(v)[len(v) // 2] for k, v in durations.items()}
        costs = {op: sum(med[(s, o)] for s in range(S) for o in [op] if (s, o) in med) / S
                 for op in {o for _, o in med}}
        stage0 = " / ".join(f"{med[(0, op)] * 1e3:.2f}" for op in sorted({o for s, o in med if s == 0},
                                                                           key=lambda o: "FBIW".index(o.value)))
        print(f"| {name} | {analysis.bubble_fraction(sch.validate(trace), analysis.COSTS):.3f} | {stage0} | "
              f"{analysis.bubble_fraction(trace, costs):.3f} |")


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        return jaxpar_worker(args)
    if args.processes:
        unknown = sorted(set(map(base, args.schedules.split(","))) - set(CROSS_SCHEDULES))
        if unknown:
            raise SystemExit(f"--schedules {','.join(unknown)}: --processes compares schedules both frameworks have; "
                             f"use some of {','.join(CROSS_SCHEDULES)}.")
        return cross_process(args)
    if not (args.stack or args.one_stage or args.zb):
        args.stack = True
    in_process(args)


if __name__ == "__main__":
    main()
