"""DataParallel vs DistributedDataParallel vs one device: samples/s and bytes per device, in one run.

    python bench/dp_vs_ddp.py                                   # 8 simulated CPU devices, mlp, global batch 256
    python bench/dp_vs_ddp.py --model convnet --batch 128 --steps 10 --out runs/dp_vs_ddp.png
    python bench/dp_vs_ddp.py --devices 0                       # the real devices (GPU), no simulation

Every strategy trains the same model from the same state on the same global batches; batches are placed ahead
(`put_batch`, as the Loader's background thread does), so the clock covers `step` only, after a warm-up that
compiles. The tutorials' claim to check: DDP (one SPMD program, gradients all-reduced in place) beats
DataParallel (a master that scatters, replicates, gathers and reduces every step from Python).
Memory: DataParallel's bytes per device at its step's peak (`DataParallel.report`); DDP's after its step.
"""
from __future__ import annotations

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: use the real ones)")
p.add_argument("--model", default="mlp", help="models.get name: linear | mlp | convnet | alexnet")
p.add_argument("--batch", type=int, default=256, help="the global batch, the same for every strategy")
p.add_argument("--steps", type=int, default=10, help="steps per timed window")
p.add_argument("--rounds", type=int, default=7, help="timed windows per strategy, taken in turn; the median counts")
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--optimizer", default="sgd")
p.add_argument("--wide-classes", type=int, default=10_000, help="outputs of the wide linear model (memory only)")
p.add_argument("--out", default="runs/dp_vs_ddp.png", help="PNG bar chart")
args = p.parse_args()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxpar.mesh import simulate_cpu_devices  # noqa: E402
from jaxpar.run.hostmem import tune_host_allocator  # noqa: E402

if args.devices:  # before JAX starts: the simulated device count is fixed at backend start-up
    simulate_cpu_devices(args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import models  # noqa: E402
from jaxpar.run import memory  # noqa: E402
from jaxpar.config import Config  # noqa: E402
from jaxpar.optim import make_optimizer  # noqa: E402
from jaxpar.step import init_state  # noqa: E402
from jaxpar.strategies.base import get_builder  # noqa: E402


def make_batches(k: int, batch: int, shape: tuple, classes: int = 10) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(batch, *shape)).astype(np.float32),
             "y": rng.integers(0, classes, batch).astype(np.int32),
             "idx": np.arange(i * batch, (i + 1) * batch, dtype=np.int32)} for i in range(k)]


class Timed:
    """One strategy, placed and warmed up; `window(steps)` times that many steps and returns samples/s."""

    def __init__(self, strategy, state, host_batches, warmup: int):
        self.strategy, self.rows = strategy, len(host_batches[0]["y"])
        self.placed = strategy.init(state)
        self.ready = [strategy.put_batch(b) for b in host_batches]  # placed ahead, as the Loader does
        self.i = 0
        self.run(warmup)  # compiles

    def run(self, steps: int):
        for _ in range(steps):
            self.placed, m = self.strategy.step(self.placed, self.ready[self.i % len(self.ready)])
            self.i += 1
        jax.block_until_ready((self.placed, m))

    def window(self, steps: int) -> float:
        t = time.perf_counter()
        self.run(steps)
        return steps * self.rows / (time.perf_counter() - t)


def held_bytes(strategy, state, batch, devices) -> dict:
    """Bytes per device the strategy holds: DataParallel at its step's peak (`measure`), others after a step;
    `delta_bytes` counts from before the strategy placed anything (the host-side state stays outside)."""
    base = memory.baseline(devices)
    placed, pb = strategy.init(state), strategy.put_batch(batch)
    placed, metrics = strategy.step(placed, pb)  # compiled already: this one only settles the layout
    if hasattr(strategy, "measure"):
        out = strategy.measure(placed, pb)
        peak = {d: r["live_bytes"] for d, r in zip(devices, out["memory"])}
        out["memory"] = memory.memory_report(devices, peak, base)
        return out
    jax.block_until_ready((placed, metrics))
    return {"memory": memory.memory_report(devices, base=base)}


