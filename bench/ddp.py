"""DDP training throughput: jaxpar DDP per algorithm vs one device vs PyTorch DDP, same model, same global batch.

    python bench/ddp.py                                  # ConvNet, 2 simulated CPU devices, global batch 128 and 256
    python bench/ddp.py --devices 4 --batches 256 --steps 10 --algorithms psum,ring --no-torch

jaxpar: the strategy's own step (put_batch once, then `steps` timed steps after 2 compiling/warm-up ones),
samples/s = global batch x steps / seconds, best of --repeats rounds; the rounds of all runs (PyTorch's too)
alternate, so load from elsewhere on a shared machine hits them alike, and the best round is the one least
disturbed; samples/CPU-s divides by the CPU time of all the run's threads and processes instead, a
measure of work that other load on the machine disturbs less. One device: jaxpar's single strategy, the same
process and thread pool. PyTorch: torch's DistributedDataParallel over gloo, --devices processes x 1 thread
(torch.multiprocessing spawn), the same ConvNet (PyTorch's examples/mnist Net) loaded with jaxpar's initial
weights (models.to_torch_state_dict), the same global batch, each rank its contiguous share, Adadelta, dropout on.
Ratios are against the one-device run and against PyTorch DDP.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices = torch processes (default 2)")
    p.add_argument("--batches", default="128,256", help="global batch sizes, comma separated")
    p.add_argument("--algorithms", default="psum,ring,reduce_broadcast,all_to_all", help="comma separated")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per run, alternating; the best counts")
    p.add_argument("--conv-impls", default="auto",
                   help="ConvNet convolutions, comma separated: auto (the model's default: chunked on CPU), "
                        "im2col, xla, chunked")
    p.add_argument("--grad-accum", default="1", help="DDP micro-steps per step, comma separated (e.g. 1,2)")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True, help="also PyTorch DDP")
    return p.parse_args(argv)


# ---- PyTorch DDP: one spawned process per rank ---------------------------------------------------------------

def _torch_net():
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):  # pytorch/examples mnist/main.py
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
            self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
            self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            x = self.fc2(self.dropout2(F.relu(self.fc1(self.dropout1(x).flatten(1)))))
            return F.log_softmax(x, dim=1)

    return Net()


def _torch_worker(rank: int, world: int, port: int, batch: int, steps: int, weights: dict, x_nchw, y, commands,
                  out) -> None:
    """One rank: set up (jaxpar's initial weights, its contiguous share of the global batch), warm up, then one
    timed round of `steps` steps per command (None ends it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the dropout masks
    net = _torch_net()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    share = slice(rank * (batch // world), (rank + 1) * (batch // world))
    x, y = torch.from_numpy(x_nchw[share]), torch.from_numpy(y[share]).long()

    def step():
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    while commands[rank].get() is not None:
        dist.barrier()
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        dist.barrier()
        out.put((rank, time.perf_counter() - t, time.process_time() - cpu))
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse(argv)
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator
    from rounds import JaxparRun, TorchRanks

    simulate_cpu_devices(args.devices)
    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    import jax
    import numpy as np

    from jaxpar import models
    from jaxpar.config import Config
    from jaxpar.step import init_state
    from jaxpar.strategies.base import get_builder
    from jaxpar.run.trainer import make_tx

    print(f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} devices; os.cpu_count()="
          f"{os.cpu_count()}; ConvNet, Adadelta, {args.steps} steps x best of {args.repeats}")
    rows, baseline, torch_name = [], {}, f"torch DDP gloo {args.devices}x1"  # baseline: the one-device run
    weights = models.to_torch_state_dict(models.get("convnet"))  # jaxpar's initial ConvNet under torch's keys
    for batch_size in [int(b) for b in args.batches.split(",")]:
        rng = np.random.default_rng(0)
        batch = {"x": rng.normal(size=(batch_size, 28, 28, 1)).astype(np.float32),
                 "y": rng.integers(0, 10, batch_size).astype(np.int32), "idx": np.arange(batch_size, dtype=np.int32)}
        base = Config(model="convnet", optimizer="adadelta", batch_size=batch_size, num_devices=args.devices, gamma=1.0)
        runs = {}
        for impl in args.conv_impls.split(","):
            suffix = "" if impl == "auto" else f", {impl} conv"
            configs = {"single": base} | {f"ddp {a}" + (f" accum {k}" if k != "1" else ""):
                                          base.replace(strategy="ddp", allreduce=a, grad_accum=int(k))
                                          for a in args.algorithms.split(",") for k in args.grad_accum.split(",")}
            for name, cfg in configs.items():
                model = models.get("convnet", **({} if impl == "auto" else {"conv_impl": impl}))
                tx = make_tx(cfg, 100)
                state = init_state(model, tx)
                runs[name + suffix] = JaxparRun(get_builder(cfg.strategy)(model, tx, cfg), state, batch, args.steps,
                                                   units=batch_size)
                baseline[name + suffix] = "single" + suffix
        if args.torch:  # the same weights and global batch
            x_nchw = np.ascontiguousarray(batch["x"].transpose(0, 3, 1, 2))
            runs[torch_name] = TorchRanks(_torch_worker, args.devices, (batch_size, args.steps, weights, x_nchw,
                                                                         batch["y"]), units=batch_size * args.steps)
            baseline[torch_name] = next(iter(runs))
        speed = {name: (0.0, 0.0) for name in runs}
        for _ in range(args.repeats):  # rounds alternate between the runs: load on the machine hits all alike
            for name, run in runs.items():
                speed[name] = tuple(max(a, b) for a, b in zip(speed[name], run.measure()))
        for name, run in runs.items():
            print(f"  batch {batch_size} {name}: {speed[name][0]:.0f} samples/s, {speed[name][1]:.0f} per CPU-s",
                  flush=True)
            if isinstance(run, TorchRanks):
                run.close()
        rows.append((batch_size, speed))

    print(f"\n| global batch | run | samples/s | vs single | vs torch DDP | samples/CPU-s | vs single | vs torch DDP |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch_size, speed in rows:
        for name, v in speed.items():
            label = name if name.startswith(("single", "torch")) else name.replace("ddp", f"ddp {args.devices} dev")
            cells = []
            for k in (0, 1):
                vs_torch = f"{v[k] / speed[torch_name][k]:.2f}x" if torch_name in speed else "-"
                cells.append(f"{v[k]:.0f} | {v[k] / speed[baseline[name]][k]:.2f}x | {vs_torch}")
            print(f"| {batch_size} | {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
