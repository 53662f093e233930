"""The schedule that is generated is the schedule that runs: one shard_map program scanning the schedule's table.

``lower(schedule)`` turns the schedule's grid into an int table ``[ticks, stages, COLS]`` (plain data, computed
once): the action of each stage at each tick, plus the buffer slots it reads and writes. ``make_step`` builds
one jitted program over the (DATA, PIPE) mesh; per tick every stage, roughly::

    op, mb, chunk, act, grad, stash, free, recv_act, recv_grad = table[t, stage]
    out = switch(branch(op, virtual stage), idle | F_v(params[chunk], input) | B_v via jax.vjp from act_buf[act])
    act_buf[stash] = x[mb] (first virtual stage: keep the input for the backward)
    act_buf[recv_act] = ppermute(F output, +1)    grad_buf[recv_grad] = ppermute(B input-grad, -1)

The backward recomputes its part's forward from the stored part input (jax.vjp inside the B branch), so a stage
keeps one input per micro-batch in flight: ``act_slots`` per stage (1F1B: <= S; GPipe: M). Unused reads and
writes go to one scratch slot at index ``num_act`` (``num_grad``), so no branch needs a condition.
Cost beyond the schedule's: each tick passes the stage's flat gradient buffer through the switch (XLA copies
it) and slices the weights out of the flat buffer, so a tick costs about one pass over the stage's weights --
noise for large micro-batches on a GPU, visible for tiny ones on CPU (bench/pipeline.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.mesh import DATA, PIPE
from jaxpar.pipeline.module import Part
from jaxpar.step import sample_keys

COLS = ("op", "mb", "chunk", "act", "grad", "stash", "free", "recv_act", "recv_grad")
OP, MB, CHUNK, ACT, GRAD, STASH, FREE, RECV_ACT, RECV_GRAD = range(len(COLS))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule lowered to buffer slots: ``table[t, s]`` holds COLS for stage s at tick t."""
    schedule: schedule_lib.Schedule
    table: np.ndarray
    act_slots: tuple[int, ...]  # per stage: stage inputs held at once (received or loaded, not yet backwarded)
    grad_slots: tuple[int, ...]  # per stage: received output-gradients waiting for their backward

    @property
    def num_act(self) -> int:
        return max(self.act_slots + (1,))

    @property
    def num_grad(self) -> int:
        return max(self.grad_slots + (1,))


def _allocate(intervals: dict) -> tuple[dict, int]:
    """Greedy interval colouring: a value written at the end of tick `a` and last read at tick `b` holds a slot
    during ticks (a, b]; a slot is reused once its last reader has run. Returns ({key: slot}, slots used)."""
    ends, slot = [], {}
    for key, (a, b) in sorted(intervals.items(), key=lambda kv: kv[1]):
        free = [i for i, e in enumerate(ends) if e <= a]
        i = free[0] if free else len(ends)
        ends[i:i + 1] = [b]
        slot[key] = i
    return slot, len(ends)


def lower(schedule: schedule_lib.Schedule) -> Plan:
    """The schedule's table with slots: where each stage input and output-gradient waits until it is used."""
    S, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    K, T = S * V, schedule.num_ticks
    tick = {}
    for t, row in enumerate(schedule.grid):
        for a in row:
            if a is not None:
                tick[a.op, a.chunk * S + a.stage, a.microbatch] = t
    F, B = schedule_lib.Op.F, schedule_lib.Op.B
    act, grad, act_n, grad_n = {}, {}, [], []
    for s in range(S):
        parts = range(s, K, S)
        a, n = _allocate({(v, m): (tick[F, max(v - 1, 0), m], tick[B, v, m]) for v in parts for m in range(M)})
        act.update({(s,) + k: i for k, i in a.items()})
        act_n.append(n)
        g, n = _allocate({(v, m): (tick[B, v + 1, m], tick[B, v, m]) for v in parts if v < K - 1 for m in range(M)})
        grad.update({(s,) + k: i for k, i in g.items()})
        grad_n.append(n)
    na, ng = max(act_n + [1]), max(grad_n + [1])
    table = np.zeros((T, S, len(COLS)), np.int32)
    table[..., [ACT, STASH, FREE, RECV_ACT]] = na
    table[..., [GRAD, RECV_GRAD]] = ng
    for (op, v, m), t in tick.items():
        s, c = v % S, v // S
        row = table[t, s]
        row[[OP, MB, CHUNK, ACT]] = (schedule_lib.FORWARD if op is F else schedule_lib.BACKWARD), m, c, act[s, v, m]
        if op is F:
            if v == 0:
                row[STASH] = act[s, v, m]
            if v < K - 1:
                table[t, (v + 1) % S, RECV_ACT] = act[(v + 1) % S, v + 1, m]
        else:
            row[FREE] = act[s, v, m]
            if v < K - 1:
                row[GRAD] = grad[s, v, m]
            if v > 0:
                table[t, (v - 1) % S, RECV_GRAD] = grad[(v - 1) % S, v - 1, m]
    return Plan(schedule, table, tuple(act_n), tuple(grad_n))


