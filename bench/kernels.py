"""What XLA:CPU's kernels give against PyTorch's on this machine, below any jaxpar code: GEMMs (small-row ones too),
the ConvNet's convolutions in jaxpar's three implementations, and a textbook JAX GPT step.

    python bench/kernels.py                     # every table, 2 threads on both sides
    python bench/kernels.py --only gemm,conv

Every row times the same shapes and values on both sides, alternating, best of --repeats runs of --calls calls
(jitted on the JAX side, eager torch with torch.set_num_threads(--threads)). The question each table answers:

- gemm: is XLA:CPU's matrix multiply slower than torch's? (the ratio is torch time / jax time: > 1 means JAX
  is faster; every table's ratio reads so);
- conv: the ConvNet's second convolution (32 -> 64 channels, 3x3, 26x26, batch 128), forward and forward +
  backward, XLA's conv, jaxpar's "chunked" (32 samples per call, the CPU default) and im2col against torch's
  conv2d (oneDNN);
- attention: gpt-cpu's attention (batch 16, 4 heads of 64, 256 tokens): its batched GEMMs and softmax, each
  against torch at --threads and at 1 thread, then causal attention forward + backward, jaxpar's
  (jaxpar.models.gpt_ops.causal_attention, what the GPT runs on CPUs) against torch's scaled_dot_product_attention;
- gpt: a GPT step written plainly in jax.numpy (no NNX, no jaxpar: nanoGPT's math, whole batch, AdamW) against
  torch eager on the same shapes as bench/gpt.py's gpt-cpu, so jaxpar's own 0.7-0.8x there can be read against
  what plain JAX reaches.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jaxpar

jaxpar.tune_host_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="gemm,conv,attention,gpt", help="comma separated: gemm, conv, attention, gpt")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (XLA uses every core)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    return p.parse_args(argv)


def best_pair(jax_fn, torch_fn, repeats: int, calls: int) -> tuple[float, float]:
    """(jax s/call, torch s/call): best of `repeats` alternating runs of `calls` calls, after one warm-up each."""
    jax.block_until_ready(jax_fn())
    torch_fn()
    best = [math.inf, math.inf]
    for _ in range(repeats):
        for i, fn in enumerate((lambda: jax.block_until_ready(jax_fn()), torch_fn)):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t) / calls)
    return best[0], best[1]


def gemm(args) -> None:
    import torch

    rng = np.random.default_rng(0)
    print("\n| GEMM m x k x n | jax GFLOP/s | torch GFLOP/s | jax speed vs torch |")
    print("|---|---:|---:|---:|")
    mm = jax.jit(jnp.matmul)
    for m, k, n in [(32, 512, 512), (64, 512, 512), (256, 512, 512), (4096, 256, 1024), (4096, 1024, 256),
                    (73728, 288, 64), (1024, 1024, 1024)]:
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        aj, bj, at, bt = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
        tj, tt = best_pair(lambda: mm(aj, bj), lambda: at @ bt, args.repeats, args.calls * 10 if m < 512 else
                           args.calls)
        fl = 2 * m * k * n / 1e9
        print(f"| {m} x {k} x {n} | {fl / tj:.0f} | {fl / tt:.0f} | {tt / tj:.2f}x |")


def conv(args) -> None:
    import torch

    from jaxpar.models.layers import conv_chunked, conv_im2col, conv_xla

    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 26, 26, 32), dtype=np.float32)
    k = rng.standard_normal((3, 3, 32, 64), dtype=np.float32) * 0.1
    xj, kj = jnp.asarray(x), jnp.asarray(k)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_()
    kt = torch.from_numpy(k.transpose(3, 2, 0, 1).copy()).requires_grad_()

    def torch_fwd():
        with torch.no_grad():
            torch.nn.functional.conv2d(xt, kt)

    def torch_fwd_bwd():
        (torch.nn.functional.conv2d(xt, kt) ** 2).sum().backward()

    print("\n| conv 32->64, 3x3, 26x26, batch 128 | jax fwd ms | torch fwd ms | jax fwd+bwd ms | torch fwd+bwd ms | "
          "fwd+bwd jax speed vs torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, impl in (("xla", conv_xla), ("chunked (CPU default)", conv_chunked), ("im2col", conv_im2col)):
        f = jax.jit(lambda x, k, impl=impl: impl(x, k, (1, 1), (0, 0)))
        g = jax.jit(jax.grad(lambda x, k, impl=impl: jnp.sum(impl(x, k, (1, 1), (0, 0)) ** 2), argnums=(0, 1)))
        jf, tf = best_pair(lambda: f(xj, kj), torch_fwd, args.repeats, args.calls)
        jb, tb = best_pair(lambda: g(xj, kj), torch_fwd_bwd, args.repeats, max(args.calls // 2, 1))
        print(f"| {name} | {jf * 1e3:.1f} | {tf * 1e3:.1f} | {jb * 1e3:.1f} | {tb * 1e3:.1f} | {tb / jb:.2f}x |")


def gpt(args) -> None:
    """nanoGPT's step in plain jax.numpy against the nanoGPT twin in torch eager: gpt-cpu, batch 16 x 256."""
    import optax
    import torch

    sys.path.insert(0, TESTS)
    import gpt_torch

    B, T, C, L, V, NH = 16, 256, 256, 4, 256, 4
    torch.manual_seed(0)
    net = gpt_torch.GPT(gpt_torch.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=NH, n_embd=C,
                                            dropout=0.0, bias=True))
    sd = {k: jnp.asarray(v.detach().numpy()) for k, v in net.state_dict().items()}
    lin = lambda p: (sd[p + ".weight"].T, sd[p + ".bias"])  # noqa: E731  (torch [out, in] -> [in, out])
    norm = lambda p: (sd[p + ".weight"], sd[p + ".bias"])  # noqa: E731
    params = {"wte": sd["transformer.wte.weight"], "wpe": sd["transformer.wpe.weight"],
              "ln_f": norm("transformer.ln_f"),
              "h": [{"ln_1": norm(f"transformer.h.{i}.ln_1"), "ln_2": norm(f"transformer.h.{i}.ln_2"),
                     "c_attn": lin(f"transformer.h.{i}.attn.c_attn"), "proj": lin(f"transformer.h.{i}.attn.c_proj"),
                     "fc": lin(f"transformer.h.{i}.mlp.c_fc"), "fc_proj": lin(f"transformer.h.{i}.mlp.c_proj")}
                    for i in range(L)]}

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p[0] + p[1]

    def forward(p, idx):
        x = p["wte"][idx] + p["wpe"][:T]
        for h in p["h"]:
            q, k, v = (a.reshape(B, T, NH, C // NH) for a in jnp.split(ln(x, h["ln_1"]) @ h["c_attn"][0]
                                                                        + h["c_attn"][1], 3, -1))
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, C)
            x = x + y @ h["proj"][0] + h["proj"][1]
            x = x + jax.nn.gelu(ln(x, h["ln_2"]) @ h["fc"][0] + h["fc"][1], approximate=True) @ h["fc_proj"][0] \
                + h["fc_proj"][1]
        return ln(x, p["ln_f"]) @ p["wte"].T

    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    idx_j, tgt_j = jnp.asarray(idx, jnp.int32), jnp.asarray(tgt, jnp.int32)
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)

    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(forward(p, idx_j), tgt_j).mean())(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    box = [(params, tx.init(params))]
    first = float(step(*box[0])[2])

    def jax_steps():
        p, o = box[0]
        for _ in range(4):
            p, o, loss = step(p, o)
        box[0] = (p, o)
        return p

    opt = torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ti, tt_ = torch.from_numpy(idx).long(), torch.from_numpy(tgt).long()

    def torch_steps():
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            logits = net(ti)
            logits = logits[0] if isinstance(logits, tuple) else logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, V), tt_.reshape(-1)).backward()
            opt.step()

    with torch.no_grad():
        out = net(ti)
        out = out[0] if isinstance(out, tuple) else out
        torch_first = float(torch.nn.functional.cross_entropy(out.reshape(-1, V), tt_.reshape(-1)))
    tj, tt = best_pair(jax_steps, torch_steps, args.repeats, 1)
    tokens = 4 * B * T
    print(f"\n| GPT step, plain jax.numpy vs torch eager (gpt-cpu, {B} x {T}, AdamW; first losses {first:.5f} / "
          f"{torch_first:.5f}) | jax tokens/s | torch tokens/s | jax / torch |")
    print("|---|---:|---:|---:|")
    print(f"| whole batch, jax.nn.dot_product_attention | {tokens / tj:,.0f} | {tokens / tt:,.0f} | {tt / tj:.2f}x |")


