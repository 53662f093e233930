"""ZeRO stages 1-3 against DDP on 8 simulated CPU devices: bytes held per device and step time, GPT configs.

    python bench/zero.py                              # memory: gpt-nano ... gpt2-medium; time: gpt-nano ... gpt-mini
    python bench/zero.py --memory gpt2 --time gpt-micro --steps 5 --png ''

Memory (bytes per device, float32 Adam, GPT-2's vocabulary and block size): parameters and optimizer state are
what the strategy's placement puts on one device (the shard shapes of its arrays; the models are abstract,
nothing is allocated), gradients what its compiled gradient function returns per device (XLA's memory
analysis): stage 1 the full local gradient, stages 2-3 the device's shard. Beside them the ZeRO paper's formula
for the same optimizer: 16 Psi (DDP), 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N. DDP: its replicated state
and the outputs of a compiled value_and_grad (the full gradient). Beside the step times: the bytes each device
sends per step by the compiled step's collectives (jaxpar.comm.cost.hlo_bytes_per_device, ring costs; the
metrics' small psum included) and the compiled step's temporaries (activations, gathered weights, the
optimizer's scratch; not part of the formula).
Megatron TP on the same devices (T the largest divisor of the heads and the device count, the rest data replicas,
GPT-2's vocabulary padded to 50304): what its placement puts on one device, the token embedding split by
vocabulary rows (VocabParallelEmbedding) and, beside it, kept whole, and split with ZeRO-1 on top (Megatron's
distributed optimizer: each tensor rank's Adam moments split over the data replicas); gradients are the
parameters' shape. Then
(--sequence-parallel, on by default) the compiled TP step's temporaries at T=2 without and with Megatron's
sequence parallelism, and (--parallel-output, on by default) with GPT-2's vocabulary, the head's logits all-gathered
for the loss against kept split into Megatron's vocab_parallel_cross_entropy.
(--pipe-time) The pipeline at S=2 x D=N/2 alone and with ZeRO-1 (by reduce-scatter, by all-reduce): step time and
the bytes one device sends at the step's end.
Time: per config every strategy is compiled and warmed up (2 steps), then --repeats rounds alternate between
them; a round is the median of --steps steps, the best round counts (load from elsewhere on a shared machine
hits all alike). Random byte tokens (vocabulary 256, as --dataset text), --batch sequences of --seq-len,
dropout 0 (nanoGPT's pretraining default), the per-sample objective train.py builds; "loss" is the loss of one
more step, the same for every strategy. The machine's load average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

STRATEGIES = ("ddp", "zero-1", "zero-2", "zero-3")


PNG = "docs/img/zero_memory.png"  # the README's figure


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--memory", default="gpt-nano,gpt-micro,gpt-mini,gpt-cpu,gpt2,gpt2-medium",
                   help="GPT configs for the memory table, comma separated ('' for none)")
    p.add_argument("--time", default="gpt-nano,gpt-micro,gpt-mini", help="GPT configs for the step time ('' for none)")
    p.add_argument("--tp-time", default="gpt-micro", help="GPT configs for TP's step time alone and with ZeRO-1 "
                   "('' for none)")
    p.add_argument("--pipe-time", default="gpt-micro", help="GPT configs for the pipeline's step time alone and with "
                   "ZeRO-1 by reduce-scatter and by all-reduce ('' for none)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences) of the timed steps")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence of the timed steps")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per strategy, alternating; the best counts")
    p.add_argument("--frozen", default="gpt2", help="GPT configs for the fine-tune table: every block's attention "
                   "and MLP frozen (left out of wrt), held per device under stages 2 and 3 ('' for none)")
    p.add_argument("--png", default=None, help=f"the plot ('' for none; default {PNG} when the memory and time "
                   "tables run their default configs, none otherwise: a partial run does not overwrite the figure)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="also the TP step's temporaries without and with Megatron's sequence parallelism")
    p.add_argument("--parallel-output", action=argparse.BooleanOptionalAction, default=True,
                   help="also the TP step's temporaries with the logits gathered and split into the loss")
    args = p.parse_args(argv)
    if args.png is None:
        full = (args.memory, args.time) == (p.get_default("memory"), p.get_default("time"))
        args.png = PNG if full else ""
    return args


def strategy(name: str, objective, tx, devices: int, batch_size: int | None = None):
    import jaxpar

    mesh = jaxpar.make_mesh(devices)
    if name == "ddp":
        return jaxpar.DistributedDataParallel(objective, tx, mesh=mesh, batch_size=batch_size)
    return jaxpar.ZeroRedundancy(objective, tx, stage=int(name[-1]), mesh=mesh, batch_size=batch_size)


def ddp_memory(objective, tx, state, rows, devices: int) -> dict:
    """DDP's bytes per device: its replicated state (shard shapes of a replicated placement) and the outputs of a
    compiled value_and_grad of one device's rows (the full local gradient it all-reduces)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpar
    from jaxpar.strategies import zero

    mesh = jaxpar.make_mesh(devices)
    spec = lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p))  # noqa: E731
    placed = jax.tree.map(lambda a: spec(P(), a), state)
    local = jax.tree.map(lambda a: spec(P(jaxpar.DATA), a), rows)
    grads = jax.jit(jax.shard_map(lambda s, r: objective.value_and_grad(s.params, s.model_state, r)[1], mesh=mesh,
                                  in_specs=(P(), P(jaxpar.DATA)), out_specs=P(jaxpar.DATA), check_vma=False))
    device = mesh.devices.flat[0]
    held = {"params": zero.held_bytes(placed.params, device),
            "gradients": grads.lower(placed, local).compile().memory_analysis().output_size_in_bytes,
            "optimizer": zero.held_bytes(placed.opt_state, device)}
    psi = sum(a.size for a in jax.tree.leaves(state.params))
    return {**held, "total": sum(held.values()), "step_temp": None, "paper": zero.paper_bytes(0, psi, devices),
            "num_params": psi}


