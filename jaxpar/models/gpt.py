"""GPT-2 in Flax NNX, as nanoGPT writes it, and its PyTorch state dicts (Hugging Face's and nanoGPT's layouts).

    model = GPT(GPTConfig.named("gpt2", vocab_size=50257, block_size=1024), rngs=nnx.Rngs(params=0, dropout=0))
    logits_BxTxV = model(idx_BxT)                           # int tokens in, float logits out
    sd = model.torch_state_dict("hf")                       # or "nanogpt"; numpy arrays under torch's keys
    model = from_torch_state_dict(sd, n_head=12)            # layout and sizes read off the dict

The architecture is GPT-2's: learned token (`wte`) and position (`wpe`) embeddings, dropout, `n_layer` pre-LayerNorm
blocks `h.{i}` (`ln_1`, causal self-attention `attn` with a fused `c_attn` and an output `c_proj`, `ln_2`, an MLP
`mlp.c_fc` -> GELU (tanh, GPT-2's and HF's `gelu_new`; nanoGPT's nn.GELU() is the erf form) -> `mlp.c_proj`), a
final `ln_f`, and `lm_head` tied to `wte` (logits = x @ wte^T; the model holds the embedding once). LayerNorm eps
1e-5. Init as nanoGPT: weights N(0, 0.02), the residual projections (`c_proj`) N(0, 0.02 / sqrt(2 n_layer)), biases
zero. Dropout (stock nnx.Dropout) after the embeddings, on the attention weights, after each residual projection.

Attention runs through `jax.nn.dot_product_attention`: cuDNN's fused (flash) kernel on a GPU for bf16/fp16 inputs
and head sizes it takes, XLA elsewhere. With attention dropout on in training, the weights are formed explicitly
(as nanoGPT's non-flash path does), since the fused call has no dropout.

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
LAYOUTS = ("hf", "nanogpt")
ATTENTION = ("auto", "xla", "cudnn")
LN_EPS = 1e-5  # torch's LayerNorm default, GPT-2's
CPU_QUERY_BLOCK = 64  # causal attention on CPUs: query rows per block (up to 8 blocks), see causal_attention
_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF Conv1D / nanoGPT nn.Linear
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older checkpoints carry: not weights


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's GPTConfig. `bias`: biases in Linears and LayerNorms (GPT-2: True). `attention`: auto | xla | cudnn."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention: str = "auto"

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


def _linear(n_in: int, n_out: int, cfg: GPTConfig, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=cfg.bias, kernel_init=nnx.initializers.normal(std),
                      bias_init=nnx.initializers.zeros_init(), rngs=rngs)


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.n_embd, epsilon=LN_EPS, use_bias=cfg.bias, rngs=rngs)


def attention_impl(setting: str, dtype, head_dim: int) -> str:
    """'cudnn' (fused flash attention) on a GPU for bf16/fp16 and head sizes cuDNN takes, else 'xla'."""
    if setting != "auto":
        return setting
    fits = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array,
                     setting: str = "auto") -> jax.Array:
    """softmax(q k^T / sqrt(H), causal) v through `jax.nn.dot_product_attention`: one call on GPUs (cuDNN's fused
    kernel for bf16/fp16); on CPUs in query blocks of about CPU_QUERY_BLOCK rows, each over its key prefix only.

    XLA:CPU materialises the T x T scores and their gradients (memory-bound passes); the blocks skip most of the
    masked upper triangle: at T=256 in 4 blocks, 35 % less attention time than one causal call (bench/gpt.py)."""
    impl = attention_impl(setting, q_BxTxNxH.dtype, q_BxTxNxH.shape[-1])
    t = q_BxTxNxH.shape[-3]
    blocks = max(1, min(8, t // CPU_QUERY_BLOCK)) if jax.default_backend() == "cpu" else 1
    if blocks == 1:
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, is_causal=True, implementation=impl)
    bounds = np.linspace(0, t, blocks + 1).astype(int)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # rows lo:hi see keys 0:hi, key j <= row i
        mask_1x1xQxK = np.tril(np.ones((hi - lo, hi), bool), k=lo)[None, None]
        out.append(jax.nn.dot_product_attention(q_BxTxNxH[..., lo:hi, :, :], k_BxTxNxH[..., :hi, :, :],
                                                v_BxTxNxH[..., :hi, :, :], mask=mask_1x1xQxK, implementation=impl))
    return jnp.concatenate(out, axis=-3)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention: one fused qkv projection `c_attn`, the output projection `c_proj`.

    Megatron tensor parallelism (jaxpar.strategies.tensor sets `tensor_axis`): this rank holds the q, k and v
    columns of n_head / T heads and the matching rows of `c_proj`; its input passes Megatron's f, its output g."""

    tensor_axis: str | None = None  # the TENSOR mesh axis when the heads are split over it
    tensor_size: int = 1

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.c_attn = _linear(cfg.n_embd, 3 * cfg.n_embd, cfg, 0.02, rngs)
        self.c_proj = _linear(cfg.n_embd, cfg.n_embd, cfg, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)
        self.attn_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.n_head, self.attention = cfg.n_head, cfg.attention

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        """How Megatron splits this module: qkv columns by head, c_proj by rows (its bias stays whole)."""
        h = self.c_proj.kernel.shape[1] // self.n_head  # heads stay whole: split in units of a head's size
        out = {("c_attn", "kernel"): ("qkv", 1, h), ("c_proj", "kernel"): ("rows", 0, h)}
        return {**out, ("c_attn", "bias"): ("qkv", 0, h)} if self.c_attn.bias is not None else out

    def __call__(self, x_BxTxC: jax.Array) -> jax.Array:
        if self.tensor_axis is not None:
            return self._tensor_parallel(x_BxTxC)
        b, t, c = x_BxTxC.shape
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = (a.reshape(b, t, self.n_head, c // self.n_head)
                                           for a in jnp.split(self.c_attn(x_BxTxC), 3, axis=-1))
        y_BxTxNxH = self._attend(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, self.attn_dropout)
        return self.resid_dropout(self.c_proj(y_BxTxNxH.reshape(b, t, c)))

    def _attend(self, q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, dropout) -> jax.Array:
        """Causal attention; with attention dropout on in training, nanoGPT's explicit path (the weights formed,
        `dropout(att)` applied), else the fused call."""
        if not (self.attn_dropout.rate > 0 and not self.attn_dropout.deterministic):
            return causal_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, self.attention)
        t, h = q_BxTxNxH.shape[1], q_BxTxNxH.shape[-1]
        att_BxNxTxT = jnp.einsum("bqnh,bknh->bnqk", q_BxTxNxH, k_BxTxNxH) / math.sqrt(h)
        att_BxNxTxT = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att_BxNxTxT, -jnp.inf)
        att_BxNxTxT = jax.nn.softmax(att_BxNxTxT.astype(jnp.float32), axis=-1).astype(q_BxTxNxH.dtype)
        return jnp.einsum("bnqk,bknh->bqnh", dropout(att_BxNxTxT), v_BxTxNxH)

    def _tensor_parallel(self, x_BxTxC: jax.Array) -> jax.Array:
        """This rank's heads: f(x) @ its qkv columns, attention, then g(y @ its c_proj rows) + the bias."""
        b, t, c = x_BxTxC.shape
        h, n = c // self.n_head, self.n_head // self.tensor_size  # head size, this rank's heads
        qkv_BxTx3D = megatron.column_linear(self.c_attn, megatron.f(x_BxTxC, self.tensor_axis))
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = (a.reshape(b, t, n, h) for a in jnp.split(qkv_BxTx3D, 3, axis=-1))
        y_BxTxNxH = self._attend(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, self._head_dropout)
        return self.resid_dropout(megatron.row_linear(self.c_proj, y_BxTxNxH.reshape(b, t, n * h),
                                                      self.tensor_axis))

    def _head_dropout(self, att_BxNxTxT: jax.Array) -> jax.Array:
        """nnx.Dropout's mask for ALL heads (the same draw as the single-device model), this rank's heads kept:
        the numbers equal the unsplit model's (Megatron draws per-rank masks instead; they differ from it)."""
        n, keep = att_BxNxTxT.shape[1], 1.0 - self.attn_dropout.rate
        whole = (att_BxNxTxT.shape[0], self.n_head) + att_BxNxTxT.shape[2:]
        mask = jax.random.bernoulli(self.attn_dropout.rngs(), p=keep, shape=whole)
        mask = jax.lax.dynamic_slice_in_dim(mask, megatron.rank(self.tensor_axis) * n, n, axis=1)
        return jax.lax.select(mask, att_BxNxTxT / keep, jnp.zeros_like(att_BxNxTxT))


