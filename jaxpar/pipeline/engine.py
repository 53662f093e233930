"""The interpreter: one Python loop walks the schedule's per-tick instruction lists and dispatches each
instruction of this process's stages through a table (DeepSpeed's ``_INSTRUCTION_MAP``). The schedule that is
generated is the schedule that runs.

Each compute instruction is ONE call of its stage's jitted function over that stage's own weights (see
jaxpar.pipeline.stage); JAX's asynchronous dispatch lets the stages' devices run at once while Python walks on.
Roughly, per step::

    for t, row in enumerate(schedule.steps):          # ticks
        for s in my stages: for instruction in row[s]: DISPATCH[instruction.op](instruction)
        post the cross-process messages SENT at tick t to the courier, one program per pair of stages (both sides)
    REDUCE_GRADS: merge chunks, all-reduce over the stage's replicas, sum tied weights across stages, add the
                  Sums and squared gradient norms over processes (one small vector); ZeRO-1 by reduce-scatter
                  sums the tied weights first, then reduce-scatters each stage's flat gradient
    OPT:          every stage updates its weights with grads / global weight (in place: buffers donated)

With fp16's loss scaler (`scaled`) the last stage seeds each backward with one seed for the step (set by its first
micro-batch, see jaxpar.pipeline.stage.PartFns), every stage's gradient carries it, and the step's vector takes it
to every stage's update, which divides it out with the global weight (jaxpar.pipeline.optimizer.mean_scale).

A last-stage F followed at once by its own B (or I) runs as one fused call (no residuals kept), and an I followed
at once by its own W as one B (no cotangents kept): the same work in fewer calls. W's of one chunk back to back
(all of them with `defer_wgrad`, ZB-H1's last ones) run as one call over their micro-batches' rows joined, for
per-sample objectives (PartFns.weight_grads): each weight-gradient product sums the micro-batches inside its
contraction, where adding each W into the accumulator was a pass over the stage's gradient. Messages between
stages of one process are device_puts at the send. Across processes they are two-sided ppermutes, all of a
tick's messages between two stages in one program (1F1B's activation and gradient go together), run by one
courier thread per process (Transport.post) in the global order, each finished before the next: neither side's
Python waits for the other until a compute instruction needs the received value.
"""
from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar.comm import shards as sh
from jaxpar.mesh import DATA, TENSOR
from jaxpar.objective import Sums
from jaxpar.pipeline import optimizer as opt_lib
from jaxpar.pipeline.schedule import Action, Op, Schedule, message, virtual
from jaxpar.pipeline.stage import Layout, PartFns, part_fns, split_float


def _add_up(sums: list) -> jax.Array:
    """The micro-batches' Sums added, as one float32 vector (loss, weight, rows, metrics...)."""
    return jnp.stack([sum(xs) for xs in zip(*[jax.tree.leaves(x) for x in sums])])


def _merge_chunks(owned: dict, parts: list, accs: list, one, given: dict | None = None) -> list:
    """A stage's gradient list (leaf j at owned[j]) from its chunks' accumulators (`parts`: each chunk's leaves):
    every chunk holding leaf j adds `one` of its accumulator (a device's own value, or the replicas' sum); a leaf
    in `given` takes that value instead."""
    out = [None] * len(owned)
    for j, g in (given or {}).items():
        out[owned[j]] = g
    for idx, acc in zip(parts, accs):
        for j, g in zip(idx, acc):
            if j not in (given or {}):
                out[owned[j]] = one(g) if out[owned[j]] is None else out[owned[j]] + one(g)
    return out


def _assemble(total, norms: list, seed, n: int) -> jax.Array:
    """[Sums vector, sum of squared gradient norms, the backward's seed] (the Sums and the seed zeros on processes
    without the last stage: summed over processes, the vector is the step's everywhere)."""
    head = jnp.zeros((n,), jnp.float32) if total is None else total
    seed = jnp.zeros((), jnp.float32) if total is None else jnp.asarray(seed, jnp.float32)
    return jnp.concatenate([head, sum(norms, jnp.zeros((), jnp.float32))[None], seed[None]])


class _Pending:
    """A cross-process message on its way: result `i` of a posted exchange (its future)."""

    def __init__(self, fut, i: int):
        self.fut, self.i = fut, i

    def get(self):
        return self.fut.result()[self.i]


