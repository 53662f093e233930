"""torch.nn.DataParallel, eagerly: one master device, a scatter / replicate / parallel_apply / gather each step.

No SPMD program: every step is a sequence of single-device computations dispatched from Python, exactly the
data movement of PyTorch's DataParallel, so its costs can be watched. One step, roughly:

    chunks   = scatter(batch)                  # torch.chunk along the batch (ceil(B/N) rows), chunk i -> device i
    replicas = replicate(params)               # jax.device_put of the master's params to every device used
    outs, vjps = parallel_apply(forward, replicas, chunks)   # dispatched back to back: devices run concurrently
    logits   = gather(outs)                    # onto the output device; loss and dL/dlogits there
    grads_i  = vjps[i](scatter(dL/dlogits))    # each device's backward from its SAVED residuals (no recompute)
    grads    = reduce_add(grads_i)             # onto the master, one replica at a time: the sum of the chunk
                                               # terms == the gradient of the global mean loss
    state    = apply_updates(tx, state, grads) # the optimizer runs on the master only

`loss_on_device=True` (the tutorials' fix): each device's forward ends in its own summed loss, only the scalars
travel to the output device, and the cotangent sent back is 1 / (global weight), so the loss is the
weight-weighted mean of the per-device means and the gradients are those of the global mean loss.

The model and loss follow jaxpar's contract (jaxpar.objective). Gathering the outputs needs the loss on
outputs (`jaxpar.OutputLoss`, the default cross-entropy is one); `loss_on_device` takes any loss(model, batch).
Model state: RNG streams advance once per step; BatchNorm (per_sample=False) normalises each chunk with its own
statistics and keeps replica 0's running buffers -- torch's DataParallel, whose replica 0 shares the module's
buffers on device_ids[0].

The master (params, gradients, optimizer state) is `device_ids[0]`; outputs are gathered on `output_device`
(an index into `jax.local_devices()`, as torch's cuda index; default `device_ids[0]`, as torch's).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar import loss_scale
from jaxpar.batch import Rows, as_rows, check_unpadded
from jaxpar.config import Config
from jaxpar.objective import Objective, OutputLoss, check_rows_leading, metrics_of
from jaxpar.run import memory
from jaxpar.step import TrainState, apply_updates, grad_norm
from jaxpar.strategies.base import (LayersCheck, cfg_objective, check_foreign_options, check_placed, check_state,
                                    objective_of, arm_first_batch, refuse_sync_batch_norm, to_device)


def chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """torch.chunk(batch, num_devices): chunks of ceil(B/N) rows, the last one smaller, possibly fewer than N.

    30 on 8 -> [4]*7 + [2]; 10 on 8 -> [2]*5 (five chunks: only five devices work this step).
    """
    if batch_size < 1 or num_devices < 1:
        raise ValueError(f"{batch_size=} and {num_devices=} must both be >= 1; pass a non-empty batch.")
    size = -(-batch_size // num_devices)
    full, rest = divmod(batch_size, size)
    return [size] * full + ([rest] if rest else [])


@partial(jax.jit, static_argnums=1)
def _split(tree, sizes: tuple[int, ...]):
    """The rows of every leaf cut into consecutive chunks of `sizes` (one dispatch on the holding device)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(jax.tree.map(lambda a: a[s:s + n], tree) for s, n in zip(starts, sizes))


@jax.jit
def _concat(*outs):
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *outs)


@jax.jit
def _add(total, grads):
    """One step of the reduction onto the master: total + one replica's gradients."""
    return jax.tree.map(jnp.add, total, grads)


@jax.jit
def _sum(*sums):
    """The gathered per-device Sums, added; the cotangent 1 / weight of the global mean loss."""
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    return total, 1.0 / total.weight


@jax.jit
def _times(a, b):
    return a * b


# The per-device pieces: module-level jits (objective static), so every DataParallel of one objective shares
# their compilations. Each runs on the device its inputs are committed to; XLA compiles once per (shape, device).
@partial(jax.jit, static_argnums=0)
def _forward_outputs(objective: Objective, params, model_state, chunk: Rows, shard):
    """(outputs, vjp, model state): the replica's forward, keeping its residuals in `vjp` for the backward."""
    return jax.vjp(lambda p: objective.outputs(p, model_state, chunk, shard=shard), params, has_aux=True)


