"""GPT-2 state dicts in PyTorch's two layouts: Hugging Face's GPT2LMHeadModel and nanoGPT's.

    sd = to_torch_state_dict(model, "hf")      # numpy arrays under torch's keys; lm_head.weight = wte's copy
    model = from_torch_state_dict(sd, n_head=12)   # either layout, found from c_attn's shape; sizes read off it

NNX kernels are [in, out], which is HF's Conv1D layout, so HF weights load as they are; nanoGPT's nn.Linear
weights are [out, in] and are transposed. Keys: transformer.wte / wpe, transformer.h.{i}.ln_1 / attn.c_attn /
attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj, transformer.ln_f, lm_head (tied).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models.convert import as_array, check_values, duplicate_key_message, unwrapped
from jaxpar.models.gpt import CONFIGS, GPT, LN_EPS, GPTConfig

LAYOUTS = ("hf", "nanogpt")
_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF Conv1D / nanoGPT nn.Linear
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older checkpoints carry: not weights
_BASE_KEYS = ("wte.", "wpe.", "h.", "ln_f.")  # GPT2Model's (transformers' bare GPT-2) keys: GPT2LMHeadModel's less
# its `transformer.` prefix
# transformers' activation_function names of the GELUs jaxpar's GPT runs -> its own (gpt.ACTIVATIONS)
HF_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new", "gelu": "gelu"}


def to_torch_state_dict(model: GPT, layout: str = "hf") -> dict[str, np.ndarray]:
    """The weights under GPT2LMHeadModel's keys (`layout='hf'`, Conv1D weights [in, out]) or nanoGPT's
    (`'nanogpt'`, nn.Linear weights [out, in]); lm_head.weight is wte's array, as both state dicts hold it. Each
    array is writable and its own (convert.to_torch_state_dict: not a read-only view of JAX's buffer)."""
    _check_layout(layout)
    out = {}
    for key, (module, name) in _entries(model).items():
        value = np.asarray(getattr(module, name)[...], np.float32)
        out[key] = np.array(value.T if layout == "nanogpt" and _is_linear_weight(key) else value, order="C")
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def load_torch_state_dict(model: GPT, state_dict: Mapping[str, Any]) -> None:
    """Copy a GPT-2 state dict (either layout, found from the shapes) into `model`, in place."""
    sd, layout = normalize_state_dict(state_dict)
    expected = {k: _torch_shape(m, n, k, layout) for k, (m, n) in _entries(model).items()}
    missing, extra = [k for k in expected if k not in sd], [k for k in sd if k not in expected]
    if missing or extra:
        raise ValueError(f"state dict does not match this GPT ({model.config.n_layer} layers, bias="
                         f"{model.config.bias}): missing {missing[:4]}, unexpected {extra[:4]}; a GPT-2 state dict "
                         "(GPT2LMHeadModel's, GPT2Model's or nanoGPT's) holds exactly these keys: drop the weights of "
                         "other heads or modules (a GPT2ForSequenceClassification's score), or build the model from "
                         "the state dict (from_torch_state_dict) so its sizes are read off it.")
    for key, shape in expected.items():
        if tuple(np.shape(sd[key])) != shape:
            raise ValueError(f"state dict key {key!r} has shape {tuple(np.shape(sd[key]))}, this GPT expects "
                             f"{shape} ({layout} layout); build the model from the state dict instead.")
    for key, (module, name) in _entries(model).items():
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

    Accepts HF's GPT2LMHeadModel and GPT2Model (no `transformer.` prefix) dicts and nanoGPT's, under the prefixes
    torch's wrappers add (`convert.unwrapped`); drops the causal-mask buffers; checks lm_head.weight equals wte
    (tied). The layout is read off c_attn's weight: [C, 3C] is HF's Conv1D, [3C, C] nanoGPT's nn.Linear."""
    sd, source = {}, {}
    for original, value in unwrapped(state_dict).items():
        if original.endswith(_BUFFERS):
            continue
        # GPT2Model's keys under GPT2LMHeadModel's prefix; any other key as given, so an error names the file's key
        key = f"transformer.{original}" if original.startswith(_BASE_KEYS) else original
        if key in sd:  # GPT2Model's key and GPT2LMHeadModel's of one weight: one would be dropped in silence
            raise ValueError(duplicate_key_message(source[key], original, key))
        sd[key], source[key] = as_array(value), original
    needed = ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight")
    if any(np.ndim(sd.get(k)) != 2 for k in needed):
        got = {k: np.shape(sd[k]) if k in sd else "missing" for k in needed}
        raise ValueError(f"the state dict (keys {list(state_dict)[:5]}...) is not a GPT-2 one: it needs the 2-D "
                         f"weights {', '.join(needed)} (got {got}), as Hugging Face's GPT2LMHeadModel and nanoGPT "
                         "hold them; save model.state_dict() of one of them.")
    for key in sd:
        if key.startswith("transformer.h.") and not key.split(".")[2].isdigit():
            raise ValueError(f"state dict key {key!r} is not a GPT-2 one: a block's keys are "
                             "transformer.h.<index>.<name>, the index an integer; rename it or drop it from the "
                             "state dict.")
    attn, c = sd["transformer.h.0.attn.c_attn.weight"], sd["transformer.wte.weight"].shape[1]
    if attn.shape not in ((c, 3 * c), (3 * c, c)):
        raise ValueError(f"transformer.h.0.attn.c_attn.weight has shape {attn.shape}; with wte's width {c} it must "
                         f"be [{c}, {3 * c}] (HF Conv1D) or [{3 * c}, {c}] (nanoGPT nn.Linear).")
    layout = "hf" if attn.shape == (c, 3 * c) else "nanogpt"
    fc = sd.get("transformer.h.0.mlp.c_fc.weight")
    inner = fc.shape[1 if layout == "hf" else 0] if np.ndim(fc) == 2 else 4 * c
    if inner != 4 * c:
        raise ValueError(f"transformer.h.0.mlp.c_fc.weight has shape {fc.shape}: an MLP {inner} wide, but jaxpar's "
                         f"GPT, as GPT-2 and nanoGPT, is 4 x n_embd = {4 * c} wide (Hugging Face's n_inner unset); "
                         "use a checkpoint of that shape.")
    check_values(sd)
    head = sd.pop("lm_head.weight", None)
    if head is not None and (head.shape != sd["transformer.wte.weight"].shape
                             or not np.array_equal(head, sd["transformer.wte.weight"])):
        raise ValueError("lm_head.weight differs from transformer.wte.weight, but GPT-2 ties them (one matrix); "
                         "pass the state dict of a tied model (or copy wte into lm_head).")
    return sd, layout


def _sizes(sd: Mapping[str, np.ndarray]) -> tuple[int, int, int, int]:
    """(vocab, block size, layers, width) of a normalized GPT-2 state dict."""
    vocab, width = sd["transformer.wte.weight"].shape
    # the blocks holding their attention weights: a stray key of a block beyond them (h.5.ln_1.weight in a 2-layer
    # dict) is reported as unexpected, not read as 4 more layers whose keys are all missing
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.") and
                     k.endswith(".attn.c_attn.weight"))
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
                     bias="transformer.ln_f.bias" in sd or "transformer.h.0.ln_1.bias" in sd,  # one lost: missing
                     **{k: v for k, v in overrides.items() if v is not None})


