"""Ready-made losses on a model's outputs, ``fn(outputs, batch) -> (loss_sum, weight_sum, metrics)``.

Each returns sums (jaxpar.objective says why): wrap one in `jaxpar.OutputLoss` -- or pass it to train.py's
``--loss`` -- and every strategy, the pipeline included, can train with it. The defaults mirror torch's:

    cross_entropy     nn.CrossEntropyLoss: integer targets of any shape ([B], [B, T]), ignore_index=-100, and an
                      optional 0/1 ``batch["mask"]`` of the targets' shape; weight = the counted targets;
                      metrics: accuracy (argmax == target), and with torch's label_smoothing the unsmoothed
                      nll (the loss is smoothed). It also takes logits split by vocabulary over tensor ranks
                      (Megatron's parallel_output=True: jaxpar.comm.megatron.VocabParallelLogits)
    mse               nn.MSELoss: squared error summed over every element; weight = the number of elements
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.comm import megatron
from jaxpar.objective import LossOutput, OutputLoss, record_classes

IGNORE_INDEX = -100  # torch's CrossEntropyLoss default


def _targets(batch, key: str):
    if isinstance(batch, dict):
        if key not in batch:
            raise KeyError(f"the loss reads batch[{key!r}], but the batch has keys {sorted(batch)}; name the "
                           f"targets {key!r}.")
        return batch[key]
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[1]
    raise TypeError(f"a {type(batch).__name__} batch has no targets; use a dict with {key!r} or a tuple (x, y).")


def _mask(batch, shape) -> jnp.ndarray:
    mask = batch.get("mask") if isinstance(batch, dict) else None
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    if mask.shape != shape:
        raise ValueError(f"batch['mask'] has shape {mask.shape} but the targets have {shape}; give one 0/1 entry "
                         "per target.")
    return mask.astype(jnp.float32)


def cross_entropy(logits, batch, *, key: str = "y", ignore_index: int = IGNORE_INDEX,
                  label_smoothing: float = 0.0) -> LossOutput:
    """Summed softmax cross-entropy of `logits` [..., C] against integer targets [...] (torch's CrossEntropyLoss,
    its `label_smoothing` too: (1 - e) x the target's -log p + e x the mean of -log p over the C classes); `logits`
    split by vocabulary over tensor ranks (VocabParallelLogits) go through Megatron's vocab_parallel_cross_entropy,
    never gathered. A counted target outside [0, C) makes the loss NaN (torch raises; a jitted step cannot) and adds
    nothing to the gradient; as the default loss (an OutputLoss of it), every strategy's put_batch refuses one held
    on the host before any work (Objective.check_ids). A target that is not counted (ignore_index,
    or mask 0) adds nothing to the loss whatever it holds (a pad id outside [0, C) too) and whatever its logits
    hold (an inf or NaN in a padded row: the loss stays finite, and those logits' gradient is NaN, both as torch's)."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1] (torch's rule; 0 is plain "
                         "cross-entropy); pass e.g. --label-smoothing 0.1.")
    y = _targets(batch, key)
    if not jnp.issubdtype(jnp.result_type(y), jnp.integer):  # bool would train as classes 0 and 1; torch raises
        raise TypeError(f"cross_entropy: targets batch[{key!r}] of dtype {jnp.result_type(y)}; give integer class "
                        "ids (e.g. y.astype(np.int32)); for soft or real-valued targets write a loss of your own, or "
                        "use --loss mse.")
    y = y.astype(jnp.int32)  # uint8 targets: -100 would read 156, and class ids wrap past 255
    split = isinstance(logits, megatron.VocabParallelLogits)
    local = logits.local if split else logits
    if local.shape[:-1] != y.shape:
        raise ValueError(f"cross_entropy: logits {local.shape} do not match targets {y.shape}: expected logits of "
                         f"shape {tuple(y.shape)} + (classes,). It is the strategies' loss when none is given; for "
                         "other targets pass loss_fn=jaxpar.OutputLoss(jaxpar.mse) or a loss of your own.")
    w = _mask(batch, y.shape) * (y != ignore_index)
    counted = w != 0
    classes = local.shape[-1] * (jax.lax.psum(1, logits.axis) if split else 1)
    if not split:  # while Objective.check_inputs traces the loss: the bound every step checks host targets against
        record_classes(classes)
    inside = (y >= 0) & (y < classes)
    safe = jnp.where(counted & inside, y, 0)
    if split:
        nll = megatron.vocab_parallel_cross_entropy(local, safe, logits.axis)
        losses = megatron.vocab_parallel_cross_entropy(local, safe, logits.axis, label_smoothing) \
            if label_smoothing else nll
        predicted = megatron.vocab_parallel_argmax(local, logits.axis)
    else:
        if label_smoothing:  # one log-softmax for the target's term and the mean over the classes
            logp = jax.nn.log_softmax(local.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
            losses = (1.0 - label_smoothing) * nll - label_smoothing * jnp.mean(logp, axis=-1)
            predicted = jnp.argmax(local, -1)
        else:
            nll, predicted = nll_and_argmax(logits, safe)
            losses = nll
    losses = jnp.where(counted & ~inside, jnp.nan, losses)
    correct = (predicted == y).astype(jnp.float32)
    metrics = {"accuracy": jnp.sum(w * correct)}
    if label_smoothing:  # the targets' own -log p, which bits per byte and perplexity are made of
        metrics["nll"] = _counted_sum(w, jax.lax.stop_gradient(nll))
    return LossOutput(_counted_sum(w, losses), jnp.sum(w), metrics)


def _counted_sum(w: jax.Array, values: jax.Array) -> jax.Array:
    """sum(w * values) over the positions with w != 0 only: a dropped position adds nothing, even an inf or NaN
    (0 x inf is NaN), as torch skips an ignored target whatever its logits hold."""
    return jnp.sum(jnp.where(w != 0, w * values, 0.0))


cross_entropy.takes_vocab_parallel = True  # type: ignore[attr-defined]


@jax.custom_vjp
def nll_and_argmax(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(-log softmax(logits)[label] in float32, argmax(logits)) over the last axis; the same numbers as optax's
    softmax_cross_entropy_with_integer_labels on float32 logits and jnp.argmax, in fewer passes over the logits.

    The logits stay in their own dtype (bf16 under mixed precision): one pass finds the argmax (and so the max),
    one sums exp(x - max) in float32, and the backward, softmax - one_hot times the cotangent, reads them once more
    and writes the gradient in their dtype. Autodiff of the float32 formula would write a float32 copy of the logits
    and keep it for the backward: for GPT-2's 50,304 classes, 3.3 GB per 16 x 1024 tokens, about 5 ms of an H100's
    step in passes over it (bench/gpt_profile.py). Reverse mode only, as any jax.custom_vjp: jax.grad and
    jax.hessian work, jax.jvp and jax.jacfwd raise."""
    return _nll_and_argmax_fwd(logits, labels)[0]


def _nll_and_argmax_fwd(logits, labels):
    predicted = jnp.argmax(logits, axis=-1)
    top = jnp.take_along_axis(logits, predicted[..., None], axis=-1).astype(jnp.float32)  # the max
    log_sum = jnp.log(jnp.sum(jnp.exp(logits.astype(jnp.float32) - top), axis=-1))
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(jnp.float32)
    nll = log_sum - (picked - top[..., 0])  # optax's order: -(log_softmax)[label]
    return (nll, predicted), (logits, labels, top[..., 0] + log_sum)


def _nll_and_argmax_bwd(res, cotangents):
    logits, labels, log_z = res
    softmax = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
    one_hot = labels[..., None].astype(jnp.int32) == jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return ((softmax - one_hot) * cotangents[0][..., None]).astype(logits.dtype), None


nll_and_argmax.defvjp(_nll_and_argmax_fwd, _nll_and_argmax_bwd)


def takes_vocab_parallel(loss) -> bool:
    """Whether `loss` (a loss(model, batch), an OutputLoss, a functools.partial of either) declares that it takes
    logits split by vocabulary (``fn.takes_vocab_parallel = True``, as `cross_entropy` does)."""
    while True:
        if getattr(loss, "takes_vocab_parallel", False):
            return True
        if isinstance(loss, OutputLoss):
            loss = loss.fn
        elif isinstance(loss, functools.partial):
            loss = loss.func
        else:
            return False


def mse(outputs, batch, *, key: str = "y") -> LossOutput:
    """Summed squared error over every element (torch's MSELoss, whose mean divides by the element count)."""
    y = _targets(batch, key)
    if outputs.shape != y.shape:
        raise ValueError(f"outputs {outputs.shape} and targets {y.shape} differ in shape; MSE compares them "
                         "element by element (reshape one of them).")
    w = _mask(batch, y.shape)
    err = (outputs.astype(jnp.float32) - y.astype(jnp.float32)) ** 2
    return LossOutput(_counted_sum(w, err), jnp.sum(w), {})


LOSSES = {"cross_entropy": cross_entropy, "mse": mse}


def classification() -> OutputLoss:
    """The default loss: cross-entropy of ``model(batch["x"])`` against ``batch["y"]``."""
    return OutputLoss(cross_entropy)
