"""Single-device training throughput, jaxpar vs PyTorch: the same model, batch, optimizer and starting weights.

    python bench/single.py                                   # convnet@128, alexnet@64px x 16, mlp@128
    python bench/single.py --models convnet --batches 64,128,256 --optimizer sgd --repeats 5
    python bench/single.py --conv-impl xla --no-torch

jaxpar: jaxpar.step.make_train_step (value_and_grad of the summed cross-entropy / count, then the optax
update), dropout on, `steps` timed steps after 2 compiling/warm-up ones. PyTorch: model.train(),
cross_entropy, backward, optimizer.step(), torch.set_num_threads(--threads). samples/s is the best of
--repeats runs (the machine is shared: the best run is the least disturbed); samples/CPU-s divides by the
CPU time of all this process's threads, a measure of work that other load disturbs less. The two
frameworks alternate within each repeat so both see the same load.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import jaxpar

jaxpar.tune_host_allocator()  # first, as train.py does: glibc's allocator tuned before JAX allocates

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

from jaxpar import models
from jaxpar.optim import make_optimizer
from jaxpar.batch import as_rows
from jaxpar.objective import Objective
from jaxpar.step import init_state, make_train_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
DEFAULT_BATCH = {"linear": 128, "mlp": 128, "convnet": 128, "alexnet": 16}
DEFAULT_LR = {"adadelta": 1.0, "sgd": 0.01}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="convnet,alexnet,mlp", help=f"comma separated, from {models.NAMES}")
    p.add_argument("--batches", default="", help="batch sizes, comma separated (default: per model, "
                   f"{DEFAULT_BATCH})")
    p.add_argument("--image-size", type=int, default=None, help="alexnet input size (default 64; 224 as "
                   "DeepSpeed's tutorial)")
    p.add_argument("--optimizer", default="adadelta", choices=("adadelta", "sgd"))
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the best counts")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--conv-impl", default=None, choices=models.CONV_IMPLS, help="default: by backend")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True, help="also PyTorch")
    return p.parse_args(argv)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(run, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `run(steps)`."""
    w, c = time.perf_counter(), _cpu()
    run(steps)
    return time.perf_counter() - w, _cpu() - c


def _model_kwargs(name: str, args) -> dict:
    kw = {"conv_impl": args.conv_impl} if name in ("convnet", "alexnet") and args.conv_impl else {}
    return kw


def jax_runner(name: str, batch: int, args, x: np.ndarray, y: np.ndarray):
    """A `run(steps)` closure over a compiled, warmed-up jaxpar train step; also returns the initial model."""
    model = models.get(name, **_model_kwargs(name, args))
    tx = make_optimizer(args.optimizer, DEFAULT_LR[args.optimizer])
    objective = Objective.of(model)  # the classifier default: cross-entropy, per-sample (dropout split-free)
    state = init_state(model, tx, objective)
    step = make_train_step(objective, tx)
    data = as_rows({"x": jnp.asarray(x), "y": jnp.asarray(y)})
    box = [state]

    def run(steps: int) -> None:
        s = box[0]
        for _ in range(steps):
            s, metrics = step(s, data)
        jax.block_until_ready(s.params)
        box[0] = s

    run(2)
    return run, model


def torch_runner(name: str, args, model, x: np.ndarray, y: np.ndarray):
    """The same model (starting from the JAX weights), batch and optimizer in PyTorch."""
    import torch
    import torch.nn.functional as F
    from make_torch_fixtures import torch_model

    torch.set_num_threads(args.threads)
    sd = models.to_torch_state_dict(model)
    net = torch_model(name, **models.kwargs_from_state_dict(name, sd))
    net.load_state_dict({k.split(".", 1)[1] if name == "linear" else k: torch.from_numpy(v.copy())
                         for k, v in sd.items()})
    net.train()
    if args.optimizer == "adadelta":
        opt = torch.optim.Adadelta(net.parameters(), lr=DEFAULT_LR["adadelta"], rho=0.9, eps=1e-6)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=DEFAULT_LR["sgd"], momentum=0.9)
    tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy() if x.ndim == 4 else x)
    ty = torch.from_numpy(y.astype(np.int64))

    def run(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(tx), ty).backward()
            opt.step()

    run(2)
    return run


def bench(name: str, batch: int, args, have_torch: bool) -> dict:
    shape = models.input_shape(name, args.image_size if name == "alexnet" else None)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    y = rng.integers(0, 2 if name == "linear" else 10, size=batch).astype(np.int32)
    jrun, model = jax_runner(name, batch, args, x, y)
    trun = torch_runner(name, args, model, x, y) if have_torch else None
    best = {"jax": (np.inf, np.inf), "torch": (np.inf, np.inf)}
    for _ in range(args.repeats):
        for fw, run in (("jax", jrun), ("torch", trun)):
            if run is not None:
                w, c = _timed(run, args.steps)
                best[fw] = (min(best[fw][0], w), min(best[fw][1], c))
    n = batch * args.steps
    row = dict(model=name, batch=batch, input="x".join(map(str, shape)),
               jax=n / best["jax"][0], jax_cpu=n / best["jax"][1])
    if have_torch:
        row.update(torch=n / best["torch"][0], torch_cpu=n / best["torch"][1])
    return row


def table(rows: list[dict]) -> str:
    head = f"{'model':8s} {'batch':>5s} {'input':>9s} | {'jax smp/s':>10s} {'torch smp/s':>11s} {'ratio':>6s} | " \
           f"{'jax smp/CPU-s':>13s} {'torch smp/CPU-s':>15s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        t, tc = r.get("torch"), r.get("torch_cpu")
        fmt = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
        lines.append(f"{r['model']:8s} {r['batch']:5d} {r['input']:>9s} | {r['jax']:10.0f} {fmt(t):>11s} "
                     f"{ratio(r['jax'], t):>6s} | {r['jax_cpu']:13.0f} {fmt(tc):>15s} {ratio(r['jax_cpu'], tc):>6s}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    names = [n for n in args.models.split(",") if n]
    for n in names:
        if n not in models.NAMES:
            raise SystemExit(f"unknown model {n!r}; use one of {models.NAMES}")
    have_torch = False
    if args.torch:
        try:
            import torch  # noqa: F401
            have_torch = True
        except ImportError:
            print("torch is not importable: jax only")
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"backend {jax.default_backend()}, conv {args.conv_impl or models.default_conv_impl()}, "
          f"optimizer {args.optimizer}, {args.steps} steps x best of {args.repeats}, torch threads {args.threads}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    rows = []
    for name in names:
        for batch in batches or [DEFAULT_BATCH[name]]:
            rows.append(bench(name, batch, args, have_torch))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