class MLP(nnx.Module):
    """c_fc (4x wider) -> GELU (tanh) -> c_proj -> dropout. Under Megatron tensor parallelism (`tensor_axis`) this
    rank holds 4C / T columns of c_fc and the matching rows of c_proj: f before, g after."""

    tensor_axis: str | None = None
    tensor_size: int = 1

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.c_fc = _linear(cfg.n_embd, 4 * cfg.n_embd, cfg, 0.02, rngs)
        self.c_proj = _linear(4 * cfg.n_embd, cfg.n_embd, cfg, 0.02 / math.sqrt(2 * cfg.n_layer), rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def tensor_layout(self) -> dict[tuple, tuple[str, int]]:
        out = {("c_fc", "kernel"): ("columns", 1), ("c_proj", "kernel"): ("rows", 0)}
        return {**out, ("c_fc", "bias"): ("columns", 0)} if self.c_fc.bias is not None else out

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.tensor_axis is not None:
            h = jax.nn.gelu(megatron.column_linear(self.c_fc, megatron.f(x, self.tensor_axis)), approximate=True)
            return self.dropout(megatron.row_linear(self.c_proj, h, self.tensor_axis))
        return self.dropout(self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True)))


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
    `wte`, `wpe` and `drop` (the same objects), not a copy."""

    def __init__(self, wte: nnx.Embed, wpe: nnx.Embed, drop: nnx.Dropout):
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def __call__(self, idx_BxT: jax.Array) -> jax.Array:
        t = idx_BxT.shape[-1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block_size "
                             f"{self.wpe.num_embeddings} (its position table); use --seq-len <= "
                             f"{self.wpe.num_embeddings}, or a model with a larger block size.")
        return self.drop(self.wte(idx_BxT) + self.wpe(jnp.arange(t)))


class LMHead(nnx.Module):
    """The last pipeline layer: ln_f, then logits against the token embedding, ``x @ wte^T`` (tied: `wte` is the
    same Embed as the first layer's, as DeepSpeed's TiedLayerSpec('embed', ...) shares it between stages)."""

    tied = {"wte": "wte"}  # attribute here -> attribute of the first layer holding the same weights

    def __init__(self, ln_f: nnx.LayerNorm, wte: nnx.Embed):
        self.ln_f, self.wte = ln_f, wte

    def __call__(self, x_BxTxC: jax.Array) -> jax.Array:
        return self.wte.attend(self.ln_f(x_BxTxC))


class GPT(nnx.Module):
    """GPT-2 (see the module docstring). ``model(idx [B, T] int) -> logits [B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = _layer_norm(cfg, rngs)

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        """The flat sequence for the pipeline: Embedding, the blocks, LMHead; their composition is the model.
        The first and last share `wte` (the same nnx.Param): the tie a pipeline keeps on both stages."""
        return (Embedding(self.wte, self.wpe, self.drop), *self.h, LMHead(self.ln_f, self.wte))

    def __call__(self, idx_BxT: jax.Array) -> jax.Array:
        x = idx_BxT
        for layer in self.layers:
            x = layer(x)
        return x

    def num_params(self, non_embedding: bool = True) -> int:
        """nanoGPT's get_num_params: every parameter once (wte counted: it is also the head), less wpe if asked."""
        n = sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - (math.prod(self.wpe.embedding.shape) if non_embedding else 0)

    # -- PyTorch state dicts -------------------------------------------------------------------------------

    def torch_state_dict(self, layout: str = "hf") -> dict[str, np.ndarray]:
        """The weights under GPT2LMHeadModel's keys (`layout='hf'`, Conv1D weights [in, out]) or nanoGPT's
        (`'nanogpt'`, nn.Linear weights [out, in]); lm_head.weight is wte's copy, as both state dicts hold it."""
        _check_layout(layout)
        out = {}
        for key, (module, name) in _entries(self).items():
            value = np.asarray(getattr(module, name)[...], np.float32)
            out[key] = np.ascontiguousarray(value.T if layout == "nanogpt" and _is_linear_weight(key) else value)
        out["lm_head.weight"] = out["transformer.wte.weight"]
        return out

    def load_torch_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a GPT-2 state dict (either layout, found from the shapes) into this model, in place."""
        sd, layout = normalize_state_dict(state_dict)
        expected = {k: _torch_shape(m, n, k, layout) for k, (m, n) in _entries(self).items()}
        missing, extra = [k for k in expected if k not in sd], [k for k in sd if k not in expected]
        if missing or extra:
            raise ValueError(f"state dict does not match this GPT ({self.config.n_layer} layers, bias="
                             f"{self.config.bias}): missing {missing[:4]}, unexpected {extra[:4]}; build the model "
                             "from the state dict (from_torch_state_dict) so its sizes are read off it.")
        for key, shape in expected.items():
            if tuple(np.shape(sd[key])) != shape:
                raise ValueError(f"state dict key {key!r} has shape {tuple(np.shape(sd[key]))}, this GPT expects "
                                 f"{shape} ({layout} layout); build the model from the state dict instead.")
        for key, (module, name) in _entries(self).items():
            value = np.asarray(sd[key], np.float32)
            getattr(module, name).set_value(jnp.asarray(value.T if layout == "nanogpt" and _is_linear_weight(key)
                                                        else value))


def _entries(model: GPT) -> dict[str, tuple[nnx.Module, str]]:
    """torch key -> (module, NNX attribute) for every weight, in GPT2LMHeadModel's order (lm_head left out)."""
    t = "transformer"
    out = {f"{t}.wte.weight": (model.wte, "embedding"), f"{t}.wpe.weight": (model.wpe, "embedding")}
    for i, block in enumerate(model.h):
        p = f"{t}.h.{i}"
        for key, module in (("ln_1", block.ln_1), ("attn.c_attn", block.attn.c_attn),
                            ("attn.c_proj", block.attn.c_proj), ("ln_2", block.ln_2), ("mlp.c_fc", block.mlp.c_fc),
                            ("mlp.c_proj", block.mlp.c_proj)):
            out.update(_weight_and_bias(f"{p}.{key}", module))
    out.update(_weight_and_bias(f"{t}.ln_f", model.ln_f))
    return out


def _weight_and_bias(prefix: str, module: nnx.Module) -> dict[str, tuple[nnx.Module, str]]:
    weight = "kernel" if isinstance(module, nnx.Linear) else "scale"
    out = {f"{prefix}.weight": (module, weight)}
    if getattr(module, "bias", None) is not None:
        out[f"{prefix}.bias"] = (module, "bias")
    return out


def _is_linear_weight(key: str) -> bool:
    return key.endswith(".weight") and any(f".{name}." in key for name in _LINEARS)


def _torch_shape(module: nnx.Module, name: str, key: str, layout: str) -> tuple[int, ...]:
    shape = tuple(getattr(module, name).shape)
    return shape[::-1] if layout == "nanogpt" and _is_linear_weight(key) else shape


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"torch layout {layout!r} is not known; use 'hf' (transformers' GPT2LMHeadModel) or "
                         "'nanogpt'.")