def attention(args) -> None:
    """gpt-cpu's attention: its batched GEMMs and softmax (torch at --threads and at 1), then causal attention
    forward + backward, jaxpar's query blocks against torch's scaled_dot_product_attention."""
    import torch

    from jaxpar.models.gpt_ops import causal_attention

    B, N, T, H = 16, 4, 256, 64
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((B, T, N, H), dtype=np.float32) for _ in range(4))
    s = rng.standard_normal((B, N, T, T), dtype=np.float32)
    qn, sn = np.ascontiguousarray(q.transpose(0, 2, 1, 3)), s  # [B, N, T, H] and [B, N, T, T], both sides
    qj, sj, qt, st = jnp.asarray(qn), jnp.asarray(sn), torch.from_numpy(qn), torch.from_numpy(sn)
    gemm_flops = 2 * B * N * T * T * H / 1e9
    rows = [("q k^T (batched GEMM)", jax.jit(lambda a: jnp.einsum("bnqh,bnkh->bnqk", a, a)), (qj,),
             lambda: qt @ qt.transpose(-1, -2), gemm_flops),
            ("p v (batched GEMM)", jax.jit(lambda p, a: p @ a), (sj, qj), lambda: st @ qt, gemm_flops),
            ("p^T dy (batched GEMM, the backward's)", jax.jit(lambda p, a: jnp.einsum("bnqk,bnqh->bnkh", p, a)),
             (sj, qj), lambda: st.transpose(-1, -2) @ qt, gemm_flops),
            ("softmax over the keys", jax.jit(lambda p: jax.nn.softmax(p, axis=-1)), (sj,),
             lambda: torch.softmax(st, -1), None)]
    print(f"\n| attention part, batch {B} x {N} heads, {T} tokens, head {H} | jax ms | torch ms ({args.threads} "
          "threads) | torch ms (1 thread) | jax speed vs torch |")
    print("|---|---:|---:|---:|---:|")
    for name, fn, fargs, tfn, flops in rows:
        tj, tt = best_pair(lambda: fn(*fargs), tfn, args.repeats, args.calls)
        torch.set_num_threads(1)
        _, t1 = best_pair(lambda: fn(*fargs), tfn, 2, args.calls)
        torch.set_num_threads(args.threads)
        rate = "" if flops is None else f" ({flops / tj:.0f} vs {flops / tt:.0f} / {flops / t1:.0f} GFLOP/s)"
        print(f"| {name}{rate} | {tj * 1e3:.2f} | {tt * 1e3:.2f} | {t1 * 1e3:.2f} | {tt / tj:.2f}x |")

    loss = lambda q, k, v, dy: jnp.sum(causal_attention(q, k, v, "xla") * dy)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jargs = [jnp.asarray(a) for a in (q, k, v, dy)]
    tq, tk, tv, tdy = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).requires_grad_()
                       for a in (q, k, v, dy))

    def torch_fwd_bwd():
        for t in (tq, tk, tv):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(tdy)

    tj, tt = best_pair(lambda: grad(*jargs), torch_fwd_bwd, args.repeats, args.calls)
    dq = np.asarray(grad(*jargs)[0])
    err = float(np.abs(dq - tq.grad.numpy().transpose(0, 2, 1, 3)).max())
    print(f"| causal attention forward + backward (dq max diff {err:.1e}) | {tj * 1e3:.2f} | {tt * 1e3:.2f} | | "
          f"{tt / tj:.2f}x |")


def main(argv=None) -> None:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} with {args.threads} threads, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    for name in args.only.split(","):
        {"gemm": gemm, "conv": conv, "attention": attention, "gpt": gpt}[name](args)


if __name__ == "__main__":
    main()