def memory_rows(names: list[str], devices: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import gpt

    tx, out = optax.adam(1e-3), []
    for name in names:
        cfg = gpt.GPTConfig.named(name)
        model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
        state = jax.eval_shape(lambda: jaxpar.init_state(gpt.GPT(cfg, rngs=nnx.Rngs(0)), tx))
        objective = jaxpar.Objective.of(model, per_sample=False)  # the same bytes held; a smaller program
        t = 16  # tokens per row: the gradients' size does not depend on it
        rows = jaxpar.Rows({"x": jax.ShapeDtypeStruct((devices, t), jnp.int32),
                            "y": jax.ShapeDtypeStruct((devices, t), jnp.int32)},
                           jax.ShapeDtypeStruct((devices,), jnp.float32), jax.ShapeDtypeStruct((devices,), jnp.int32))
        for s in STRATEGIES:
            start = time.perf_counter()
            if s == "ddp":
                mem = ddp_memory(objective, tx, state, rows, devices)
            else:
                z = strategy(s, objective, tx, devices)
                placed, spec = z.abstract(state, rows)
                mem = z.memory(placed, spec, step=False)
            out.append({"model": name, "strategy": s, **mem, "seconds": time.perf_counter() - start})
            print(f"  {name:<12} {s:<7} held {mem['total'] / 2**20:10.2f} MiB, paper {mem['paper']['total'] / 2**20:10.2f}"
                  f" MiB ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return out


def frozen_rows(names: list[str], devices: int) -> list[dict]:
    """A fine-tune: every block's attention and MLP weights frozen (left out of wrt), the embeddings and LayerNorms
    trained. Held per device under ZeRO stages 2 and 3: the trained state as in the paper's table, and the model
    state (the frozen weights), whole on every device at stage 2 and 1/N at stage 3 (DeepSpeed's zero.Init)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import gpt

    tx, out = optax.adam(1e-3), []
    wrt = nnx.All(nnx.Param, nnx.Not(nnx.Any(nnx.PathContains("attn"), nnx.PathContains("mlp"))))
    for name in names:
        cfg = gpt.GPTConfig.named(name)
        model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
        objective = jaxpar.Objective.of(model, per_sample=False, wrt=wrt)
        state = jax.eval_shape(lambda: jaxpar.init_state(gpt.GPT(cfg, rngs=nnx.Rngs(0)), tx, objective))
        rows = jaxpar.Rows({"x": jax.ShapeDtypeStruct((devices, 16), jnp.int32),
                            "y": jax.ShapeDtypeStruct((devices, 16), jnp.int32)},
                           jax.ShapeDtypeStruct((devices,), jnp.float32), jax.ShapeDtypeStruct((devices,), jnp.int32))
        frozen = sum(a.size for a in jax.tree.leaves(nnx.state(state.model_state, nnx.Param)))
        for s in ("zero-2", "zero-3"):
            z = strategy(s, objective, tx, devices)
            placed, spec = z.abstract(state, rows)
            mem = z.memory(placed, spec, step=False)
            out.append({"model": name, "strategy": s, "trained": mem["num_params"], "frozen": frozen, **mem})
            print(f"  {name:<12} {s:<7} frozen {mem['model_state'] / 2**20:10.2f} MiB", file=sys.stderr, flush=True)
    return out


def _rounds(runs: dict, steps: int, repeats: int) -> dict:
    """name -> ms per step, the best of `repeats` rounds that alternate between the runs (load from elsewhere hits
    them alike), each round the median of `steps` steps; `runs`: name -> [strategy, placed state, batch], the
    state advanced in place."""
    import jax

    medians: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            st, placed, rows = run[:3]
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                placed, metrics = st.step(placed, rows)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            run[1] = placed
            medians[name].append(statistics.median(times))
    return {name: 1e3 * min(m) for name, m in medians.items()}


def _timed(built: dict, state, data: dict, devices: int, steps: int, repeats: int) -> dict:
    """name -> (ms per step: the best round's median, seconds of the first two steps, compiled temporaries,
    bytes sent per device, the loss of one more step): every strategy of `built` compiled and warmed up, then `repeats`
    rounds that alternate between them (load from elsewhere hits them alike)."""
    import jax

    from jaxpar.comm import cost as comm_cost

    runs = {}
    for s, st in built.items():
        placed, rows = st.init(state), st.put_batch(data)
        start = time.perf_counter()
        for _ in range(2):
            placed, metrics = st.step(placed, rows)
        jax.block_until_ready(metrics)
        compiled = st._step.lower(placed, rows).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        sent = max(comm_cost.hlo_bytes_per_device(compiled.as_text(), devices))
        runs[s] = [st, placed, rows, time.perf_counter() - start, (temp, sent)]
    best = _rounds(runs, steps, repeats)
    return {s: (best[s], compile_s, temp, sent, float(st.step(placed, rows)[1]["loss"]))
            for s, (st, placed, rows, compile_s, (temp, sent)) in runs.items()}


def _stage_programs(pipe, s: int) -> list:
    """The compiled step-end programs (reductions, norms, updates; the tied weights' updates on every stage that
    holds them) stage `s` ran in the last step, as recording_jit kept them."""
    out = []
    for key, fn in pipe.engine._updates.items():
        if not getattr(fn, "hlo", None) or not isinstance(key[0], str):
            continue  # a closure over recorded programs (a stage's update around its ties), or a cached index
        if (s in pipe.module.tied[key[1][0]]) if key[0] == "tied" else key[1] == s:
            out.append(fn)
    return out


def _byte_batch(batch: int, seq_len: int) -> dict:
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def time_rows(names: list[str], devices: int, batch: int, seq_len: int, steps: int, repeats: int) -> list[dict]:
    """Per config: DDP and ZeRO stages 1-3 timed by _timed."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import gpt

    tx, out, data = optax.adam(1e-3), [], _byte_batch(batch, seq_len)
    for name in names:
        cfg = gpt.GPTConfig.named(name, vocab_size=256, block_size=seq_len)
        model = gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0))
        objective = jaxpar.Objective.of(model)
        built = {s: strategy(s, objective, tx, devices, batch) for s in STRATEGIES}
        timed = _timed(built, jaxpar.init_state(model, tx), data, devices, steps, repeats)
        for s, (step_ms, compile_s, temp, sent, loss) in timed.items():
            out.append({"model": name, "strategy": s, "num_params": model.num_params(non_embedding=False),
                        "step_ms": step_ms, "compile_s": compile_s, "step_temp": temp, "hlo_sent": sent,
                        "loss": loss})
            print(f"  {name:<12} {s:<7} {step_ms:8.1f} ms/step (first two {compile_s:.0f} s)",
                  file=sys.stderr, flush=True)
    return out


