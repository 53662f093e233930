"""One virtual stage's compiled functions: forward, backward (fused, or split into input and weight gradients),
forward+backward on the last stage, and an evaluation forward -- pure, over ITS OWN parameters only.

Roughly, for part v (a few segments, see jaxpar.pipeline.module) and one micro-batch::

    y, saved       = forward(params, state, x, data)           # saved: every segment's residuals (its vjp)
    acc            = zeros(params)                             # the step's first backward's accumulator
    acc, dx        = backward(acc, params, state, x, data, saved, dy)   # acc += dparams, in place (donated)
    g, dx          = backward(None, params, ...)               # the part's only backward of the step: dparams
    dx, cots       = input_grad(params, state, x, data, saved, dy)      # zero-bubble I: dx now, cotangents kept
    acc            = weight_grad(acc, params, state, x, data, saved, cots)   # zero-bubble W, later
    acc            = weight_grads(acc, params, state, [x..], [data..], [saved..], [cots..])  # a run of W's at once

The residuals a vjp keeps that are the function's own inputs (the weights, the stage input, the batch) are not
returned -- jit would copy them -- but passed again to the backward (`Saved` records where they go). On the last
virtual stage the forward ends in the loss: it returns the micro-batch's Sums and the backward seeds dloss = 1
(the gradient of the SUMMED loss; the engine divides by the global weight once), or with fp16's loss scaler the
step's seed (PartFns). Per-sample objectives run each
segment vmapped over rows, reseeding the segment's RNG streams by sample id as the reference step does, so
dropout masks equal single-device ones. With D data-parallel replicas of the stage the functions run under
shard_map over its DATA sub-mesh: rows sharded, weights replicated; residuals and gradient accumulators stay
per device (a leading axis of D) until the reduction once per step.

3-D (data x pipeline x Megatron tensor): with ``module.tensor_layouts`` set (PipelineModule.set_tensor_parallel)
the stage's sub-mesh is (DATA, TENSOR) and the functions run under shard_map over both axes: each weight comes in
as its slice (the per-parameter PartitionSpecs of jaxpar.strategies.tensor's plan, kind "params"), the blocks
inside call Megatron's f / g over TENSOR, the batch is replicated over TENSOR (kind "rows": by rows over DATA
only), and so are the activations and their gradients between stages (kind "act") -- except under Megatron's
sequence parallelism, where each tensor rank holds its tokens of them (by rows over DATA, tokens over TENSOR) --
and the per-device values -- residuals, cotangents, gradient accumulators of the slices -- carry a leading axis of
D x T (kind "local").
"""
from __future__ import annotations

import copy
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.batch import Rows
from jaxpar.loss_scale import power_of_two
from jaxpar.mesh import DATA, TENSOR
from jaxpar.objective import (Objective, Sums, _fresh, advance_rng, drop_sown, cast_floating,
                              refuse_one_value_per_channel, reseed)
from jaxpar.pipeline.module import apply_layers


@jax.tree_util.register_pytree_node_class
class Saved:
    """A list of vjp closures with the leaves that were inputs taken out: ``refs[i]`` is None (kept here) or
    (argument, leaf) to fetch from the backward's own arguments."""

    def __init__(self, leaves, static):
        self.leaves, self.static = list(leaves), static

    def tree_flatten(self):
        return self.leaves, self.static

    @classmethod
    def tree_unflatten(cls, static, leaves):
        return cls(leaves, static)

    @classmethod
    def strip(cls, vjps: list, inputs: tuple) -> "Saved":
        where = {id(a): (i, k) for i, arg in enumerate(inputs) for k, a in enumerate(jax.tree.leaves(arg))}
        leaves, treedef = jax.tree.flatten(vjps)
        refs = tuple(where.get(id(a)) for a in leaves)
        return cls([a for a, r in zip(leaves, refs) if r is None], (treedef, refs))

    def rebuild(self, inputs: tuple) -> list:
        treedef, refs = self.static
        args = [jax.tree.leaves(arg) for arg in inputs]
        kept = iter(self.leaves)
        return jax.tree.unflatten(treedef, [next(kept) if r is None else args[r[0]][r[1]] for r in refs])