@partial(jax.jit, static_argnums=0)
def _forward_loss(objective: Objective, params, model_state, chunk: Rows, shard):
    """(Sums, vjp, model state): the replica's forward ending in its own summed loss (loss_on_device)."""
    def local_loss(p):
        sums, new_state = objective.sums(p, model_state, chunk, shard=shard)
        return sums.loss, (sums, new_state)

    _, vjp, (sums, new_state) = jax.vjp(local_loss, params, has_aux=True)
    return sums, vjp, new_state


@partial(jax.jit, static_argnums=0)
def _output_grad(objective: Objective, outputs, rows: Rows, scale=None):
    """(Sums, dL/doutputs) of the global mean loss L, on the output device; times the loss scale `scale`, if
    any (torch's scaler.scale(loss).backward())."""
    def mean_loss(z):
        sums = objective.output_sums(z, rows)
        return sums.loss / sums.weight, sums

    # vjp, not grad: jax.grad refuses integer outputs (an argmax, predicted ids), whose cotangent is float0
    loss, vjp, sums = jax.vjp(mean_loss, outputs, has_aux=True)
    return sums, vjp(jnp.ones_like(loss) if scale is None else scale.astype(loss.dtype))[0]


@jax.jit
def _backward(vjp, cotangent):
    """The replica's parameter gradients from its saved residuals."""
    return vjp(cotangent)[0]


@partial(jax.jit, static_argnums=0)
def _update(tx: optax.GradientTransformation, state: TrainState, grads, model_state, scale=None):
    """The optimizer on the master, the gradients first unscaled (exact for a power-of-two loss scale)."""
    grads = loss_scale.unscale(grads, scale)
    return apply_updates(tx, state, grads, model_state), grad_norm(grads)


def _shape(tree) -> tuple:
    """The tutorial's "size" of a pytree: the shape of its one leaf, or the shapes of its leaves."""
    shapes = [tuple(a.shape) for a in jax.tree.leaves(tree)]
    return shapes[0] if len(shapes) == 1 else tuple(shapes)


TORCH_ONLY = {"dim": "the batch is scattered along every leaf's leading axis (torch's default dim=0) and the "
                      "outputs gathered along it; move the batch axis to 0"}