def boundary_shapes(parts: list[Part], x: jax.ShapeDtypeStruct) -> list[tuple]:
    """Per-sample input shape of every part, then the last part's output shape (abstract evaluation)."""
    shapes = [tuple(x.shape[1:])]
    for part in parts:
        x = jax.eval_shape(part.fn, [jax.ShapeDtypeStruct(s, jnp.float32) for s in part.shapes], x, None)
        shapes.append(tuple(x.shape[1:]))
    return shapes


def make_step(parts: list[Part], loss_fn: Callable, plan: Plan, mesh, tx: optax.GradientTransformation,
              *, x_shape: tuple):
    """(jitted ``(params [S,V,P], opt_state, step, key, batch) -> (params, opt_state, grads, metrics, live)``,
    info: micro_batch, boundary (the widest boundary, floats per sample), shapes).

    grads [S, V, P]: the accumulated gradient of the global mean loss that the update used (summed over the
    DATA groups); live [S]: the most stage inputs each stage held at once. batch: x, y, idx, w with rows
    sharded over (PIPE, DATA): replica d's rows are the blocks (s, d) of every stage s.
    """
    S, M, V = plan.schedule.num_stages, plan.schedule.num_microbatches, plan.schedule.virtual_stages
    K, NA, NG = S * V, plan.num_act, plan.num_grad
    D = mesh.shape[DATA]
    if x_shape[0] % math.lcm(S * D, D * M) or x_shape[0] == 0:
        raise ValueError(f"batch rows={x_shape[0]} must split into {D} data replicas x {M} micro-batches and over "
                         f"{S * D} devices; place batches with Pipeline.put_batch, which pads them (w = 0).")
    mb = x_shape[0] // (D * M)
    shapes = boundary_shapes(parts, jax.ShapeDtypeStruct((mb,) + tuple(x_shape[1:]), jnp.float32))
    A = max(math.prod(s) for s in shapes[:-1])  # flat per-sample size of the widest boundary
    zeros_a, zeros_aux = jnp.zeros((mb, A)), jnp.zeros((3,))

    def unpad(a, k):
        return a[:, :math.prod(shapes[k])].reshape((mb,) + shapes[k])

    def pad(y):
        y = y.reshape(mb, -1)
        return jnp.pad(y, ((0, 0), (0, A - y.shape[1])))

    def forward(k):
        def branch(params, grads, x_in, a_in, cot, keys, labels, inv):
            leaves = parts[k].unravel(params[k // S])
            y = parts[k].fn(leaves, unpad(x_in if k == 0 else a_in, k), keys)
            if k < K - 1:
                return pad(y), zeros_a, grads, zeros_aux
            _, aux = loss_fn(y, labels)
            return zeros_a, zeros_a, grads, jnp.stack([aux["loss_sum"], aux["correct"], aux["count"]])
        return branch

    def backward(k):
        part = parts[k]

        def branch(params, grads, x_in, a_in, cot, keys, labels, inv):
            leaves = part.unravel(params[k // S])
            if k < K - 1:
                f = lambda l_, a_: part.fn(l_, a_, keys)  # noqa: E731
                seed = unpad(cot, k + 1)
            else:
                f = lambda l_, a_: loss_fn(part.fn(l_, a_, keys), labels)[0]  # noqa: E731
                seed = inv  # d(loss_sum / global count) / d(loss_sum)
            if k == 0:  # the first part's input is data: no gradient to send
                _, vjp = jax.vjp(lambda l_: f(l_, unpad(a_in, 0)), leaves)
                (dp,), da = vjp(seed), zeros_a
            else:
                _, vjp = jax.vjp(f, leaves, unpad(a_in, k))
                dp, da = vjp(seed)
                da = pad(da)
            if part.size:  # the weight gradient, raveled, into the first `size` floats of the chunk's buffer
                grads = grads.at[k // S, :part.size].add(part.ravel(dp))
            return zeros_a, da, grads, zeros_aux
        return branch

    def idle(params, grads, *_):
        return zeros_a, zeros_a, grads, zeros_aux

    branches = [idle] + [forward(k) for k in range(K)] + [backward(k) for k in range(K)]
    ring = [(i, (i + 1) % S) for i in range(S)] if V > 1 else [(i, i + 1) for i in range(S - 1)]
    back = [(j, i) for i, j in ring]

    def body(params, opt_state, step, key, batch):
        stage = lax.axis_index(PIPE)
        params = params[0]  # [V, P]: this stage's chunks
        if S > 1:  # rows arrive spread over the replica's stages (process-major); every stage sees them all
            batch = jax.tree.map(lambda a: lax.all_gather(a, PIPE, tiled=True), batch)
        xs = jax.vmap(pad)(batch["x"].reshape((M, mb) + batch["x"].shape[1:]))
        ys, ws, idxs = (batch[k].reshape(M, mb) for k in ("y", "w", "idx"))
        count = lax.psum(jnp.sum(batch["w"]), DATA)
        all_keys = sample_keys(key, step, idxs.ravel()).reshape(M, mb)  # per-sample dropout keys
        table = jnp.asarray(plan.table)[:, stage]

        def tick(carry, row):
            act_buf, grad_buf, grads, live, peak, aux = carry
            v = row[CHUNK] * S + stage
            op, m = row[OP], row[MB]
            index = jnp.where(op == schedule_lib.IDLE, 0, jnp.where(op == schedule_lib.FORWARD, 1 + v, 1 + K + v))
            keys = all_keys[m]
            act_out, grad_out, grads, aux_t = lax.switch(  # the chunk is static in every branch
                index, branches, params, grads, xs[m], act_buf[row[ACT]], grad_buf[row[GRAD]], keys,
                {"y": ys[m], "w": ws[m]}, 1.0 / count)
            act_buf = act_buf.at[row[STASH]].set(xs[m])
            if S > 1:  # neighbours exchange: activations forward, input-gradients backward
                act_out = lax.ppermute(act_out, PIPE, ring)
                grad_out = lax.ppermute(grad_out, PIPE, back)
            act_buf = act_buf.at[row[RECV_ACT]].set(act_out)
            grad_buf = grad_buf.at[row[RECV_GRAD]].set(grad_out)
            live = live.at[row[FREE]].set(0).at[row[STASH]].set(1).at[row[RECV_ACT]].set(1).at[NA].set(0)
            return (act_buf, grad_buf, grads, live, jnp.maximum(peak, live.sum()), aux + aux_t), None

        carry = (jnp.zeros((NA + 1, mb, A)), jnp.zeros((NG + 1, mb, A)), jnp.zeros_like(params),
                 jnp.zeros((NA + 1,), jnp.int32), jnp.zeros((), jnp.int32), zeros_aux)
        (_, _, grads, _, peak, aux), _ = lax.scan(tick, carry, table)
        aux = lax.psum(aux, (DATA, PIPE))
        metrics = {"loss": aux[0] / aux[2], "correct": aux[1], "count": aux[2]}
        if D > 1:
            grads = lax.psum(grads, DATA)  # each stage's gradients, summed over its data-parallel group
        local = jax.tree.map(lambda a: a[0], opt_state)
        updates, local = tx.update(grads, local, params)
        new_params = optax.apply_updates(params, updates)
        return new_params[None], jax.tree.map(lambda a: a[None], local), grads[None], metrics, peak[None]

    specs_in = (P(PIPE), P(PIPE), P(), P(), P((PIPE, DATA)))
    specs_out = (P(PIPE), P(PIPE), P(PIPE), P(), P(PIPE))
    program = jax.shard_map(body, mesh=mesh, in_specs=specs_in, out_specs=specs_out, check_vma=False)
    info = {"micro_batch": mb, "boundary": A, "shapes": shapes}
    return jax.jit(program, donate_argnums=(0, 1)), info
