"""GPT-2 in Flax NNX, as nanoGPT writes it, and its PyTorch state dicts (Hugging Face's and nanoGPT's layouts).

    model = GPT(GPTConfig.named("gpt2", vocab_size=50257, block_size=1024), rngs=nnx.Rngs(params=0, dropout=0))
    logits_BxTxV = model(idx_BxT)                           # int tokens in, float logits out
    sd = model.torch_state_dict("hf")                       # or "nanogpt"; numpy arrays under torch's keys
    model = from_torch_state_dict(sd, n_head=12)            # layout and sizes read off the dict

The architecture is GPT-2's: learned token (`wte`) and position (`wpe`) embeddings, dropout, `n_layer` pre-LayerNorm
blocks `h.{i}` (`ln_1`, causal self-attention `attn` with a fused `c_attn` and an output `c_proj`, `ln_2`, an MLP
`mlp.c_fc` -> GELU -> `mlp.c_proj`), a
final `ln_f`, and `lm_head` tied to `wte` (logits = x @ wte^T; the model holds the embedding once). LayerNorm eps
1e-5. Init as nanoGPT: weights N(0, 0.02), the residual projections (`c_proj`) N(0, 0.02 / sqrt(2 n_layer)), biases
zero. Dropout (stock nnx.Dropout) after the embeddings, on the attention weights, after each residual projection.
The GELU is GPT-2's tanh form by default (`activation_function="gelu_new"`, transformers' name); nanoGPT's model
runs nn.GELU(), the erf form (`"gelu"`): logits ~1e-3 apart on the same weights, so load nanoGPT's own
checkpoints with "gelu" to compute what nanoGPT computes.

Attention runs through `jax.nn.dot_product_attention`: cuDNN's fused (flash) kernel on a GPU for bf16/fp16 inputs
and head sizes it takes, XLA elsewhere (on CPUs in query blocks, see causal_attention). With attention dropout on in
training, the weights are formed explicitly (as nanoGPT's non-flash path does), since the fused call has no dropout.
On CPUs the Linears' and the head's products go through `matmul` / `matmul_t`, whose weight gradient is one plain
GEMM over every token (XLA:CPU would run it as a transposed-operand dot outside YNNPACK: 22 % of a step's time).
`recompute_granularity="selective"` (Megatron's selective recompute) keeps only q, k, v of each block's attention
and runs the core attention again in the backward, so the T x T weights (and their dropout mask) are never kept.

Layouts: NNX kernels are [in, out], which is HF's Conv1D layout, so HF weights load as they are; nanoGPT's
nn.Linear weights are [out, in] and are transposed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.comm import megatron
from jaxpar.models.gpt_ops import (CPU_QUERY_BLOCK, attention_impl, bias_gelu, causal_attention,  # noqa: F401
                                   linear_dot_general, matmul, matmul_t)
from jaxpar.models import gpt_generate
from jaxpar.precision import LOW, add_wide, take_wide
from jaxpar.recompute import recompute_call

CONFIGS = {  # name -> (n_layer, n_head, n_embd)
    "gpt2": (12, 12, 768),  # 124M with GPT-2's vocabulary
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
    "gpt2-xl": (48, 25, 1600),  # 1558M
    "gpt-mini": (6, 6, 192),  # minGPT's small configs, for CPUs
    "gpt-micro": (4, 4, 128),
    "gpt-nano": (3, 3, 48),
    "gpt-cpu": (4, 4, 256),  # 4 layers x 256 wide: the CPU benchmark's model
}
ATTENTION = ("auto", "xla", "cudnn")
# the MLP's GELU by transformers' activation_function name -> jax.nn.gelu's `approximate`: GPT-2's tanh form
# (HF's gelu_new), or the erf form (HF's gelu; nanoGPT's and torch's nn.GELU())
ACTIVATIONS = {"gelu_new": True, "gelu": False}
LN_EPS = 1e-5  # torch's LayerNorm default, GPT-2's


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's GPTConfig, but for `vocab_size`: GPT-2's 50257 by default (Hugging Face's, and nanoGPT's
    from_pretrained), where nanoGPT's GPTConfig() pads it to 50304 (124,475,904 parameters against 124,439,808 here;
    pass vocab_size=50304 for nanoGPT's, which --tensor-parallel also splits evenly). `bias`: biases in Linears and
    LayerNorms (GPT-2: True). `attention`: auto | xla | cudnn.
    `activation_function`: the MLP's GELU, by transformers' name: gelu_new (GPT-2's tanh form) or gelu (the erf
    form, nanoGPT's nn.GELU()). `recompute_granularity` "selective": Megatron's selective recompute, each block's
    core attention (q k^T, softmax, dropout, the weighted sum of v) recomputed in the backward from q, k, v instead
    of keeping its T x T weights; None keeps them (full recompute is the strategy's activation_checkpoint_interval)."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention: str = "auto"
    recompute_granularity: str | None = None
    activation_function: str = "gelu_new"

    def __post_init__(self):
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, field), (int, np.integer)) or getattr(self, field) < 1:
                raise ValueError(f"GPT {field}={getattr(self, field)!r} must be an int >= 1.")
        if self.n_embd % self.n_head:
            divisors = [d for d in range(1, self.n_embd + 1) if self.n_embd % d == 0 and d <= 64]
            raise ValueError(f"n_head={self.n_head} does not divide the width n_embd={self.n_embd}; every head takes "
                             f"n_embd / n_head features: pass --n-head as one of {divisors}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1) (nanoGPT pretrains with 0.0).")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not known; use one of {ATTENTION}.")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"activation_function={self.activation_function!r} is not known; use gelu_new (GPT-2's "
                             "tanh GELU) or gelu (the erf form, nanoGPT's nn.GELU()).")
        if self.recompute_granularity not in (None, "selective"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r} is not known; use 'selective' "
                             "(the core attention) or None; full recompute (whole layers) is the strategy's "
                             "activation_checkpoint_interval=N (--activation-checkpoint-interval N).")

    @classmethod
    def named(cls, name: str, **overrides: Any) -> "GPTConfig":
        """The config `name` (CONFIGS: layers, heads, width); overrides set any field (vocab_size, block_size...)."""
        if name not in CONFIGS:
            raise ValueError(f"unknown GPT config {name!r}; use one of {', '.join(CONFIGS)}.")
        n_layer, n_head, n_embd = CONFIGS[name]
        return cls(**{"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
                      **{k: v for k, v in overrides.items() if v is not None}})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Linear(nnx.Linear):
    """nnx.Linear whose bias is added in float32 when the compute is 16-bit (jaxpar.precision.add_wide): its
    gradient, a sum over every token, then accumulates in float32 as torch autocast's does. Otherwise nnx.Linear."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if self.bias is None or jnp.dtype(self.bias.dtype) not in LOW and jnp.dtype(inputs.dtype) not in LOW:
            return super().__call__(inputs, out_sharding)
        return add_wide(*self.product(inputs, out_sharding))

    def product(self, inputs: jax.Array, out_sharding=None) -> tuple[jax.Array, jax.Array | None]:
        """(inputs @ kernel, the bias), both in the dtype __call__ computes in: the layer before its bias add."""
        x, kernel, bias = self.promote_dtype((inputs, self.kernel[...], self.bias[...] if self.bias is not None
                                              else None), dtype=self.dtype)
        kwargs = {"out_sharding": out_sharding}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        return self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision,
                                **kwargs), bias


