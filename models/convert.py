"""PyTorch state dicts <-> NNX models: torch's keys and layouts, no torch import.

Conv2d weight OIHW <-> kernel HWIO; Linear weight [out, in] <-> kernel [in, out]; biases as they are.
The Flatten in front of the first Linear flattens in NCHW order, so fc1 / classifier.1 rows need no
permutation.
"""
from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
from flax import nnx

from jaxpar.models.layers import Conv2d, Linear


WRAPPERS = ("_orig_mod.", "module.")  # the prefixes torch.compile and DistributedDataParallel add to every key


def unwrapped(state_dict: Mapping[str, object]) -> dict[str, object]:
    """The state dict under the wrapped model's own keys: the prefixes of torch.compile (`_orig_mod.`) and
    DistributedDataParallel (`module.`) stripped, in any order (DDP of a compiled model saves `module._orig_mod.`),
    as torch.nn.modules.utils.consume_prefix_in_state_dict_if_present strips DDP's."""
    out, source = {}, {}
    for original, value in state_dict.items():
        key = original
        while key.startswith(WRAPPERS):
            key = key.split(".", 1)[1]
        if key in out:  # two keys of one weight: either would be dropped without a word
            raise ValueError(duplicate_key_message(source[key], original, key))
        out[key], source[key] = value, original
    return out


def duplicate_key_message(first: str, second: str, key: str) -> str:
    """One line: two keys of a state dict name the same weight `key` once a wrapper's prefix is stripped."""
    return (f"state dict keys {first!r} and {second!r} both name the weight {key!r} (a wrapper's or a model's "
            "prefix stripped), so one would be dropped without a word; pass the state dict of one model (drop one "
            "of the two keys).")


def as_array(value: object) -> np.ndarray:
    """A state dict's value as a numpy array; a torch tensor detached to the CPU (its bfloat16, which numpy lacks,
    as float32: the same values), without importing torch."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu()
        value = (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    return np.asarray(value)


def check_values(state_dict: Mapping[str, np.ndarray]) -> None:
    """ValueError naming the first key whose values are not floating point (integers, bools or complex numbers
    would be cast to float32 in silence, a complex number losing its imaginary part) or not finite (a diverged or
    damaged checkpoint)."""
    for key, value in state_dict.items():
        if not jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            raise ValueError(f"state dict key {key!r} holds {value.dtype} values, but a model's weights are floating "
                             "point; pass the float weights of the model (float32, float16 or bfloat16), not an "
                             "integer, bool or complex array, which would be cast to float32 without a word.")
        if not np.isfinite(value).all():  # np.isfinite takes bfloat16 too: no float32 copy of every weight
            raise ValueError(f"state dict key {key!r} holds NaN or infinite values (a diverged or damaged "
                             "checkpoint); load one saved before the run diverged.")


def _to_torch(layer: Linear | Conv2d, name: str, value: np.ndarray) -> np.ndarray:
    if name == "bias":
        return value
    return value.T if isinstance(layer, Linear) else value.transpose(3, 2, 0, 1)  # HWIO -> OIHW


def _from_torch(layer: Linear | Conv2d, name: str, value: np.ndarray) -> np.ndarray:
    if name == "bias":
        return value
    return value.T if isinstance(layer, Linear) else value.transpose(2, 3, 1, 0)  # OIHW -> HWIO


def _torch_shape(layer: Linear | Conv2d, name: str) -> tuple[int, ...]:
    shape = getattr(layer, name).shape
    if name == "bias":
        return tuple(shape)
    return (shape[1], shape[0]) if isinstance(layer, Linear) else (shape[3], shape[2], shape[0], shape[1])


def _entries(model: nnx.Module):
    """(torch key, layer, param name) for every weight and bias, in torch's order."""
    if not callable(getattr(model, "torch_modules", None)):
        raise ValueError(f"{type(model).__name__} has no torch_modules(); define it (state-dict prefix -> layer) "
                         f"or use a models.get(...) model.")
    for prefix, layer in model.torch_modules().items():
        yield f"{prefix}.weight", layer, "kernel"
        yield f"{prefix}.bias", layer, "bias"


def torch_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """The PyTorch state-dict keys of `model` and their shapes (works on an nnx.eval_shape model too)."""
    return {key: _torch_shape(layer, name) for key, layer, name in _entries(model)}


def to_torch_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's weights under PyTorch's keys and layouts (OIHW conv weights, [out, in] linear weights), each a
    writable array of its own: np.asarray of a CPU jax.Array is a read-only view of JAX's buffer, which
    torch.from_numpy warns of and an in-place torch update (load_state_dict(assign=True), then a step) would write
    into the model's weights."""
    return {key: np.array(_to_torch(layer, name, np.asarray(getattr(layer, name)[...])), order="C")
            for key, layer, name in _entries(model)}


def check_state_dict(expected: Mapping[str, tuple[int, ...]], state_dict: Mapping[str, object],
                     model_name: str) -> None:
    """ValueError naming the first missing / unexpected key or wrong shape."""
    missing = [k for k in expected if k not in state_dict]
    extra = [k for k in state_dict if k not in expected]
    if missing or extra:
        raise ValueError(f"state dict does not match {model_name}: missing keys {missing}, unexpected keys "
                         f"{extra}; expected keys {list(expected)} (check the model name and its kwargs)")
    for key, shape in expected.items():
        got = tuple(np.shape(state_dict[key]))
        if got != shape:
            raise ValueError(f"state dict key {key!r} of {model_name} has shape {got}, expected {shape}; "
                             f"pass the kwargs the torch model was built with (e.g. num_classes)")


def load_torch_state_dict(model: nnx.Module, state_dict: Mapping[str, object], model_name: str = "") -> None:
    """Copy a checked PyTorch state dict into `model` in place (values as float32); a wrapper's prefixes are
    stripped (`unwrapped`)."""
    state_dict = {key: as_array(value) for key, value in unwrapped(state_dict).items()}
    check_state_dict(torch_shapes(model), state_dict, model_name or type(model).__name__)
    check_values(state_dict)
    for key, layer, name in _entries(model):
        value = _from_torch(layer, name, np.asarray(state_dict[key], np.float32))
        getattr(layer, name).set_value(jax.numpy.asarray(value))
