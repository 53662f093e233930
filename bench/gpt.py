"""GPT-2 training throughput: jaxpar's single and DDP steps against PyTorch, same architecture, weights and batch.

    python bench/gpt.py                                   # CPU: gpt-cpu (4 x 256), batch 16 x 256, single and DDP x 2
    python bench/gpt.py --model gpt2 --batch-size 16 --seq-len 1024 --precision bf16   # a GPU: torch.compile

jaxpar: SingleDevice, and DistributedDataParallel on --ddp simulated CPU devices in this process (psum, buckets,
overlap: the defaults). PyTorch: the nanoGPT twin (tests/gpt_torch.py, F.scaled_dot_product_attention) loaded
with jaxpar's initial weights, in spawned worker processes kept alive between rounds: on a CPU eagerly with the
same thread count as XLA's pool (--threads, default os.cpu_count()), DDP over gloo with --ddp processes x
(threads / ddp) threads; on a GPU under torch.compile (--compile), bf16 autocast with --precision bf16 (jaxpar:
bf16 compute, float32 master weights, cuDNN attention). Both sides: AdamW(6e-4, betas (0.9, 0.95), weight decay
0.1 on every weight), the same global batch of real text (the standard library's bytes; random tokens when the
vocabulary is larger than 256), DDP ranks each taking their contiguous share.

Rounds alternate between the runs (load from elsewhere on a shared machine hits them alike); each run's best
round gives tokens/s, the median round is shown too; tokens per CPU-second divide by the CPU time of every
thread and process of the run, a measure of work that other load disturbs less. MFU is model FLOPs
(jaxpar.models.gpt.flops_per_token, nanoGPT's 6N + 12 L H Q T) per second over the device's peak: the GPU
table (jaxpar.run.flops) or --peak-tflops; on a CPU the peak is measured (the better of torch's and XLA's float32
GEMM at 2048^3 with the same threads), so CPU MFU reads "of the GEMM rate this CPU reaches".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GPT config name (default: gpt-cpu on a CPU, gpt2 on a GPU)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 256 CPU, 1024 GPU)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: 256 (bytes) for small configs, 50304 "
                   "for gpt2* (GPT-2's 50257 padded to a multiple of 64, as nanoGPT)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--dropout", type=float, default=0.0, help="every dropout of the model, on both sides (nanoGPT "
                   "pretrains with 0.0; Hugging Face's GPT-2 config has 0.1)")
    p.add_argument("--ddp", type=int, default=None, help="DDP devices = torch processes (default 2 on a CPU, "
                   "0 on a GPU: no DDP run)")
    p.add_argument("--threads", type=int, default=None, help="CPU cores per side (default os.cpu_count()): torch's "
                   "threads, and the cores this process (jaxpar, whose XLA:CPU pool has no thread limit) and torch's "
                   "workers may run on")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per run, alternating")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the PyTorch model (default: on a GPU only)")
    p.add_argument("--per-sample", default="on", choices=("on", "off"), help="jaxpar's objective mode")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                   help="also a hand-written NNX step without jaxpar (fp32): the ceiling jaxpar's own code sits under")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True, help="also run PyTorch")
    return p.parse_args(argv)


# ---- PyTorch: worker processes kept alive between rounds ----------------------------------------------------

def _torch_worker(rank: int, world: int, port: int, spec: dict, commands, out) -> None:
    """One rank: build the twin from jaxpar's state dict, warm up, then time one round per command."""
    sys.path.insert(0, TESTS)
    import gpt_torch
    import numpy as np
    import torch

    torch.set_num_threads(spec["threads"])
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg = gpt_torch.GPTConfig(**spec["config"])
    model = gpt_torch.GPT(cfg).to(device)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in spec["state_dict"].items()})
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rows = slice(rank * len(spec["x"]) // world, (rank + 1) * len(spec["x"]) // world)
    x, y = (torch.as_tensor(np.asarray(spec[k][rows], np.int64)).to(device) for k in ("x", "y"))
    forward = torch.compile(model) if spec["compile"] else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"])

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = forward(x)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    first = float(step().detach())
    step()
    out.put(("ready", rank, first))
    while commands[rank].get() is not None:
        if world > 1:
            torch.distributed.barrier()
        if cuda:
            torch.cuda.synchronize()
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(spec["steps"]):
            step()
        if cuda:
            torch.cuda.synchronize()
        if world > 1:
            torch.distributed.barrier()
        out.put((rank, time.perf_counter() - t, time.process_time() - cpu))
    if world > 1:
        torch.distributed.destroy_process_group()


def torch_run(world: int, spec: dict):
    """PyTorch on `world` spawned ranks (world 1: no DDP), `first_loss` the mean of the ranks' first losses (equal
    shards: the global mean loss)."""
    from rounds import TorchRanks

    run = TorchRanks(_torch_worker, world, (spec,), units=spec["x"].size * spec["steps"], threads=spec["threads"],
                     ready=True)
    run.first_loss = sum(r[2] for r in run.ready) / world
    return run


class PlainStep:
    """The ceiling without jaxpar: the same model and optimizer in a hand-written jitted NNX step (nnx.split, the
    mean cross-entropy over the whole batch, jax.value_and_grad, optax; `compute_dtype`: the weights cast to it for
    the forward and backward). Shaped like a strategy (init, put_batch, step) so rounds.JaxparRun times it as it
    times jaxpar's."""

    def __init__(self, model, tx, compute_dtype=None):
        import jax
        import optax
        from flax import nnx

        graphdef, self.params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, batch):
            if compute_dtype is not None:
                p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
            logits = nnx.merge(graphdef, p, rest)(batch["x"]).astype(jax.numpy.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        @jax.jit
        def step(state, batch):
            p, o = state
            value, g = jax.value_and_grad(loss)(p, batch)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), {"loss": value}

        self.tx, self.step = tx, step

    def init(self, state):
        return self.params, self.tx.init(self.params)  # the model's own weights: the same as `state`'s

    def put_batch(self, batch: dict) -> dict:
        import jax.numpy as jnp

        return {"x": jnp.asarray(batch["x"]), "y": jnp.asarray(batch["y"])}


