"""What torch's DistributedDataParallel does to BatchNorm, recorded: tests/fixtures/batchnorm_ddp.npz.

    /work/venv2/bin/python tests/make_torch_bn_fixture.py      # needs torch; the tests do not

A Linear(6, 16) -> BatchNorm1d(16) -> ReLU -> Linear(16, 3) classifier, trained 3 steps with SGD(0.1,
momentum 0.9) on a global batch of 12 rows: (a) by torch DDP (gloo, 2 processes, rows 0-5 on rank 0 and 6-11
on rank 1, broadcast_buffers=True, the default), and (b) on one process over all 12 rows. The fixture holds
the initial state dict (`init/<key>`), the batches (`x<step>`, `y<step>`), rank 0's state dict after DDP
(`ddp/<key>`: what `model.module.state_dict()` saves), rank 1's running buffers (`rank1/<key>`), and the
single-process result (`single/<key>`). DDP normalises each rank's rows with that rank's statistics, so (a)
and (b) differ; the running buffers are rank 0's, broadcast at each forward.
"""
from __future__ import annotations

import os
import sys

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "batchnorm_ddp.npz")
STEPS, ROWS, WORLD = 3, 12, 2


def model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def data():
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((ROWS, 6)).astype(np.float32) * (1 + s), rng.integers(0, 3, ROWS))
            for s in range(STEPS)]


def train(net, batches, rows: slice):
    """3 steps on `rows` of each batch: mean cross-entropy over the GLOBAL batch (DDP averages the ranks')."""
    import torch

    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x[rows])), torch.from_numpy(y[rows]))
        loss.backward()
        opt.step()


def worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = model()
    init = {k: v.clone() for k, v in net.state_dict().items()}
    ddp = torch.nn.parallel.DistributedDataParallel(net)  # broadcast_buffers=True
    per = ROWS // WORLD
    train(ddp, data(), slice(rank * per, (rank + 1) * per))
    np.savez(f"{out}.rank{rank}.npz", **{f"init/{k}": v.numpy() for k, v in init.items()},
             **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    dist.destroy_process_group()


def main() -> None:
    import subprocess
    import tempfile

    import torch

    tmp = tempfile.mkdtemp()
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), f"{tmp}/out"]) for r in range(WORLD)]
    assert all(p.wait() == 0 for p in procs)
    ranks = [dict(np.load(f"{tmp}/out.rank{r}.npz")) for r in range(WORLD)]
    init = {k[5:]: v for k, v in ranks[0].items() if k.startswith("init/")}
    net = model()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    train(net, data(), slice(None))
    fx = {f"init/{k}": v for k, v in init.items()}
    fx.update({f"ddp/{k}": v for k, v in ranks[0].items() if not k.startswith("init/")})
    fx.update({f"rank1/{k}": v for k, v in ranks[1].items() if k.startswith("1.running")})
    fx.update({f"single/{k}": v.detach().numpy() for k, v in net.state_dict().items()})
    for s, (x, y) in enumerate(data()):
        fx[f"x{s}"], fx[f"y{s}"] = x, y.astype(np.int32)
    np.savez_compressed(FIXTURE, **fx)
    print(f"{FIXTURE}: {os.path.getsize(FIXTURE) / 1e3:.1f} kB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]), sys.argv[3])
    else:
        main()
