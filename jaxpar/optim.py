"""Optimizers by name with PyTorch's defaults, nanoGPT's warmup + cosine learning rate, weight decay on every
parameter or on the matrices only (nanoGPT's and Megatron's parameter groups), and the global-norm clipping that
strategies can feed."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

OPTIMIZERS = ("sgd", "adam", "adamw", "adadelta")
DECAY_PARAMS = ("all", "matrices")  # torch.optim on model.parameters() | nanoGPT's / Megatron's groups: 2+ dims only
EPS_MIN = float(np.finfo(np.float32).tiny)  # the smallest eps float32 holds as a normal number (1.18e-38)
LR_SCHEDULES = ("step", "cosine")  # torch's StepLR (per epoch, gamma); nanoGPT's warmup + cosine decay


def make_optimizer(name: str, lr: float | optax.Schedule, momentum: float = 0.0,
                   weight_decay: float | None = None, decay_params: str = "all",
                   nesterov: bool = False, eps: float | None = None,
                   betas: tuple[float, float] = (0.9, 0.999)) -> optax.GradientTransformation:
    """torch.optim's SGD (momentum 0 unless given; `nesterov` as torch's, which needs a momentum), Adam, AdamW
    (weight_decay 0.01) and Adadelta (rho 0.9). `eps`: torch's, added to the denominator (default 1e-8 for Adam
    and AdamW, 1e-6 for Adadelta; SGD has none). `betas`: Adam's and AdamW's, torch's default (0.9, 0.999).
    `decay_params` "matrices": the decay only on parameters of 2+ dimensions (weights, embeddings), none on biases
    and LayerNorm/BatchNorm scales, as nanoGPT's configure_optimizers and Megatron's param groups do."""
    if decay_params not in DECAY_PARAMS:
        raise ValueError(f"decay_params={decay_params!r} is not known; use 'all' (torch.optim on model.parameters()) "
                         "or 'matrices' (nanoGPT's and Megatron's: no decay on biases and norms).")
    if eps is not None and (name == "sgd" or not eps_ok(eps)):
        rule = "is not an optimizer setting of sgd" if name == "sgd" else \
            f"must be a finite number of at least {EPS_MIN:.3g} (zero in float32 gives NaN updates where a gradient " \
            "is zero, infinity no update at all)"
        raise ValueError(f"eps={eps!r} {rule}; pass e.g. 1e-8 to adam, adamw or adadelta (torch's defaults: 1e-8, "
                         "1e-8, 1e-6).")
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas={tuple(betas)} must each be in [0, 1) (torch.optim.Adam's rule); pass e.g. torch's "
                         "(0.9, 0.999) or nanoGPT's (0.9, 0.95).")
    matrices = decay_params == "matrices"
    decay = add_decayed_weights_to_matrices if matrices else optax.add_decayed_weights
    if nesterov and not (name == "sgd" and momentum > 0):
        raise ValueError(f"nesterov=True needs SGD with a momentum > 0 (torch.optim.SGD's rule), not "
                         f"optimizer={name!r} with momentum={momentum}; pass a momentum, or drop nesterov.")
    if name == "sgd":  # optax's trace is torch's buffer (dampening 0): b = m b + g; nesterov steps by g + m b
        tx = optax.sgd(lr, momentum=momentum or None, nesterov=nesterov)
        return optax.chain(decay(weight_decay), tx) if weight_decay else tx
    if name == "adam":
        tx = optax.adam(lr, b1=b1, b2=b2, eps=1e-8 if eps is None else eps)
        return optax.chain(decay(weight_decay), tx) if weight_decay else tx
    if name == "adamw":
        weight_decay = 0.01 if weight_decay is None else weight_decay
        eps = 1e-8 if eps is None else eps
        if matrices:  # optax.adamw's own chain, its decay masked
            return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), decay(weight_decay),
                               optax.scale_by_learning_rate(lr))
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if name == "adadelta":
        tx = optax.adadelta(lr, rho=0.9, eps=1e-6 if eps is None else eps)
        return optax.chain(decay(weight_decay), tx) if weight_decay else tx
    raise ValueError(f"optimizer={name!r} is not known; use one of {', '.join(OPTIMIZERS)}.")


def eps_ok(x) -> bool:
    """Whether x can be an optimizer's eps: a real number (not a bool) that float32 holds as a finite value above
    zero (at least EPS_MIN)."""
    try:
        value = float(x) if not isinstance(x, (bool, str, bytes)) and np.ndim(x) == 0 else None
    except (TypeError, ValueError):
        return False
    return value is not None and EPS_MIN <= value < np.finfo(np.float32).max


def decays(shape: tuple) -> bool:
    """Whether weight decay reaches a parameter of this shape under decay_params="matrices": 2+ dimensions
    (nanoGPT's rule: weights and embeddings, not biases or norms' scales)."""
    return len(shape) >= 2


def add_decayed_weights_to_matrices(weight_decay: float) -> optax.GradientTransformationExtraArgs:
    """optax.add_decayed_weights (updates + weight_decay x params) on the parameters of 2+ dimensions only (optax's
    own, masked, gives the same numbers). A strategy that hands optax one flat vector of many parameters (ZeRO's
    shards) gives the per-element rule as the extra argument ``decay_mask`` (a tree like the updates, 1.0 where
    the decay applies, 0.0 elsewhere)."""
    def update(updates, state, params=None, *, decay_mask=None, **extra):
        del extra
        if params is None:
            raise ValueError("add_decayed_weights_to_matrices needs the parameters: call tx.update(grads, state, "
                             "params).")
        mask = decay_mask if decay_mask is not None else jax.tree.map(lambda p: float(decays(jnp.shape(p))), params)
        return jax.tree.map(decayed, updates, params, mask), state

    def decayed(u, p, m):
        if isinstance(m, float):  # one rule for the whole leaf
            return u + weight_decay * p if m else u
        return u + (weight_decay * m) * p  # per element, m 1.0 or 0.0: the same bits where it is 1.0

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm that takes the norm as the extra argument ``global_norm`` when a strategy
    gives it (the pipeline: the norm over every stage's gradients, tied weights once); without it, the norm of
    the updates it sees, exactly as optax's. Chain it like optax's: ``optax.chain(clip_by_global_norm(1.0),
    optax.adam(1e-3))``."""
    def update(updates, state, params=None, *, global_norm=None, **extra):
        del params, extra
        g_norm = optax.tree.norm(updates) if global_norm is None else global_norm
        trigger = jnp.squeeze(g_norm < max_norm)
        updates = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def state_kind(state) -> str:
    """An optimizer state's types, short (for errors): ScaleByAdamState, or (EmptyState, ScaleByAdamState)."""
    if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
        return "(" + ", ".join(state_kind(x) for x in state) + ")"
    return type(state).__name__