def cpu_gemm_tflops(threads: int) -> dict[str, float]:
    """The float32 GEMM rates this CPU reaches with `threads` threads, in TFLOP/s: {"torch": ..., "xla": ...}
    (2048^3, best of 5 each). The peak for MFU is the better of the two: either library alone can sit far under
    the CPU (stock torch's MKL skips its AVX-512 kernels on AMD CPUs: 0.21 against XLA's 0.41 TFLOP/s on a
    2-core Zen 5), and a peak under the step's own rate reads as MFU over 100 %. Both are printed: where one
    library's GEMM is the faster, the step's ratio starts from there."""
    import jax
    import jax.numpy as jnp
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.rand(2048, 2048)
    a @ a
    rates = {"torch": min(_timed(lambda: a @ a) for _ in range(5))}
    torch.set_num_threads(before)
    x = jnp.asarray(a.numpy())
    mm = jax.jit(lambda x: x @ x)
    mm(x).block_until_ready()
    rates["xla"] = min(_timed(lambda: mm(x).block_until_ready()) for _ in range(5))
    return {k: 2 * 2048 ** 3 / t / 1e12 for k, t in rates.items()}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    args = parse(argv)
    threads = args.threads or os.cpu_count()
    if hasattr(os, "sched_setaffinity") and threads < len(os.sched_getaffinity(0)):  # before XLA sizes its pool
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:threads]))  # torch's workers inherit it
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator

    simulate_cpu_devices(max(2 if args.ddp is None else args.ddp, 1))  # before JAX starts; no effect on a GPU
    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # on a GPU the torch workers share it
    gpu = _has_gpu()
    ddp = (0 if gpu else 2) if args.ddp is None else args.ddp
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpar
    from rounds import JaxparRun, TorchRanks
    from jaxpar import models
    from jaxpar.data import text
    from jaxpar.models import gpt
    from jaxpar.run import flops

    name = args.model or ("gpt2" if gpu else "gpt-cpu")
    seq_len = args.seq_len or (1024 if gpu else 256)
    vocab = args.vocab_size or (50304 if name.startswith("gpt2") else 256)
    compile_torch = gpu if args.compile is None else args.compile
    model = models.get(name, seed=0, vocab_size=vocab, block_size=seq_len, dropout=args.dropout)
    cfg = model.config
    if vocab == 256:
        batch = text.load("train", None, seq_len=seq_len, seed=0).batch(np.arange(args.batch_size))
    else:
        tokens = np.random.default_rng(0).integers(0, vocab, (args.batch_size, seq_len + 1), dtype=np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    options = dict(compute_dtype=jnp.bfloat16 if args.precision == "bf16" else None,
                   per_sample=args.per_sample == "on")
    fpt = gpt.flops_per_token(cfg, seq_len)
    state = jaxpar.init_state(model, tx)
    tokens = batch["x"].size
    runs = {"jaxpar single": JaxparRun(jaxpar.SingleDevice(model, tx, **options), state, batch, args.steps, tokens)}
    if args.plain and args.precision == "fp32":
        runs["plain NNX step (no jaxpar)"] = JaxparRun(PlainStep(model, tx), state, batch, args.steps, tokens)
    if ddp:
        ddp_strategy = jaxpar.DistributedDataParallel(model, tx, mesh=jaxpar.make_mesh(ddp), **options)
        runs[f"jaxpar DDP {ddp} dev"] = JaxparRun(ddp_strategy, state, batch, args.steps, tokens)
    torch_label = "torch.compile" if compile_torch else "torch eager"
    if args.torch:
        spec = dict(config=dict(vocab_size=vocab, block_size=seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                n_embd=cfg.n_embd, dropout=args.dropout), state_dict=model.torch_state_dict("nanogpt"), x=batch["x"],
                    y=batch["y"], steps=args.steps, threads=threads, device="cuda" if gpu else "cpu",
                    compile=compile_torch, bf16=args.precision == "bf16")
        runs[f"{torch_label} single"] = torch_run(1, spec)
        if ddp:
            runs[f"torch DDP {'nccl' if gpu else 'gloo'} {ddp}x{max(threads // ddp, 1)}"] = torch_run(
                ddp, {**spec, "threads": max(threads // ddp, 1)})
    load_before = os.getloadavg()
    cpu_peak = None if gpu or args.peak_tflops else cpu_gemm_tflops(threads)
    rounds = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, run in runs.items():
            rounds[k].append(run.measure())
    load_after = os.getloadavg()
    for run in runs.values():
        if isinstance(run, TorchRanks):
            run.close()
    peak, peak_note = args.peak_tflops, "--peak-tflops"
    if peak is None and gpu:
        kind = jax.devices()[0].device_kind
        peak, peak_note = flops.peak_tflops(), f"table ({kind}; its dense bf16 peak, for fp32 too)"
    if peak is None and not gpu:  # the better of two measurements, before and after the rounds
        after = cpu_gemm_tflops(threads)
        gemm = {k: max(cpu_peak[k], after[k]) for k in after}
        peak = max(gemm.values())
        peak_note = (f"the better measured fp32 GEMM at 2048^3, {threads} threads: XLA {gemm['xla']:.3g}, torch "
                     f"{gemm['torch']:.3g}")
    devices = lambda k: ddp if "DDP" in k and gpu else 1  # noqa: E731  (simulated CPU devices share one CPU)

    print(f"\nGPT {name}: {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, vocab {vocab}, "
          f"{model.num_params() / 1e6:.2f}M params (less wpe), batch {args.batch_size} x {seq_len} tokens, "
          f"{args.precision}, dropout {args.dropout}, {fpt / 1e6:.1f} MFLOP/token")
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"{threads} threads; {args.rounds} rounds x {args.steps} steps, alternating; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; peak {peak:.3g} TFLOP/s per device ({peak_note})")
    print("first-step loss (same weights and batch): " + ", ".join(f"{k} {r.first_loss:.5f}" for k, r in runs.items()))
    torch_single = f"{torch_label} single"
    print(f"\n| run | tokens/s (best) | median | tokens/CPU-s | vs torch | vs torch per CPU-s | TFLOP/s | MFU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, v in rounds.items():
        best, median, per_cpu = max(a for a, _ in v), statistics.median(a for a, _ in v), max(c for _, c in v)
        peer = next((p for p in rounds if p.startswith("torch") and ("DDP" in p) == ("DDP" in k)), None)
        if peer is None and torch_single in rounds:
            peer = torch_single
        vs = vs_cpu = "-"
        if peer and peer != k:
            vs = f"{best / max(a for a, _ in rounds[peer]):.2f}x"
            vs_cpu = f"{per_cpu / max(c for _, c in rounds[peer]):.2f}x"
        achieved = best * fpt / 1e12
        print(f"| {k} | {best:,.0f} | {median:,.0f} | {per_cpu:,.0f} | {vs} | {vs_cpu} | {achieved:.3g} | "
              f"{100 * achieved / (peak * devices(k)):.1f} % |")


def _has_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