class Plan:
    """What one batch layout compiles to: every part's functions, the boundary shapes, the fused actions, the
    cross-process messages of each tick in their global order."""

    def __init__(self, engine: "Engine", layout: Layout, schedule: Schedule):
        mod, tr = engine.module, engine.transport
        self.schedule = schedule
        self.fns = [part_fns(mod, v, engine.objective, layout, tr.meshes[mod.stage_of(v)], schedule.num_microbatches,
                             engine.compiler_options, engine.scaled) for v in range(mod.num_parts)]
        self.out_specs, x = [], None
        rows = layout.specs[0].shape[0]
        for v, fns in enumerate(self.fns):
            s = mod.stage_of(v)
            params = [mod.param_specs[j] for j in fns.pidx]
            state = [engine.state_specs[j] for j in fns.sidx]
            data = engine.data_specs(layout, s)
            x = jax.eval_shape(fns.evaluate, params, state, x, data)
            self.out_specs.append(x)
        self.sums_treedef = jax.tree.structure(x)
        self.grad_specs = [split_float(o)[0] for o in self.out_specs]
        S = schedule.num_stages
        self.fused, self.merged = set(), set()
        for s in range(S):
            prog = schedule.program(s)
            for a, b in zip(prog, prog[1:]):
                same = (b.microbatch, b.chunk) == (a.microbatch, a.chunk)
                if a.op is Op.F and b.op in (Op.B, Op.I) and same \
                        and virtual(a, S, schedule.placement) == mod.num_parts - 1:
                    self.fused.add(a)
                if a.op is Op.I and b.op is Op.W and same:
                    self.merged.add(a)
        # a run of W's of one part, back to back in a stage's program (W's deferred to the flush), runs as ONE
        # call over those micro-batches at its first W (PartFns.weight_grads): first W -> the run; the rest
        self.runs, self.in_run = {}, set()
        if engine.objective.per_sample:  # batch mode: the rows could not be joined, each W alone as before
            for s in range(S):
                run: list = []
                for a in schedule.program(s) + [None]:
                    own = a is not None and a.op is Op.W and Action(s, Op.I, a.microbatch, a.chunk) not in self.merged
                    if own and run and a.chunk == run[0].chunk:
                        run.append(a)
                        continue
                    if len(run) > 1:
                        self.runs[run[0]] = tuple(run)
                        self.in_run.update(run[1:])
                    run = [a] if own else []
        grads = Counter(virtual(a, S, schedule.placement) for s in range(S) for a in schedule.program(s)
                        if a.op in (Op.B, Op.W) and a not in self.in_run)
        self.once = {v for v, n in grads.items() if n == 1}  # parts whose one backward needs no accumulator
        self.messages = []  # per tick: [(stage a, stage b, [(kind, src, dst, src virtual, micro-batch)])]
        for row in schedule.steps:  # the messages SENT across processes, one group per pair of stages
            groups: dict = {}
            for s, ins in enumerate(row):
                for a in ins:
                    msg = message(a, S, schedule.placement)
                    if msg and msg[0] == "send" and not tr.same_process(s, mod.stage_of(msg[1][1])):
                        _, (kind, dst_v, m) = msg
                        dst = mod.stage_of(dst_v)
                        group = groups.setdefault(frozenset((s, dst)), (s, dst, []))
                        group[2].append((kind, s, dst, virtual(a, S, schedule.placement), m))
            self.messages.append(list(groups.values()))
        del rows