def from_torch_state_dict(state_dict: Mapping[str, Any], n_head: int | None = None, name: str | None = None,
                          seed: int = 0, **overrides: Any) -> GPT:
    """A GPT holding a state dict's weights (HF or nanoGPT layout); sizes read off the dict, the head count from
    `n_head` or the config `name` (whose layers and width must match), other fields (dropout, attention,
    activation_function) from `overrides`; dropout streams from `seed`. The GELU is not in the weights either:
    GPT-2's (and HF's) is the default tanh form; nanoGPT's own checkpoints ran the erf form, so load them with
    activation_function="gelu" (jaxpar.run.weights.read reads it off a file that records it)."""
    if name is not None:
        n_layer, heads, n_embd = GPTConfig.named(name).n_layer, GPTConfig.named(name).n_head, CONFIGS[name][2]
        _, _, layers, width = _sizes(normalize_state_dict(state_dict)[0])
        if (layers, width) != (n_layer, n_embd):
            raise ValueError(f"the state dict holds {layers} layers x {width} wide, but {name} (--model) is {n_layer} "
                             f"x {n_embd}; pass the config name of that size ({_name_of(layers, width)}), or no name "
                             "and the head count: jaxpar.models.gpt.from_torch_state_dict(sd, n_head=H).")
        n_head = heads if n_head is None else n_head
    cfg = config_from_state_dict(state_dict, n_head, **overrides)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0)))  # every weight is overwritten
    streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
    for i, stream in enumerate(streams):  # eval_shape left abstract keys: one real, distinct key per stream
        stream.key.set_value(jax.random.fold_in(jax.random.key(seed), i))
        stream.count.set_value(jnp.zeros((), jnp.uint32))
    model.load_torch_state_dict(state_dict)
    return model


