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
travel to the output device, and the cotangent sent back is 1 / (global sample count), so the loss is the
chunk-size-weighted mean of the per-device means and the gradients are those of the global mean loss.

The master (params, gradients, optimizer state) is `device_ids[0]`; outputs are gathered on `output_device`
(an index into `jax.local_devices()`, as torch's cuda index); with the defaults both are device 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.run import memory
from jaxpar.config import Config
from jaxpar.step import TrainState, apply_model, apply_updates, cast_floating, metrics_of, output_terms, sample_keys
from jaxpar.strategies.base import to_device
from jaxpar.types import Batch


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
    return jnp.concatenate(outs, axis=0)


@jax.jit
def _add(total, grads):
    """One step of the reduction onto the master: total + one replica's gradients."""
    return jax.tree.map(jnp.add, total, grads)


@jax.jit
def _sum_losses(*auxs):
    """The gathered per-device (loss_sum, correct, count), summed; the cotangent 1/count; the losses vector."""
    total = jax.tree.map(lambda *a: sum(a[1:], a[0]), *auxs)
    losses = jnp.stack([a["loss_sum"] / a["count"] for a in auxs])
    return total, 1.0 / total["count"], losses


def _targets(batch: Batch) -> Batch:
    """What the loss needs besides the outputs: labels and (padding) weights."""
    return {k: batch[k] for k in ("y", "w") if k in batch}


# The per-device pieces: module-level jits (graphdef static), so every DataParallel of one model shares their
# compilations. Each runs on the device its inputs are committed to; XLA compiles once per (shape, device).
def _model(graphdef, compute_dtype, params, chunk: Batch, key, step):
    keys = sample_keys(key, step, chunk["idx"])  # this chunk's own rows: the reference's dropout masks
    x = chunk["x"]
    if compute_dtype is not None:
        params, x = cast_floating(params, compute_dtype), x.astype(compute_dtype)
    return apply_model(graphdef, params, x, keys)


@partial(jax.jit, static_argnums=(0, 1))
def _forward_logits(graphdef, compute_dtype, params, key, step, chunk: Batch):
    """(logits, vjp): the replica's forward, keeping its residuals in `vjp` for the backward."""
    return jax.vjp(lambda p: _model(graphdef, compute_dtype, p, chunk, key, step), params)


@partial(jax.jit, static_argnums=(0, 1))
def _forward_loss(graphdef, compute_dtype, params, key, step, chunk: Batch):
    """(aux, vjp): the replica's forward ending in its own summed loss (loss_on_device)."""
    def local_loss(p):
        return output_terms(_model(graphdef, compute_dtype, p, chunk, key, step), chunk)

    _, vjp, aux = jax.vjp(local_loss, params, has_aux=True)
    return aux, vjp


@jax.jit
def _output_grad(logits, targets: Batch):
    """(aux, dL/dlogits) of the global mean loss L, on the output device."""
    def mean_loss(z):
        loss_sum, aux = output_terms(z, targets)
        return loss_sum / aux["count"], aux

    dz, aux = jax.grad(mean_loss, has_aux=True)(logits)
    return aux, dz


@jax.jit
def _backward(vjp, cotangent):
    """The replica's parameter gradients from its saved residuals."""
    return vjp(cotangent)[0]


@partial(jax.jit, static_argnums=0)
def _update(tx: optax.GradientTransformation, state: TrainState, grads):
    return apply_updates(tx, state, grads)


@dataclass
class DataParallel:
    """PyTorch's nn.DataParallel over `device_ids` (indices into jax.local_devices(); default all)."""

    graphdef: nnx.GraphDef  # or an nnx.Module, whose graphdef is taken
    tx: optax.GradientTransformation
    device_ids: Sequence[int] | None = None
    output_device: int = 0
    loss_on_device: bool = False
    print_shapes: bool = False
    compute_dtype: object = None
    name: str = "dp"
    devices: list = field(init=False)
    _tracker: memory.PeakTracker | None = field(init=False, default=None, repr=False)
    _last_batch: Batch | None = field(init=False, default=None, repr=False)
    _shapes: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.graphdef, nnx.Module):
            self.graphdef = nnx.graphdef(self.graphdef)
        if jax.process_count() > 1:
            raise ValueError(f"strategy='dp' runs in one process, but jax.process_count()={jax.process_count()}; "
                             "use --strategy ddp across processes.")
        local = jax.local_devices()
        ids = list(range(len(local))) if self.device_ids is None else list(self.device_ids)
        bad = [i for i in ids + [self.output_device] if not 0 <= i < len(local)]
        if not ids or bad or len(set(ids)) != len(ids):
            raise ValueError(f"device_ids={ids} and output_device={self.output_device} must be distinct indices "
                             f"into the {len(local)} local devices; pass fewer devices or more --cpu-devices.")
        self.devices = [local[i] for i in ids]
        self.master, self.out_device = self.devices[0], local[self.output_device]
        self._forward = partial(_forward_loss if self.loss_on_device else _forward_logits,
                                self.graphdef, self.compute_dtype)

    def _logits_shape(self, params, x: jax.Array) -> tuple:
        """The model's output shape for input `x` (loss_on_device never materialises the logits outside)."""
        if x.shape not in self._shapes:
            self._shapes[x.shape] = jax.eval_shape(partial(apply_model, self.graphdef), params, x).shape
        return self._shapes[x.shape]

    # -- the Strategy protocol --
    def init(self, state: TrainState) -> TrainState:
        return to_device(state, self.master)

    def put_batch(self, batch: Batch) -> Batch:
        """The whole global batch onto the master (the tutorial's `input.to(device)`); step scatters it."""
        return jax.device_put(batch, self.master)

    def step(self, state: TrainState, batch: Batch):
        mark = self._tracker.mark if self._tracker else (lambda label: None)
        show = self.print_shapes and self._tracker is None  # a measuring step (report) prints nothing
        self._last_batch = batch  # for report(): one measured step over it
        sizes = tuple(chunk_sizes(batch["x"].shape[0], len(self.devices)))
        devices = self.devices[:len(sizes)]
        # scatter: cut on the master, copy chunk i to device i (each movement below is one coalesced device_put)
        chunks = jax.device_put(list(_split(batch, sizes)), devices)
        # replicate: the master's params (and the dropout key and step) onto every device used this step
        replicas = jax.device_put([(state.params, state.key, state.step)] * len(devices), devices)
        # parallel_apply: one dispatch per device, back to back; nothing waits here
        outs, vjps = zip(*[self._forward(p, k, s, c) for (p, k, s), c in zip(replicas, chunks)])
        if show:
            for c, o in zip(chunks, outs):
                shape = self._logits_shape(state.params, c["x"]) if self.loss_on_device else o.shape
                print(f"\tIn Model: input size {tuple(c['x'].shape)} output size {tuple(shape)}")
        # gather onto the output device (the replicas' outputs are dropped once copied); the loss there
        gathered = jax.device_put(list(outs), [self.out_device] * len(outs))
        del outs
        if self.loss_on_device:
            aux, cotangent, losses = _sum_losses(*gathered)
            cotangents = jax.device_put([cotangent] * len(devices), devices)
            on_output = [losses]
            del losses, cotangent
        else:
            logits = _concat(*gathered)
            aux, dlogits = _output_grad(logits, jax.device_put(_targets(batch), self.out_device))
            cotangents = jax.device_put(list(_split(dlogits, sizes)), devices)  # scatter back
            on_output = [logits, dlogits]
            del logits, dlogits
        del gathered
        if show:
            print(f"Outside: input size {tuple(batch['x'].shape)} output size {tuple(on_output[0].shape)}")
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
        state = _update(self.tx, state, total)
        mark("after update: new params and optimizer state on the master")
        return state, metrics_of(aux)

    def unplace(self, state: TrainState) -> TrainState:
        return state

    def describe(self) -> str:
        loss = ("on each device (scalars gathered)" if self.loss_on_device
                else f"on {self.out_device} (outputs gathered)")
        return (f"DataParallel over {len(self.devices)} devices {[d.id for d in self.devices]}: master "
                f"{self.master}, torch.chunk scatter, params replicated every step, loss {loss}, "
                "gradients reduced to the master, optimizer on the master")

    def measure(self, state: TrainState, batch: Batch) -> dict:
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
        """Per-device bytes at the step's peak, measured on one extra step over the last batch (state unchanged)."""
        if self._last_batch is None:
            return {"devices": len(self.devices)}
        return self.measure(state, self._last_batch)


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config) -> DataParallel:
    from jaxpar.precision import compute_dtype

    ids = None if cfg.num_devices is None else list(range(cfg.num_devices))
    return DataParallel(nnx.graphdef(model), tx, ids, cfg.output_device, cfg.loss_on_device, cfg.print_shapes,
                        compute_dtype(cfg.precision))
