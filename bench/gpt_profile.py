"""Where a GPT training step's time goes on a GPU: jaxpar's single-device step under variants, each profiled.

    python bench/gpt_profile.py                          # gpt2 124M, batch 16 x 1024, bf16 (a GPU)
    python bench/gpt_profile.py --model gpt-nano --seq-len 64 --batch-size 4 --rounds 1   # a dry run on a CPU
    python bench/gpt_profile.py --xla-flag-sets default  # jaxpar's default step under XLA flag sets (FLAG_SETS)
    python bench/gpt_profile.py --xla-flag-sets="--xla_gpu_enable_triton_gemm=false;--xla_gpu_autotune_level=0"

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
  qkv as three products   the defaults, but q, k and v as three products x @ c_attn.kernel[:, i C:(i + 1) C] plus
                          the bias's slice instead of one product split in three (the same parameters and dtypes:
                          no [B, T, 3C] output to split, and the gradients concatenated are the kernel's, C x 3C)
  GELU by autodiff        the defaults, but the MLP's bias add and GELU as jaxpar had them before bias_gelu: the
                          bias added in float32 (add_wide), then jax.nn.gelu differentiated by JAX (its tanh kept for
                          the backward, so no cuBLASLt epilogue takes the GELU)
The runs alternate round by round; tokens/s is each run's best round. Then each run's steps are traced with
jax.profiler and its GPU kernels summed by kind (GEMMs, attention, the rest: XLA's fusions, copies), per step, and
"GPU busy" is the part of the time from the traced steps' first kernel to their last in which some kernel ran: the
rest is the device waiting on the host. The top kernels of the first run (jaxpar's default unless --variants
leaves it out) close the output.

--xla-flag-sets="A;B" (sets of space-separated XLA flags, after "=" since they start with "--"; `default`: FLAG_SETS)
runs jaxpar's default step once per set, and once without one (the baseline), each in its own process (XLA reads
XLA_FLAGS once, when its backend starts) with XLA_FLAGS the environment's plus the set. The sets run in turn, the
baseline first, --rounds times over (one round of --steps each; later passes load their programs from a compilation
cache), and one table compares them: best tokens/s, the kernels by kind of the first pass, or why a set failed (a
flag this jaxlib lacks aborts its process). --time-limit ends the sweep in time, the sets not reached said so.
--sweep-variant N runs variant N instead of the defaults under every set (flags on top of a variant).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = {  # kernel-name pattern -> kind; the first match wins
    "attention": r"sdpa|flash|fmha|attention|cudnn(?!.*(norm|gemm))",  # cuDNN's, less its norms' and GEMMs' (flags)
    "GEMM": r"gemm|nvjet|cutlass|xmma|cublas|sm\d+_.*(tst|mma)|triton_gemm|dot",
    "copy": r"memcpy|memset|copy",
}
KIND_COLUMNS = ("GEMM", "attention", "other (fusions)", "copy")  # the tables' columns, in ms per step


VARIANTS = ("jaxpar (defaults)", "per_sample=False", "per_sample=False, 16-bit bias/lookup",
            "per_sample=False, XLA attention", "plain NNX step (no jaxpar)", "jaxpar, qkv as three products",
            "jaxpar, GELU by autodiff")

FLAG_SETS = (  # --xla-flag-sets default: XLA:GPU settings that change how the step's fusions and GEMMs are made
    "--xla_gpu_enable_cudnn_layer_norm=true",  # LayerNorms as cuDNN's norm kernels, not XLA's reduction fusions
    "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",  # every fusion through Triton's tiled emitter
    "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",  # fusion forms Triton fusions first
    "--xla_gpu_cudnn_gemm_fusion_level=2",  # cuDNN GEMMs that take their neighbours (bias adds, ...) in (default 0)
    "--xla_gpu_enable_triton_gemm=false",  # every GEMM through cuBLAS, none as a Triton fusion
    "--xla_gpu_exhaustive_tiling_search=true",  # Triton GEMMs' tilings all autotuned (a longer compile: last)
)


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
                   "(default: all, in the order above)")
    p.add_argument("--save-trace", default=None, help="a folder to copy the first run's trace into "
                   "(gpt_profile.xplane.pb: jax.profiler.ProfileData or TensorBoard's profile plugin reads it)")
    p.add_argument("--json", default=None, help="also write each run's numbers to this file (the flag sweep's "
                   "processes report that way)")
    p.add_argument("--xla-flag-sets", default=None, help="';'-separated sets of XLA flags, or 'default' (FLAG_SETS): "
                   "jaxpar's default step under each, in its own process, against the baseline without; write "
                   "--xla-flag-sets='--xla_...' (with '=': a value starting with -- reads as an option)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole flag sweep: a process "
                   "still running then is stopped, the sets not reached are reported so")
    p.add_argument("--sweep-variant", type=int, default=None, help="the variant (1-based, as --variants) the flag "
                   "sweep runs under every set (default 1: jaxpar's defaults), to try flags on top of a variant")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.trace_steps < 0:
        p.error(f"--trace-steps {args.trace_steps} must be >= 0 (0: no profile)")
    if args.xla_flag_sets is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("variants", "save_trace", "json") if getattr(args, k)]
        if given:
            p.error(f"--xla-flag-sets runs jaxpar's default step alone, untraced to disk: drop {' and '.join(given)}")
        sets = FLAG_SETS if args.xla_flag_sets.strip() == "default" else \
            [s.strip() for s in args.xla_flag_sets.split(";") if s.strip()]
        if not sets or not all(f.startswith("--xla_") for s in sets for f in s.split()):
            p.error(f"--xla-flag-sets {args.xla_flag_sets!r}: give sets of --xla_* flags separated by ';', e.g. "
                    "'--xla_gpu_enable_cudnn_layer_norm=true;--xla_gpu_enable_triton_gemm=false', or 'default'")
        args.xla_flag_sets = list(sets)
    elif args.time_limit is not None or args.sweep_variant is not None:
        given = "--time-limit" if args.time_limit is not None else "--sweep-variant"
        p.error(f"{given} belongs to the flag sweep: give --xla-flag-sets too")
    if args.sweep_variant is not None and not 1 <= args.sweep_variant <= len(VARIANTS):
        p.error(f"--sweep-variant {args.sweep_variant}: give a number from 1 to {len(VARIANTS)} (see --variants)")
    if args.time_limit is not None and args.time_limit <= 0:
        p.error(f"--time-limit {args.time_limit} must be > 0 (seconds)")
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


def mlp_autodiff_gelu(mlp, x):
    """MLP.__call__ for the variant "GELU by autodiff": c_fc (its bias added by add_wide), then jax.nn.gelu, whose
    backward JAX derives (jaxpar's MLP before models.gpt_ops.bias_gelu)."""
    import jax

    return mlp.dropout(mlp.c_proj(jax.nn.gelu(mlp.c_fc(x), approximate=mlp.approximate)))


def qkv_three_products(attn, x_BxTxC):
    """CausalSelfAttention.qkv (the variant "qkv as three products" puts it there): q, k and v as three products
    x @ c_attn.kernel[:, i C:(i + 1) C] plus the bias's slice, each [B, T, heads, head size], in place of one product
    split in three. c_attn's own parameters, dtype promotion and bias add (float32 under 16-bit compute, as
    models.gpt.Linear adds it): only the product is split. (XLA:GPU's dot merger joins products of one input again
    below 32 MB of operands and output each, xla_gpu_dot_merger_threshold_mb: GPT-2 at 16 x 1024 has 52 MB.)"""
    from jaxpar.models import gpt

    lin, (b, t, c) = attn.c_attn, x_BxTxC.shape
    x, kernel, bias = lin.promote_dtype((x_BxTxC, lin.kernel[...], None if lin.bias is None else lin.bias[...]),
                                        dtype=lin.dtype)
    kw = {} if lin.preferred_element_type is None else {"preferred_element_type": lin.preferred_element_type}
    out = []
    for cols in (slice(0, c), slice(c, 2 * c), slice(2 * c, 3 * c)):
        y = lin.dot_general(x, kernel[:, cols], (((x.ndim - 1,), (0,)), ((), ())), precision=lin.precision, **kw)
        y = y if bias is None else gpt.add_wide(y, bias[cols])
        out.append(y.reshape(b, t, attn.n_head, c // attn.n_head))
    return tuple(out)


def failure(rc: int, output: str) -> str:
    """Why a flag sweep's process gave no result, in one line, from its exit status and its output."""
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", output)  # XLA's abort when it starts its backend
    if unknown:
        return f"FAILED: unknown flag on this jaxlib: {unknown.group(1).strip()}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = ([line for line in lines if ": FAILED: " in line] or lines or ["no output"])[-1]
    return f"FAILED (exit status {rc}): {last[:200]}"


def sweep(args: argparse.Namespace) -> None:
    """--xla-flag-sets: this script again for each set and pass (jaxpar's default step, one round), XLA_FLAGS the
    environment's plus the set; then one table. It imports no JAX itself, so the processes have the GPU alone."""
    base, sets = os.environ.get("XLA_FLAGS", ""), ["", *args.xla_flag_sets]
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    runs, reasons, took = {s: [] for s in sets}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", tmp),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # later passes load their programs
        for r in range(args.rounds):
            for i, flags in enumerate(sets):
                left = None if deadline is None else deadline - time.monotonic()
                if flags in reasons or left is not None and (left <= 0 or r and left < took[flags]):
                    continue  # failed before (it would again), or no time for it
                out = os.path.join(tmp, f"run{r}-{i}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--batch-size",
                       str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--rounds",
                       "1", "--trace-steps", str(args.trace_steps if r == 0 else 0), "--top", "0", "--variants",
                       str(args.sweep_variant or 1),
                       "--json", out] + (["--vocab-size", str(args.vocab_size)] if args.vocab_size else [])
                t, result = time.monotonic(), {"runs": []}
                try:
                    proc = subprocess.run(cmd, env={**env, "XLA_FLAGS": f"{base} {flags}".strip()}, timeout=left,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    if proc.returncode == 0 and os.path.exists(out):
                        with open(out) as f:
                            result = json.load(f)
                    why = None if result["runs"] else failure(proc.returncode, proc.stdout)
                except subprocess.TimeoutExpired:
                    why = f"TIMED OUT after {time.monotonic() - t:.0f} s (--time-limit)"
                took[flags] = time.monotonic() - t
                name = flags or "baseline (no flags added)"
                if why:
                    reasons[flags] = why
                    print(f"pass {r + 1}, {name}: {why}", flush=True)
                    continue
                runs[flags].append({**result["header"], **result["runs"][0]})
                print(f"pass {r + 1}, {name}: {runs[flags][-1]['tokens_per_s']:,.0f} tokens/s "
                      f"({took[flags]:.0f} s)", flush=True)
    head = next((rs[0] for rs in runs.values() if rs), None)
    print(f"\nXLA flag sets: GPT {args.model}, batch {args.batch_size} x {args.seq_len}, bf16, "
          f"{head['run'] if head else VARIANTS[(args.sweep_variant or 1) - 1]}"
          + (f", jax {head['jax']} on {head['device']}" if head else "") + f"; XLA_FLAGS {base or '(unset)'} plus each "
          f"set; best of up to {args.rounds} passes x {args.steps} steps, the sets in turn; kernels of the first pass")
    cols = ("| XLA flags added | tokens/s | vs baseline | ms/step | MFU | GPU busy | GEMM ms | attention ms "
            "| other ms | copy ms | passes | first loss |")
    print("\n" + cols + "\n|---|" + "---:|" * (cols.count("|") - 2))
    best = {s: max(rs, key=lambda run: run["tokens_per_s"]) for s, rs in runs.items() if rs}
    for flags in sets:
        name = flags or "(none: the baseline)"
        if flags not in best:
            why = reasons.get(flags, "not run: no time left (--time-limit)")
            print(f"| {name} | {why} |" + " - |" * (cols.count("|") - 3))
            continue
        run, first = best[flags], runs[flags][0]
        vs = f"{100 * (run['tokens_per_s'] / best['']['tokens_per_s'] - 1):+.1f} %" if "" in best else "-"
        kinds = [f"{100 * first['busy']:.0f} %" if first["kinds"] else "-"] + [
            f"{first['kinds'].get(k, 0.0):.2f}" if first["kinds"] else "-" for k in KIND_COLUMNS]
        mfu = "-" if run["mfu"] is None else f"{run['mfu']:.1f} %"
        print(f"| {name} | {run['tokens_per_s']:,.0f} | {vs} | {run['ms_per_step']:.2f} | {mfu} | "
              + " | ".join(kinds) + f" | {len(runs[flags])} | {first['first_loss']:.5f} |")


def main(argv=None) -> None:
    args = parse(argv)
    if args.xla_flag_sets:
        return sweep(args)
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
    wide, fused_qkv, mlp_call = (gpt.add_wide, gpt.take_wide), gpt.CausalSelfAttention.qkv, gpt.MLP.__call__

    def patch(sixteen: bool, three: bool, gelu: bool = False) -> None:  # looked up when a step is traced
        gpt.add_wide, gpt.take_wide = (plain_add, plain_take) if sixteen else wide
        gpt.CausalSelfAttention.qkv = qkv_three_products if three else fused_qkv
        gpt.MLP.__call__ = mlp_autodiff_gelu if gelu else mlp_call

    def timed(step_maker) -> JaxparRun:  # compiled and warmed up; a step once compiled never looks at `patch`
        return JaxparRun(step_maker, state, batch, args.steps, n)

    single = lambda m=model, **kw: jaxpar.SingleDevice(m, tx, compute_dtype=bf16, **kw)  # noqa: E731
    variants = {  # name -> (build the run, 16-bit adds, q k v as three products)
        VARIANTS[0]: (lambda: timed(single()), False, False),
        VARIANTS[1]: (lambda: timed(single(per_sample=False)), False, False),
        VARIANTS[2]: (lambda: timed(single(per_sample=False)), True, False),
        VARIANTS[3]: (lambda: timed(single(build(attention="xla"), per_sample=False)), False, False),
        VARIANTS[4]: (lambda: timed(PlainStep(model, tx, compute_dtype=bf16)), True, False),
        VARIANTS[5]: (lambda: timed(single()), False, True),
        VARIANTS[6]: (lambda: timed(single()), False, False, True),
    }
    runs = {}
    for name in args.variants:
        make, *settings = variants[name]
        patch(*settings)
        t = time.perf_counter()
        try:
            runs[name] = make()
            print(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s, first loss "
                  f"{runs[name].first_loss:.5f}", flush=True)
        except Exception as e:  # one variant's failure (an attention kernel this GPU lacks) is a row, not the end
            print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    patch(False, False)
    rates = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, run in runs.items():
            rates[k].append(run.measure()[0])
    fpt = gpt.flops_per_token(model.config, args.seq_len)
    peak = flops.peak_tflops()
    print(f"\nGPT {args.model}: batch {args.batch_size} x {args.seq_len}, vocab {vocab}, bf16, jax {jax.__version__} "
          f"on {jax.devices()[0].device_kind}; {args.rounds} rounds x {args.steps} steps, alternating; "
          f"{fpt / 1e6:.1f} MFLOP/token; peak " + (f"{peak} TFLOP/s" if peak else "unknown (no MFU)"))
    head = "| run | tokens/s | ms/step | MFU | GPU busy | GEMM ms | attention ms | other ms | copy ms |"
    print("\n" + head)
    print("|---|" + "---:|" * (head.count("|") - 2))
    first, top_first, rows = next(iter(runs), None), [], []
    for k, run in runs.items():
        best = max(rates[k])
        mfu = 100 * best * fpt / 1e12 / peak if peak else None
        kinds, busy, cells = {}, None, ["-"] * 5
        if args.trace_steps:
            save = os.path.join(args.save_trace, "gpt_profile.xplane.pb") if args.save_trace and k == first else None
            kinds, top, busy = profile(run, args.trace_steps, save)
            if kinds:  # none on a CPU: the cells stay "-" (not "nan %" and zeros), as in the flag sweep's table
                cells = [f"{100 * busy:.0f} %"] + [f"{kinds.get(c, 0.0):.2f}" for c in KIND_COLUMNS]
            if k == first:
                top_first = top
        rows.append({"run": k, "tokens_per_s": best, "ms_per_step": n / best * 1e3, "mfu": mfu,
                     "busy": busy if kinds else None, "kinds": kinds, "first_loss": run.first_loss})
        print(f"| {k} | {best:,.0f} | {n / best * 1e3:.2f} | " + ("-" if mfu is None else f"{mfu:.1f} %") + " | "
              + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": {"jax": jax.__version__, "device": jax.devices()[0].device_kind}, "runs": rows}, f)
    if top_first:
        print(f"\nTop kernels of '{first}' (ms per step, calls per step):")
        print("| kernel | ms | calls |\n|---|---:|---:|")
        for name, ms, calls in top_first[:args.top]:
            print(f"| {name[:110]} | {ms:.3f} | {calls:.0f} |")
    elif args.trace_steps:
        print("\n(no GPU kernels in the trace: a CPU run)")


if __name__ == "__main__":
    main()