class Layout(NamedTuple):
    """A micro-batch's data as the stages get it: the batch pytree's treedef and leaf shapes (one micro-batch,
    all its replicas' rows), and which leaves the first stage (the model's inputs) and the loss read."""
    treedef: Any
    specs: tuple  # jax.ShapeDtypeStruct per leaf
    inputs: tuple  # leaf positions read by loss.inputs(batch): sent to the first stage only
    targets: tuple  # leaf positions read by the loss: sent to the last stage only


def _floating(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.floating)


def split_float(x) -> tuple[list, list, Any, tuple]:
    """(float leaves, other leaves, treedef, which leaves are float) of a boundary pytree."""
    leaves, treedef = jax.tree.flatten(x)
    kinds = tuple(_floating(a) for a in leaves)
    return [a for a, f in zip(leaves, kinds) if f], [a for a, f in zip(leaves, kinds) if not f], treedef, kinds


def join_float(floats, others, treedef, kinds):
    fl, ot = iter(floats), iter(others)
    return jax.tree.unflatten(treedef, [next(fl) if f else next(ot) for f in kinds])


_COMPILED: dict = {}  # structure key -> PartFns: a part of the same structure on the same devices compiles once


def act_spec(module) -> P:
    """How a value crossing a stage boundary lies on the stage's devices: by rows over DATA (replicated over TENSOR),
    or with Megatron's sequence parallelism (`module.sequence_parallel`) also by tokens (axis 1) over TENSOR."""
    return P(DATA, TENSOR) if module.sequence_parallel else P(DATA)


def part_fns(module, part: int, objective: Objective, layout: Layout, mesh, micro_batches: int,
             compiler_options: dict | None = None, scaled: bool = False) -> "PartFns":
    """PartFns of `part`, shared with any earlier part of the same structure on the same devices (another
    Pipeline of the same model, another schedule over the same partition): XLA compiles each function once."""
    fns = PartFns(module, part, objective, layout, mesh, micro_batches, compiler_options, scaled)
    shared = _COMPILED.setdefault(fns.key, fns)
    if shared is fns:
        return fns
    # the same compiled functions (they take the parameters as arguments), but THIS part's parameters and state:
    # two parts of one structure on one stage (interleaved or V chunks of identical blocks) hold different ones
    out = copy.copy(shared)
    out.part, out.pidx, out.sidx = fns.part, fns.pidx, fns.sidx
    return out