def _linear(n_in: int, n_out: int, cfg: GPTConfig, std: float, rngs: nnx.Rngs) -> Linear:
    return Linear(n_in, n_out, use_bias=cfg.bias, kernel_init=nnx.initializers.normal(std),
                  bias_init=nnx.initializers.zeros_init(), dot_general=linear_dot_general, rngs=rngs)


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.n_embd, epsilon=LN_EPS, use_bias=cfg.bias, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention: one fused qkv projection `c_attn`, the output projection `c_proj`.

    Megatron tensor parallelism (jaxpar.strategies.tensor sets `tensor_axis`): this rank holds the q, k and v
    columns of n_head / T heads and the matching rows of `c_proj`; its input passes Megatron's f, its output g."""

    tensor_axis: str | None = None  # the TENSOR mesh axis when the heads are split over it
    tensor_size: int = 1
    sequence_parallel: bool = False  # its input and output are this rank's tokens (Megatron's --sequence-parallel)

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.c_attn = _linear(cfg.n_embd, 3 * cfg.n_embd, cfg, 0.02, rngs)
        self.c_proj = _linear(cfg.n_embd, cfg.n_embd, cfg, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)
        self.attn_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.n_head, self.attention = cfg.n_head, cfg.attention
        self.recompute_core = cfg.recompute_granularity == "selective"

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        """How Megatron splits this module: qkv columns by head, c_proj by rows (its bias stays whole)."""
        h = self.c_proj.kernel.shape[1] // self.n_head  # heads stay whole: split in units of a head's size
        out = {("c_attn", "kernel"): ("qkv", 1, h), ("c_proj", "kernel"): ("rows", 0, h)}
        return {**out, ("c_attn", "bias"): ("qkv", 0, h)} if self.c_attn.bias is not None else out

    def __call__(self, x_BxTxC: jax.Array) -> jax.Array:
        if self.tensor_axis is not None:
            return self._tensor_parallel(x_BxTxC)
        b, t, c = x_BxTxC.shape
        y_BxTxNxH = self._core_attention(*self.qkv(x_BxTxC))
        return self.resid_dropout(self.c_proj(y_BxTxNxH.reshape(b, t, c)))

    def qkv(self, x_BxTxC: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v [B, T, heads, head size] from the fused c_attn (the unsplit model's)."""
        b, t, c = x_BxTxC.shape
        return tuple(a.reshape(b, t, self.n_head, c // self.n_head) for a in jnp.split(self.c_attn(x_BxTxC), 3, -1))

    def _core_attention(self, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH) -> jax.Array:
        """Megatron's core attention, from q, k, v to the heads' outputs; under selective recompute its backward
        runs it again (the same dropout mask) from q, k, v and the dropout's saved RNG state."""
        if self.recompute_core:
            return recompute_call(self._attend, self.attn_dropout, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
        return self._attend(self.attn_dropout, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)

    def _attend(self, drop: nnx.Dropout, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH) -> jax.Array:
        """Causal attention; with attention dropout on in training, nanoGPT's explicit path (the weights formed,
        `drop(att)` applied; under tensor parallelism the whole model's mask, this rank's heads), else the fused
        call."""
        if not (drop.rate > 0 and not drop.deterministic):
            return causal_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, self.attention)
        t, h = q_BxTxNxH.shape[1], q_BxTxNxH.shape[-1]
        att_BxNxTxT = jnp.einsum("bqnh,bknh->bnqk", q_BxTxNxH, k_BxTxNxH) / math.sqrt(h)
        att_BxNxTxT = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att_BxNxTxT, -jnp.inf)
        att_BxNxTxT = jax.nn.softmax(att_BxNxTxT.astype(jnp.float32), axis=-1).astype(q_BxTxNxH.dtype)
        dropped_BxNxTxT = megatron.split_dropout(drop, att_BxNxTxT, self.tensor_axis, 1)  # all heads' mask, ours
        return jnp.einsum("bnqk,bknh->bqnh", dropped_BxNxTxT, v_BxTxNxH)

    def _tensor_parallel(self, x_BxTxC: jax.Array) -> jax.Array:
        """This rank's heads: f(x) @ its qkv columns, attention, then g(y @ its c_proj rows) + the bias. Sequence
        parallel: x is this rank's tokens, all-gathered in place of f, and the output reduce-scattered in place of
        g."""
        sp = self.sequence_parallel
        x_BxTxC = megatron.gather_sequence(x_BxTxC, self.tensor_axis, 1) if sp else megatron.f(x_BxTxC,
                                                                                              self.tensor_axis)
        b, t, c = x_BxTxC.shape
        h, n = c // self.n_head, self.n_head // self.tensor_size  # head size, this rank's heads
        qkv_BxTx3D = megatron.column_linear(self.c_attn, x_BxTxC)
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = (a.reshape(b, t, n, h) for a in jnp.split(qkv_BxTx3D, 3, axis=-1))
        y_BxTxNxH = self._core_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
        y_BxTxC = megatron.row_linear(self.c_proj, y_BxTxNxH.reshape(b, t, n * h), self.tensor_axis,
                                      1 if sp else None)
        return sequence_dropout(self.resid_dropout, y_BxTxC, self.tensor_axis, sp)


class MLP(nnx.Module):
    """c_fc (4x wider) -> GELU (cfg.activation_function's) -> c_proj -> dropout. Under Megatron tensor parallelism
    (`tensor_axis`) this rank holds 4C / T columns of c_fc and the matching rows of c_proj: f before, g after."""

    tensor_axis: str | None = None
    tensor_size: int = 1
    sequence_parallel: bool = False

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.c_fc = _linear(cfg.n_embd, 4 * cfg.n_embd, cfg, 0.02, rngs)
        self.c_proj = _linear(4 * cfg.n_embd, cfg.n_embd, cfg, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.approximate = ACTIVATIONS[cfg.activation_function]  # the tanh GELU (else erf)

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        out = {("c_fc", "kernel"): ("columns", 1), ("c_proj", "kernel"): ("rows", 0)}
        return {**out, ("c_fc", "bias"): ("columns", 0)} if self.c_fc.bias is not None else out

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.tensor_axis is not None:
            sp = self.sequence_parallel
            x = megatron.gather_sequence(x, self.tensor_axis, 1) if sp else megatron.f(x, self.tensor_axis)
            h = self._gelu(*megatron.column_linear(self.c_fc, x, skip_bias_add=True))
            y = megatron.row_linear(self.c_proj, h, self.tensor_axis, 1 if sp else None)
            return sequence_dropout(self.dropout, y, self.tensor_axis, sp)
        return self.dropout(self.c_proj(self._gelu(*self.c_fc.product(x))))

    def _gelu(self, y: jax.Array, bias: jax.Array | None) -> jax.Array:
        """GELU(y + bias): with a bias, gpt_ops.bias_gelu (Megatron's bias-GELU fusion: on a GPU, c_fc's cuBLASLt
        epilogue)."""
        if bias is None:
            return jax.nn.gelu(y, approximate=self.approximate)
        return bias_gelu(y, bias, self.approximate)


class Block(nnx.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)): the pre-LayerNorm residual block."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(cfg, rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln_2 = _layer_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nnx.Module):
    """The first pipeline layer: tokens [B, T] -> drop(wte[idx] + wpe[0:T]) [B, T, C]. A view of the model's own
    `wte`, `wpe` and `drop` (the same objects), not a copy. Under tensor parallelism with `wte` split by vocabulary
    rows: Megatron's VocabParallelEmbedding (each rank looks up its own rows, one all-reduce)."""

    tensor_axis: str | None = None
    tensor_size: int = 1
    sequence_parallel: bool = False

    def __init__(self, wte: nnx.Embed, wpe: nnx.Embed, drop: nnx.Dropout, tensor_axis: str | None = None,
                 tensor_size: int = 1, sequence_parallel: bool = False):
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.tensor_axis, self.tensor_size, self.sequence_parallel = tensor_axis, tensor_size, sequence_parallel

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        return {("wte", "embedding"): ("vocab", 0)}

    def __call__(self, idx_BxT: jax.Array) -> jax.Array:
        t = idx_BxT.shape[-1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block_size "
                             f"{self.wpe.num_embeddings} (its position table); use --seq-len <= "
                             f"{self.wpe.num_embeddings}, or a model with a larger block size.")
        positions = _lookup(self.wpe, jnp.arange(t))
        if self.sequence_parallel:  # this rank's tokens: the lookups' sum reduce-scattered, its positions
            _check_sequence(t, self.tensor_size)
            tokens = megatron.vocab_parallel_embed(self.wte.embedding[...], idx_BxT, self.tensor_axis, 1)
            x = add_wide(tokens, megatron.my_slice(positions, self.tensor_axis, 0))
            return sequence_dropout(self.drop, x, self.tensor_axis, True)
        if _vocab_split(self.wte, self.tensor_axis):
            tokens = megatron.vocab_parallel_embed(self.wte.embedding[...], idx_BxT, self.tensor_axis)
        else:
            tokens = _lookup(self.wte, idx_BxT)
        return self.drop(add_wide(tokens, positions))  # wpe's gradient sums over the batch in float32 (16-bit)


def _lookup(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
    """nnx.Embed's lookup through take_wide: a 16-bit table's gradient sums repeated ids in float32."""
    (table,) = embed.promote_dtype((embed.embedding[...],), dtype=embed.dtype, inexact=False)
    return take_wide(table, ids)


class LMHead(nnx.Module):
    """The last pipeline layer: ln_f, then logits against the token embedding, ``x @ wte^T`` (tied: `wte` is the
    same Embed as the first layer's, as DeepSpeed's TiedLayerSpec('embed', ...) shares it between stages). Under
    tensor parallelism with `wte` split by vocabulary rows, each rank computes the logits of its rows, f before:
    with `parallel_output` (Megatron's; the strategy sets it when the loss takes them) they stay split, as
    megatron.VocabParallelLogits, else they are all-gathered."""

    tied = {"wte": "wte"}  # attribute here -> attribute of the first layer holding the same weights
    tensor_axis: str | None = None
    tensor_size: int = 1
    sequence_parallel: bool = False
    parallel_output: bool = False

    def __init__(self, ln_f: nnx.LayerNorm, wte: nnx.Embed, tensor_axis: str | None = None, tensor_size: int = 1,
                 sequence_parallel: bool = False, parallel_output: bool = False):
        self.ln_f, self.wte = ln_f, wte
        self.tensor_axis, self.tensor_size, self.sequence_parallel = tensor_axis, tensor_size, sequence_parallel
        self.parallel_output = parallel_output

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        return {("wte", "embedding"): ("vocab", 0)}

    def __call__(self, x_BxTxC: jax.Array) -> jax.Array | megatron.VocabParallelLogits:
        h = self.ln_f(x_BxTxC)
        split = _vocab_split(self.wte, self.tensor_axis)
        if self.sequence_parallel:  # every rank's tokens, against its vocabulary rows
            h = megatron.gather_sequence(h, self.tensor_axis, 1)
        elif split:
            h = megatron.f(h, self.tensor_axis)
        if jax.default_backend() != "cpu":
            logits = self.wte.attend(h)
        else:
            h, table_VxC = self.wte.promote_dtype((h, self.wte.embedding[...]), dtype=self.wte.dtype)
            logits = matmul_t(h, table_VxC)  # x @ wte^T, its weight gradient one NN GEMM
        if not split:
            return logits
        if self.parallel_output:
            return megatron.VocabParallelLogits(logits, self.tensor_axis)
        return megatron.gather_from_tensor_region(logits, self.tensor_axis)


def sequence_dropout(drop: nnx.Dropout, x_BxTxC: jax.Array, axis: str | None, sequence_parallel: bool) -> jax.Array:
    """`drop(x)`; under sequence parallelism, where x holds this rank's tokens, the single-device model's mask for
    every token (the same draw) with this rank's tokens kept: the numbers equal the unsplit model's."""
    return megatron.split_dropout(drop, x_BxTxC, axis if sequence_parallel else None, 1)


def _check_sequence(t: int, tp: int) -> None:
    if t % tp:
        raise ValueError(f"a sequence of {t} tokens does not split over --tensor-parallel {tp} ranks "
                         f"(sequence parallelism gives each rank t / {tp} tokens); use a --seq-len that is a "
                         f"multiple of {tp}, or no --sequence-parallel.")


def _vocab_split(wte: nnx.Embed, axis: str | None) -> bool:
    """Inside a tensor-parallel step, whether this rank holds a slice of the vocabulary rows (the plan splits
    them when T divides the vocabulary) rather than the whole table."""
    return axis is not None and wte.embedding.shape[0] != wte.num_embeddings


class GPT(nnx.Module):
    """GPT-2 (see the module docstring). ``model(idx [B, T] int) -> logits [B, T, vocab]`` (under tensor
    parallelism with `parallel_output`: this rank's vocabulary columns, as megatron.VocabParallelLogits)."""

    tensor_axis: str | None = None  # the TENSOR mesh axis when wte is split by vocabulary rows over it
    tensor_size: int = 1
    sequence_parallel: bool = False
    parallel_output: bool = False  # the head's logits stay split by vocabulary (Megatron's parallel_output=True)

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.wte.dtype = self.wpe.dtype = None  # compute in the tables' dtype (Flax pins it to float32 otherwise)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = _layer_norm(cfg, rngs)

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        """The flat sequence for the pipeline: Embedding, the blocks, LMHead; their composition is the model.
        The first and last share `wte` (the same nnx.Param): the tie a pipeline keeps on both stages."""
        axis = self.tensor_axis, self.tensor_size, self.sequence_parallel
        return (Embedding(self.wte, self.wpe, self.drop, *axis), *self.h,
                LMHead(self.ln_f, self.wte, *axis, self.parallel_output))

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        """Megatron's vocabulary-parallel embedding and head: wte split by rows (when T divides the vocabulary)."""
        return {("wte", "embedding"): ("vocab", 0)}

    def __call__(self, idx_BxT: jax.Array) -> jax.Array:
        x = idx_BxT
        for layer in self.layers:
            x = layer(x)
        return x

    def num_params(self, non_embedding: bool = True) -> int:
        """nanoGPT's get_num_params: every parameter once (wte counted: it is also the head), less wpe if asked."""
        n = sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - (math.prod(self.wpe.embedding.shape) if non_embedding else 0)

    def generate(self, prompt_BxT, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0, kv_cache: bool = True, vocab_limit: int | None = None) -> np.ndarray:
        """nanoGPT's generate: the prompt and `max_new_tokens` sampled tokens (jaxpar.models.gpt_generate); with a
        KV cache while the context fits block_size (`kv_cache=False`: nanoGPT's recompute every step); only tokens
        below `vocab_limit` when given."""
        return gpt_generate.generate(self, prompt_BxT, max_new_tokens, temperature=temperature, top_k=top_k,
                                     seed=seed, kv_cache=kv_cache, vocab_limit=vocab_limit)

    # -- PyTorch state dicts (jaxpar.models.gpt_state_dict) -------------------------------------------------

    def torch_state_dict(self, layout: str = "hf") -> dict[str, np.ndarray]:
        """The weights under HF GPT2LMHeadModel's keys and layout ('hf') or nanoGPT's ('nanogpt')."""
        return gpt_state_dict.to_torch_state_dict(self, layout)

    def load_torch_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a GPT-2 state dict (either layout) into this model, in place."""
        gpt_state_dict.load_torch_state_dict(self, state_dict)


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token as nanoGPT's estimate_mfu (PaLM appendix B): 6 N + 12 L H Q T, with N the
    parameters less wpe (wte counted: it is the head too) and T the sequence length (default block_size)."""
    t = cfg.block_size if seq_len is None else seq_len
    c, v = cfg.n_embd, cfg.vocab_size
    per_block = 12 * c * c + (13 * c if cfg.bias else 2 * c)  # c_attn, c_proj, c_fc, c_proj (+ biases), 2 LNs
    n = cfg.n_layer * per_block + v * c + (2 if cfg.bias else 1) * c
    return 6.0 * n + 12.0 * cfg.n_layer * c * t


from jaxpar.models import gpt_state_dict  # noqa: E402  (it imports GPT from here)
from jaxpar.models.gpt_state_dict import (LAYOUTS, activation_of, check_hf_config,  # noqa: E402,F401
                                          config_from_state_dict, file_meta, from_torch_state_dict, hf_config,
                                          implied_activation, model_args, normalize_state_dict)
