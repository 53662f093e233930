"""Sampling from a GPT, as nanoGPT's `GPT.generate` does: each new token drawn from the logits at the last position,
divided by `temperature` and cropped to the `top_k` largest, the context cropped to the last `block_size` tokens.

    tokens_BxL = generate(model, prompt_BxT, max_new_tokens=200, temperature=0.8, top_k=200, seed=0)

The whole loop is one compiled program: the tokens live in a buffer of the final length, and each step runs the
model on a fixed window of it (the first `block_size` tokens, or the last `block_size` before the position being
filled), so no shape changes. Positions after the one being predicted are zeros, which causal attention never
reads. `temperature=0` takes the argmax (greedy). Dropout is off (a clone of the model in eval mode).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(model, prompt_BxT, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             seed: int = 0) -> np.ndarray:
    """The prompt followed by `max_new_tokens` sampled tokens, [B, T + max_new_tokens] int32 (see the module)."""
    prompt = np.asarray(prompt_BxT)
    cfg = model.config
    if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer) or prompt.shape[1] < 1:
        raise ValueError(f"the prompt has shape {prompt.shape} and dtype {prompt.dtype}; pass integer tokens [B, T] "
                         "with T >= 1 (a batch of one: prompt[None]).")
    outside = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)]
    if outside.size:
        raise ValueError(f"the prompt holds token {int(outside[0])}, outside the model's vocabulary "
                         f"0..{cfg.vocab_size - 1}; tokenize it for this model.")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0.")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy; nanoGPT samples at 0.8).")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must be in 1..{cfg.vocab_size} (the vocabulary), or None for every token.")
    b, t0 = prompt.shape
    total = t0 + int(max_new_tokens)
    if not max_new_tokens:
        return prompt.astype(np.int32)
    window = min(total, cfg.block_size)
    evaluated = nnx.clone(model)
    evaluated.eval()
    graphdef, state = nnx.split(evaluated)

    def pick(logits_BxV, key):
        if temperature == 0:
            return jnp.argmax(logits_BxV, axis=-1)
        logits_BxV = logits_BxV.astype(jnp.float32) / temperature
        if top_k is not None:
            kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
            logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
        return jax.random.categorical(key, logits_BxV, axis=-1)

    @jax.jit
    def run(state, tokens_BxL, key):
        m = nnx.merge(graphdef, state)

        def fill(t, carry):  # position t gets the token sampled from the logits at t - 1
            tokens_BxL, key = carry
            start = jnp.clip(t - window, 0, total - window)
            logits_BxWxV = m(jax.lax.dynamic_slice_in_dim(tokens_BxL, start, window, axis=1))
            key, draw = jax.random.split(key)
            nxt_B = pick(jax.lax.dynamic_index_in_dim(logits_BxWxV, t - 1 - start, axis=1, keepdims=False), draw)
            return jax.lax.dynamic_update_slice_in_dim(tokens_BxL, nxt_B[:, None].astype(jnp.int32), t, axis=1), key

        return jax.lax.fori_loop(t0, total, fill, (tokens_BxL, key))[0]

    tokens = np.zeros((b, total), np.int32)
    tokens[:, :t0] = prompt
    return np.asarray(run(state, jnp.asarray(tokens), jax.random.key(seed)))