def normalize_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], str]:
    """(the weights under GPT2LMHeadModel's keys, 'hf' | 'nanogpt') of a GPT-2 state dict.

    Accepts HF's GPT2LMHeadModel and GPT2Model (no `transformer.` prefix) dicts and nanoGPT's (a torch.compile'd
    one's `_orig_mod.` prefix too); drops the causal-mask buffers; checks lm_head.weight equals wte (tied). The
    layout is read off c_attn's weight: [C, 3C] is HF's Conv1D, [3C, C] nanoGPT's nn.Linear."""
    sd = {}
    for key, value in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            key = key[len(prefix):] if key.startswith(prefix) else key
        if key.endswith(_BUFFERS):
            continue
        if not key.startswith(("transformer.", "lm_head.")):
            key = f"transformer.{key}"
        sd[key] = np.asarray(value)
    attn = sd.get("transformer.h.0.attn.c_attn.weight")
    if "transformer.wte.weight" not in sd or attn is None or np.ndim(attn) != 2:
        raise ValueError(f"the state dict (keys {list(state_dict)[:5]}...) is not a GPT-2 one: it needs "
                         "transformer.wte.weight and transformer.h.0.attn.c_attn.weight (Hugging Face's "
                         "GPT2LMHeadModel or nanoGPT's layout); save model.state_dict() of one of them.")
    c = sd["transformer.wte.weight"].shape[1]
    if attn.shape not in ((c, 3 * c), (3 * c, c)):
        raise ValueError(f"transformer.h.0.attn.c_attn.weight has shape {attn.shape}; with wte's width {c} it must "
                         f"be [{c}, {3 * c}] (HF Conv1D) or [{3 * c}, {c}] (nanoGPT nn.Linear).")
    head = sd.pop("lm_head.weight", None)
    if head is not None and (head.shape != sd["transformer.wte.weight"].shape
                             or not np.array_equal(head, sd["transformer.wte.weight"])):
        raise ValueError("lm_head.weight differs from transformer.wte.weight, but GPT-2 ties them (one matrix); "
                         "pass the state dict of a tied model (or copy wte into lm_head).")
    return sd, "hf" if attn.shape == (c, 3 * c) else "nanogpt"


