"""Pipeline step time, bubble fraction and activation memory against the micro-batch count: GPipe, 1F1B and
interleaved 1F1B, side by side with single-device training of the same model on the same global batch.

    python bench/pipeline.py                                   # 16-layer MLP stack, 4 stages on 4 simulated CPU devices
    python bench/pipeline.py --model convnet --stages 2 --batch 64 --micro-batches 1,2,4,8
    python bench/pipeline.py --devices 0 --stages 4            # the real devices (GPU)

Per run: the strategy's own step (put_batch once, 2 compiling / warm-up steps, then --steps timed steps; the
best of --repeats, since the machine may be shared). bubble: idle slots of the schedule's grid (GPipe and 1F1B:
(S-1)/(M+S-1)). act slots: stage inputs held at once, MEASURED in the program (stage 0 | the most on any stage);
act MB: the activation buffers a stage allocates (input slots + gradient slots, x micro-batch x widest boundary).
Simulated CPU devices share the host's cores, so stage parallelism cannot show as speed there: read the step
times as the cost of the schedule's extra ticks and of recomputation, and the memory columns as what they are.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--devices", type=int, default=4, help="simulated CPU devices (0: use the real ones)")
p.add_argument("--model", default="stack", help="stack (16 x Linear(512)+ReLU) | mlp | convnet | alexnet")
p.add_argument("--stages", type=int, default=4)
p.add_argument("--batch", type=int, default=64, help="global batch")
p.add_argument("--micro-batches", default="1,2,4,8,16", help="comma separated")
p.add_argument("--schedules", default="gpipe,1f1b,interleaved", help="comma separated")
p.add_argument("--virtual-stages", type=int, default=2, help="chunks per stage for interleaved")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--repeats", type=int, default=2)
args = p.parse_args()

if args.devices:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import models  # noqa: E402
from jaxpar.pipeline import schedule as schedule_lib  # noqa: E402
from jaxpar.strategies.pipeline import Pipeline, PipelineModule, pipeline_mesh  # noqa: E402
from jaxpar.step import init_state, make_train_step  # noqa: E402
from jaxpar.models.layers import Linear, ReLU  # noqa: E402
from jaxpar.models.nets import Layered  # noqa: E402


class Stack(Layered):
    """A deep, evenly balanced MLP: the shape pipelines are made for."""

    def __init__(self, width=512, depth=16, classes=10, *, rngs):
        self.fcs = nnx.List([Linear(width, width if i < depth - 1 else classes, rngs=rngs) for i in range(depth)])

    @property
    def layers(self):
        return tuple(x for fc in self.fcs for x in (fc, ReLU()))[:-1]


def problem():
    if args.model == "stack":
        model, shape = Stack(rngs=nnx.Rngs(0)), (512,)
    else:
        shape = models.input_shape(args.model)
        kw = {"in_features": shape[0]} if args.model == "mlp" else {"num_classes": 10}
        model = models.get(args.model, **kw)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(args.batch, *shape)).astype(np.float32),
             "y": rng.integers(0, 10, args.batch).astype(np.int32), "idx": np.arange(args.batch, dtype=np.int32)}
    return model, optax.adam(1e-3), batch


def timed(step, state, batch) -> float:
    """Best-of-repeats seconds per step, after 2 warm-up (compiling) steps."""
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    best = float("inf")
    for _ in range(args.repeats):
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t)
        best = min(best, statistics.median(times))
    return best


def main():
    model, tx, batch = problem()
    graphdef, state = init_state(model, tx)
    single = timed(make_train_step(graphdef, tx), jax.device_put(state, jax.devices()[0]), batch)
    S = args.stages
    print(f"{args.model}: {sum(a.size for a in jax.tree.leaves(state.params)):,} params, global batch {args.batch}, "
          f"{S} stages on {S} of {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"single device {single * 1e3:.1f} ms/step")
    head = (f"{'schedule':<12} {'M':>3} {'V':>2} {'ticks':>5} {'bubble':>7} {'ms/step':>8} {'vs single':>9} "
            f"{'samples/s':>9} {'act slots':>10} {'act MB':>7}")
    print(head + "\n" + "-" * len(head))
    for name in args.schedules.split(","):
        V = args.virtual_stages if name == "interleaved" else 1
        for M in [int(m) for m in args.micro_batches.split(",")]:
            if args.batch % M:
                continue
            pm = PipelineModule.from_model(model, S, virtual_stages=V, verbose=False,
                                           partition_method="uniform" if V > 1 else "parameters")
            strategy = Pipeline(pm, tx, mesh=pipeline_mesh(S, S), schedule=name, micro_batches=M)
            placed, pb = strategy.init(state), strategy.put_batch(batch)
            t = timed(strategy.step, placed, pb)
            r = strategy.report()
            live = r["measured_live_activations"]
            print(f"{name:<12} {M:>3} {V:>2} {r['ticks']:>5} {r['bubble_fraction']:>7.3f} {t * 1e3:>8.1f} "
                  f"{t / single:>8.2f}x {args.batch / t:>9.0f} {f'{live[0]} | {max(live)}':>10} "
                  f"{r['activation_bytes_per_stage'] / 2**20:>7.2f}")
            assert name == "interleaved" or abs(r["bubble_fraction"] - (S - 1) / (M + S - 1)) < 1e-12
    print("bubble (S-1)/(M+S-1) for gpipe/1f1b; 1F1B holds min(S, M) micro-batches on stage 0, GPipe M "
          f"({schedule_lib.peak_inflight(schedule_lib.one_f_one_b(S, 8))[0]} vs 8 at M = 8).")


if __name__ == "__main__":
    main()