class PartFns:
    """The compiled functions of virtual stage `part` (see the module docstring); `mesh` is the stage's DATA
    sub-mesh (D devices), `micro_batches` keys batch-mode RNG draws (shard = replica * M + micro-batch).

    `scaled` (fp16's loss scaler, jaxpar.loss_scale): the last part's backward starts from a seed instead of 1.
    Its forward functions take and return ``sv = [S, seed]``: a seed of 0 is set from this micro-batch, to
    S / 2**round(log2(w M / D)) (w its loss weight over the D replicas, M the micro-batches: DeepSpeed scales each
    micro-batch's mean loss over gradient_accumulation_steps), so the step's first micro-batch fixes the seed of
    all; its backward and input_grad take sv as their ``dy``.
    Every stage's gradient then carries the seed, which the engine divides out once at the step's end."""

    def __init__(self, module, part: int, objective: Objective, layout: Layout, mesh, micro_batches: int,
                 compiler_options: dict | None = None, scaled: bool = False):
        self.module, self.part, self.obj, self.layout, self.mesh = module, part, objective, layout, mesh
        self.segments = module.parts[part]
        self.first, self.last = part == 0, part == module.num_parts - 1
        self.pidx = sorted({j for seg in self.segments for j in seg.param_index})
        self.sidx = sorted({j for seg in self.segments for j in seg.state_index})
        ppos, spos = {j: k for k, j in enumerate(self.pidx)}, {j: k for k, j in enumerate(self.sidx)}
        self.seg_ppos = [tuple(ppos[j] for j in seg.param_index) for seg in self.segments]
        self.seg_spos = [tuple(spos[j] for j in seg.state_index) for seg in self.segments]
        self.frozen_pos = {spos[j]: j for j in self.sidx if j in getattr(module, "shared_frozen", ())}
        self.D, self.M = mesh.shape[DATA], micro_batches  # data replicas of the stage (x T tensor ranks: mesh.size)
        layouts = getattr(module, "tensor_layouts", None)
        self.param_specs = P() if layouts is None else \
            [layouts[j].spec(len(module.param_specs[j].shape)) for j in self.pidx]
        self.state_specs = module.state_specs(self.sidx)  # 3-D: frozen split weights lie split
        self.loss = objective.output_loss() if (self.first or self.last) else None
        self.scaled = scaled and self.last  # only the last part seeds the backward
        obj = objective
        self.key = (tuple((seg.graphdef, seg.eval_graphdef, seg.param_treedef, seg.state_treedef, seg.remat,
                           seg.layers.start > 0, pp, sp) for seg, pp, sp in zip(self.segments, self.seg_ppos,
                                                                                self.seg_spos)),
                    tuple(module.param_specs[j] for j in self.pidx), self.first, self.last, module.unpack,
                    obj.loss_fn, obj.wrt, obj.per_sample, obj.rows_per_call, obj.compute_dtype, layout,
                    tuple(mesh.devices.flat), tuple(mesh.shape.items()), str(self.param_specs),
                    str(self.state_specs), micro_batches,
                    act_spec(module), self.scaled,
                    tuple(sorted((compiler_options or {}).items())))
        self.options = compiler_options
        # "act": what crosses a stage boundary (x, y, dx, dy), by rows -- and under sequence parallelism also by
        # tokens over TENSOR (act_spec); "rows": the micro-batch's data
        # "state": the model-state leaves (3-D: a frozen split weight split as a trained one); the new state a
        # forward returns is () under per_sample
        replicated_out = "rep" if self.last else "act"
        sv = ("rep",) if self.scaled else ()  # the loss scaler's [S, seed], in and out
        dy = "rep" if self.scaled else "act"  # the last part's backward: sv (else None, the seed 1)
        new = "rep" if objective.per_sample else "state"
        self.forward = self._compile(self._forward, ("params", "state", "act", "rows", "rep", *sv),
                                     (replicated_out, "local", new, *sv))
        self.backward = self._compile(self._backward, ("local", "params", "state", "act", "rows", "local", dy),
                                      ("local", "act"), donate=(0,))
        self.input_grad = self._compile(self._input_grad, ("params", "state", "act", "rows", "local", dy),
                                        ("act", "local"))
        self.weight_grad = self._compile(self._weight_grad,
                                         ("local", "params", "state", "act", "rows", "local", "local"), "local",
                                         donate=(0,))
        self.joined: dict[int, bool] = {}  # micro-batches in a run of W's -> whether weight_grads joined their rows
        self.weight_grads = self._compile(self._weight_grads,
                                          ("local", "params", "state", "act", "rows", "local", "local"), "local",
                                          donate=(0,))
        self.forward_backward = self._compile(self._forward_backward,
                                              ("local", "params", "state", "act", "rows", "rep", *sv),
                                              ("local", "act", "rep", new, *sv), donate=(0,))
        self.forward_input_grad = self._compile(self._forward_input_grad,
                                                ("params", "state", "act", "rows", "rep", *sv),
                                                ("act", "local", "local", "rep", new, *sv))
        self.evaluate = self._compile(self._evaluate, ("params", "state", "act", "rows"), replicated_out)
        self.zeros = self._compile(self._zeros, ("params",), "local", placed=True)

    # -- compiling: one device, or shard_map over the stage's replicas ---------------------------------------

    def _compile(self, fn, ins, outs, donate=(), placed=False):
        """`placed`: the outputs read none of the inputs (zeros), so jit would leave them uncommitted on one device
        and the backward that takes them would compile again for them; they are placed as its outputs are."""
        if self.mesh.size == 1:
            where = {"out_shardings": NamedSharding(self.mesh, P())} if placed else {}
            return jax.jit(fn, donate_argnums=donate, compiler_options=self.options, **where)
        local = P(DATA) if len(self.mesh.axis_names) == 1 else P(tuple(self.mesh.axis_names))  # one slice a device
        spec = {"rep": P(), "rows": P(DATA), "act": act_spec(self.module), "local": local, "params": self.param_specs,
                "state": self.state_specs}
        expand = lambda kinds, xs: jax.tree.map(lambda a: a[None], xs) if kinds == "local" else xs  # noqa: E731
        squeeze = lambda kinds, xs: jax.tree.map(lambda a: a[0], xs) if kinds == "local" else xs  # noqa: E731

        def body(*args):
            out = fn(*[squeeze(k, a) for k, a in zip(ins, args)])
            if isinstance(outs, str):
                return expand(outs, out)
            return tuple(expand(k, o) for k, o in zip(outs, out))

        out_specs = spec[outs] if isinstance(outs, str) else tuple(spec[k] for k in outs)
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(spec[k] for k in ins), out_specs=out_specs,
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=donate, compiler_options=self.options)

    # -- the math --------------------------------------------------------------------------------------------

    def _rows(self, data) -> Rows:
        """The micro-batch as the loss sees it: the leaves this stage was sent, zeros (never read) elsewhere."""
        leaves, mask, ids = data
        have = dict(leaves)
        full = [have[i] if i in have else jnp.zeros((mask.shape[0],) + s.shape[1:], s.dtype)
                for i, s in enumerate(self.layout.specs)]
        return Rows(jax.tree.unflatten(self.layout.treedef, full), mask, ids)

    def _shard(self, m):
        return (lax.axis_index(DATA) * self.M + m) if self.D > 1 else m

    def _seg_apply(self, k, p, st, x, rows: Rows, train: bool, shard, whole: bool = False):
        """(output, state) of segment k on rows; `st` its state leaves, made Variables here, at the caller's
        trace level (NNX refuses to mutate a Variable from another one). `whole`: per-sample rows in one vmapped
        call, whatever the objective's rows_per_call (the joined W's trace, `_joined`)."""
        seg, obj = self.segments[k], self.obj
        graphdef = seg.graphdef if train else seg.eval_graphdef
        p = cast_floating(p, obj.compute_dtype)
        st = jax.tree.unflatten(seg.state_treedef, list(st))

        unpack, first = self.module.unpack, seg.layers.start
        run = lambda model, a: apply_layers(model, a, unpack, first)  # noqa: E731

        if not obj.per_sample:
            # copies of the state's Variables: nnx.merge keeps the Variables it is given, and reseed would overwrite
            # st's RNG key in place, which advance_rng below then keeps
            model = nnx.merge(graphdef, p, _fresh(st))
            if train:
                reseed(model, shard)
                refuse_one_value_per_channel(model)
            y = run(model, x)
            new = drop_sown(nnx.split(model, obj.wrt, ...)[2], st)
            if train and self.D > 1:  # buffers (BatchNorm running stats) of replica 0, as DDP's broadcast_buffers:
                from jaxpar.strategies.ddp import from_replica_0  # the state's spec says replicated

                new = from_replica_0(new, DATA, st)
            return y, (advance_rng(new, st, by=0) if train else st)

        def one(xr, sid, p, st):
            model = nnx.merge(graphdef, p, st)
            if train:
                reseed(model, sid)
            y = run(model, jax.tree.map(lambda a: a[None], xr))
            self._check_rows(y, seg.layers.stop - 1)
            return jax.tree.map(lambda a: a[0], y)

        n = rows.mask.shape[0]
        step = n if whole else (obj.rows_per_call or n)
        parts = [jax.vmap(one, in_axes=(0, 0, None, None))(jax.tree.map(lambda a: a[lo:lo + step], x),
                                                            rows.ids[lo:lo + step], p, st)
                 for lo in range(0, n, step)]  # unrolled: XLA:CPU runs convolutions in a loop slower
        y = parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
        return y, st

    def _refuse_frozen_change(self, k: int, j: int) -> None:
        """ValueError (at trace time): segment k's forward assigned frozen weight j, which several segments hold a
        copy of each (the copies would drift apart, each stage keeping its own change)."""
        mod = self.module
        layers = ", ".join(mod.names[i] for i in self.segments[k].layers)
        raise ValueError(f"frozen weight {'/'.join(map(str, mod.state_paths[j]))} (an nnx.Param that wrt leaves out) "
                         f"is used by layers on several pipeline parts, which each hold a copy, and layers {layers} "
                         f"(part {self.part}) change it in their forward; the copies would drift apart: keep a "
                         "value the forward updates in a variable of its own layer (not an nnx.Param), or train it "
                         "(include it in wrt).")

    def _check_rows(self, y, last: int) -> None:
        """ValueError unless every leaf of layer `last`'s output on one row (a batch of 1) has that row as its
        leading axis: the pipeline takes the row back out of each (a time-major [T, 1, D] would keep time step 0)."""
        for path, a in jax.tree_util.tree_flatten_with_path(y)[0]:
            shape = jnp.shape(a)
            if not shape or shape[0] != 1:
                raise ValueError(
                    f"layer {last} ({self.module.names[last]}) returns output{jax.tree_util.keystr(path)} shaped "
                    f"{shape} for one row (a batch of 1), whose leading axis is not that row "
                    f"({'a scalar has none' if not shape else f'dimension 0 is {shape[0]}'}); the pipeline passes "
                    "activations between layers by rows: return batch-first outputs (transpose a time-major one "
                    "back inside the layer), and keep batch-level values inside one layer.")

    def _seg_params(self, k, params):
        seg = self.segments[k]
        return jax.tree.unflatten(seg.param_treedef, [params[i] for i in self.seg_ppos[k]])

    def _seg_state(self, k, state):
        return [state[i] for i in self.seg_spos[k]]

    def _input(self, x, rows: Rows):
        return cast_floating(self.loss.inputs(rows.data), self.obj.compute_dtype) if self.first else x

    def _run(self, params, state, x, data, m, *, train: bool, grad: bool, loss: bool = True, whole: bool = False):
        """(output or loss, per-segment vjps, Sums or None, new state leaves); `loss` False: the last part's
        segments only (their output, no loss); `whole` as _seg_apply's."""
        rows, shard = self._rows(data), self._shard(m)
        x = self._input(x, rows)
        state, vjps = list(state), []
        for k, seg in enumerate(self.segments):
            p, st = self._seg_params(k, params), self._seg_state(k, state)
            if not grad:
                x, st = self._seg_apply(k, p, st, x, rows, train, shard)
            else:
                xf, xo, treedef, kinds = split_float(x)
                box = []  # the output's static split, recorded while f is traced

                def f(p, xf, st=st, xo=xo, treedef=treedef, kinds=kinds, k=k, box=box):
                    y, new = self._seg_apply(k, p, st, join_float(xf, xo, treedef, kinds), rows, True, shard,
                                             whole)
                    yf, yo, ytree, ykinds = split_float(y)
                    box[:] = [ytree, ykinds]
                    return yf, (yo, new)  # only float leaves carry gradients: others ride as aux

                yf, vjp, (yo, st) = jax.vjp(jax.checkpoint(f) if seg.remat else f, p, xf, has_aux=True)
                x = join_float(yf, yo, *box)
                vjps.append(vjp)
            for pos, leaf in zip(self.seg_spos[k], jax.tree.leaves(st)):
                if pos in self.frozen_pos and leaf is not state[pos]:
                    self._refuse_frozen_change(k, self.frozen_pos[pos])
                state[pos] = leaf
        if not (self.last and loss):
            return x, vjps, None, state
        if grad:
            xf, xo, treedef, kinds = split_float(x)

            def loss(xf):
                sums = self.obj.output_sums(join_float(xf, xo, treedef, kinds), rows)
                return sums.loss, sums

            _, vjp, sums = jax.vjp(loss, xf, has_aux=True)
            vjps.append(vjp)
        else:
            sums = self.obj.output_sums(x, rows)
        if self.D > 1:
            sums = jax.tree.map(lambda a: lax.psum(a, DATA), sums)
        return sums.loss, vjps, sums, state

    def _grads(self, vjps, dy, acc, params=None, *, weights: bool = True):
        """Walk the segments backwards from cotangent dy (on the last stage None: dloss = 1, or the loss scaler's
        sv: dloss = its seed): (acc + dparams -- or dparams where acc is None -- or None without weights, dx or
        None on the first stage, each segment's output cotangent)."""
        if self.last:
            dy = vjps[-1](jnp.ones((), jnp.float32) if dy is None else dy[1])[0]
            vjps = vjps[:-1]
        grads, cots = [None] * len(self.pidx), [None] * len(self.segments)
        for k in reversed(range(len(self.segments))):
            cots[k] = dy
            if k == 0 and self.first and not weights:
                break  # the input gradient of the first stage goes nowhere
            dp, dy = vjps[k](dy)  # what is not returned, XLA drops (dparams in I, dx in W)
            if weights:
                self._add(grads, k, dp)
        return (self._finish(grads, acc, params) if weights else None), (None if self.first else dy), cots

    def _add(self, grads: list, k: int, dp) -> None:
        for pos, g in zip(self.seg_ppos[k], jax.tree.leaves(dp)):
            grads[pos] = g if grads[pos] is None else grads[pos] + g  # a weight two segments share

    def _finish(self, grads: list, acc, params):
        """acc + this micro-batch's gradient; a leaf no segment here took a gradient of keeps acc's value. acc
        None (the part's only backward of the step, M = 1): the gradient itself, zeros for such a leaf -- no
        accumulator to write and read back (a pass over the stage's gradient that the single-device step skips)."""
        if acc is None:
            return [jnp.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        return [a if g is None else a + g for a, g in zip(acc, grads)]

    def _zeros(self, params):
        """The accumulator a step's first backward adds to (0 + g is g, bit for bit): one program per part, so
        the backward compiles once, not again for the first micro-batch's accumulator-less call."""
        return [jnp.zeros_like(p) for p in params]

    def _seed(self, sv, sums):
        """sv with its seed set from this micro-batch's weight, unless the step's first already set it."""
        fresh = sv[0] / power_of_two(sums.weight * (self.M / self.D))
        return sv.at[1].set(jnp.where(sv[1] > 0, sv[1], fresh))

    def _forward(self, params, state, x, data, m, *sv):
        out, vjps, sums, state = self._run(params, state, x, data, m, train=True, grad=True)
        saved = Saved.strip(vjps, (params, state, x, data))
        return (sums if self.last else out), saved, (() if self.obj.per_sample else state), \
            *(self._seed(sv[0], sums) for _ in sv)

    def _backward(self, acc, params, state, x, data, saved, dy):
        grads, dx, _ = self._grads(saved.rebuild((params, state, x, data)), dy, acc, params)
        return grads, dx

    def _input_grad(self, params, state, x, data, saved, dy):
        _, dx, cots = self._grads(saved.rebuild((params, state, x, data)), dy, None, weights=False)
        return dx, self._weighted(cots)

    def _weighted(self, cots: list) -> list:
        """The cotangents a W reads: those of the segments with weights (a ReLU's, written and never read, would
        double what an I keeps for its W on a stack of Linear + ReLU)."""
        return [c if self.seg_ppos[k] else None for k, c in enumerate(cots)]

    def _weight_grad(self, acc, params, state, x, data, saved, cots):
        vjps, grads = saved.rebuild((params, state, x, data)), [None] * len(self.pidx)
        for k in range(len(self.segments)):
            if self.seg_ppos[k]:
                self._add(grads, k, vjps[k](cots[k])[0])
        return self._finish(grads, acc, params)

    def _weight_grads(self, acc, params, state, xs, datas, saveds, cotss):
        """acc + the weight gradients of several micro-batches (a run of deferred W's) in one call. Where their
        stored residuals line up by rows (`_joined`) the micro-batches are pulled back as one batch of their rows
        joined, so each weight-gradient product sums over them inside its contraction: no accumulator pass per
        micro-batch (Megatron's gradient-accumulation fusion does this in the GEMM; its deferred wgrad, at the
        flush). Elsewhere each micro-batch's W in turn, adding up."""
        vjps = self._joined(params, state, xs, datas, saveds)
        self.joined[len(xs)] = vjps is not None
        if vjps is None:
            for x, data, saved, cots in zip(xs, datas, saveds, cotss):
                acc = self._weight_grad(acc, params, state, x, data, saved, cots)
            return acc
        grads = [None] * len(self.pidx)
        for k in range(len(self.segments)):
            if not self.seg_ppos[k]:
                continue
            cot = jax.tree.map(lambda *a: jnp.concatenate(a), *[c[k] for c in cotss])  # boundaries: rows first
            self._add(grads, k, vjps[k](cot)[0])
        return self._finish(grads, acc, params)

    def _joined(self, params, state, xs, datas, saveds) -> list | None:
        """The part's vjps at the micro-batches' rows joined, built from their STORED residuals, or None.

        Per-sample objectives only: every segment runs vmapped over rows, so each residual either carries the
        rows (the one axis that grows from R to n*R when the part is traced at the joined rows: the micro-batches'
        are concatenated along it) or none (made from the weights alone: micro-batch 0's is every one's). The
        forward traced here at the joined rows only supplies the vjps' structure; what it computes is unused and
        compiled away, and traced with all the joined rows in one vmapped call: it lines up with micro-batches
        that each ran as one call (no more rows than rows_per_call). None where the traces do not line up leaf for
        leaf (a micro-batch in several rows_per_call groups), or for batch-mode objectives, whose layers may mix
        rows (BatchNorm)."""
        if not self.obj.per_sample:
            return None
        n, cat, segments = len(xs), (lambda *a: jnp.concatenate(a)), len(self.segments)
        x = None if xs[0] is None else jax.tree.map(cat, *xs)
        data = jax.tree.map(cat, *datas)
        _, vjps, _, _ = self._run(params, state, x, data, 0, train=True, grad=True, loss=False, whole=True)
        fresh = Saved.strip(vjps, (params, state, x, data))
        stored = []  # each micro-batch's segment vjps (a last part's unfused forward also kept its loss's)
        for x_m, data_m, saved in zip(xs, datas, saveds):
            inputs = (params, state, x_m, data_m)
            stored.append(Saved.strip(saved.rebuild(inputs)[:segments], inputs))
        if fresh.static[1] != stored[0].static[1] or len(fresh.leaves) != len(stored[0].leaves):
            return None
        leaves = []
        for i, (new, old) in enumerate(zip(fresh.leaves, stored[0].leaves)):
            if new.dtype != old.dtype or new.ndim != old.ndim:
                return None
            grown = [ax for ax, (a, b) in enumerate(zip(new.shape, old.shape)) if a != b]
            if not grown:
                leaves.append(old)
            elif len(grown) == 1 and new.shape[grown[0]] == n * old.shape[grown[0]]:
                leaves.append(jnp.concatenate([s.leaves[i] for s in stored], axis=grown[0]))
            else:
                return None
        return Saved(leaves, fresh.static).rebuild((params, state, x, data))

    def _forward_backward(self, acc, params, state, x, data, m, *sv):
        _, vjps, sums, new_state = self._run(params, state, x, data, m, train=True, grad=True)
        sv = tuple(self._seed(a, sums) for a in sv)
        grads, dx, _ = self._grads(vjps, sv[0] if sv else None, acc, params)
        return grads, dx, sums, (() if self.obj.per_sample else new_state), *sv

    def _forward_input_grad(self, params, state, x, data, m, *sv):
        _, vjps, sums, new_state = self._run(params, state, x, data, m, train=True, grad=True)
        sv = tuple(self._seed(a, sums) for a in sv)
        _, dx, cots = self._grads(vjps, sv[0] if sv else None, None, weights=False)
        saved = Saved.strip(vjps[:-1], (params, state, x, data))
        return dx, saved, self._weighted(cots), sums, (() if self.obj.per_sample else new_state), *sv

    def _evaluate(self, params, state, x, data):
        out, _, sums, _ = self._run(params, state, x, data, 0, train=False, grad=False)
        return sums if self.last else out
