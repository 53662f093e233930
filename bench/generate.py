"""GPT sampling speed: jaxpar's generate with its KV cache, without it (nanoGPT's recompute every step), and Hugging
Face transformers' GPT2LMHeadModel.generate (use_cache=True) on the same weights, greedy, rounds alternating.

    python bench/generate.py                          # gpt-cpu (4 x 256), batch 1, 32-token prompt, 224 new tokens
    python bench/generate.py --model gpt2 --new 100   # GPT-2 124M's shape (random weights: nothing is downloaded)

Greedy decoding on the same weights must give the same tokens on every side; the table says where they part (a
near-tie in float32 can flip one late token). Tokens/s counts new tokens, the prefill's time included; tokens per
CPU-second count every thread. transformers is imported only here (pip install transformers); with
--no-torch the HF side is left out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-cpu", help="a GPT config name")
    p.add_argument("--vocab-size", type=int, default=None, help="default: 256 for small configs, 50304 for gpt2*")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new", type=int, default=224, help="new tokens per sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (XLA uses every core)")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True, help="also run transformers")
    return p.parse_args(argv)


def _torch_worker(rank: int, world: int, port: int, spec: dict, commands, out) -> None:
    """transformers' GPT2LMHeadModel with jaxpar's weights: warm up, then one timed greedy generate per command."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(spec["threads"])
    cfg = GPT2Config(vocab_size=spec["vocab"], n_positions=spec["block"], n_embd=spec["n_embd"],
                     n_layer=spec["n_layer"], n_head=spec["n_head"], activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(cfg).eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in spec["state_dict"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    prompt = torch.from_numpy(spec["prompt"]).long()

    def run():
        with torch.inference_mode():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=spec["new"],
                                  min_new_tokens=spec["new"], do_sample=False, use_cache=True,
                                  pad_token_id=0).numpy()

    tokens = run()
    out.put(tokens)
    while commands[rank].get():
        t, cpu = time.perf_counter(), time.process_time()
        run()
        out.put((rank, time.perf_counter() - t, time.process_time() - cpu))


def main(argv=None) -> None:
    args = parse(argv)
    import jax
    import numpy as np
    from flax import nnx

    import jaxpar
    from jaxpar.models.gpt import GPT, GPTConfig

    jaxpar.tune_host_allocator()
    vocab = args.vocab_size or (50304 if args.model.startswith("gpt2") else 256)
    cfg = GPTConfig.named(args.model, vocab_size=vocab, dropout=0.0)
    total = args.prompt + args.new
    if total > cfg.block_size:
        raise SystemExit(f"--prompt {args.prompt} + --new {args.new} = {total} tokens is more than {args.model}'s "
                         f"block_size {cfg.block_size}; the cache holds one block: lower --new.")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, vocab, (args.batch_size, args.prompt)).astype(np.int32)
    units = args.batch_size * args.new

    def jaxpar_side(kv_cache: bool):
        model.generate(prompt, args.new, temperature=0, kv_cache=kv_cache)  # compile

        def measure():
            t, cpu = time.perf_counter(), time.process_time()
            model.generate(prompt, args.new, temperature=0, kv_cache=kv_cache)
            return units / (time.perf_counter() - t), units / (time.process_time() - cpu)
        return measure

    tokens = {"jaxpar, KV cache": model.generate(prompt, args.new, temperature=0),
              "jaxpar, no cache (recompute)": model.generate(prompt, args.new, temperature=0, kv_cache=False)}
    sides = {name: jaxpar_side(name == "jaxpar, KV cache") for name in tokens}
    torch_ranks = None
    if args.torch:
        from bench.rounds import TorchRanks

        spec = {"threads": args.threads, "vocab": vocab, "block": cfg.block_size, "n_embd": cfg.n_embd,
                "n_layer": cfg.n_layer, "n_head": cfg.n_head, "state_dict": model.torch_state_dict("hf"),
                "prompt": prompt, "new": args.new}
        torch_ranks = TorchRanks(_torch_worker, 1, (spec,), units=units, threads=args.threads, ready=True)
        tokens["transformers, use_cache"] = torch_ranks.ready[0]
        sides["transformers, use_cache"] = torch_ranks.measure
    rates = {name: [] for name in sides}
    try:
        for _ in range(args.rounds):
            for name, measure in sides.items():
                rates[name].append(measure())
    finally:
        if torch_ranks is not None:
            torch_ranks.close()

    print(f"GPT {args.model}: {cfg.n_layer} layers x {cfg.n_embd} wide, vocab {vocab}, batch {args.batch_size}, "
          f"prompt {args.prompt} + {args.new} new tokens, greedy")
    print(f"jax {jax.__version__} on {jax.default_backend()}; torch threads {args.threads}; {args.rounds} rounds, "
          f"alternating; load average {os.getloadavg()[0]:.1f}")
    ref = tokens["jaxpar, KV cache"]
    print("| run | new tokens/s (best) | median | tokens/CPU-s | vs the KV cache | same new tokens |")
    print("|---|---:|---:|---:|---:|---|")
    best_cached = max(r for r, _ in rates["jaxpar, KV cache"])
    for name, got in rates.items():
        best = max(r for r, _ in got)
        new = np.asarray(tokens[name])[:, args.prompt:] == np.asarray(ref)[:, args.prompt:]  # not the prompt's
        parted = np.flatnonzero(~new.all(axis=0))  # the first new position where any sequence differs
        print(f"| {name} | {best:,.0f} | {statistics.median(r for r, _ in got):,.0f} | "
              f"{max(c for _, c in got):,.0f} | {best / best_cached:.2f}x | "
              f"{'all' if new.all() else f'{100 * new.mean():.1f} %, parting at new token {parted[0]}'} |")


if __name__ == "__main__":
    main()
