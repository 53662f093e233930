"""Loss scaling for float16 compute: DeepSpeed's fp16 `loss_scale` (static) and `DynamicLossScaler` (dynamic).

float16 flushes gradients below 6e-8 to zero. The backward therefore runs on the loss times a scale S, which lifts
the small gradients into range, and the gradients are divided by it again before the optimizer sees them. The
factor is a power of two (for a power-of-two S, as the dynamic scale always is), so in float32 both
multiplications are exact: without an overflow the optimizer gets the numbers it would get unscaled, to the
rounding of XLA fusing the two programs differently.

    tx = jaxpar.loss_scaling(optax.adamw(1e-3))           # DeepSpeed's fp16 defaults: 2**16, window 1000, ...
    ddp = jaxpar.DistributedDataParallel(objective, tx, ...)   # objective: Objective.of(..., compute_dtype=float16)

The scaler lives in the optimizer state (`LossScaleState` in front of the wrapped optimizer's), so checkpoints,
ZeRO's partitions and the pipeline's stages carry it as they carry Adam's step count. Each strategy reads the
current S from the state at the start of its step and seeds its backward with S / 2**round(log2(w)), w the summed
loss weight of the device's rows (`value_and_grad`): DeepSpeed and torch scale each rank's MEAN loss, jaxpar's
strategies differentiate SUMS (which keeps them split-independent), and the power of two keeps the seed exact.
The gradient is brought back (`unscale`) before any division by the global weight, clipping or update.

Dynamic scaling, step by step (DeepSpeed's `DynamicLossScaler.update_scale`): a step whose global gradient norm
is inf or NaN is skipped (no update, the optimizer's state and step count unchanged: no learning-rate step either)
and, once `hysteresis` overflows have used up their allowance, halves S (not below `min_loss_scale`); after
`loss_scale_window` steps without an overflow S doubles. The overflow test is the global norm every strategy
already feeds `jaxpar.optim.clip_by_global_norm`, so all devices, shards and stages skip together. A static scale
(`static=S`, DeepSpeed's `LossScaler`) never changes, and a step that overflows is skipped all the same: DeepSpeed's
fp16 optimizers check for an overflow whichever scaler they hold (and torch's GradScaler skips every inf step).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

MODES = ("dynamic", "static")
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """DeepSpeed's fp16 section: `loss_scale` 0 (dynamic) or a fixed scale, and the dynamic scaler's settings."""

    loss_scale: float = 0.0  # 0: dynamic; > 0: this fixed scale (a power of two keeps the unscaling exact)
    initial_scale_power: int = 16  # the dynamic scale starts at 2**initial_scale_power
    loss_scale_window: int = 1000  # steps without an overflow before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves (DeepSpeed's delayed_shift)
    consecutive_hysteresis: bool = False  # refill the hysteresis on every step without an overflow
    min_loss_scale: float = 1.0  # the scale never halves below this

    def __post_init__(self):
        def bad(what, rule, fix):
            raise ValueError(f"{what} {rule}; {fix}.")

        if not (self.loss_scale == 0 or 0 < self.loss_scale <= FLOAT32_MAX):  # the scale is held in float32
            bad(f"loss_scale={self.loss_scale}", f"must be 0 (dynamic) or a scale > 0 that float32 holds (at most "
                f"{FLOAT32_MAX:.4g})", "pass 0 for DeepSpeed's dynamic scaling, or a fixed scale such as 128")
        if self.loss_scale:  # static: the dynamic scaler's settings would be read by nothing
            given = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)[1:]
                     if getattr(self, f.name) != f.default]
            if given:
                bad(", ".join(given), f"set(s) the dynamic scaler, but loss_scale={self.loss_scale} is a fixed "
                    "scale", "drop them, or pass loss_scale=0 for dynamic scaling")
        for name, fix in (("initial_scale_power", "pass DeepSpeed's default 16"),
                          ("loss_scale_window", "pass DeepSpeed's default 1000"),
                          ("hysteresis", "pass DeepSpeed's default 2")):
            v = getattr(self, name)  # 2**2.5 was taken as a scale that is no power of two, a window of 2.5 steps
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not float(v).is_integer():
                bad(f"{name}={v!r}", "must be a whole number", fix)
        if not isinstance(self.consecutive_hysteresis, (bool, np.bool_)):  # 'no' was taken as True
            bad(f"consecutive_hysteresis={self.consecutive_hysteresis!r}", "must be True or False",
                "pass DeepSpeed's default False, or True to refill the hysteresis after every step without an overflow")
        if not 0 <= self.initial_scale_power <= 126:
            bad(f"initial_scale_power={self.initial_scale_power}", "must be in 0..126 (2**p a float32)",
                "pass DeepSpeed's default 16, or a smaller power")
        if self.loss_scale_window < 1:
            bad(f"loss_scale_window={self.loss_scale_window}", "must be >= 1", "pass DeepSpeed's default 1000")
        if self.hysteresis < 1:
            bad(f"hysteresis={self.hysteresis}", "must be >= 1", "pass 1 to halve the scale at every overflow, "
                "or DeepSpeed's default 2")
        if not 0 < self.min_loss_scale <= 2.0 ** self.initial_scale_power:
            bad(f"min_loss_scale={self.min_loss_scale}", f"must be in (0, 2**initial_scale_power = "
                f"{2.0 ** self.initial_scale_power:g}]", "pass DeepSpeed's default 1")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


class LossScaleState(NamedTuple):
    """The scaler's state: all scalars, shared by every device, shard and stage."""

    scale: jax.Array  # float32: the S of the next step
    iteration: jax.Array  # int32: steps taken (DeepSpeed's cur_iter)
    last_overflow: jax.Array  # int32: the step of the last overflow, -1 for none (last_overflow_iter)
    hysteresis: jax.Array  # int32: overflows left before the scale halves (cur_hysteresis)
    inner: Any  # the wrapped optimizer's state