def tp_time_rows(names: list[str], devices: int, batch: int, seq_len: int, steps: int, repeats: int) -> list[dict]:
    """Megatron TP at T=2 x D=devices/2, alone and with ZeRO-1 (the gradient reduce-scattered, or all-reduced),
    timed by _timed: what the distributed optimizer costs in step time and bytes sent."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import jaxpar
    from jaxpar.models import gpt
    from jaxpar.strategies.tensor import TensorParallel

    tx, out, data = optax.adam(1e-3), [], _byte_batch(batch, seq_len)
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // 2, 2), (jaxpar.DATA, jaxpar.TENSOR))
    variants = {"tp": {}, "tp + zero-1": {"zero_stage": 1},
                "tp + zero-1, all-reduce": {"zero_stage": 1, "zero_reduce": "all_reduce"}}
    for name in names:
        cfg = gpt.GPTConfig.named(name, vocab_size=256, block_size=seq_len)
        fresh = lambda: gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0))  # noqa: E731  (TP points its blocks)
        built = {k: TensorParallel(fresh(), tx, tensor_parallel=2, mesh=mesh, **kw) for k, kw in variants.items()}
        timed = _timed(built, jaxpar.init_state(fresh(), tx), data, devices, steps, repeats)
        for k, (step_ms, _, temp, sent, loss) in timed.items():
            out.append({"model": name, "variant": k, "step_ms": step_ms, "step_temp": temp, "hlo_sent": sent,
                        "loss": loss})
    return out


def pipe_time_rows(names: list[str], devices: int, batch: int, seq_len: int, steps: int, repeats: int,
                   micro_batches: int = 4) -> list[dict]:
    """The pipeline at S=2 x D=devices/2 (1F1B), alone and with ZeRO-1 (the gradient reduce-scattered after the
    tied wte's per-replica gradients are summed across the stages, or all-reduced whole): ms per step (the best
    of `repeats` alternating rounds, each the median of `steps`), and the bytes one device of the busier stage
    sends at the step's end (the reductions' and updates' compiled collectives; the tied sum's device-to-device
    copy is the same in every variant and not counted)."""
    import jax
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.comm import cost as comm_cost
    from jaxpar.models import gpt
    from jaxpar.strategies.pipeline import Pipeline, pipeline_mesh

    tx, out, data = optax.adam(1e-3), [], _byte_batch(batch, seq_len)
    variants = {"pipeline": {}, "pipeline + zero-1": {"zero_stage": 1},
                "pipeline + zero-1, all-reduce": {"zero_stage": 1, "zero_reduce": "all_reduce"}}
    for name in names:
        cfg = gpt.GPTConfig.named(name, vocab_size=256, block_size=seq_len)
        fresh = lambda: gpt.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0))  # noqa: E731
        state, runs = jaxpar.init_state(fresh(), tx), {}
        for k, kw in variants.items():
            pipe = Pipeline(fresh(), tx, num_stages=2, micro_batches=micro_batches, schedule="1f1b",
                            mesh=pipeline_mesh(devices, 2), **kw)
            plain = pipe.engine.jit
            pipe.engine.jit = comm_cost.recording_jit(plain, [])
            placed, rows = pipe.init(state), pipe.put_batch(data)
            placed, metrics = pipe.step(placed, rows)
            sent = [sum(max(comm_cost.hlo_bytes_per_device(fn.hlo[0], pipe.D)) for fn in _stage_programs(pipe, s))
                    for s in range(2)]
            pipe.engine.jit, pipe.engine._updates = plain, {}  # compiled again plainly: the probe off the clock
            placed, metrics = pipe.step(placed, rows)
            jax.block_until_ready(metrics)
            runs[k] = [pipe, placed, rows, max(sent)]
        best = _rounds(runs, steps, repeats)
        for k, (pipe, placed, rows, sent) in runs.items():
            out.append({"model": name, "variant": k, "step_ms": best[k], "hlo_sent": sent,
                        "loss": float(pipe.step(placed, rows)[1]["loss"])})
    return out


def tp_rows(names: list[str], devices: int) -> list[dict]:
    """Megatron TP's bytes per device (T the largest divisor of the heads and of `devices`; GPT-2's vocabulary
    padded to 50304 as nanoGPT's, so T divides it): what TensorParallel's placement puts on one device (the shard
    shapes of its plan), with the token embedding split by vocabulary rows and, beside it, kept whole."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding

    import jaxpar
    from jaxpar.models import gpt
    from jax.sharding import PartitionSpec as P

    from jaxpar.strategies import zero, zero1
    from jaxpar.strategies.tensor import Layout, leaf_specs, tensor_plan

    tx, out = optax.adam(1e-3), []
    for name in names:
        cfg = gpt.GPTConfig.named(name, vocab_size=50304)
        tp = max(t for t in range(1, devices + 1) if devices % t == 0 and cfg.n_head % t == 0)
        if tp == 1:
            continue
        model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
        state = jax.eval_shape(lambda: jaxpar.init_state(gpt.GPT(cfg, rngs=nnx.Rngs(0)), tx))
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // tp, tp), (jaxpar.DATA, jaxpar.TENSOR))
        device = mesh.devices.flat[0]
        plan = tensor_plan(model, tp)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
        whole = [Layout() if "wte" in p else lay for p, lay in zip(paths, plan)]
        for label, layouts in (("vocab split", plan), ("wte whole", whole)):
            def placed(tree):
                specs = jax.tree.leaves(leaf_specs(tree, state.params, layouts), is_leaf=lambda x: isinstance(
                    x, jax.sharding.PartitionSpec))
                return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                        for a, s in zip(jax.tree.leaves(tree), specs)]

            params, opt = zero.held_bytes(placed(state.params), device), zero.held_bytes(placed(state.opt_state), device)
            psi = sum(a.size for a in jax.tree.leaves(state.params))
            out.append({"model": name, "tp": tp, "wte": label, "params": params, "gradients": params,
                        "optimizer": opt, "total": 2 * params + opt, "ddp": 16 * psi, "num_params": psi})
        # + ZeRO-1 (Megatron's distributed optimizer): the moments as TensorParallel(zero_stage=1) places them
        leaves = jax.tree.leaves(state.params)
        layout = zero1.of(mesh, zero1.device_leaves(leaves, [lay.spec(len(a.shape)) for a, lay in zip(leaves, plan)],
                                                    mesh), [lay.axis for lay in plan])
        shard = jax.eval_shape(tx.init, {"shard": jax.ShapeDtypeStruct((layout.plan.shard_size,), np.float32)})
        flat = [jax.ShapeDtypeStruct((tp, (devices // tp) * a.shape[0]) if a.ndim else a.shape, a.dtype,
                                     sharding=NamedSharding(mesh, layout.spec if a.ndim else P()))
                for a in jax.tree.leaves(shard)]
        params, opt = out[-2]["params"], zero.held_bytes(flat, device)
        out.append({**out[-2], "wte": "vocab split, ZeRO-1", "optimizer": opt, "total": 2 * params + opt})
    return out


def tp_temps(name: str, batch: int, seq: int, tp: int, vocab: int = 256, dropout: float = 0.0, **options) -> int:
    """The compiled TP step's temporaries (XLA's memory analysis: activations and scratch) on `tp` devices (no data
    replicas), whole-batch objective; a real step is run first. `options` go to TensorParallel."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import jaxpar
    from jaxpar.models import gpt
    from jaxpar.strategies.tensor import TensorParallel

    tx = optax.adam(1e-3)
    cfg = gpt.GPTConfig.named(name, vocab_size=vocab, block_size=seq, dropout=dropout)
    x = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    mesh = Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), (jaxpar.DATA, jaxpar.TENSOR))
    strategy = TensorParallel(gpt.GPT(cfg, rngs=nnx.Rngs(0)), tx, tensor_parallel=tp, mesh=mesh, per_sample=False,
                              **options)
    placed = strategy.init(jaxpar.init_state(gpt.GPT(cfg, rngs=nnx.Rngs(0)), tx))
    placed, _ = strategy.step(placed, strategy.put_batch({"x": x[:, :-1], "y": x[:, 1:]}))
    return strategy._step.lower(placed, strategy._batch_spec).compile().memory_analysis().temp_size_in_bytes


def sp_rows(cases=(("gpt-cpu", 16, 64, 0.0), ("gpt-mini", 8, 256, 0.1))) -> list[dict]:
    """Megatron's sequence parallelism: the TP step's temporaries at T=2 without and with it (byte vocabulary)."""
    return [{"model": name, "batch": batch, "seq": seq, "dropout": dropout,
             **{key: tp_temps(name, batch, seq, 2, dropout=dropout, sequence_parallel=sp, parallel_output=False)
                for key, sp in (("tp", False), ("sp", True))}}
            for name, batch, seq, dropout in cases]


def parallel_output_rows(cases=(("gpt-cpu", 8, 256, 2), ("gpt-cpu", 8, 256, 4)), devices: int = 8) -> list[dict]:
    """Megatron's parallel_output: the TP step's temporaries with GPT-2's vocabulary (50304) when the head's logits
    are all-gathered for the loss and when they go split into vocab_parallel_cross_entropy (the cases whose T fits
    on `devices`)."""
    return [{"model": name, "batch": batch, "seq": seq, "tp": tp,
             "logits": batch * seq * 50304 * 4,  # one float32 copy of the whole [tokens, V] logits
             **{key: tp_temps(name, batch, seq, tp, vocab=50304, parallel_output=on)
                for key, on in (("gathered", False), ("split", True))}}
            for name, batch, seq, tp in cases if tp <= devices]


def tp_table(rows: list[dict]) -> str:
    lines = ["| model (vocab 50304) | Psi | T | wte | params MiB | grads MiB | optimizer MiB | held MiB | DDP's 16 Psi MiB "
             "| held / DDP |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['num_params']:,} | {r['tp']} | {r['wte']} | {_mib(r['params'])} | "
                     f"{_mib(r['gradients'])} | {_mib(r['optimizer'])} | {_mib(r['total'])} | {_mib(r['ddp'])} | "
                     f"{r['total'] / r['ddp']:.3f} |")
    return "\n".join(lines)


def versus_rows(rows: list[dict], base: str, cells) -> str:
    """Table rows: model, variant, ms/step, its ratio to the `base` variant's of the same model, then cells(row)."""
    ref = {r["model"]: r["step_ms"] for r in rows if r["variant"] == base}
    return "\n".join(f"| {r['model']} | {r['variant']} | {r['step_ms']:.1f} | {r['step_ms'] / ref[r['model']]:.2f}x | "
                     + " | ".join(cells(r)) + " |" for r in rows)


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def table(mem: list[dict], times: list[dict]) -> str:
    lines = []
    if mem:
        lines += ["| model | Psi | strategy | params MiB | grads MiB | optimizer MiB | held MiB | paper MiB "
                  "| paper formula | held / paper |", "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in mem:
            p = r["paper"]
            lines.append(f"| {r['model']} | {r['num_params']:,} | {r['strategy']} | {_mib(r['params'])} | "
                         f"{_mib(r['gradients'])} | {_mib(r['optimizer'])} | {_mib(r['total'])} | {_mib(p['total'])} | "
                         f"{p['formula']} | {r['total'] / p['total']:.5f} |")
    if times:
        lines += ["", "| model (vocab 256) | Psi | strategy | step ms | vs DDP | HLO MiB sent / device | vs DDP "
                  "| step temps MiB | loss |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        ddp = {r["model"]: r for r in times if r["strategy"] == "ddp"}
        for r in times:
            d = ddp[r["model"]]
            lines.append(f"| {r['model']} | {r['num_params']:,} | {r['strategy']} | {r['step_ms']:.1f} | "
                         f"{r['step_ms'] / d['step_ms']:.2f}x | {_mib(r['hlo_sent'])} | "
                         f"{r['hlo_sent'] / d['hlo_sent']:.3f}x | {_mib(r['step_temp'])} | {r['loss']:.4f} |")
    return "\n".join(lines)


def plot(mem: list[dict], times: list[dict], path: str, devices: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2 if times else 1, figsize=(13 if times else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    models = list(dict.fromkeys(r["model"] for r in mem))
    width = 0.8 / len(STRATEGIES)
    for k, s in enumerate(STRATEGIES):
        rows = [next(r for r in mem if r["model"] == m and r["strategy"] == s) for m in models]
        x = np.arange(len(models)) + (k - 1.5) * width
        ax.bar(x, [r["total"] / 2**20 for r in rows], width, label=s)
        ax.scatter(x, [r["paper"]["total"] / 2**20 for r in rows], marker="_", color="black", s=80, zorder=3,
                   label="ZeRO paper's formula" if k == 0 else None)
    ax.set_xticks(np.arange(len(models)), models, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("MiB per device (params + grads + Adam)")
    ax.set_title(f"Held per device, N={devices}, float32 Adam")
    ax.legend(fontsize=8)
    if times:
        ax = axes[0][1]
        tmodels = list(dict.fromkeys(r["model"] for r in times))
        for k, s in enumerate(STRATEGIES):
            rows = [next(r for r in times if r["model"] == m and r["strategy"] == s) for m in tmodels]
            ax.bar(np.arange(len(tmodels)) + (k - 1.5) * width, [r["step_ms"] for r in rows], width, label=s)
        ax.set_xticks(np.arange(len(tmodels)), tmodels)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"Step time, {devices} simulated CPU devices")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxpar.mesh import simulate_cpu_devices
    from jaxpar.run.hostmem import tune_host_allocator

    tune_host_allocator()
    simulate_cpu_devices(args.devices)  # before JAX starts
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    mem = memory_rows(split(args.memory), args.devices)
    frozen = frozen_rows(split(args.frozen), args.devices)
    tp = tp_rows(split(args.memory), args.devices)
    times = time_rows(split(args.time), args.devices, args.batch, args.seq_len, args.steps, args.repeats)
    print(table(mem, times))
    if frozen:
        print(f"\nA fine-tune, every block's attention and MLP frozen: held per device, N={args.devices}\n"
              "| model | trained | frozen | strategy | params + grads + optimizer MiB | frozen weights MiB | total MiB |\n"
              "|---|---:|---:|---|---:|---:|---:|")
        for r in frozen:
            print(f"| {r['model']} | {r['trained']:,} | {r['frozen']:,} | {r['strategy']} | {_mib(r['total'])} | "
                  f"{_mib(r['model_state'])} | {_mib(r['total'] + r['model_state'])} |")
    if tp:
        print("\nMegatron tensor parallelism, the same devices (T x data): held per device\n" + tp_table(tp))
    tp_times = tp_time_rows(split(args.tp_time), args.devices, args.batch, args.seq_len, args.steps, args.repeats)
    if tp_times:
        print(f"\nTP (T=2 x D={args.devices // 2}) alone and with ZeRO-1: step time, bytes sent per device\n"
              "| model | variant | ms/step | vs tp | sent KiB | temporaries MiB | loss |\n"
              "|---|---|---:|---:|---:|---:|---:|")
        print(versus_rows(tp_times, "tp", lambda r: (f"{r['hlo_sent'] / 1024:.1f}", _mib(r["step_temp"]),
                                                     f"{r['loss']:.5f}")))
    pipe_times = pipe_time_rows(split(args.pipe_time), args.devices, args.batch, args.seq_len, args.steps,
                                args.repeats)
    if pipe_times:
        print(f"\nThe pipeline (S=2 x D={args.devices // 2}, 1F1B, 4 micro-batches) alone and with ZeRO-1: step time, "
              "bytes one device sends at the step's end\n"
              "| model | variant | ms/step | vs pipeline | sent at the end KiB | loss |\n|---|---|---:|---:|---:|---:|")
        print(versus_rows(pipe_times, "pipeline", lambda r: (f"{r['hlo_sent'] / 1024:.1f}", f"{r['loss']:.5f}")))
    if args.sequence_parallel:
        sp = sp_rows()
        print("\nSequence parallelism: the compiled TP step's temporaries, T=2\n| model | batch x seq | dropout | "
              "TP MiB | TP + SP MiB | SP / TP |\n|---|---|---:|---:|---:|---:|")
        for r in sp:
            print(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['dropout']} | {_mib(r['tp'])} | {_mib(r['sp'])} | "
                  f"{r['sp'] / r['tp']:.3f} |")
    if args.parallel_output:
        po = parallel_output_rows(devices=args.devices)
        print("\nMegatron's parallel_output: the compiled TP step's temporaries, vocabulary 50304\n"
              "| model | batch x seq | T | whole logits MiB | gathered MiB | split MiB | split / gathered |\n"
              "|---|---|---:|---:|---:|---:|---:|")
        for r in po:
            print(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['tp']} | {_mib(r['logits'])} | "
                  f"{_mib(r['gathered'])} | {_mib(r['split'])} | {r['split'] / r['gathered']:.3f} |")
    load = os.getloadavg()  # after every timed table
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if args.png and mem:
        plot(mem, times, args.png, args.devices)
        print(f"wrote {args.png}")
    return {"memory": mem, "frozen": frozen, "tp": tp, "time": times, "tp_time": tp_times, "pipe_time": pipe_times}


if __name__ == "__main__":
    main()
