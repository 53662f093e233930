"""All-reduce benchmark in the style of nccl-tests: every algorithm of jaxpar.comm.collectives on N devices.

    python bench/allreduce.py                                # 8 simulated CPU devices, 1, 4, 25 and 100 MB
    python bench/allreduce.py --devices 4 --sizes 1,10,100 --reps 20 --plot /tmp/busbw.png --jsonl ar.jsonl
    python bench/allreduce.py --no-alexnet --inplace         # skip the gradient part; donate the buffers
    python bench/allreduce.py --processes 2 --devices 4      # 2 processes x 4 CPU devices, collectives over gloo

Per size S (bytes per device, float32, rounded down to a multiple of N elements): median time over --reps
calls (the algorithms interleaved, so load on a shared machine hits them alike), min time, algbw = S / time
and busbw = algbw x 2(N-1)/N (nccl-tests: comparable across N; a ring's wire rate), and the bytes each device
sends in the compiled HLO; "err vs psum" is each result's max difference from lax.psum's on the same input,
relative to its largest value (float32 sums in another order: ~1e-7; a wrong algorithm: ~1). "floor" is the
bare ring traffic: 2(N-1) chained ppermutes of S/N, no adds and no output assembly; the ring can only add work
to it. Out-of-place by default; --inplace donates the input
(torch's all_reduce works in place on the bucket buffer, and so does the ring on a dead gradient bucket).

Then AlexNet-shaped gradients (torchvision AlexNet, num_classes=10: 16 leaves, 57M float32) reduced leaf by
leaf, in torch's 25 MB buckets, and as one flat buffer, with psum and with the ring (buffers donated, as in
a DDP step where the gradients are dead after the reduction).

With --processes P the bench starts itself P times through `jaxpar.launch` (jax.distributed, one coordinator);
each process holds --devices simulated CPU devices, the mesh spans all P x devices, and every transfer between
processes goes through XLA:CPU's cross-process collectives (gloo over loopback TCP). Process 0 prints.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# torchvision.models.alexnet(num_classes=10) parameter shapes, in forward order (torch layout).
ALEXNET_SHAPES = [
    ("features.0.weight", (64, 3, 11, 11)), ("features.0.bias", (64,)),
    ("features.3.weight", (192, 64, 5, 5)), ("features.3.bias", (192,)),
    ("features.6.weight", (384, 192, 3, 3)), ("features.6.bias", (384,)),
    ("features.8.weight", (256, 384, 3, 3)), ("features.8.bias", (256,)),
    ("features.10.weight", (256, 256, 3, 3)), ("features.10.bias", (256,)),
    ("classifier.1.weight", (4096, 9216)), ("classifier.1.bias", (4096,)),
    ("classifier.4.weight", (4096, 4096)), ("classifier.4.bias", (4096,)),
    ("classifier.6.weight", (10, 4096)), ("classifier.6.bias", (10,)),
]
MB = 10**6


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices per process")
    p.add_argument("--processes", type=int, default=1,
                   help="processes on this machine (via jaxpar.launch); the mesh has processes x devices")
    p.add_argument("--sizes", default="1,4,25,100", help="MB (10^6 bytes) per device, comma separated")
    p.add_argument("--algorithms", default="psum,ring,reduce_broadcast,all_to_all", help="comma separated")
    p.add_argument("--reps", type=int, default=10, help="timed calls per algorithm and size")
    p.add_argument("--inplace", action="store_true", help="donate the input buffer (nccl-tests' in-place)")
    p.add_argument("--alexnet", action=argparse.BooleanOptionalAction, default=True,
                   help="also time per-leaf vs bucketed reduction of AlexNet-shaped gradients")
    p.add_argument("--alexnet-reps", type=int, default=3, help="timed calls per AlexNet configuration")
    p.add_argument("--plot", default="/tmp/jaxpar_allreduce_busbw.png", help="PNG of busbw vs size ('' for none)")
    p.add_argument("--jsonl", default="", help="also write {algorithm, bytes, busbw, ...} JSON lines here")
    return p.parse_args(argv)


def simulate_devices(n: int) -> None:
    """N simulated CPU devices (jax_num_cpu_devices wins over an inherited XLA_FLAGS count): before JAX starts."""
    from jaxpar.mesh import simulate_cpu_devices

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    simulate_cpu_devices(n)


def relaunch(args: argparse.Namespace, argv: list[str]) -> int | None:
    """With --processes P > 1 outside a launched group: run this file under jaxpar.launch; its exit code."""
    from jaxpar.run import distributed

    if args.processes < 1:
        raise ValueError(f"--processes {args.processes} must be >= 1; use 1 for one process.")
    if args.processes == 1 or distributed.detect() is not None:
        return None
    import subprocess

    return subprocess.call([sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", str(args.processes),
                            os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    _args = parse()
    _code = relaunch(_args, sys.argv[1:])
    if _code is not None:
        sys.exit(_code)
    simulate_devices(_args.devices)  # before jax is imported

from jaxpar.run.hostmem import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as train.py does, before JAX allocates

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.comm import collectives as C  # noqa: E402
from jaxpar.comm import cost as K  # noqa: E402
from jaxpar.run import distributed  # noqa: E402
from jaxpar.comm.buckets import plan_buckets, reduce_buckets  # noqa: E402
from jaxpar.mesh import DATA  # noqa: E402


def say(*args, **kwargs) -> None:
    """print on process 0 only."""
    if jax.process_index() == 0:
        print(*args, **kwargs, flush=True)


def floor(x: jax.Array, axis_name: str) -> jax.Array:
    """The ring's communication alone: 2(N-1) chained ppermutes of one S/N chunk."""
    n = lax.axis_size(axis_name)
    y = x[: -(-x.size // n)]
    for _ in range(2 * (n - 1)):
        y = lax.ppermute(y, axis_name, [(j, (j + 1) % n) for j in range(n)])
    return y


def compile_fn(body, mesh: Mesh, spec, donate: bool):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA), out_specs=P(DATA)),
                 donate_argnums=0 if donate else ())
    return fn.lower(spec).compile()


