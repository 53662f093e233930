"""Where a GPT training step's time goes on a GPU: jaxpar's single-device step under variants, each profiled.

    python bench/gpt_profile.py                          # gpt2 124M, batch 16 x 1024, bf16 (a GPU)
    python bench/gpt_profile.py --model gpt-nano --seq-len 64 --batch-size 4 --rounds 1   # a dry run on a CPU

Variants, one change at a time from jaxpar's defaults (SingleDevice, bf16 compute, float32 master weights,
AdamW(6e-4, betas (0.9, 0.95), weight decay 0.1)):
  jaxpar                  per-sample objective (the model vmapped over rows), float32 bias adds and lookups
                          (jaxpar.precision.add_wide / take_wide), cuDNN attention
  per_sample=False        the loss over the whole batch at once
  + 16-bit bias/lookup    add_wide / take_wide replaced by the plain 16-bit add and lookup (their gradients then
                          sum in bf16, as JAX does by default)
  + XLA attention         GPTConfig(attention="xla") instead of cuDNN's fused kernel
  plain NNX step          no jaxpar: nnx.split, the weights cast to bf16, the mean cross-entropy, optax (the
                          ceiling jaxpar's own code sits under)
The runs alternate round by round; tokens/s is each run's best round. Then each run's steps are traced with
jax.profiler and its GPU kernels summed by kind (GEMMs, attention, the rest: XLA's fusions, copies), per step, and
"GPU busy" is the part of the time from the traced steps' first kernel to their last in which some kernel ran: the
rest is the device waiting on the host. The top kernels of the first run (jaxpar's default unless --variants
leaves it out) close the output.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = {  # kernel-name pattern -> kind; the first match wins
    "attention": r"sdpa|flash|fmha|attention|cudnn",
    "GEMM": r"gemm|nvjet|cutlass|xmma|cublas|sm\d+_.*(tst|mma)|triton_gemm|dot",
    "copy": r"memcpy|memset|copy",
}


VARIANTS = ("jaxpar (defaults)", "per_sample=False", "per_sample=False, 16-bit bias/lookup",
            "per_sample=False, XLA attention", "plain NNX step (no jaxpar)")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=None, help="default: 50304 for gpt2*, else 256")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trace-steps", type=int, default=3, help="steps traced per run (0: no profile)")
    p.add_argument("--top", type=int, default=12, help="kernels listed for jaxpar's default run")
    p.add_argument("--variants", default=None, help="comma-separated 1-based numbers of the variants to run "
                   "(default: all five, in the order above)")
    p.add_argument("--save-trace", default=None, help="a folder to copy the first run's trace into "
                   "(gpt_profile.xplane.pb: jax.profiler.ProfileData or TensorBoard's profile plugin reads it)")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.trace_steps < 0:
        p.error(f"--trace-steps {args.trace_steps} must be >= 0 (0: no profile)")
    picked = (args.variants or ",".join(str(i + 1) for i in range(len(VARIANTS)))).split(",")
    if not all(i.strip().isdigit() and 1 <= int(i) <= len(VARIANTS) for i in picked):
        p.error(f"--variants {args.variants!r}: give numbers from 1 to {len(VARIANTS)}, e.g. --variants 1,5")
    args.variants = [VARIANTS[int(i) - 1] for i in picked]
    return args


def trace_file(trace_dir: str) -> str:
    """The .xplane.pb that jax.profiler wrote under `trace_dir`."""
    return sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]


def kernel_table(trace_dir: str, steps: int) -> tuple[dict, list, float]:
    """({kind: ms per step}, [(kernel, ms per step, calls per step)] by time, GPU busy fraction) of a trace."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(trace_file(trace_dir))
    by_kind, by_name, spans = collections.Counter(), collections.Counter(), []
    calls = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # the streams' kernels; "XLA Ops" and others repeat them
                continue
            for ev in line.events:
                name = ev.name
                kind = next((k for k, pat in KINDS.items() if re.search(pat, name, re.I)), "other (fusions)")
                by_kind[kind] += ev.duration_ns
                by_name[name] += ev.duration_ns
                calls[name] += 1
                spans.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    if not spans:
        lines = sorted({f"{p.name}: {ln.name}" for p in data.planes if p.name.startswith("/device") for ln in p.lines})
        if lines:
            print("no kernels on lines named Stream*; the device planes' lines: " + "; ".join(lines)[:2000])
        return {}, [], float("nan")
    spans.sort()
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    busy += hi - lo
    wall = max(b for _, b in spans) - spans[0][0]
    per_step = lambda ns: ns / steps / 1e6  # noqa: E731
    top = [(n, per_step(t), calls[n] / steps) for n, t in by_name.most_common()]
    return {k: per_step(v) for k, v in by_kind.items()}, top, busy / wall