class DataParallel:
    """PyTorch's nn.DataParallel over `device_ids` (indices into jax.local_devices(); default all):
    `DataParallel(model, tx, loss_fn=...)` or `DataParallel(objective, tx)`."""

    name = "dp"

    def __init__(self, model: nnx.Module | Objective, tx: optax.GradientTransformation, *, loss_fn=None,
                 device_ids: Sequence[int] | None = None, output_device: int | None = None, loss_on_device: bool = False,
                 print_shapes: bool = False, **objective_options):
        self._layers_check = LayersCheck()  # armed by init where the layers run instead of __call__
        check_foreign_options("DataParallel", objective_options, TORCH_ONLY)  # before "unexpected keyword argument"
        if jax.process_count() > 1:
            raise ValueError(f"strategy='dp' runs in one process, but jax.process_count()={jax.process_count()}; "
                             "use DistributedDataParallel (--strategy ddp) across processes.")
        self.objective = objective_of(model, loss_fn, who="DataParallel", **objective_options)
        if not loss_on_device:  # gathering the outputs needs the loss on outputs: fail now, not mid-step
            try:
                self.objective.output_loss()
            except ValueError:
                raise ValueError("DataParallel gathers the replicas' outputs and runs the loss on them (torch's "
                                 "DataParallel), which needs a loss on the model's outputs, not a loss(model, batch): "
                                 "pass jaxpar.OutputLoss(fn, inputs=...) with fn(outputs, batch) -> (loss_sum, "
                                 "weight_sum[, metrics]), or loss_on_device=True (each replica runs the loss on "
                                 "its own rows).") from None
        elif print_shapes:  # the "In Model" line shows the outputs' shape, which loss(model, batch) hides
            try:
                self.objective.output_loss()
            except ValueError:
                raise ValueError("print_shapes prints each replica's output shape, which a loss(model, batch) "
                                 "never hands the strategy: pass the loss as jaxpar.OutputLoss(fn, inputs=...) (a "
                                 "loss on the outputs), or drop print_shapes (--print-shapes).") from None
        self.tx, self.output_device, self.loss_on_device, self.print_shapes = tx, output_device, loss_on_device, \
            print_shapes
        local = jax.local_devices()
        ids = list(range(len(local))) if device_ids is None else list(device_ids)
        if not ids:  # the check below compared None with an int
            raise ValueError(f"device_ids={ids} names no device; pass at least one index into the {len(local)} local "
                             "devices (or None for all of them).")
        output_device = ids[0] if output_device is None and ids else output_device  # torch's default
        self.output_device = output_device
        bad = [i for i in ids + [output_device] if not 0 <= i < len(local)]
        if not ids or bad or len(set(ids)) != len(ids):
            raise ValueError(f"device_ids={ids} and output_device={output_device} must be distinct indices "
                             f"into the {len(local)} local devices; pass an output_device (--output-device) in "
                             f"0..{len(local) - 1}, fewer devices, or more --cpu-devices.")
        self.devices = [local[i] for i in ids]
        self.master, self.out_device = self.devices[0], local[output_device]
        self._forward = partial(_forward_loss if loss_on_device else _forward_outputs, self.objective)
        self._tracker: memory.PeakTracker | None = None
        self._last_batch: Rows | None = None
        self._shapes: dict = {}

    def _inputs(self, chunk: Rows):
        loss = self.objective.loss_fn
        return loss.inputs(chunk.data) if isinstance(loss, OutputLoss) else chunk.data

    def _output_shape(self, state: TrainState, chunk: Rows) -> tuple:
        """The model's output shape on `chunk` (loss_on_device never materialises the outputs outside)."""
        key = jax.tree.map(jnp.shape, chunk.data)
        key = str(key)
        if key not in self._shapes:
            fn = lambda p, m, c: self.objective.outputs(p, m, c)[0]  # noqa: E731
            self._shapes[key] = _shape(jax.eval_shape(fn, state.params, state.model_state, chunk))
        return self._shapes[key]

    # -- the Strategy protocol --
    def init(self, state: TrainState) -> TrainState:
        check_state(state, self.tx, self.objective)
        arm_first_batch(self.objective, state, self._layers_check, self.tx)
        refuse_sync_batch_norm(self.objective.merge(state.params, state.model_state),
                               "DataParallel's per-device forwards")
        return to_device(state, self.master)

    def put_batch(self, batch) -> Rows:
        """The whole global batch onto the master (the tutorial's `input.to(device)`); step scatters it."""
        rows = as_rows(batch)
        self._layers_check(rows)
        if not self.objective.per_sample:
            check_unpadded(rows, "per_sample=False")
        return jax.device_put(rows, self.master)

    def step(self, state: TrainState, batch: Rows):
        check_placed(batch, Rows, "DataParallel", state)
        mark = self._tracker.mark if self._tracker else (lambda label: None)
        show = self.print_shapes and self._tracker is None  # a measuring step (report) prints nothing
        if self._last_batch is None or batch.mask.shape[0] > self._last_batch.mask.shape[0]:
            self._last_batch = batch  # for report(): one measured step over the largest batch (not a short last one)
        sizes = tuple(chunk_sizes(batch.mask.shape[0], len(self.devices)))
        devices = self.devices[:len(sizes)]
        scale = loss_scale.current(state.opt_state)  # fp16: the loss scale S, None without a scaler
        # scatter: cut on the master, copy chunk i to device i (each movement below is one coalesced device_put)
        chunks = jax.device_put(list(_split(batch, sizes)), devices)
        # replicate: the master's params and model state onto every device used this step
        replicas = jax.device_put([(state.params, state.model_state)] * len(devices), devices)
        # parallel_apply: one dispatch per device, back to back; nothing waits here
        outs, vjps, states = zip(*[self._forward(p, m, c, i) for i, ((p, m), c) in enumerate(zip(replicas, chunks))])
        if show:
            for c, o in zip(chunks, outs):
                shape = self._output_shape(state, c) if self.loss_on_device else _shape(o)
                print(f"\tIn Model: input size {_shape(self._inputs(c))} output size {shape}")
        # gather onto the output device (the replicas' outputs are dropped once copied); the loss there
        gathered = jax.device_put(list(outs), [self.out_device] * len(outs))
        del outs
        if self.loss_on_device:
            sums, cotangent = _sum(*gathered)
            if scale is not None:  # the backward of S times the loss
                cotangent = _times(cotangent, jax.device_put(scale, self.out_device))
            cotangents = jax.device_put([cotangent] * len(devices), devices)
            on_output = [sums]
            del cotangent
            if show:  # what torch's DataParallel gathers here: one loss per replica
                print(f"Outside: input size {_shape(self._inputs(batch))} output size ({len(devices)},)")
        else:
            check_rows_leading(gathered[0], sizes[0], ", or pass loss_on_device=True")
            outputs = _concat(*gathered)
            sums, doutputs = _output_grad(self.objective, outputs, *jax.device_put((batch, scale), self.out_device))
            cotangents = jax.device_put(list(_split(doutputs, sizes)), devices)  # scatter back
            on_output = [outputs, doutputs]
            if show:
                print(f"Outside: input size {_shape(self._inputs(batch))} output size {_shape(outputs)}")
            del outputs, doutputs
        del gathered
        mark("after gather: outputs and their gradient on the output device, residuals on every replica")
        # backward on every replica from its own residuals, dispatched back to back; then the step lets go of
        # the outputs, their gradients and the residuals (torch frees the graph as backward runs)
        grads = [_backward(v, g) for v, g in zip(vjps, cotangents)]
        del vjps, replicas, cotangents, on_output
        mark("after backward: every replica's gradients on its device")
        # reduce onto the master one replica at a time (torch's reduce_add: one incoming copy held at once)
        total = jax.device_put(grads[0], self.master)
        for g in grads[1:]:
            total = _add(total, jax.device_put(g, self.master))
            mark("reducing: the running sum and one replica's gradients on the master")
        del grads
        # replica 0's model state (its BatchNorm buffers; RNG streams advanced once) is the module's
        state, norm = _update(self.tx, state, total, jax.device_put(states[0], self.master), scale)
        mark("after update: new params and optimizer state on the master")
        # on the output device, where torch computes the loss
        return state, {**metrics_of(sums, norm), **loss_scale.metrics(scale)}

    def unplace(self, state: TrainState) -> TrainState:
        return state

    def describe(self) -> str:
        loss = ("on each device (scalars gathered)" if self.loss_on_device
                else f"on {self.out_device} (outputs gathered)")
        return (f"DataParallel over {len(self.devices)} devices {[d.id for d in self.devices]}: master "
                f"{self.master}, torch.chunk scatter, params replicated every step, loss {loss}, "
                "gradients reduced to the master, optimizer on the master")

    def measure(self, state: TrainState, batch: Rows) -> dict:
        """One (discarded) step of `state` on `batch`, measured: per device, `live_bytes` at the step's peak and
        `delta_bytes` over the bytes live before it; the master's extra over the fullest other device."""
        base = memory.baseline(self.devices)
        self._tracker = tracker = memory.PeakTracker(self.devices)
        try:
            jax.block_until_ready(self.step(state, batch))
        finally:
            self._tracker = None
        peak = tracker.peak
        others = max([peak[d] for d in self.devices[1:]], default=0)
        extra = peak[self.master] - others
        ratio = f" (x{peak[self.master] / others:.1f})" if others else ""
        return {
            "devices": len(self.devices),
            "memory": memory.memory_report(self.devices, peak, base),
            "master_peak_at": tracker.where[self.master],
            "master_extra_bytes": extra,
            "master_extra": f"{extra / 2**20:.3f} MiB more than the fullest other device{ratio}",
        }

    def report(self, state: TrainState) -> dict:
        """Per-device bytes at the step's peak, measured on one extra step (state unchanged) over the largest batch
        it stepped on: a full one, where the epoch's short last batch would reach fewer devices."""
        if self._last_batch is None:
            return {"devices": len(self.devices)}
        return self.measure(state, self._last_batch)


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config, loss_fn=None) -> DataParallel:
    ids = None if cfg.num_devices is None else list(range(cfg.num_devices))
    return DataParallel(cfg_objective(model, loss_fn, cfg), tx, device_ids=ids, output_device=cfg.output_device,
                        loss_on_device=cfg.loss_on_device, print_shapes=cfg.print_shapes)
