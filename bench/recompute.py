"""Activation recompute: step time against memory on a GPT, one device, the policies alternating.

    python bench/recompute.py                         # gpt-cpu (4 x 256), batch 16 x 256 tokens, dropout 0.1
    python bench/recompute.py --model gpt-mini --batch-size 8 --seq-len 512 --rounds 5

Policies (all jaxpar.SingleDevice, AdamW, the same weights and batch):
- keep: every activation kept for the backward (no recompute);
- selective: Megatron's selective recompute, each block's core attention run again in the backward from q, k, v
  (GPTConfig.recompute_granularity="selective");
- full N: DeepSpeed's activation_checkpoint_interval / Megatron's full recompute, the blocks in N-layer segments
  that keep only their input (jaxpar.recompute).

Memory is XLA's own account of the compiled step (`memory_analysis()`): temporaries, which hold the activations
kept for the backward and the backward's scratch; the arguments (weights, optimizer state, batch) are the same
for every policy. Rounds alternate between the policies, so load from elsewhere hits them alike; each policy's
best round gives tokens/s, its median is shown too, and tokens per CPU-second count every thread of the process.
"""
from __future__ import annotations

import argparse
import statistics
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-cpu", help="a GPT config name (jaxpar.models.gpt.CONFIGS)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1, help="dropout everywhere (the attention weights' too)")
    p.add_argument("--intervals", default="1,2", help="the full-recompute segment lengths to run, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per policy, alternating")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    from jaxpar.run.hostmem import tune_host_allocator

    tune_host_allocator()  # the CPU fast path train.py takes, before JAX allocates
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import gpt
    from rounds import JaxparRun

    intervals = [int(n) for n in args.intervals.split(",") if n]
    policies = {"keep": (None, 0), "selective": ("selective", 0), **{f"full N={n}": (None, n) for n in intervals}}
    seq = np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len + 1)).astype(np.int32)
    batch = {"x": seq[:, :-1], "y": seq[:, 1:]}
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    runs, temp, losses = {}, {}, {}
    for name, (granularity, interval) in policies.items():
        cfg = gpt.GPTConfig.named(args.model, vocab_size=256, block_size=args.seq_len, dropout=args.dropout,
                                  recompute_granularity=granularity)
        model = gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        objective = jaxpar.Objective.of(model, activation_checkpoint_interval=interval)
        state = jaxpar.init_state(model, tx)
        compiled = jaxpar.make_train_step(objective, tx).lower(state, jaxpar.as_rows(batch)).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        runs[name] = JaxparRun(jaxpar.SingleDevice(objective, tx), state, batch, args.steps,
                               units=args.batch_size * args.seq_len)
        losses[name] = runs[name].first_loss
    rates = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(run.measure())
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    cfg = gpt.GPTConfig.named(args.model)
    print(f"\nGPT {args.model}: {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, batch {args.batch_size} "
          f"x {args.seq_len} tokens, dropout {args.dropout}, fp32, one device ({jax.devices()[0].platform}); "
          f"{args.rounds} rounds x {args.steps} steps, alternating; load average {load} after; "
          f"{time.strftime('%Y-%m-%d')}")
    print("first-step loss: " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    print("\n| policy | temporaries MiB | vs keep | tokens/s (best) | median | tokens/CPU-s | speed vs keep |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    best = {n: max(r for r, _ in v) for n, v in rates.items()}
    for name, got in rates.items():
        print(f"| {name} | {temp[name]:,.1f} | {temp[name] / temp['keep']:.2f}x | {best[name]:,.0f} | "
              f"{statistics.median(r for r, _ in got):,.0f} | {max(c for _, c in got):,.0f} | "
              f"{best[name] / best['keep']:.2f}x |")


if __name__ == "__main__":
    main()