def op_by_op(fn):
    """`fn` run under jax.disable_jit(): the strategies' optimizer probes (a few update steps on tiny copies of the
    parameters), op by op. A lax.cond inside the optimizer (optax.MultiSteps, a loss scaler's skip) then runs the
    branch it takes, where outside jit each call compiled a program of its own (ZeRO's init with MultiSteps around
    a masked AdamW: 4.8 s, now 0.4 s)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.disable_jit():
            return fn(*args, **kwargs)

    return wrapped


def probe_gradients(shapes: list[tuple], rng: np.random.Generator) -> list[list[np.ndarray]]:
    """The gradients ZeRO's and the pipeline's optimizer probes step on, one list of leaves per step: standard
    normals at three scales, then normals x 1e12 with an inf in the largest leaf. A clipping threshold below ~1e12
    clips the whole tree and a part of it differently, and a transform that skips the update on a non-finite
    gradient anywhere (as optax.apply_if_finite does) updates the parts without the inf: neither is per-parameter.
    The scales change from step to step because Adam's update is blind to a constant one: a clip measuring
    something else than the parts are told (the decayed gradient, Adam's updates) shows only when it varies."""
    draw = lambda scale: [np.asarray(scale * rng.standard_normal(s), np.float32) for s in shapes]  # noqa: E731
    steps, large = [draw(1.0), draw(8.0), draw(0.125)], draw(1e12)
    large[int(np.argmax([int(np.prod(s)) for s in shapes]))].flat[0] = np.inf
    return [*steps, large]


def warmup_cosine(lr: float, warmup_steps: int, decay_steps: int, min_lr: float) -> optax.Schedule:
    """nanoGPT's learning rate for update `count` (0 = the first): lr x (count + 1) / (warmup_steps + 1) while
    count < warmup_steps, then a half cosine from lr down to min_lr at count = decay_steps, and min_lr after.
    (optax.warmup_cosine_decay_schedule differs: its warmup starts at exactly 0.)"""
    if not 0 <= warmup_steps < decay_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and below decay_steps={decay_steps}; "
                         "pass a larger decay_steps or fewer warmup_steps.")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr={min_lr} must be in [0, lr={lr}]; nanoGPT takes lr / 10.")

    def schedule(count):
        it = jnp.asarray(count, jnp.float32)
        ratio = jnp.clip((it - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cosine = min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (lr - min_lr)
        return jnp.where(it < warmup_steps, lr * (it + 1) / (warmup_steps + 1), cosine)

    return schedule