@jax.jit
def fresh_copy(tree):
    """New buffers holding `tree`'s values: a donated input is consumed, so every call needs its own."""
    return jax.tree.map(lambda a: a + 0.0, tree)


def time_calls(fns: dict, make_input, reps: int, donate: bool) -> dict[str, list[float]]:
    """Seconds per call of each compiled fn, interleaved rep by rep after 2 warm-up calls each.

    A donated input is consumed by the call, so each call then gets a fresh one (made before the clock starts).
    """
    shared = None if donate else make_input()
    times = {k: [] for k in fns}
    for rep in range(reps + 2):
        for k, f in fns.items():
            x = jax.block_until_ready(make_input() if donate else shared)
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            if rep >= 2:
                times[k].append(time.perf_counter() - t)
    return times


@jax.jit
def relative_error(got: jax.Array, want: jax.Array) -> jax.Array:
    """max |got - want| / max |want| over all devices (nccl-tests' correctness check, as a number)."""
    return jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))


def check_results(fns: dict, mesh: Mesh, spec, make_input) -> dict[str, float]:
    """Each algorithm's output on one input against lax.psum's: a wrong algorithm shows before its speed."""
    psum = fns.get("psum") or compile_fn(lambda x: C.psum_all_reduce(x, DATA), mesh, spec, False)
    want = psum(make_input())  # every call gets a fresh input, so donating fns are fine here
    return {a: float(relative_error(f(make_input()), want)) for a, f in fns.items() if a != "floor"}