def next_scale(cfg: LossScaleConfig, state: LossScaleState, overflow: jax.Array) -> LossScaleState:
    """DeepSpeed's DynamicLossScaler.update_scale as a pure function of the state (the inner state untouched)."""
    s, it, last, hyst = state.scale, state.iteration, state.last_overflow, state.hysteresis
    full = jnp.asarray(cfg.hysteresis, jnp.int32)
    halve = (cfg.hysteresis == 1) | (hyst == 1)
    o_scale = jnp.where(halve, jnp.maximum(s / 2.0, cfg.min_loss_scale), s)
    o_hyst = jnp.where(halve, hyst, hyst - 1)
    stable = it - last - 1
    grow = (stable > 0) & (stable % cfg.loss_scale_window == 0)
    ok_hyst = full if cfg.consecutive_hysteresis else jnp.where(grow, full, hyst)
    ok_scale = jnp.where(grow, s * 2.0, s)
    return LossScaleState(jnp.where(overflow, o_scale, ok_scale), it + 1, jnp.where(overflow, it, last),
                          jnp.where(overflow, o_hyst, ok_hyst), state.inner)


TORCH_NAMES = {  # torch.amp.GradScaler's argument -> what jaxpar (DeepSpeed) takes instead
    "init_scale": "initial_scale_power=p for a start at 2**p (16: torch's 65536), or static=S for a fixed scale",
    "growth_factor": "nothing for growth_factor (DeepSpeed's scale_factor is 2, torch's default)",
    "backoff_factor": "nothing for backoff_factor (the scale halves, torch's default 0.5), hysteresis=1 to halve at "
                      "every overflow as torch does",
    "growth_interval": "loss_scale_window=N for growth_interval (the scale doubles after N clean steps; DeepSpeed's "
                       "default 1000, torch's 2000)",
    "enabled": "nothing for enabled (leave the optimizer unwrapped to turn scaling off)",
}


def loss_scaling(tx: optax.GradientTransformation, config: LossScaleConfig | None = None, *,
                 static: float | None = None, **settings) -> optax.GradientTransformationExtraArgs:
    """`tx` behind a loss scaler: dynamic with DeepSpeed's defaults, `static=S` for a fixed scale, or a
    LossScaleConfig / its fields as keywords (`loss_scaling(tx, initial_scale_power=12, hysteresis=1)`).

    The update skips (zero updates, `tx`'s state kept) when the global gradient norm is not finite, under a static
    scale too (which then stays: only the dynamic one halves). It reads the
    norm from the extra argument ``global_norm`` when a strategy gives one (ZeRO, tp and the pipeline do, for
    their shards and stages), else computes it from the updates it is given (the whole gradient)."""
    torch = {k: TORCH_NAMES[k] for k in settings if k in TORCH_NAMES}
    if torch:  # torch.amp.GradScaler's names: a TypeError that named no fix
        raise ValueError(f"{', '.join(f'{k}={settings[k]!r}' for k in torch)}: torch.amp.GradScaler's name(s); "
                         "jaxpar.loss_scaling takes DeepSpeed's fp16 settings (the scale doubles and halves by 2): "
                         f"pass {'; '.join(torch.values())}.")
    if config is None:
        config = LossScaleConfig(loss_scale=float(static or 0.0), **settings)
    elif static is not None or settings:
        raise ValueError("pass either a LossScaleConfig or its fields as keywords, not both.")
    inner = optax.with_extra_args_support(tx)
    start = config.loss_scale or 2.0 ** config.initial_scale_power

    def init(params):
        return LossScaleState(jnp.asarray(start, jnp.float32), jnp.zeros((), jnp.int32),
                              jnp.full((), -1, jnp.int32), jnp.asarray(config.hysteresis, jnp.int32),
                              inner.init(params))

    def update(updates, state, params=None, *, global_norm=None, **extra):
        if global_norm is not None:
            extra["global_norm"] = global_norm
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        overflow = ~jnp.isfinite(norm)
        new, inner_state = inner.update(updates, state.inner, params, **extra)
        new = jax.tree.map(lambda u: jnp.where(overflow, jnp.zeros_like(u), u), new)
        inner_state = jax.tree.map(lambda a, b: jnp.where(overflow, a, b), state.inner, inner_state)
        if not config.dynamic:  # the scale stays; the counters say what happened
            return new, state._replace(iteration=state.iteration + 1,
                                       last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
                                       inner=inner_state)
        return new, next_scale(config, state, overflow)._replace(inner=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _is_state(x) -> bool:
    return isinstance(x, LossScaleState)


def find(opt_state: Any) -> LossScaleState | None:
    """The LossScaleState of an optimizer state, or None. ValueError where the scaler wraps only part of the
    optimizer (its state nested in a chain's, MultiSteps', ...): the transforms outside it would still run on a
    skipped step's inf/NaN gradients (Adam ahead of it turned its moments NaN for good, weight decay after it moved
    the weights of a step reported as skipped)."""
    found = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]
             if _is_state(x)]
    if len(found) > 1:
        raise ValueError("the optimizer holds more than one loss scaler; wrap the whole optimizer in one "
                         "jaxpar.loss_scaling.")
    if found and found[0][0]:
        raise ValueError(f"the loss scaler wraps only part of the optimizer (its state is opt_state"
                         f"{jax.tree_util.keystr(found[0][0])}), so the transforms outside it still run on the inf/NaN "
                         "gradients of a step it skips (Adam's moments turn NaN, weight decay moves the weights); wrap "
                         "the whole optimizer: jaxpar.loss_scaling(optax.chain(...)), outermost.")
    return found[0][1] if found else None


