"""A small decoder-only transformer language model in stock Flax NNX, and its next-token loss.

    python examples/lm.py tokens.npz                            # writes a synthetic token set with padding
    python train.py --model examples/lm.py:TinyLM --model-kwargs '{"vocab": 64}' --loss cross_entropy \
        --dataset npz --data-path tokens.npz --optimizer adamw --lr 3e-3 --strategy pipeline --num-stages 2

Batches are {"x": tokens [B, T], "y": next tokens [B, T], "mask": 0/1 [B, T]}: jaxpar's cross_entropy reads
the mask (padding positions count for nothing), and every strategy divides by the number of real tokens.
The model is a flat `layers` list (embedding, blocks, head) so the pipeline can cut it into stages.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Embedding(nnx.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, vocab: int, dim: int, max_len: int, dropout: float, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.positions = nnx.Embed(max_len, dim, rngs=rngs)
        self.tokens.dtype = self.positions.dtype = None  # compute in the tables' dtype (bf16 under a cast)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        return self.dropout(self.tokens(tokens) + self.positions(jnp.arange(t)))


class Block(nnx.Module):
    """Pre-LayerNorm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float, attention_dropout: float, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, dropout_rate=attention_dropout, decode=False,
                                           deterministic=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.proj = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        x = x + self.attn(h, mask=nnx.make_causal_mask(jnp.ones(x.shape[:-1])))
        return x + self.dropout(self.proj(jax.nn.gelu(self.fc(self.ln2(x)))))


class Head(nnx.Module):
    """Final LayerNorm and the projection to the vocabulary."""

    def __init__(self, dim: int, vocab: int, *, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(dim, rngs=rngs)
        self.out = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.ln(x))


class TinyLM(nnx.Module):
    """Embedding -> `depth` blocks -> head, as the flat `layers` list. `attention_dropout` (on the attention
    weights) defaults to `dropout`."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 2, max_len: int = 32,
                 dropout: float = 0.1, attention_dropout: float | None = None, *, rngs: nnx.Rngs):
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.layers = nnx.List([Embedding(vocab, dim, max_len, dropout, rngs=rngs),
                                *[Block(dim, heads, dropout, attention_dropout, rngs=rngs) for _ in range(depth)],
                                Head(dim, vocab, rngs=rngs)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x


def make_data(n: int = 256, seq_len: int = 16, vocab: int = 64, seed: int = 0, n_test: int = 64):
    """Token sequences from a noisy repeating pattern, right-padded to seq_len (mask 0 on the padding)."""
    rng = np.random.default_rng(seed)
    total = n + n_test
    start = rng.integers(0, vocab, (total, 1))
    step = rng.integers(1, 4, (total, 1))
    seq = (start + step * np.arange(seq_len + 1)) % vocab
    noise = rng.random(seq.shape) < 0.1
    seq = np.where(noise, rng.integers(0, vocab, seq.shape), seq).astype(np.int32)
    lengths = rng.integers(seq_len // 2, seq_len + 1, total)
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.float32)
    x, y = seq[:, :-1] * (mask > 0), seq[:, 1:] * (mask > 0)
    return {"x": x[:n], "y": y[:n], "mask": mask[:n], "x_test": x[n:], "y_test": y[n:], "mask_test": mask[n:]}


if __name__ == "__main__":
    data = make_data()
    np.savez(sys.argv[1] if len(sys.argv) > 1 else "tokens.npz", **{k: v for k, v in data.items()})
