"""The two sides of a side-by-side benchmark, each timed one round at a time so rounds can alternate.

    runs = {"jaxpar": JaxparRun(strategy, state, batch, steps, units=batch_rows),
            "torch": TorchRanks(worker, world, (batch, steps), units=batch_rows * steps)}
    rate, per_cpu_s = runs[name].measure()      # units per second, units per CPU-second (every thread, every rank)

`units` are what the table counts (samples, tokens). A torch worker is called as
worker(rank, world, port, *args, commands, out): it warms up (with ``ready=True`` it then puts one message on
`out`), and for each True from commands[rank] runs one timed round and puts (rank, wall s, CPU s); None ends it.
"""
from __future__ import annotations

import os
import time

from jaxpar.launch import free_port


class TorchRanks:
    """PyTorch ranks spawned once and kept alive between timed rounds, so rounds can alternate with jaxpar's."""

    def __init__(self, worker, world: int, args: tuple, units: float, threads: int = 1, ready: bool = False):
        import torch.multiprocessing as mp

        os.environ["OMP_NUM_THREADS"] = str(threads)
        ctx = mp.get_context("spawn")
        self.commands, self.out = [ctx.Queue() for _ in range(world)], ctx.Queue()
        self.world, self.units = world, units
        self.procs = mp.start_processes(worker, args=(world, free_port(), *args, self.commands, self.out),
                                        nprocs=world, join=False, start_method="spawn")
        self.ready = [self.out.get() for _ in range(world)] if ready else []

    def measure(self) -> tuple[float, float]:
        """(units/s over the slowest rank's wall time, units per CPU-second of all ranks) of one round."""
        for q in self.commands:
            q.put(True)
        runs = [self.out.get() for _ in range(self.world)]
        return self.units / max(w for _, w, _ in runs), self.units / sum(c for _, _, c in runs)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        self.procs.join()


class JaxparRun:
    """A strategy compiled and warmed up on one placed batch (2 untimed steps; `first_loss` the first's loss);
    `measure()` times one round of `steps` steps."""

    def __init__(self, strategy, state, batch: dict, steps: int, units: float):
        import jax

        self.strategy, self.steps, self.units = strategy, steps, units * steps
        self.placed, self.batch = strategy.init(state), strategy.put_batch(batch)
        self.placed, metrics = strategy.step(self.placed, self.batch)
        self.first_loss = float(metrics["loss"])
        self.placed, metrics = strategy.step(self.placed, self.batch)
        jax.block_until_ready((self.placed, metrics))

    def measure(self) -> tuple[float, float]:
        """(units/s, units per CPU-second of this process) of one round."""
        import jax

        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(self.steps):
            self.placed, metrics = self.strategy.step(self.placed, self.batch)
        jax.block_until_ready((self.placed, metrics))
        return self.units / (time.perf_counter() - t), self.units / (time.process_time() - cpu)