def profile(run, steps: int, save: str | None = None) -> tuple[dict, list, float]:
    """Trace `steps` steps of a warmed-up JaxparRun: kernel_table's (kind table, top kernels, GPU busy fraction);
    `save`: a path to copy the trace to."""
    import shutil

    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.block_until_ready(run.placed)
        jax.profiler.start_trace(d)
        for _ in range(steps):
            run.placed, metrics = run.strategy.step(run.placed, run.batch)
        jax.block_until_ready((run.placed, metrics))
        jax.profiler.stop_trace()
        if save:
            os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
            shutil.copy(trace_file(d), save)
        return kernel_table(d, steps)


def main(argv=None) -> None:
    args = parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpar
    from gpt import PlainStep
    from jaxpar import models
    from jaxpar.models import gpt
    from jaxpar.run import flops
    from rounds import JaxparRun

    vocab = args.vocab_size or (50304 if args.model.startswith("gpt2") else 256)
    build = lambda **kw: models.get(args.model, seed=0, vocab_size=vocab, block_size=args.seq_len,  # noqa: E731
                                    dropout=0.0, **kw)
    model = build()
    tokens = np.random.default_rng(0).integers(0, vocab, (args.batch_size, args.seq_len + 1), dtype=np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    state = jaxpar.init_state(model, tx)
    bf16, n = jnp.bfloat16, batch["x"].size
    plain_add, plain_take = (lambda x, b: x + b), (lambda table, ids: jnp.take(table, ids, axis=0))
    wide = (gpt.add_wide, gpt.take_wide)

    def narrow(on: bool) -> None:  # the models module looks them up when a step is traced
        gpt.add_wide, gpt.take_wide = (plain_add, plain_take) if on else wide

    def timed(step_maker) -> JaxparRun:  # compiled and warmed up; a step once compiled never looks at `narrow`
        return JaxparRun(step_maker, state, batch, args.steps, n)

    single = lambda m=model, **kw: jaxpar.SingleDevice(m, tx, compute_dtype=bf16, **kw)  # noqa: E731
    variants = {  # name -> (build the run, 16-bit adds)
        VARIANTS[0]: (lambda: timed(single()), False),
        VARIANTS[1]: (lambda: timed(single(per_sample=False)), False),
        VARIANTS[2]: (lambda: timed(single(per_sample=False)), True),
        VARIANTS[3]: (lambda: timed(single(build(attention="xla"), per_sample=False)), False),
        VARIANTS[4]: (lambda: timed(PlainStep(model, tx, compute_dtype=bf16)), True),
    }
    runs = {}
    for name in args.variants:
        make, sixteen = variants[name]
        narrow(sixteen)
        t = time.perf_counter()
        try:
            runs[name] = make()
            print(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s, first loss "
                  f"{runs[name].first_loss:.5f}", flush=True)
        except Exception as e:  # one variant's failure (an attention kernel this GPU lacks) is a row, not the end
            print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    narrow(False)
    rates = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, run in runs.items():
            rates[k].append(run.measure()[0])
    fpt = gpt.flops_per_token(model.config, args.seq_len)
    peak = flops.peak_tflops()
    print(f"\nGPT {args.model}: batch {args.batch_size} x {args.seq_len}, vocab {vocab}, bf16, jax {jax.__version__} "
          f"on {jax.devices()[0].device_kind}; {args.rounds} rounds x {args.steps} steps, alternating; "
          f"{fpt / 1e6:.1f} MFLOP/token; peak {peak} TFLOP/s")
    head = "| run | tokens/s | ms/step | MFU | GPU busy | GEMM ms | attention ms | other ms | copy ms |"
    print("\n" + head)
    print("|---|" + "---:|" * (head.count("|") - 2))
    first, top_first = next(iter(runs), None), []
    for k, run in runs.items():
        best = max(rates[k])
        mfu = f"{100 * best * fpt / 1e12 / peak:.1f} %" if peak else "-"
        cells = ["-"] * 5
        if args.trace_steps:
            save = os.path.join(args.save_trace, "gpt_profile.xplane.pb") if args.save_trace and k == first else None
            kinds, top, busy = profile(run, args.trace_steps, save)
            cells = [f"{100 * busy:.0f} %"] + [f"{kinds.get(c, 0.0):.2f}" for c in
                                               ("GEMM", "attention", "other (fusions)", "copy")]
            if k == first:
                top_first = top
        print(f"| {k} | {best:,.0f} | {n / best * 1e3:.2f} | {mfu} | " + " | ".join(cells) + " |")
    if top_first:
        print(f"\nTop kernels of '{first}' (ms per step, calls per step):")
        print("| kernel | ms | calls |\n|---|---:|---:|")
        for name, ms, calls in top_first[:args.top]:
            print(f"| {name[:110]} | {ms:.3f} | {calls:.0f} |")
    elif args.trace_steps:
        print("\n(no GPU kernels in the trace: a CPU run)")


if __name__ == "__main__":
    main()