def plot(path: str, speed: dict, mem: dict, devices: list) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = list(speed)
    ax1.bar(names, [speed[n] for n in names], color=["#888", "#d62728", "#ff7f0e", "#1f77b4", "#17becf"][:len(names)])
    ax1.tick_params(axis="x", labelrotation=20)
    ax1.set_ylabel("samples / s")
    ax1.set_title(f"{args.model}, global batch {args.batch}, {len(devices)} devices")
    width = 0.8 / max(len(mem), 1)
    for j, (name, rows) in enumerate(mem.items()):
        xs = np.arange(len(rows)) + j * width
        ax2.bar(xs, [r["delta_bytes"] / 2**20 for r in rows], width, label=name)
    ax2.set_xticks(np.arange(len(devices)) + width * (len(mem) - 1) / 2, [str(d.id) for d in devices])
    ax2.set_xlabel("device")
    ax2.set_ylabel("MiB held (DP: at the step's peak)")
    ax2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    devices = jax.devices()
    shape = models.input_shape(args.model)
    model = models.get(args.model, seed=0)
    tx = make_optimizer(args.optimizer, 0.01)
    state = init_state(model, tx)
    host = make_batches(4, args.batch, shape)
    cfg = Config(model=args.model, batch_size=args.batch, optimizer=args.optimizer)
    print(f"{args.model}: global batch {args.batch}, {len(devices)} {devices[0].platform} devices, "
          f"median of {args.rounds} windows of {args.steps} steps, after {args.warmup} warm-up steps")

    runs = {"single": cfg.replace(strategy="single"), "dp": cfg.replace(strategy="dp"),
            "dp loss_on_device": cfg.replace(strategy="dp", loss_on_device=True), "ddp": cfg.replace(strategy="ddp"),
            "ddp overlap=off": cfg.replace(strategy="ddp", overlap=False)}
    timed, speed, mem = {}, {}, {}
    for name, c in runs.items():
        try:
            timed[name] = Timed(get_builder(c.strategy)(model, tx, c), state, host, args.warmup)
        except ImportError as e:  # a strategy module not there yet
            print(f"{name:<18} skipped: {e}")
    windows = {name: [] for name in timed}
    for _ in range(args.rounds):  # in turn, so a busy moment on a shared machine hits every strategy alike
        for name, t in timed.items():
            windows[name].append(t.window(args.steps))
    for name, t in timed.items():
        speed[name] = float(np.median(windows[name]))
        print(f"{name:<18} {speed[name]:10.1f} samples/s  (windows {min(windows[name]):.0f}..{max(windows[name]):.0f})"
              f"   {t.strategy.describe()}")
    del timed
    for name in ("dp", "dp loss_on_device", "ddp"):  # memory: one strategy's arrays alive at a time
        if name in speed:
            mem[name] = held_bytes(get_builder(runs[name].strategy)(model, tx, runs[name]), state, host[0], devices)

    print()
    base = speed.get("dp")
    for name, s in speed.items():
        ratios = [f"x{s / speed[ref]:.2f} vs {ref}" for ref in ("dp", "single") if ref in speed and ref != name]
        print(f"{name:<18} {s:10.1f} samples/s   {', '.join(ratios)}")
    print()
    for name in (n for n in speed if n.startswith("ddp") and base):
        verdict = "faster" if speed[name] > base else "NOT faster"
        print(f"{name} is {verdict} than DataParallel: x{speed[name] / base:.2f} samples/s")

    for name, m in mem.items():
        note = f"; master {m['master_extra']}" if "master_extra" in m else ""
        print(f"\n{name}: bytes per device" + (" at the step's peak" if note else " after its step") + note)
        print(memory.format_table(m["memory"]))

    # a wide output (the tutorial's LinearModel with many classes): where loss_on_device pays off
    wide, wide_cfg = models.get("linear", seed=0, output_size=args.wide_classes), cfg.replace(strategy="dp")
    wide_state = init_state(wide, tx)
    wide_batch = make_batches(1, args.batch, (5,), args.wide_classes)[0]
    print(f"\nlinear 5 -> {args.wide_classes} (wide output), global batch {args.batch}: the master's extra bytes")
    for lod in (False, True):
        dp = get_builder("dp")(wide, tx, wide_cfg.replace(loss_on_device=lod))
        extra = held_bytes(dp, wide_state, wide_batch, devices)["master_extra"]
        print(f"  dp{' loss_on_device' if lod else '':<16} master {extra}")
    plot(args.out, speed, {k: m["memory"] for k, m in mem.items()}, devices)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
