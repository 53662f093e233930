"""The PyTorch tutorial models as Flax NNX modules (NHWC images), attribute names mirroring PyTorch's.

Each model's `layers` is its flat sequence of layers and `__call__` is exactly their composition.
`torch_modules()` maps each PyTorch state-dict prefix to the layer holding those weights.
"""
from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

from jaxpar.models.layers import (AdaptiveAvgPool2d, ConvImpl, Conv2d, Flatten, Linear, LogSoftmax, MaxPool2d,
                                  ReLU)


class Layered(nnx.Module):
    """A model that is the composition of its `layers`: x -> layers[-1](...layers[0](x)...)."""

    layers: Sequence[nnx.Module]  # a property, or an nnx.List attribute
    # and, for PyTorch conversion, torch_modules() -> {state-dict prefix: Linear | Conv2d}; every model below has it

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class LinearModel(Layered):
    """The DataParallel tutorial's model: one nn.Linear. torch keys: fc.weight [out, in], fc.bias."""

    def __init__(self, input_size: int = 5, output_size: int = 2, *, rngs: nnx.Rngs):
        self.fc = Linear(input_size, output_size, rngs=rngs)

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        return (self.fc,)

    def torch_modules(self) -> dict[str, Linear | Conv2d]:
        return {"fc": self.fc}


class MLP(Layered):
    """nn.Sequential(Linear, ReLU, Linear) on [B, in_features].

    torch keys: 0.weight [hidden, in], 0.bias, 2.weight [out, hidden], 2.bias; here `layers[0]`, `layers[2]`
    (NNX state paths layers/0/kernel, layers/2/kernel: the Sequential's indices).
    """

    def __init__(self, in_features: int = 784, hidden_dim: int = 512, out_features: int = 10, *,
                 rngs: nnx.Rngs):
        self.layers = nnx.List([Linear(in_features, hidden_dim, rngs=rngs), ReLU(),
                                Linear(hidden_dim, out_features, rngs=rngs)])

    def torch_modules(self) -> dict[str, Linear | Conv2d]:
        return {"0": self.layers[0], "2": self.layers[2]}


class ConvNet(Layered):
    """PyTorch examples/mnist `Net` on [B, 28, 28, 1]; returns log-probabilities. 1,199,882 params.

    torch keys: conv1.{weight,bias} [32, 1, 3, 3], conv2 [64, 32, 3, 3], fc1 [128, 9216] (NCHW flatten
    order), fc2 [10, 128].
    """

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs, conv_impl: ConvImpl | None = None):
        self.conv1 = Conv2d(1, 32, 3, 1, rngs=rngs, impl=conv_impl)
        self.conv2 = Conv2d(32, 64, 3, 1, rngs=rngs, impl=conv_impl)
        self.dropout1 = nnx.Dropout(0.25, rngs=rngs)
        self.dropout2 = nnx.Dropout(0.5, rngs=rngs)
        self.fc1 = Linear(9216, 128, rngs=rngs)
        self.fc2 = Linear(128, num_classes, rngs=rngs)
        # torch's F.relu / F.max_pool2d / torch.flatten / F.log_softmax, as (parameterless) layers
        self.relu, self.max_pool, self.flatten, self.log_softmax = ReLU(), MaxPool2d(2), Flatten(), LogSoftmax()

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        return (self.conv1, self.relu, self.conv2, self.relu, self.max_pool, self.dropout1, self.flatten,
                self.fc1, self.relu, self.dropout2, self.fc2, self.log_softmax)

    def torch_modules(self) -> dict[str, Linear | Conv2d]:
        return {"conv1": self.conv1, "conv2": self.conv2, "fc1": self.fc1, "fc2": self.fc2}


class AlexNet(Layered):
    """torchvision AlexNet on [B, H, W, 3] with H, W >= 63 (64 -> 1x1 features, replicated to 6x6).

    torch keys: features.{0,3,6,8,10}.{weight,bias} (OIHW), classifier.{1,4,6}.{weight,bias}; the Flatten
    between avgpool and classifier is torch.flatten(x, 1) (NCHW order). 57,044,810 params at 10 classes.
    """

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs, conv_impl: ConvImpl | None = None,
                 dropout: float = 0.5):
        def conv(cin, cout, k, s, p):
            return Conv2d(cin, cout, k, s, p, rngs=rngs, impl=conv_impl)

        self.features = nnx.List([
            conv(3, 64, 11, 4, 2), ReLU(), MaxPool2d(3, 2),
            conv(64, 192, 5, 1, 2), ReLU(), MaxPool2d(3, 2),
            conv(192, 384, 3, 1, 1), ReLU(),
            conv(384, 256, 3, 1, 1), ReLU(),
            conv(256, 256, 3, 1, 1), ReLU(), MaxPool2d(3, 2)])
        self.avgpool = AdaptiveAvgPool2d(6)
        self.flatten = Flatten()  # torch.flatten(x, 1) in AlexNet.forward
        self.classifier = nnx.List([
            nnx.Dropout(dropout, rngs=rngs), Linear(256 * 6 * 6, 4096, rngs=rngs), ReLU(),
            nnx.Dropout(dropout, rngs=rngs), Linear(4096, 4096, rngs=rngs), ReLU(),
            Linear(4096, num_classes, rngs=rngs)])

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        return (*self.features, self.avgpool, self.flatten, *self.classifier)

    def torch_modules(self) -> dict[str, Linear | Conv2d]:
        mods = {f"features.{i}": m for i, m in enumerate(self.features) if isinstance(m, Conv2d)}
        mods.update({f"classifier.{i}": m for i, m in enumerate(self.classifier) if isinstance(m, Linear)})
        return mods


def as_layers(model: nnx.Module) -> Sequence[nnx.Module]:
    """The flat layer sequence of a model (nn.Sequential / DeepSpeed join_layers); composition == model."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `layers`; use a models.get(...) model")
    return tuple(layers)
