"""The PyTorch tutorial models in Flax NNX: registry, layer view, PyTorch state-dict conversion.

    model = models.get("convnet", seed=0)           # NHWC input, model(x); dropout from nnx.Dropout
    layers = models.as_layers(model)                 # flat sequence; composition == model
    sd = models.to_torch_state_dict(model)           # torch keys and layouts, numpy arrays
    model = models.from_torch_state_dict("convnet", sd)
    gpt = models.get("gpt-micro", seed=0, vocab_size=256, block_size=256)   # GPT-2 family (jaxpar.models.gpt)
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx

from jaxpar.models import convert, gpt
from jaxpar.models.convert import load_torch_state_dict, torch_shapes, unwrapped
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.layers import (CONV_IMPLS, AdaptiveAvgPool2d, Conv2d, Flatten, Linear, LogSoftmax,
                           MaxPool2d, ReLU, default_conv_impl)
from jaxpar.models.nets import MLP, AlexNet, ConvNet, LinearModel, as_layers

GPT_NAMES = tuple(gpt.CONFIGS)  # gpt2, gpt2-medium, ..., and small ones for CPUs: sizes in gpt.CONFIGS
NAMES = ("linear", "mlp", "convnet", "alexnet", *GPT_NAMES)


def _gpt(name: str, *, rngs: nnx.Rngs, **config: Any) -> GPT:
    return GPT(GPTConfig.named(name, **config), rngs=rngs)


_CLASSES: dict[str, Callable[..., nnx.Module]] = {
    "linear": LinearModel, "mlp": MLP, "convnet": ConvNet, "alexnet": AlexNet,
    **{name: functools.partial(_gpt, name) for name in GPT_NAMES}}
ALEXNET_IMAGE_SIZE = 64  # smallest convenient size (>= 63); DeepSpeed's tutorial uses 224


def _check_name(name: str) -> None:
    if name not in _CLASSES:
        raise ValueError(f"unknown model {name=}; use one of {NAMES}")


def get(name: str, *, seed: int = 0, **kwargs: Any) -> nnx.Module:
    """Build model `name` with PyTorch's default init from nnx.Rngs(params=seed, dropout=seed); kwargs go to its
    constructor. Its dropout layers hold their own streams (nnx.Dropout forks one each)."""
    _check_name(name)
    return _CLASSES[name](**kwargs, rngs=nnx.Rngs(params=seed, dropout=seed))


def abstract(name: str, **kwargs: Any) -> nnx.Module:
    """Model `name` with ShapeDtypeStruct weights (nnx.eval_shape): shapes and counts, no memory."""
    return nnx.eval_shape(lambda: get(name, **kwargs))


def num_params(model: nnx.Module) -> int:
    """Number of parameters (works on abstract models too)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def input_shape(name: str, image_size: int | None = None, **kwargs: Any) -> tuple[int, ...]:
    """Default shape of one sample: linear (input_size,), mlp (in_features,), convnet (28, 28, 1),
    alexnet (image_size or 64, same, 3); GPT configs (block_size,) int tokens (default 1024)."""
    _check_name(name)
    if name in GPT_NAMES:
        return (kwargs.get("block_size", GPTConfig.block_size),)
    if name == "alexnet":
        size = ALEXNET_IMAGE_SIZE if image_size is None else image_size
        if size < 63:
            raise ValueError(f"{image_size=} must be >= 63 for alexnet (its features shrink to 0x0 below)")
        return (size, size, 3)
    if name == "convnet":
        if image_size not in (None, 28):
            raise ValueError(f"{image_size=} must be 28 (or None) for convnet: fc1 takes 64 x 12 x 12 features")
        return (28, 28, 1)
    if image_size is not None:
        raise ValueError(f"{image_size=} is only for image models; {name} takes vectors")
    model = abstract(name, **kwargs)
    return (model.fc.in_features,) if name == "linear" else (model.layers[0].in_features,)


def kwargs_from_state_dict(name: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor kwargs read off a PyTorch state dict's shapes (a wrapper's prefixes stripped: `unwrapped`): sizes
    of linear / mlp, num_classes."""
    state_dict = unwrapped(state_dict)
    shape = lambda k: tuple(np.shape(state_dict[k])) if k in state_dict else None  # noqa: E731
    if name == "linear" and shape("fc.weight") and len(shape("fc.weight")) == 2:
        out, inp = shape("fc.weight")
        return dict(input_size=inp, output_size=out)
    if name == "mlp" and shape("0.weight") and shape("2.weight") and len(shape("2.weight")) == 2:
        (hidden, inp), (out, _) = shape("0.weight"), shape("2.weight")
        return dict(in_features=inp, hidden_dim=hidden, out_features=out)
    if name in ("convnet", "alexnet"):
        last = "fc2.weight" if name == "convnet" else "classifier.6.weight"
        if shape(last) and len(shape(last)) == 2:
            return dict(num_classes=shape(last)[0])
    return {}


def from_torch_state_dict(name: str, state_dict: Mapping[str, Any], *, seed: int = 0, **kwargs: Any) -> nnx.Module:
    """Model `name` holding a PyTorch state dict's weights. Sizes not in kwargs are read off the dict; the RNG
    streams (dropout) are seeded from `seed`, as `get` seeds them.

    Raises ValueError naming the key on missing/unexpected keys or wrong shapes. GPT configs read either layout
    (Hugging Face's or nanoGPT's) and take n_head / dropout / activation_function in kwargs
    (jaxpar.models.gpt.from_torch_state_dict).
    """
    _check_name(name)
    if name in GPT_NAMES:
        return gpt.from_torch_state_dict(state_dict, name=name, seed=seed, **kwargs)
    kwargs = {**kwargs_from_state_dict(name, state_dict), **kwargs}
    model = abstract(name, **kwargs)  # every weight is overwritten: skip the random init
    load_torch_state_dict(model, state_dict, name)
    seed_streams(model, seed)
    return model


def seed_streams(model: nnx.Module, seed: int) -> None:
    """Give an abstract model's RNG streams concrete keys, as nnx.Rngs(dropout=seed) forks them, in place."""
    rngs = nnx.Rngs(dropout=seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RngStream):
            fresh = rngs.dropout.fork()
            node.key.set_value(fresh.key.get_value())
            node.count.set_value(fresh.count.get_value())


def to_torch_state_dict(model: nnx.Module, **options: Any) -> dict[str, np.ndarray]:
    """The model's weights under PyTorch's keys: its own ``torch_state_dict(**options)`` where it has one (GPT:
    layout='hf' | 'nanogpt'), else the tutorial models' conversion (jaxpar.models.convert)."""
    own = getattr(model, "torch_state_dict", None)
    return own(**options) if callable(own) else convert.to_torch_state_dict(model)


__all__ = [
    "NAMES", "get", "abstract", "num_params", "input_shape", "as_layers", "from_torch_state_dict",
    "to_torch_state_dict", "torch_shapes", "kwargs_from_state_dict",
    "LinearModel", "MLP", "ConvNet", "AlexNet", "GPT", "GPTConfig", "GPT_NAMES", "gpt",
    "Conv2d", "Linear", "ReLU", "MaxPool2d", "AdaptiveAvgPool2d", "Flatten", "LogSoftmax",
    "CONV_IMPLS", "default_conv_impl",
]