def model_args(cfg: GPTConfig) -> dict[str, Any]:
    """nanoGPT's model_args for `cfg` (the fields of its GPTConfig, as its ckpt.pt keeps them); an exported file
    keeps them and the GELU beside the weights (file_meta)."""
    return {"n_layer": int(cfg.n_layer), "n_head": int(cfg.n_head), "n_embd": int(cfg.n_embd),
            "block_size": int(cfg.block_size), "bias": bool(cfg.bias), "vocab_size": int(cfg.vocab_size),
            "dropout": float(cfg.dropout)}


def file_meta(cfg: GPTConfig) -> dict[str, Any]:
    """What a file keeps beside a GPT's weights (jaxpar.run.weights.write's `meta`): nanoGPT's model_args and the
    GELU, which no weight shows either (a nanoGPT ckpt.pt keeps the GELU beside its model_args). Pass this, not
    model_args alone: a file without its GELU loads with the default tanh one."""
    return {**model_args(cfg), "activation_function": cfg.activation_function}


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """transformers' GPT2Config (config.json) for `cfg`: what `GPT2LMHeadModel.from_pretrained(folder)` needs
    beside the weights. A GPT without biases has no GPT2Config: nanoGPT's bias=False is not in transformers."""
    if not cfg.bias:
        raise ValueError("this GPT has no biases (bias=False), which transformers' GPT2 cannot hold; export it as "
                         "a file with --torch-layout nanogpt instead of a Hugging Face folder.")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": cfg.activation_function,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "layer_norm_epsilon": LN_EPS,
            "initializer_range": 0.02, "tie_word_embeddings": True,
            # GPT2Config's default bos/eos, 50256 ("<|endoftext|>"), only where the vocabulary holds it: a byte-level
            # model's transformers warned on every load that the id is outside it (a QA finding)
            **{k: 50256 if cfg.vocab_size > 50256 else None for k in ("bos_token_id", "eos_token_id")}}


def activation_of(meta: Mapping[str, Any]) -> str | None:
    """The GELU a checkpoint's meta (config.json, a file's record: jaxpar.run.weights.read) names, as jaxpar's
    activation_function (gpt.ACTIVATIONS), or None where it names none. check_hf_config refuses the others."""
    act = meta.get("activation_function")
    return None if act is None else HF_ACTIVATIONS.get(act)


def implied_activation(meta: Mapping[str, Any]) -> str | None:
    """The GELU a checkpoint implies without naming one: "gelu" (the erf form) for a ckpt.pt nanoGPT's train.py
    saved (its model.py runs nn.GELU() only), else None. A default, where a named one is a fact."""
    return "gelu" if meta.get("source") == "nanogpt-train" and activation_of(meta) is None else None


def check_hf_config(meta: Mapping[str, Any], where: str) -> None:
    """ValueError unless a Hugging Face GPT2Config's fields (config.json) describe a GPT jaxpar runs: a GELU it has
    (tanh or erf) and LayerNorm eps 1e-5 (other sizes are read off the weights, and a mismatch fails their load)."""
    inner, width = meta.get("n_inner"), meta.get("n_embd")
    if None not in (inner, width) and inner != 4 * width:  # (without n_embd the weights' shapes are checked)
        raise ValueError(f"{where}'s config.json has n_inner={inner}, but jaxpar's GPT, as GPT-2, runs an MLP 4 x "
                         f"n_embd = {4 * width} wide (n_inner unset); use a GPT-2 checkpoint of that shape.")
    act = meta.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"{where} names activation_function={act!r}, but jaxpar's GPT runs a GELU "
                         f"({', '.join(HF_ACTIVATIONS)}); its logits would differ. Use a GPT-2 checkpoint.")
    eps = meta.get("layer_norm_epsilon", LN_EPS)
    if not np.isclose(eps, LN_EPS, rtol=0, atol=1e-12):
        raise ValueError(f"{where}'s config.json has layer_norm_epsilon={eps}, but jaxpar's GPT uses {LN_EPS} "
                         "(GPT-2's); its logits would differ. Use a GPT-2 checkpoint.")
    for field, gpt2 in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if bool(meta.get(field, gpt2)) != gpt2:  # HF's GPT2Attention: scores / sqrt(head) [/ (layer + 1)]
            raise ValueError(f"{where}'s config.json has {field}={meta[field]!r}, but jaxpar's GPT scales the "
                             f"attention scores as GPT-2 does ({field}={gpt2}); its logits would differ. Use a "
                             "GPT-2 checkpoint.")


def _name_of(layers: int, width: int) -> str:
    names = [n for n, (l, _, c) in CONFIGS.items() if (l, c) == (layers, width)]
    return " or ".join(names) if names else "none has it"