def bench_sizes(args, mesh: Mesh) -> list[dict]:
    n = mesh.size
    sharding = NamedSharding(mesh, P(DATA))
    records = []
    say(f"\nall-reduce on {n} devices in {jax.process_count()} process(es) ({jax.devices()[0].platform}), float32, "
          f"{'in-place' if args.inplace else 'out-of-place'}, median of {args.reps}")
    say(f"{'size':>10} {'algorithm':>17} {'time ms':>9} {'min ms':>8} {'algbw GB/s':>11} {'busbw GB/s':>11} "
          f"{'sent/dev MB':>12} {'model MB':>9} {'err vs psum':>12}")
    for mb in [float(s) for s in args.sizes.split(",")]:
        elems = max(n, int(mb * MB) // 4 // n * n)
        nbytes = 4 * elems
        spec = jax.ShapeDtypeStruct((n * elems,), jnp.float32, sharding=sharding)
        bodies = {a: (lambda x, a=a: C.ALGORITHMS[a](x, DATA)) for a in args.algorithms.split(",")}
        bodies["floor"] = lambda x: floor(x, DATA)
        fns = {a: compile_fn(b, mesh, spec, args.inplace) for a, b in bodies.items()}
        base = jax.jit(lambda: jax.random.normal(jax.random.key(0), (n * elems,)), out_shardings=sharding)()
        errors = check_results(fns, mesh, spec, lambda: fresh_copy(base))
        times = time_calls(fns, lambda: fresh_copy(base), args.reps, args.inplace)
        med = {a: float(np.median(t)) for a, t in times.items()}
        for a, t in times.items():
            algbw = nbytes / med[a] / 1e9
            sent = max(K.hlo_bytes_per_device(fns[a].as_text(), n))
            model = K.comm_cost("ring" if a == "floor" else a, n, nbytes, itemsize=4).master_sent
            say(f"{nbytes / MB:>8.2f}MB {a:>17} {med[a] * 1e3:>9.2f} {min(t) * 1e3:>8.2f} {algbw:>11.2f} "
                  f"{K.bus_bandwidth(algbw, n):>11.2f} {sent / MB:>12.2f} {model / MB:>9.2f} "
                  f"{f'{errors[a]:.1e}' if a in errors else '-':>12}")
            records.append({"algorithm": a, "bytes": nbytes, "busbw": K.bus_bandwidth(algbw, n), "algbw": algbw,
                            "time_s": med[a], "min_s": min(t), "devices": n, "inplace": args.inplace,
                            "error_vs_psum": errors.get(a)})
        for ref in ("floor", "psum"):
            if "ring" in med and ref in med:
                say(f"{'':>10} {'ring/' + ref:>17} {med['ring'] / med[ref]:>8.2f}x "
                      f"{min(times['ring']) / min(times[ref]):>7.2f}x")
    return records


def bench_alexnet(args, mesh: Mesh) -> None:
    n = mesh.size
    sharding = NamedSharding(mesh, P(DATA))
    names = [name for name, _ in ALEXNET_SHAPES]
    local = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in ALEXNET_SHAPES}
    flat_order = sorted(names)  # a dict flattens in key order, not in forward order
    order = [flat_order.index(name) for name in names]
    plans = {"per-leaf": plan_buckets(local, bucket_cap_mb=0, order=order),
             "25 MB buckets": plan_buckets(local, 25.0, order=order),
             "one buffer": plan_buckets(local, bucket_cap_mb=1e9, first_bucket_mb=1e9, order=order)}
    total = sum(4 * int(np.prod(s)) for _, s in ALEXNET_SHAPES)
    say(f"\nAlexNet(num_classes=10) gradients: {len(names)} leaves, {total / MB:.1f} MB per device, "
          f"{n} devices, buffers donated, median of {args.alexnet_reps}")
    say(plans["25 MB buckets"])
    specs = {k: jax.ShapeDtypeStruct((n * s.shape[0], *s.shape[1:]), s.dtype, sharding=sharding)
             for k, s in local.items()}
    fns = {}
    for alg in ("psum", "ring"):
        for label, plan in plans.items():
            def body(grads, plan=plan, alg=alg):
                return reduce_buckets(grads, plan, lambda flat: C.all_reduce(flat, DATA, alg))

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA), out_specs=P(DATA)), donate_argnums=0)
            fns[(alg, label)] = fn.lower(specs).compile()
    base = jax.jit(lambda: {k: jax.random.normal(jax.random.fold_in(jax.random.key(0), j), s.shape)
                            for j, (k, s) in enumerate(specs.items())}, out_shardings=sharding)()
    times = {k: [] for k in fns}
    for rep in range(args.alexnet_reps + 1):
        for k, f in fns.items():
            grads = jax.block_until_ready(fresh_copy(base))
            t = time.perf_counter()
            jax.block_until_ready(f(grads))
            if rep:
                times[k].append(time.perf_counter() - t)
    say(f"{'algorithm':>10} {'reduction':>14} {'buckets':>8} {'HLO ops':>8} {'time ms':>9} {'min ms':>8}")
    for (alg, label), t in times.items():
        ops = len({c.name for c in K.hlo_collectives(fns[(alg, label)].as_text())})
        say(f"{alg:>10} {label:>14} {len(plans[label]):>8} {ops:>8} {np.median(t) * 1e3:>9.1f} {min(t) * 1e3:>8.1f}")


def main(argv=None) -> list[dict]:
    args = parse(argv)
    simulate_devices(args.devices)
    distributed.initialize()  # a no-op unless started by jaxpar.launch (--processes)
    have = jax.local_device_count()
    if have < args.devices or (jax.process_count() > 1 and have != args.devices):
        raise ValueError(f"--devices {args.devices} but this process has {have} devices: JAX started before "
                         f"XLA_FLAGS was set; run this file as a script.")
    mesh = Mesh(np.array(jax.devices()[: args.devices * jax.process_count()]), (DATA,))
    records = bench_sizes(args, mesh)
    if args.jsonl and jax.process_index() == 0:
        import json

        with open(args.jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    if args.plot and jax.process_index() == 0:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot import plot_busbw  # bench/plot.py draws the same records

        say(f"\nwrote {plot_busbw(records, args.plot)}")
    if args.alexnet:
        bench_alexnet(args, mesh)
    return records


if __name__ == "__main__":
    main()