def _sizes(sd: Mapping[str, np.ndarray]) -> tuple[int, int, int, int]:
    """(vocab, block size, layers, width) of a normalized GPT-2 state dict."""
    vocab, width = sd["transformer.wte.weight"].shape
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h."))
    return int(vocab), int(sd["transformer.wpe.weight"].shape[0]), layers, int(width)


def config_from_state_dict(state_dict: Mapping[str, Any], n_head: int | None = None, **overrides: Any) -> GPTConfig:
    """The GPTConfig a state dict was saved from: vocab, block size, width, layers and bias read off it; the head
    count is not in the weights, so `n_head` must be given (or a config name's, see from_torch_state_dict)."""
    sd, _ = normalize_state_dict(state_dict)
    vocab, block, layers, width = _sizes(sd)
    if n_head is None:
        raise ValueError(f"the state dict holds a GPT of width {width} and {layers} layers, but the head count is not "
                         "in the weights; pass --n-head (n_head=...), or a config name such as gpt2.")
    return GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=n_head, n_embd=width,
                     bias="transformer.ln_f.bias" in sd, **{k: v for k, v in overrides.items() if v is not None})


def from_torch_state_dict(state_dict: Mapping[str, Any], n_head: int | None = None, name: str | None = None,
                          seed: int = 0, **overrides: Any) -> GPT:
    """A GPT holding a state dict's weights (HF or nanoGPT layout); sizes read off the dict, the head count from
    `n_head` or the config `name` (whose layers and width must match), other fields (dropout, attention) from
    `overrides`; dropout streams from `seed`."""
    if name is not None:
        n_layer, heads, n_embd = GPTConfig.named(name).n_layer, GPTConfig.named(name).n_head, CONFIGS[name][2]
        _, _, layers, width = _sizes(normalize_state_dict(state_dict)[0])
        if (layers, width) != (n_layer, n_embd):
            raise ValueError(f"the state dict holds {layers} layers x {width} wide, but --model {name} is {n_layer} x "
                             f"{n_embd}; pass the config name of that size ({_name_of(layers, width)}).")
        n_head = heads if n_head is None else n_head
    cfg = config_from_state_dict(state_dict, n_head, **overrides)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0)))  # every weight is overwritten
    streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
    for i, stream in enumerate(streams):  # eval_shape left abstract keys: one real, distinct key per stream
        stream.key.set_value(jax.random.fold_in(jax.random.key(seed), i))
        stream.count.set_value(jnp.zeros((), jnp.uint32))
    model.load_torch_state_dict(state_dict)
    return model


def _name_of(layers: int, width: int) -> str:
    names = [n for n, (l, _, c) in CONFIGS.items() if (l, c) == (layers, width)]
    return " or ".join(names) if names else "none has it: add one to jaxpar.models.gpt.CONFIGS"


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token as nanoGPT's estimate_mfu (PaLM appendix B): 6 N + 12 L H Q T, with N the
    parameters less wpe (wte counted: it is the head too) and T the sequence length (default block_size)."""
    t = cfg.block_size if seq_len is None else seq_len
    c, v = cfg.n_embd, cfg.vocab_size
    per_block = 12 * c * c + (13 * c if cfg.bias else 2 * c)  # c_attn, c_proj, c_fc, c_proj (+ biases), 2 LNs
    n = cfg.n_layer * per_block + v * c + (2 if cfg.bias else 1) * c
    return 6.0 * n + 12.0 * cfg.n_layer * c * t
