"""The torch side of bench/pipeline.py: AlexNet as PyTorch lays it out (the same 22 layers as jaxpar.models.AlexNet,
split at the same layer) or the Linear stack, torch.distributed.pipelining's Schedule1F1B / ScheduleGPipe /
ScheduleInterleavedZeroBubble over gloo, one process per stage, and torch's own single-process step. Workers take
their rounds from control files (bench/pipeline.py)."""
from __future__ import annotations

import json
import os
import time


def alexnet(num_classes: int = 10):
    """torchvision's AlexNet as one nn.Sequential (features, avgpool, flatten, classifier): 22 layers."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, 1, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, 1, 1), nn.ReLU(), nn.Conv2d(384, 256, 3, 1, 1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(3, 2), nn.AdaptiveAvgPool2d(6), nn.Flatten(),
        nn.Dropout(0.5), nn.Linear(256 * 36, 4096), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, num_classes))


def stack(width: int = 512, depth: int = 16, classes: int = 10):
    """bench/pipeline.py's stack_model in torch: 16 x Linear(512) with ReLU between (31 layers)."""
    import torch.nn as nn

    layers = []
    for i in range(depth):
        layers += [nn.Linear(width, width if i < depth - 1 else classes)] + ([nn.ReLU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def problem(args: dict):
    """(model, x, y) of args["model"]: AlexNet on args["image"]-sized images, or the stack on 512 features."""
    import torch

    model = stack() if args["model"] == "stack" else alexnet()
    shape = (args["batch"], 512) if args["model"] == "stack" else (args["batch"], 3, args["image"], args["image"])
    return model, torch.randn(*shape), torch.randint(0, 10, (args["batch"],))


def wait_for(path: str, stop: str | None = None, poll: float = 0.002) -> str:
    """The text of file `path` once it exists ("stop" if the file `stop` appears first)."""
    while not os.path.exists(path):
        if stop is not None and os.path.exists(stop):
            return "stop"
        time.sleep(poll)
    with open(path) as f:
        return f.read()


def write(path: str, text: str) -> None:
    """Write a control file atomically (a reader never sees it half written)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def rounds(ctl: str, group: str, rank: int, run_round) -> None:
    """Serve rounds: wait for go.<group>.<k> (its text names the run), time it, write done.<group>.<k>.rank<r>."""
    write(os.path.join(ctl, f"ready.{group}.rank{rank}"), "ok")
    k = 0
    while True:
        name = wait_for(os.path.join(ctl, f"go.{group}.{k}"), os.path.join(ctl, "stop"))
        if name == "stop":
            return
        wall, cpu = run_round(name)
        write(os.path.join(ctl, f"done.{group}.{k}.rank{rank}"), json.dumps({"wall": wall, "cpu": cpu}))
        k += 1


def pipeline_worker(rank: int, world: int, port: int, ctl: str, args: dict) -> None:
    """One torch stage: its layers of AlexNet, each schedule built once, rounds of `steps` steps."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble)

    if args["pin"]:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(args["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    lo, hi = args["bounds"][rank], args["bounds"][rank + 1]
    model, x, y = problem(args)
    module = nn.Sequential(*list(model)[lo:hi])
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    stages = {}
    for name in args["schedules"]:
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        if name == "zbh1":  # ZB1P of the zero-bubble paper (= ZB-H1), torch's only form for one stage a rank
            stages[name] = ScheduleInterleavedZeroBubble([stage], n_microbatches=args["micro_batches"],
                                                         loss_fn=F.cross_entropy)
        else:
            kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
            stages[name] = kinds[name](stage, n_microbatches=args["micro_batches"], loss_fn=F.cross_entropy)

    def step(schedule):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()

    for schedule in stages.values():  # warm-up: shapes inferred, buffers allocated
        for _ in range(2):
            step(schedule)

    def run_round(name):
        dist.barrier()
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(args["steps"]):
            step(stages[name])
        dist.barrier()
        return time.perf_counter() - t, time.process_time() - cpu

    rounds(ctl, "torch", rank, run_round)
    dist.destroy_process_group()


def single_worker(rank: int, ctl: str, args: dict) -> None:
    """torch's own single-process step on the whole model."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args["single_threads"])
    torch.manual_seed(0)
    model, x, y = problem(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()

    def run_round(name):
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(args["steps"]):
            step()
        return time.perf_counter() - t, time.process_time() - cpu

    rounds(ctl, "torch-single", 0, run_round)


def start(ctl: str, args: dict, world: int = 2):
    """Spawn the torch stage processes and the single-process one; returns the process contexts."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = str(args["threads"])
    pipe = mp.start_processes(pipeline_worker, args=(world, port, ctl, args), nprocs=world, join=False,
                              start_method="spawn")
    single = mp.start_processes(single_worker, args=(ctl, args), nprocs=1, join=False, start_method="spawn")
    return pipe, single