class Engine:
    """Runs schedules of a PipelineModule (`module`) on `transport`'s stages; see the module docstring."""

    def __init__(self, module, objective, tx: optax.GradientTransformation, transport, *, needs_norm: bool,
                 compiler_options: dict | None = None):
        self.module, self.objective, self.transport = module, objective, transport
        self.compiler_options = compiler_options
        self.jit = partial(jax.jit, compiler_options=compiler_options)
        self._add_up, self._assemble = self.jit(_add_up), self.jit(_assemble, static_argnums=3)
        self.scaled = False  # fp16's loss scaler: the last stage seeds the backward (run's `scale`)
        self._sv = None  # the loss scaler's [S, seed] on the last stage, during a step
        # [S, 0] from S, and the seed from [S, seed]: one program each (an eager jnp.zeros, or an index given as
        # a Python int, would copy a host value to a device every step)
        self._seed_of = self.jit(lambda scale: jnp.stack([jnp.asarray(scale, jnp.float32), jnp.zeros(())]))
        self._seed = self.jit(lambda sv: sv[1])
        self._plus = self.jit(lambda xs: sum(xs[1:], xs[0]))  # arrays of one layout added
        self.tx, self.needs_norm = optax.with_extra_args_support(tx), needs_norm
        self.state_specs: list = []
        self._plans: dict = {}
        self.trace: list[tuple[int, Action]] = []  # (tick, compute action) of this process, last step
        self.timer: Callable[[Action, Any], None] | None = None  # profiling: called after each compute action
        self.dispatch = {Op.LOAD: self._load, Op.F: self._forward, Op.B: self._backward, Op.I: self._input_grad,
                         Op.W: self._weight_grad, Op.SEND_ACT: self._send, Op.SEND_GRAD: self._send,
                         Op.RECV_ACT: self._recv, Op.RECV_GRAD: self._recv,
                         Op.REDUCE_GRADS: lambda a: None, Op.OPT: lambda a: None}  # both at the step's end
        self._updates: dict = {}
        self._scalars: dict = {}
        self.zero: dict | None = None  # ZeRO-1: stage -> its jaxpar.strategies.zero1.StageZero
        # each part's parameter leaves (global indices), in its accumulator's order
        self._pidx = [sorted({j for seg in module.parts[v] for j in seg.param_index}) for v in range(module.num_parts)]
        self.scatter = False  # ZeRO-1's gradients by reduce-scatter (else all-reduced whole)

    def data_specs(self, layout: Layout, stage: int):
        """Abstract (leaves, mask, ids) of one micro-batch as `stage` gets it."""
        rows = layout.specs[0].shape[0]
        return ({i: layout.specs[i] for i in self.needs(layout, stage)}, jax.ShapeDtypeStruct((rows,), jnp.float32),
                jax.ShapeDtypeStruct((rows,), jnp.int32))

    def needs(self, layout: Layout, stage: int) -> tuple:
        """The batch leaves `stage` reads: the model's inputs on the first, the loss's on the last."""
        mod = self.module
        out = set(layout.inputs) if stage == mod.stage_of(0) else set()
        return tuple(sorted(out | (set(layout.targets) if stage == mod.stage_of(mod.num_parts - 1) else set())))

    def plan(self, layout: Layout, schedule: Schedule) -> Plan:
        key = (layout, schedule)
        if key not in self._plans:
            self._plans[key] = Plan(self, layout, schedule)
        return self._plans[key]

    # -- the step ------------------------------------------------------------------------------------------

    def run(self, plan: Plan, params: dict, state: dict, batch: dict, *, train: bool = True, scale=None
            ) -> tuple[Sums | None, dict, dict]:
        """Walk the schedule once: (last stage's summed Sums or None, per-stage state, per-part accumulators).
        ``train`` False: the forwards run in eval mode (a forward-only schedule). `scale`: the loss scaler's S
        on the last stage's devices (an engine that is `scaled`, training, on the process holding the last stage)."""
        tr = self.transport
        last = self.module.stage_of(self.module.num_parts - 1)
        self._sv = None
        if self.scaled and train and tr.mine(last):
            if scale is None:
                raise ValueError("this pipeline's optimizer scales the loss: pass run(..., scale=S), S the loss "
                                 "scaler's current scale (jaxpar.loss_scale.current of the last stage's state).")
            self._sv = tr.put(self._seed_of(scale), last)
        self._p, self._batch, self._params, self._train = plan, batch, params, train
        self._state = {s: list(v) for s, v in state.items()}
        self._acc, self._stash, self._out, self._mail, self._sums = {}, {}, {}, {}, []
        self.trace = []
        mine = tr.local_stages
        for t, row in enumerate(plan.schedule.steps):
            self._tick = t
            for s in mine:
                for a in row[s]:
                    self.dispatch[a.op](a)
            self._post(plan, plan.messages[t])
        tr.drain()  # every exchange done before the step's other collectives (REDUCE_GRADS) start
        total = self._add_up(self._sums) if self._sums else None  # one call: the Sums of every micro-batch, as a vector
        return total, self._state, self._acc

    def _post(self, plan: Plan, groups: list) -> None:
        """Hand this tick's cross-process messages to the transport's courier, one program per pair of stages, in
        the schedule's order (both sides); the receiver's mail holds a _Pending."""
        tr = self.transport
        for a, b, msgs in groups:
            if not (tr.mine(a) or tr.mine(b)):
                continue
            batch = []
            for kind, src, _, src_v, m in msgs:
                spec = plan.out_specs[src_v] if kind == "act" else plan.grad_specs[src_v - 1]
                batch.append((src, self._out.pop((kind, src_v, m)) if tr.mine(src) else None, spec))
            fut = tr.post(a, b, batch)
            for i, (kind, src, dst, src_v, m) in enumerate(msgs):
                if tr.mine(dst):
                    self._mail[(kind, src_v + (1 if kind == "act" else -1), m)] = _Pending(fut, i)

    def _acc_of(self, v: int, fns: PartFns, params: list):
        """Part v's gradient accumulator: zeros before the step's first backward adds to it, or None where that
        backward is the part's only one of the step (it returns the gradient as it is)."""
        acc = self._acc.get(v)
        if acc is None:
            return None if v in self._p.once else fns.zeros(params)
        return acc

    def _take(self, key):
        """A received value (waiting for its exchange if it is still under way), or None."""
        got = self._mail.pop(key, None)
        return got.get() if isinstance(got, _Pending) else got

    def _part(self, a: Action) -> tuple[int, PartFns]:
        v = virtual(a, self.module.num_stages, self.module.placement)
        return v, self._p.fns[v]

    def _args(self, a: Action, fns: PartFns):
        s = a.stage
        return [self._params[s][i] for i in self._stage_pos(s, fns.pidx)], \
            [self._state[s][i] for i in self._stage_pos(s, fns.sidx, state=True)]

    def _stage_pos(self, s: int, idx: list, state: bool = False) -> list[int]:
        key = (s, tuple(idx), state)
        if key not in self._updates:
            owned = self.module.stage_state[s] if state else self.module.stage_params[s]
            pos = {j: k for k, j in enumerate(owned)}
            self._updates[key] = [pos[j] for j in idx]
        return self._updates[key]

    def _index(self, a: Action):
        """The micro-batch index as an int32 on the stage's devices (it keys batch-mode draws)."""
        key = (a.stage, a.microbatch)
        if key not in self._scalars:
            self._scalars[key] = self.transport.put(jnp.int32(a.microbatch), a.stage)
        return self._scalars[key]

    def _data(self, a: Action):
        return self._batch[a.stage][a.microbatch]

    def _done(self, a: Action, out) -> None:
        self.trace.append((self._tick, a))
        if self.timer is not None:
            self.timer(a, out)

    def _load(self, a: Action) -> None:
        self._data(a)  # the micro-batch was placed on this stage's devices by put_batch, ahead of the step

    def _set_state(self, a: Action, fns: PartFns, new) -> None:
        if not self.objective.per_sample:
            for i, leaf in zip(self._stage_pos(a.stage, fns.sidx, state=True), new):
                self._state[a.stage][i] = leaf

    def _forward(self, a: Action) -> None:
        v, fns = self._part(a)
        params, state = self._args(a, fns)
        x = self._take(("act", v, a.microbatch))
        data, m = self._data(a), self._index(a)
        if not self._train:
            out = fns.evaluate(params, state, x, data)
            self._sums.append(out) if fns.last else self._out.__setitem__(("act", v, a.microbatch), out)
            return self._done(a, out)
        if a in self._p.fused:
            nxt = self._next_backward(a)
            sv = (self._sv,) if fns.scaled else ()
            if nxt.op is Op.B or nxt in self._p.merged:  # F, then B (or I and its W at once): one call
                self._acc[v], dx, sums, new, *sv = fns.forward_backward(self._acc_of(v, fns, params), params, state,
                                                                        x, data, m, *sv)
            else:
                dx, saved, cots, sums, new, *sv = fns.forward_input_grad(params, state, x, data, m, *sv)
                self._stash[(v, a.microbatch)] = (params, state, x, data, saved, cots)
            if sv:
                self._sv = sv[0]
            self._out[("grad", v, a.microbatch)] = dx
            self._sums.append(sums)
            out = (dx, sums, self._acc.get(v))  # what the timer waits for: everything the fused call computed
        else:
            sv = (self._sv,) if fns.scaled else ()
            out, saved, new, *sv = fns.forward(params, state, x, data, m, *sv)
            if sv:
                self._sv = sv[0]
            self._stash[(v, a.microbatch)] = (params, state, x, data, saved, None)
            if fns.last:
                self._sums.append(out)
            else:
                self._out[("act", v, a.microbatch)] = out
        self._set_state(a, fns, new)
        self._done(a, out)

    def _next_backward(self, a: Action) -> Action:
        prog = self._p.schedule.program(a.stage)
        return prog[prog.index(a) + 1]

    def _fused_into_forward(self, a: Action) -> bool:
        return Action(a.stage, Op.F, a.microbatch, a.chunk) in self._p.fused

    def _backward(self, a: Action) -> None:
        if self._fused_into_forward(a):
            return self._done(a, None)
        v, fns = self._part(a)
        params, state, x, data, saved, _ = self._stash.pop((v, a.microbatch))
        dy = self._sv if fns.scaled else self._take(("grad", v, a.microbatch))
        self._acc[v], dx = fns.backward(self._acc_of(v, fns, params), params, state, x, data, saved, dy)
        self._out[("grad", v, a.microbatch)] = dx
        self._done(a, self._acc[v])

    def _input_grad(self, a: Action) -> None:
        if self._fused_into_forward(a):
            return self._done(a, None)
        if a in self._p.merged:  # its W comes next: the whole backward in one call, no cotangents kept
            return self._backward(a)
        v, fns = self._part(a)
        params, state, x, data, saved, _ = self._stash[(v, a.microbatch)]
        dy = self._sv if fns.scaled else self._take(("grad", v, a.microbatch))
        dx, cots = fns.input_grad(params, state, x, data, saved, dy)
        self._stash[(v, a.microbatch)] = (params, state, x, data, saved, cots)
        self._out[("grad", v, a.microbatch)] = dx
        self._done(a, cots)

    def _weight_grad(self, a: Action) -> None:
        if Action(a.stage, Op.I, a.microbatch, a.chunk) in self._p.merged or a in self._p.in_run:  # done already
            return self._done(a, None)
        v, fns = self._part(a)
        if a in self._p.runs:  # the run's W's in one call, over their micro-batches' stored residuals
            got = [self._stash.pop((v, b.microbatch)) for b in self._p.runs[a]]
            params, state = got[0][:2]
            xs, datas, saveds, cotss = ([g[k] for g in got] for k in range(2, 6))
            self._acc[v] = fns.weight_grads(self._acc_of(v, fns, params), params, state, xs, datas, saveds, cotss)
            return self._done(a, self._acc[v])
        params, state, x, data, saved, cots = self._stash.pop((v, a.microbatch))
        self._acc[v] = fns.weight_grad(self._acc_of(v, fns, params), params, state, x, data, saved, cots)
        self._done(a, self._acc[v])

    def _send(self, a: Action) -> None:
        S, place = self.module.num_stages, self.module.placement
        _, (kind, dst_v, m) = message(a, S, place)
        dst, src_v = self.module.stage_of(dst_v), virtual(a, S, place)
        if self.transport.same_process(a.stage, dst):  # else: exchanged at the end of the tick
            self._mail[(kind, dst_v, m)] = self.transport.put(self._out.pop((kind, src_v, m)), dst, "act")

    def _recv(self, a: Action) -> None:
        _, key = message(a, self.module.num_stages, self.module.placement)
        if key not in self._mail:
            raise RuntimeError(f"{a!r}: nothing was received for {key}; the schedule's sends and receives disagree "
                               "(validate() it).")

    # -- the end of the step: REDUCE_GRADS, then OPT ---------------------------------------------------------

    def reduce_and_update(self, params: dict, opt_state: dict, state: dict, acc: dict, total: Sums | None,
                          sums_treedef) -> tuple[dict, dict, dict, jax.Array]:
        """Gradients of every local stage reduced, tied weights summed, Sums and norms added over processes,
        then each stage's optimizer update. Returns (params, opt_state, state, the global Sums vector).

        ZeRO-1 by reduce-scatter (DeepSpeed's order: ReduceTiedGrads, then ReduceGrads): the tied weights' per-device
        gradients are summed across their stages first, then each stage reduce-scatters its flat gradient, and
        each replica's update reads its block only."""
        mod, tr = self.module, self.transport
        if self.scatter:
            tied = self._tied_partials(acc)
            out = {s: self._scatter(s)([acc[v] for v in self._parts_of(s)], tied.get(s, []))
                   for s in tr.local_stages}
            grads = {s: block for s, (block, _) in out.items()}
            norms = [jax.device_put(sq, tr.first_device) for _, sq in out.values()]
        else:
            grads = {s: self._reduce(s, [acc[v] for v in self._parts_of(s)]) for s in tr.local_stages}
            for j, stages in mod.tied.items():
                pos = {s: mod.stage_params[s].index(j) for s in stages if tr.mine(s)}
                lay = P() if mod.tensor_layouts is None else mod.tensor_layouts[j].spec(len(mod.param_specs[j].shape))
                spec = jax.ShapeDtypeStruct(mod.param_specs[j].shape, mod.param_specs[j].dtype)
                summed = self._sum_tied(stages, {s: grads[s][k] for s, k in pos.items()}, spec, lay)
                for s, k in pos.items():
                    grads[s][k] = summed[s]
            norms = [jax.device_put(self._norm_fn(s)(grads[s]), tr.first_device) for s in tr.local_stages]
        n = sums_treedef.num_leaves
        seed = self._one() if self._sv is None else jax.device_put(self._seed(self._sv), tr.first_device)
        vec = tr.all_processes_sum(self._assemble(None if total is None else jax.device_put(total, tr.first_device),
                                                  norms, seed, n))
        for s in tr.local_stages:
            params[s], opt_state[s], state[s] = self._update_fn(s)(params[s], opt_state[s], grads[s], state[s],
                                                                   tr.put(vec, s))
        return params, opt_state, state, vec  # [Sums..., squared norm, seed]

    def _one(self) -> jax.Array:
        """1.0 on the first local device, made once: the seed of a step without a loss scaler (a Python float
        would be copied to the device at every step)."""
        if "one" not in self._scalars:
            self._scalars["one"] = jax.device_put(jnp.ones((), jnp.float32), self.transport.first_device)
        return self._scalars["one"]

    def _parts_of(self, s: int) -> list[int]:
        return [v for v in range(self.module.num_parts) if self.module.stage_of(v) == s]

    def _reduce(self, s: int, accs: list) -> list:
        """Chunks' accumulators -> the stage's gradient list (summed over its D replicas), replicated; as they
        are for one chunk on one device."""
        if self.module.tensor_layouts is not None:
            return self._reduce_slices(s)(accs)
        if len(accs) == 1 and self.transport.D == 1:
            return list(accs[0])
        if ("reduce", s) not in self._updates:
            mod, D = self.module, self.transport.D
            owned = {j: k for k, j in enumerate(mod.stage_params[s])}
            parts = [self._pidx[v] for v in self._parts_of(s)]

            def reduce(accs):
                return _merge_chunks(owned, parts, accs, (lambda g: jnp.sum(g, 0)) if D > 1 else (lambda g: g))

            self._updates[("reduce", s)] = self.jit(reduce, out_shardings=self.transport.kinds[s]["rep"])
        return self._updates[("reduce", s)](accs)

    def _reduce_slices(self, s: int):
        """3-D: the chunks' per-device accumulators (a leading axis of D x T) summed over DATA only, under
        shard_map over the stage's (DATA, TENSOR) mesh: each tensor rank keeps the gradient of its own slices,
        placed as the parameters are (the plan's specs); replicated leaves come out once (under sequence
        parallelism first summed over TENSOR: each rank's LayerNorms and positions saw only its tokens)."""
        if ("reduce", s) not in self._updates:
            mod, mesh = self.module, self.transport.meshes[s]
            owned = {j: k for k, j in enumerate(mod.stage_params[s])}
            parts = [self._pidx[v] for v in self._parts_of(s)]
            specs = [mod.tensor_layouts[j].spec(len(mod.param_specs[j].shape)) for j in mod.stage_params[s]]

            def reduce(accs):
                out = _merge_chunks(owned, parts, accs, lambda g: g[0])
                if mod.sequence_parallel:  # replicated leaves saw only this rank's tokens: sum them over TENSOR
                    out = [g if TENSOR in spec else lax.psum(g, TENSOR) for g, spec in zip(out, specs)]
                return [lax.psum(g, DATA) for g in out] if mesh.shape[DATA] > 1 else out

            mapped = jax.shard_map(reduce, mesh=mesh, in_specs=(P(tuple(mesh.axis_names)),), out_specs=specs,
                                   check_vma=False)
            self._updates[("reduce", s)] = self.jit(mapped)
        return self._updates[("reduce", s)]

    def _sum_tied(self, stages: list[int], values: dict, spec, lay: P) -> dict:
        """A tied weight's gradient summed over the stages holding it: `values` this process's stages' own, laid
        out as `lay` on each stage's mesh (replicated; a weight split over TENSOR, GPT-2's wte by vocabulary rows;
        or one value a device, the per-replica gradients ZeRO-1 sums before its reduce-scatter), `spec` its
        global shape. Summed within the process first, then once with the other process's (a pair program),
        then copied to every local stage. Pipeline refuses a tie spanning more than two processes."""
        tr = self.transport
        local = [s for s in stages if tr.mine(s)]
        if not local:
            return values
        rep = local[0]
        total = values[rep]
        for s in local[1:]:
            total = total + tr.put_as(values[s], rep, lay)
        other = next((s for s in stages if not tr.same_process(s, rep)), None)
        if other is not None:
            total = tr.pair_sum(min(rep, other), max(rep, other), total, spec, lay)
        return {**values, **{s: total if s == rep else tr.put_as(total, s, lay) for s in local}}

    def _tied_partials(self, acc: dict) -> dict:
        """ZeRO-1 by reduce-scatter: stage -> [each tied weight's per-device gradient (one value a device: the
        "local" kind), summed over the stage's chunks and then across the weight's stages], in stage_params order."""
        mod, tr = self.module, self.transport
        out: dict = {}
        for j, stages in mod.tied.items():
            values = {}
            for s in (s for s in stages if tr.mine(s)):
                pieces = [acc[v][self._pidx[v].index(j)] for v in self._parts_of(s) if j in self._pidx[v]]
                values[s] = pieces[0] if len(pieces) == 1 else self._plus(pieces)
            if not values:
                continue
            any_value = next(iter(values.values()))
            lay = tr.kinds[next(iter(values))]["local"].spec if tr.meshes[stages[0]].size > 1 else P()
            summed = self._sum_tied(stages, values, jax.ShapeDtypeStruct(any_value.shape, any_value.dtype), lay)
            for s in values:
                out.setdefault(s, []).append((j, summed[s]))
        return {s: [a for _, a in sorted(pairs, key=lambda p: p[0])] for s, pairs in out.items()}  # leaf order

    def _scatter(self, s: int):
        """ZeRO-1 by reduce-scatter, under shard_map over stage s's mesh: each device's chunk accumulators summed
        (a tied weight's taken from its cross-stage total), then ONE reduce-scatter over DATA leaves each replica its
        block of the stage's flat gradient ([T, D S], the moments' layout), and the block's share of the squared norm
        (the stage's own leaves; a leaf every tensor rank holds whole, on rank 0) summed over the mesh."""
        if ("scatter", s) not in self._updates:
            mod, mesh, zero = self.module, self.transport.meshes[s], self.zero[s]
            owned = {j: k for k, j in enumerate(mod.stage_params[s])}
            tied = [j for j in mod.stage_params[s] if j in mod.tied]
            parts = [self._pidx[v] for v in self._parts_of(s)]
            mine = [1.0 if mod.owner[j] == s else 0.0 for j in mod.stage_params[s]]  # a tied leaf: counted once
            one = (lambda g: g[0]) if mesh.size > 1 else (lambda g: g)  # noqa: E731  (the device's own value)

            def scatter(accs, totals):
                out = _merge_chunks(owned, parts, accs, one, {j: one(g) for j, g in zip(tied, totals)})
                if mod.sequence_parallel:  # replicated leaves saw only this rank's tokens: sum them over TENSOR
                    out = [g if ax is not None else lax.psum(g, TENSOR) for g, ax in zip(out, zero.axes)]
                block = zero.reduce_scatter(out)
                counted = sh.shard_of_values(zero.plan, mine, DATA, jnp.float32)
                if zero.tensor > 1:  # whole leaves: tensor rank 0's
                    counted = jnp.where(zero.replicated_mask(jnp.float32) > 0,
                                        counted * (lax.axis_index(TENSOR) == 0), counted)
                squared = lax.psum(jnp.sum(counted * jnp.square(block.astype(jnp.float32))), tuple(mesh.axis_names))
                return block[None], squared

            local = P(tuple(mesh.axis_names)) if mesh.size > 1 else P()
            mapped = jax.shard_map(scatter, mesh=mesh, in_specs=(local, local), out_specs=(zero.spec, P()),
                                   check_vma=False)
            self._updates[("scatter", s)] = self.jit(mapped)
        return self._updates[("scatter", s)]

    def _norm_fn(self, s: int):
        if ("norm", s) not in self._updates:
            mine = [k for k, j in enumerate(self.module.stage_params[s]) if self.module.owner[j] == s]
            self._updates[("norm", s)] = self.jit(lambda g: sum(jnp.sum(jnp.square(g[k].astype(jnp.float32)))
                                                               for k in mine) if mine else jnp.zeros(()))
        return self._updates[("norm", s)]

    def _update_fn(self, s: int):
        if ("update", s) not in self._updates:
            mod, tx, needs_norm = self.module, self.tx, self.needs_norm
            treedef = opt_lib.stage_treedef(mod, s)
            counts = [k for k, j in enumerate(mod.stage_state[s]) if mod.state_kinds[j].__name__ == "RngCount"]
            if self.zero is not None:  # ZeRO-1: each replica updates its block of the stage's flat weights
                params = jax.tree.unflatten(treedef, [mod.param_specs[j] for j in mod.stage_params[s]])
                lays = mod.tensor_layouts
                pspecs = [P() if lays is None else lays[j].spec(len(mod.param_specs[j].shape))
                          for j in mod.stage_params[s]]
                sspecs = mod.state_specs(mod.stage_state[s])
                self._updates[("update", s)] = self.zero[s].update_fn(tx, params, pspecs, needs_norm=needs_norm,
                                                                      counts=counts, jit=self.jit,
                                                                      scatter=self.scatter, sspecs=sspecs)
                return self._updates[("update", s)]

            own = mod.stage_params[s]
            groups: dict = {}  # the stage's tied leaves by the stages holding them
            for k, j in enumerate(own):
                if j in mod.tied:
                    groups.setdefault(tuple(mod.tied[j]), []).append(k)
            parts = [tuple(k for k in range(len(own)) if own[k] not in mod.tied), *map(tuple, groups.values())]
            rest = self.jit(self._subset_update(tuple(own[k] for k in parts[0]), counts), donate_argnums=(0, 1, 3))
            if len(parts) == 1:
                self._updates[("update", s)] = rest
                return rest
            self._updates[("rest", s)] = rest  # its compiled program, for probes (bench/zero.py's bytes)
            # each tie's leaves get ONE compiled update, which every stage holding them runs on the same values:
            # the copies stay equal bit for bit (XLA compiles a stage's whole update differently from another's).
            # The ties' updates run first and read the shared optimizer leaves (a step count); the rest's, last,
            # consumes them.
            cut = opt_lib.state_parts(tx, mod, s, parts)
            ties = []  # (its parameters, its optimizer leaves, the shared ones it reads, its update)
            for i, part in enumerate(parts[1:], 1):
                idx, flags = tuple(own[k] for k in part), tuple(k in cut.shared for k in cut.index[i])
                if ("tied", idx, flags) not in self._updates:
                    self._updates[("tied", idx, flags)] = self._tie_update(idx, cut.treedefs[i], flags)
                ties.append((part, [k for k in cut.index[i] if k not in cut.shared],
                             [k for k in cut.index[i] if k in cut.shared], self._updates[("tied", idx, flags)]))

            def update(params, opt_state, grads, state, vec):
                leaves, out = cut.treedef.flatten_up_to(opt_state), [None] * len(own)
                for part, mine, common, fn in ties:
                    new, moved = fn([params[k] for k in part], [leaves[k] for k in mine], [leaves[k] for k in common],
                                    [grads[k] for k in part], vec)
                    for k, a in zip(part, new):
                        out[k] = a
                    for k, a in zip(mine, moved):
                        leaves[k] = a
                new, state_0, state = rest([params[k] for k in parts[0]],
                                           cut.treedefs[0].unflatten([leaves[k] for k in cut.index[0]]),
                                           [grads[k] for k in parts[0]], state, vec)
                for k, a in zip(parts[0], new):
                    out[k] = a
                for k, a in zip(cut.index[0], cut.treedefs[0].flatten_up_to(state_0)):
                    leaves[k] = a
                return out, cut.treedef.unflatten(leaves), state

            self._updates[("update", s)] = update
        return self._updates[("update", s)]

    def _tie_update(self, idx: tuple, treedef, shared: list):
        """The one jitted update of tied leaves `idx`: (params, their optimizer leaves, the shared ones, grads,
        vec) -> (params, their optimizer leaves); the shared leaves (read, not donated) come back from the rest."""
        update = self._subset_update(idx, [])

        def tie(params, mine, common, grads, vec):
            mine_it, common_it = iter(mine), iter(common)
            state = treedef.unflatten([next(common_it) if c else next(mine_it) for c in shared])
            params, state, _ = update(params, state, grads, [], vec)
            return params, [a for a, c in zip(treedef.flatten_up_to(state), shared) if not c]

        return self.jit(tie, donate_argnums=(0, 1))

    def _subset_update(self, idx: tuple, counts: list):
        """update(params, opt_state, grads, state, vec) of the parameters `idx` (canonical leaves, a stage's or
        part of it) with their optimizer state: grads / global weight, tx, and the RNG streams at `counts`
        advanced once."""
        tx, needs_norm, treedef = self.tx, self.needs_norm, opt_lib.subset_treedef(self.module, idx)

        def update(params, opt_state, grads, state, vec):
            inv, extra = opt_lib.mean_scale(vec, needs_norm)
            p = jax.tree.unflatten(treedef, params)
            g = jax.tree.unflatten(treedef, [x * inv for x in grads])
            updates, opt_state = tx.update(g, opt_state, p, **extra)
            state = [x + 1 if k in counts else x for k, x in enumerate(state)]  # RNG streams advance once
            return jax.tree.leaves(optax.apply_updates(p, updates)), opt_state, state

        return update

