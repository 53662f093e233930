"""GPT on the Python standard library's sources for a fixed wall-clock budget: DDP on simulated CPU devices,
AdamW with a warmup and a cosine decay over the budget, held-out bits per byte along the way and, at the end, on
the whole held-out part (jaxpar.data.text: the last 5 % of the corpus).

    python bench/gpt_train.py --minutes 10 --devices 2 --seq-len 64 --batch-size 32 --lr 6e-3 --min-lr 6e-4 \
        --out runs/gpt10                                                       # the README's run (~13 min in all)
    python bench/gpt_train.py --plot runs/gpt10 --png docs/img/gpt_loss.png   # its curve

The budget counts training steps only (compiling, the periodic held-out checks and the final evaluation are left
out). The learning rate follows the fraction of the budget spent, so the cosine ends when the time does, however
fast the (shared) machine runs: it is set through optax.inject_hyperparams before every step. Dropout is 0 (as
nanoGPT pretrains), so the objective runs whole shards (per_sample off: the same numbers, less work).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-micro")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices for DDP")
    p.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    p.add_argument("--steps", type=int, default=None, help="a step budget instead (the cosine runs over steps)")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=5e-4, help="learning rate at the end of the cosine")
    p.add_argument("--warmup", type=float, default=0.02, help="fraction of the budget warming up linearly")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between held-out checks")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per check (the final: all)")
    p.add_argument("--final-windows", type=int, default=None, help="held-out windows of the final check (all)")
    p.add_argument("--decay-params", default="matrices", choices=("all", "matrices"),
                   help="weight decay 0.1 on the matrices only (nanoGPT's groups) or on every parameter")
    p.add_argument("--sample", type=int, default=300, help="bytes to sample from the final model (nanoGPT's "
                   "sample.py: temperature 0.8, top-k 200), from 'def '")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gpt", help="folder for metrics.jsonl, final.json, model_hf.npz")
    p.add_argument("--plot", default=None, help="draw the curve of a finished run's folder instead of training")
    p.add_argument("--png", default="docs/img/gpt_loss.png")
    return p.parse_args(argv)


def lr_at(args, frac: float) -> float:
    if frac < args.warmup:
        return args.lr * frac / args.warmup
    t = min(1.0, (frac - args.warmup) / (1 - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


def held_out(eval_step, state, test, batch_size: int, n: int | None = None) -> float:
    """Bits per byte of `state` on the first `n` held-out windows (all when None)."""
    import jax
    import numpy as np

    import jaxpar

    n = len(test) if n is None else min(n, len(test))
    loss = weight = 0.0
    for lo in range(0, n, batch_size):
        idx = np.arange(lo, min(lo + batch_size, n))
        rows = jaxpar.pad_rows(jaxpar.as_rows(test.batch(idx), idx), batch_size)
        sums = jax.device_get(eval_step(state.params, state.model_state, rows))
        loss, weight = loss + float(sums.loss), weight + float(sums.weight)
    return loss / weight / math.log(2)


def train(args) -> None:
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator

    simulate_cpu_devices(args.devices)
    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    import numpy as np
    import optax

    import jaxpar
    from jaxpar import models
    from jaxpar.data import text

    os.makedirs(args.out, exist_ok=True)
    train_set = text.load("train", None, seq_len=args.seq_len, seed=args.seed)
    test = text.load("test", None, seq_len=args.seq_len)
    model = models.get(args.model, seed=args.seed, vocab_size=text.VOCAB, block_size=args.seq_len)
    decay = (jaxpar.optim.add_decayed_weights_to_matrices(0.1) if args.decay_params == "matrices" else
             optax.add_decayed_weights(0.1))
    tx = optax.inject_hyperparams(lambda learning_rate: optax.chain(  # optax.adamw's chain, its decay as asked
        optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.99), decay,
        optax.scale_by_learning_rate(learning_rate)))(learning_rate=0.0)
    ddp = jaxpar.DistributedDataParallel(model, tx, mesh=jaxpar.make_mesh(args.devices), per_sample=False)
    eval_step = jaxpar.make_eval_step(ddp.objective)
    placed = ddp.init(jaxpar.init_state(model, tx))
    sampler = jaxpar.DistributedSampler(len(train_set), num_replicas=1, rank=0, shuffle=True, seed=args.seed,
                                        drop_last=True)
    budget, spent, step, epoch = args.minutes * 60, 0.0, 0, 0
    log = open(os.path.join(args.out, "metrics.jsonl"), "w")
    write = lambda rec: (log.write(json.dumps(rec) + "\n"), log.flush())  # noqa: E731
    write({"event": "start", **vars(args), "params": model.num_params(), "load": os.getloadavg()})
    print(f"{args.model}: {model.num_params():,} params (less wpe); {len(train_set):,} training windows of "
          f"{args.seq_len} bytes; DDP on {args.devices} devices; "
          f"{f'{args.steps} steps' if args.steps else f'{args.minutes} min'}; load {os.getloadavg()[0]:.2f}")
    next_eval, compiled = 0.0, False
    if args.steps:
        budget = math.inf
    while spent < budget and step != args.steps:
        sampler.set_epoch(epoch)
        loader = jaxpar.Loader(train_set, args.batch_size, sampler, drop_last=True, put=ddp.put_batch)
        for batch in loader:
            if spent >= next_eval:
                bpb = held_out(eval_step, ddp.unplace(placed), test, 64, args.eval_windows)
                write({"event": "eval", "step": step, "time_s": spent, "bits_per_byte": bpb})
                print(f"  step {step:5d}  {spent:6.0f} s  held-out[:{args.eval_windows}] {bpb:.3f} bits/byte",
                      flush=True)
                next_eval += args.eval_every
            lr = lr_at(args, step / args.steps if args.steps else spent / budget)
            placed.opt_state.hyperparams["learning_rate"] = jaxpar_replicate(lr, placed)
            t = time.perf_counter()
            placed, metrics = ddp.step(placed, batch)
            loss = float(metrics["loss"])  # waits for the step
            dt = time.perf_counter() - t
            spent += dt if compiled else 0.0  # the first step compiles: not counted
            compiled, step = True, step + 1
            write({"event": "step", "step": step, "time_s": spent, "lr": lr, "loss": loss,
                   "bits_per_byte": loss / math.log(2), "step_s": dt})
            if spent >= budget or step == args.steps:
                break
        epoch += 1
    state = ddp.unplace(placed)
    t = time.perf_counter()
    final = held_out(eval_step, state, test, 128, args.final_windows)
    result = {"event": "final", "steps": step, "train_s": spent, "tokens": step * args.batch_size * args.seq_len,
              "held_out_bits_per_byte": final, "held_out_bytes": (args.final_windows or len(test)) * args.seq_len,
              "unigram_bits_per_byte": test.unigram_bits, "eval_s": time.perf_counter() - t, "load": os.getloadavg()}
    write(result)
    trained = ddp.objective.merge(state.params, state.model_state)
    np.savez(os.path.join(args.out, "model_hf.npz"), **trained.torch_state_dict("hf"))
    if args.sample:
        out = trained.generate(np.frombuffer(b"def ", np.uint8).astype(np.int32)[None], args.sample,
                               temperature=0.8, top_k=200, seed=args.seed)
        result["sample"] = bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        print(f"--- sample ---\n{result['sample']}\n---")
    json.dump(result, open(os.path.join(args.out, "final.json"), "w"), indent=1)
    print(f"final: {step} steps, {result['tokens']:,} tokens in {spent:.0f} s of training; held-out ("
          f"{args.final_windows or len(test):,} windows) {final:.3f} bits/byte; unigram entropy {test.unigram_bits:.3f}")


def jaxpar_replicate(value: float, placed):
    """`value` as the learning-rate leaf of the placed optimizer state (same sharding as the one it replaces)."""
    import jax
    import jax.numpy as jnp

    old = placed.opt_state.hyperparams["learning_rate"]
    return jax.device_put(jnp.asarray(value, old.dtype), old.sharding)


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in open(os.path.join(args.plot, "metrics.jsonl"))]
    steps = [r for r in recs if r["event"] == "step"]
    evals = [r for r in recs if r["event"] == "eval"]
    final = next(r for r in recs if r["event"] == "final")
    start = recs[0]
    fig, ax = plt.subplots(figsize=(7, 4))
    k = 20  # running mean over 20 steps of the training windows' loss
    ys = [r["bits_per_byte"] for r in steps]
    smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
    ax.plot([r["time_s"] / 60 for r in steps], smooth, lw=1, label="training windows (mean of 20 steps)")
    ax.plot([r["time_s"] / 60 for r in evals], [r["bits_per_byte"] for r in evals], "o-", ms=3,
            label=f"held-out, first {start['eval_windows']} windows")
    ax.plot([final["train_s"] / 60], [final["held_out_bits_per_byte"]], "r*", ms=12,
            label=f"held-out, all of it: {final['held_out_bits_per_byte']:.3f}")
    for y, name in ((final["unigram_bits_per_byte"], "unigram entropy"), (2.5, "2.5 bits/byte")):
        ax.axhline(y, color="gray", ls=":", lw=1)
        ax.text(0.02, y + 0.04, name, color="gray", fontsize=8)
    ax.set(xlabel="training minutes", ylabel="bits per byte", ylim=(1.5, 5.6),
           title=f"{start['model']} on the Python stdlib, DDP on {start['devices']} simulated CPU devices, "
                 f"{final['steps']} steps")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    a = parse()
    plot(a) if a.plot else train(a)