def wraps(tx: optax.GradientTransformation, params: Any) -> bool:
    """Whether `tx` holds a loss scaler (its state, traced abstractly over `params`)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), params)
    return find(jax.eval_shape(tx.init, abstract)) is not None


def with_scale(opt_state: Any, scale: float) -> Any:
    """`opt_state` with its loss scaler's S set to `scale` (a resumed run's new static --loss-scale)."""
    return jax.tree.map(lambda x: x._replace(scale=jnp.asarray(scale, jnp.float32)) if _is_state(x) else x,
                        opt_state, is_leaf=_is_state)


def current(opt_state: Any) -> jax.Array | None:
    """The scale S of this step's backward, or None when the optimizer has no scaler."""
    found = find(opt_state)
    return None if found is None else found.scale


def metrics(scale: jax.Array | None) -> dict:
    """The step's `loss_scale` metric: the S its backward ran at (nothing without a scaler)."""
    return {} if scale is None else {"loss_scale": scale}


def power_of_two(x: jax.Array) -> jax.Array:
    """2**round(log2(max(x, 1))) as float32, exactly."""
    k = jnp.round(jnp.log2(jnp.maximum(x.astype(jnp.float32), 1.0))).astype(jnp.int32)
    return jnp.ldexp(jnp.ones((), jnp.float32), k)


def value_and_grad(fn: Callable, scale: jax.Array | None, axis_name: Any = None, micro_batches: int = 1
                   ) -> Callable:
    """`jax.value_and_grad(fn, has_aux=True)` for ``fn(x, ...) -> (summed loss, (Sums, ...))``, its backward run
    on the scaled loss: ``g(x, ..., seed=None) -> ((loss, aux), gradient TIMES seed, seed)``.

    The seed, the cotangent of the summed loss, is S / 2**round(log2(w K)), w the summed weight of the call's rows
    averaged over the devices of `axis_name` (one scalar psum between the forward and the backward) and K the
    `micro_batches` accumulated into one step, or the `seed` given, so that those micro-batches share it. Every
    device so runs its float16 backward at S times its mean loss over K, as DeepSpeed's scaled ``loss.backward()``
    does on each rank (it divides each micro-batch's mean loss by gradient_accumulation_steps), and all devices at
    the same seed, so the gradients they reduce inside the backward add up. The seed is a
    power of two: `unscale` recovers the gradient exactly. Without a scaler (scale None): jax.value_and_grad's
    result and seed None."""
    plain = jax.value_and_grad(fn, has_aux=True)

    def run(x, *args, seed=None):
        if scale is None:
            return *plain(x, *args), None
        loss, vjp, aux = jax.vjp(lambda x: fn(x, *args), x, has_aux=True)
        if seed is None:
            w = aux[0].weight
            if axis_name is not None:
                w = lax.psum(w, axis_name) / lax.psum(1.0, axis_name)
            seed = scale / power_of_two(w * micro_batches)
        return (loss, aux), vjp(seed.astype(loss.dtype))[0], seed

    return run


def unscale(grads: Any, seed: jax.Array | None) -> Any:
    """A gradient computed at `seed` (a power of two) brought back to seed 1: exact."""
    if seed is None:
        return grads
    inv = 1.0 / seed
    return jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)
