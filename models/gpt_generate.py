"""Sampling from a GPT, as nanoGPT's `GPT.generate` does: each new token drawn from the logits at the last position,
divided by `temperature` and cropped to the `top_k` largest, the context cropped to the last `block_size` tokens.

    tokens_BxL = generate(model, prompt_BxT, max_new_tokens=200, temperature=0.8, top_k=200, seed=0)

The whole loop is one compiled program over a buffer of the final length, in two phases:

- KV cache (`kv_cache=True`, the default; Hugging Face's `use_cache`): the prompt runs once (the prefill) and
  leaves each block's keys and values in a cache of `block_size` positions; each later step runs the model on the
  one new token at its position, attending to the cached keys up to it. A step costs one token's work, not the
  whole context's. It holds while the context fits the position table (up to `block_size` tokens).
- Window (after that, or with `kv_cache=False`): each step runs the model on a fixed window of the buffer (the first
  `block_size` tokens, or the last `block_size` before the position being filled), so no shape changes; positions
  after the one being predicted are zeros, which causal attention never reads. Past `block_size` the context is
  cropped and every position shifts, so cached keys no longer apply: nanoGPT's recompute is the rule there.

Both phases draw the same keys in the same order, so the tokens do not depend on the cache (the logits agree to
float rounding; tests/test_generate.py). `temperature=0` takes the argmax (greedy). Dropout is off (a clone of the
model in eval mode).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models.gpt_ops import causal_attention, dot_product_attention


def generate(model, prompt_BxT, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             seed: int = 0, kv_cache: bool = True, vocab_limit: int | None = None) -> np.ndarray:
    """The prompt followed by `max_new_tokens` sampled tokens, [B, T + max_new_tokens] int32 (see the module).
    `vocab_limit` V': only tokens below V' are drawn (the bytes, 256, for a model with a larger vocabulary trained
    on byte-level text: its other ids mean nothing there)."""
    try:
        prompt = np.asarray(prompt_BxT)
    except ValueError:  # numpy's "inhomogeneous shape": a list of prompts of different lengths
        raise ValueError("the prompts have different lengths; generate() takes a batch of prompts of one length "
                         "[B, T]: generate each alone (or pad them yourself to one length).") from None
    cfg = model.config
    if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer) or prompt.shape[1] < 1 or prompt.shape[0] < 1:
        raise ValueError(f"the prompt has shape {prompt.shape} and dtype {prompt.dtype}; pass integer tokens [B, T] "
                         "with B >= 1 and T >= 1 (a batch of one: prompt[None]).")
    outside = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)]
    if outside.size:
        raise ValueError(f"the prompt holds token {int(outside[0])}, outside the model's vocabulary "
                         f"0..{cfg.vocab_size - 1}; tokenize it for this model.")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not 0 <= temperature < np.inf:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy; nanoGPT samples at "
                         "0.8).")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed={seed!r} must be an int.")
    if vocab_limit is not None and (isinstance(vocab_limit, bool) or not isinstance(vocab_limit, (int, np.integer))
                                    or not 1 <= vocab_limit <= cfg.vocab_size):
        raise ValueError(f"vocab_limit={vocab_limit!r} must be an int in 1..{cfg.vocab_size} (the vocabulary), or "
                         "None for every token.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 (a k above the vocabulary, {cfg.vocab_size}, keeps "
                         "every token, as nanoGPT's min(top_k, vocab)), or None for every token.")
    if top_k is not None:  # nanoGPT's torch.topk(logits, min(top_k, logits.size(-1))): sample.py's top_k=200 on
        top_k = min(int(top_k), cfg.vocab_size)  # a 65-character vocabulary keeps all 65
    b, t0 = prompt.shape
    total = t0 + int(max_new_tokens)
    if not max_new_tokens:
        return prompt.astype(np.int32)
    evaluated = nnx.clone(model)
    evaluated.eval()
    graphdef, state = nnx.split(evaluated)
    tokens = np.zeros((b, total), np.int32)
    tokens[:, :t0] = prompt
    greedy = np.float32(temperature) == 0  # 0, or a temperature below float32's range (1e-46: 0 in float32)
    out = _generate(graphdef, state, jnp.asarray(tokens), jax.random.key(seed),
                    jnp.float32(1.0 if greedy else temperature),
                    t0=t0, block_size=cfg.block_size, greedy=greedy, top_k=top_k, kv_cache=bool(kv_cache),
                    vocab_limit=None if vocab_limit in (None, cfg.vocab_size) else int(vocab_limit))
    return np.asarray(out)


@functools.partial(jax.jit, static_argnames=("graphdef", "t0", "block_size", "greedy", "top_k", "kv_cache",
                                             "vocab_limit"))
def _generate(graphdef, state, tokens_BxL, key, temperature, *, t0: int, block_size: int, greedy: bool,
              top_k: int | None, kv_cache: bool, vocab_limit: int | None = None):
    """Positions t0.. of the buffer `tokens_BxL` filled (see the module); compiled once per model structure, prompt
    length, final length and sampling rule, so later calls with the same shapes run at once."""
    total = tokens_BxL.shape[1]
    window = min(total, block_size)
    cached_end = min(total, block_size + 1) if kv_cache and t0 <= block_size else t0  # positions < it: the cache
    m = nnx.merge(graphdef, state)

    def put(tokens_BxL, t, logits_BxV, key):  # position t gets a token drawn from the logits at t - 1
        key, draw = jax.random.split(key)
        if vocab_limit is not None:  # the ids at and above it are never drawn
            logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab_limit, logits_BxV, -jnp.inf)
        if greedy:
            nxt_B = jnp.argmax(logits_BxV, axis=-1)
        else:
            logits_BxV = logits_BxV.astype(jnp.float32)  # the largest at 0 first: a tiny temperature then
            logits_BxV = (logits_BxV - logits_BxV.max(axis=-1, keepdims=True)) / temperature  # gives -inf, not inf
            if top_k is not None:
                kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
                logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
            nxt_B = jax.random.categorical(draw, logits_BxV, axis=-1)
        return jax.lax.dynamic_update_slice_in_dim(tokens_BxL, nxt_B[:, None].astype(jnp.int32), t, axis=1), key

    if cached_end > t0:
        logits_BxV, cache = forward_cached(m, tokens_BxL[:, :t0], 0, None, window)  # the prefill
        tokens_BxL, key = put(tokens_BxL, t0, logits_BxV, key)

        def decode(t, carry):  # the token at t - 1 alone, attending to the cached keys 0..t-1
            tokens_BxL, key, cache = carry
            logits_BxV, cache = forward_cached(m, jax.lax.dynamic_slice_in_dim(tokens_BxL, t - 1, 1, axis=1), t - 1,
                                               cache, window)
            return (*put(tokens_BxL, t, logits_BxV, key), cache)

        tokens_BxL, key, _ = jax.lax.fori_loop(t0 + 1, cached_end, decode, (tokens_BxL, key, cache))

    def fill(t, carry):  # the model on the window ending at t (or the first `window` tokens)
        tokens_BxL, key = carry
        start = jnp.clip(t - window, 0, total - window)
        logits_BxWxV = m(jax.lax.dynamic_slice_in_dim(tokens_BxL, start, window, axis=1))
        return put(tokens_BxL, t, jax.lax.dynamic_index_in_dim(logits_BxWxV, t - 1 - start, axis=1, keepdims=False),
                   key)

    if max(t0, cached_end) == total:
        return tokens_BxL
    return jax.lax.fori_loop(max(t0, cached_end), total, fill, (tokens_BxL, key))[0]


def forward_cached(model, idx_BxT: jax.Array, start, cache: list | None, cache_len: int):
    """The eval-mode model on tokens at positions start..start+T-1, given the keys and values of every earlier
    position in `cache` (one (k, v) pair per block, [B, cache_len, heads, head size]; None: start is 0 and the
    cache is made here). Returns the logits at the last position [B, V] and the cache with these positions written
    in.

    The same modules and math as GPT.__call__ (causal attention over the prefill; the new queries against the
    cached keys <= their position afterwards), so the logits equal the whole-context forward's to rounding."""
    b, t = idx_BxT.shape
    x_BxTxC = model.wte(idx_BxT) + model.wpe(start + jnp.arange(t))  # Embedding's sum; its dropout is off in eval
    out = []
    for i, block in enumerate(model.h):
        attn = block.attn
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = attn.qkv(block.ln_1(x_BxTxC))
        if cache is None:
            k_BxLxNxH = jnp.zeros((b, cache_len) + k_BxTxNxH.shape[2:], k_BxTxNxH.dtype)
            v_BxLxNxH = jnp.zeros_like(k_BxLxNxH)
            y_BxTxNxH = causal_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, attn.attention)
        else:
            k_BxLxNxH, v_BxLxNxH = cache[i]
        k_BxLxNxH = jax.lax.dynamic_update_slice_in_dim(k_BxLxNxH, k_BxTxNxH, start, axis=1)
        v_BxLxNxH = jax.lax.dynamic_update_slice_in_dim(v_BxLxNxH, v_BxTxNxH, start, axis=1)
        if cache is not None:  # query start+i sees keys 0..start+i; the cache's later rows are masked out
            visible_TxL = jnp.arange(cache_len)[None, :] <= (start + jnp.arange(t))[:, None]
            y_BxTxNxH = dot_product_attention(q_BxTxNxH, k_BxLxNxH, v_BxLxNxH, mask=visible_TxL[None, None],
                                              implementation="xla")
        x_BxTxC = x_BxTxC + attn.c_proj(y_BxTxNxH.reshape(b, t, -1))  # resid_dropout is off in eval
        x_BxTxC = x_BxTxC + block.mlp(block.ln_2(x_BxTxC))
        out.append((k_BxLxNxH, v_BxLxNxH))
    return model.layers[-1](x_BxTxC[:, -1:])[:, 0], out  # the head on the last position only
