"""Build the PyTorch twins of models/ and save their outputs as tests/fixtures/<name>.npz.

    /work/venv/bin/python tests/make_torch_fixtures.py      # needs torch; the tests do not

Each fixture holds `x` (NCHW or [B, F], as torch takes it), torch's eval output `out`, the gradients
`grad/<key>` of the summed NLL of `y` for a few weights, and either the state dict itself (`sd/<key>`,
small models) or, when it would be too large to commit, only its keys and shapes (`keys`, `shapes`): the
weights are then `recipe_state_dict(...)`, regenerated from numpy in the test. alexnet.npz also holds
torch's adaptive_avg_pool2d(·, 6) of `pool_x/<h>x<w>` as `pool_out/<h>x<w>`.
"""
from __future__ import annotations

import math
import os
import zlib

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SEED = 0
MLP_SIZES = dict(in_features=20, hidden_dim=32, out_features=10)
ALEXNET_CLASSES = 10
POOL_SIZES = ((1, 1), (2, 3), (5, 5), (8, 11), (13, 7))  # input h x w of the adaptive-pool checks
GRAD_KEYS = {"convnet": ("conv1.weight", "conv2.weight", "fc2.weight", "fc2.bias"),
             "alexnet": ("features.0.weight", "features.10.bias", "classifier.6.weight")}


def recipe_state_dict(shapes: dict[str, tuple[int, ...]], seed: int = SEED) -> dict[str, np.ndarray]:
    """Deterministic weights without torch: key k ~ U(-b, b) from default_rng([seed, crc32(k)]).

    b = sqrt(6 / fan_in) for weights (He uniform, so activations stay O(1) through deep nets) and
    1 / sqrt(fan_in) for biases, fan_in taken from the weight of the same layer.
    """
    out = {}
    for key, shape in shapes.items():
        weight = shapes[key.rsplit(".", 1)[0] + ".weight"]
        fan_in = math.prod(weight[1:])
        bound = math.sqrt(6.0 / fan_in) if key.endswith(".weight") else 1.0 / math.sqrt(fan_in)
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        out[key] = ((rng.random(shape, dtype=np.float32) * 2 - 1) * bound).astype(np.float32)
    return out


def torch_model(name: str, **kwargs):
    """The PyTorch model `name`, written out here (torchvision is not needed)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):  # pytorch/examples mnist/main.py
        def __init__(self, num_classes=10):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, num_classes)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            x = torch_flatten(self.dropout1(x))
            x = self.dropout2(F.relu(self.fc1(x)))
            return F.log_softmax(self.fc2(x), dim=1)

    class AlexNet(nn.Module):  # torchvision.models.alexnet
        def __init__(self, num_classes=1000, dropout=0.5):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2),
                nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2),
                nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
                nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
                nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2))
            self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
            self.classifier = nn.Sequential(
                nn.Dropout(p=dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
                nn.Dropout(p=dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
                nn.Linear(4096, num_classes))

        def forward(self, x):
            return self.classifier(torch_flatten(self.avgpool(self.features(x))))

    def torch_flatten(x):
        import torch
        return torch.flatten(x, 1)

    if name == "linear":  # the DataParallel tutorial's Model
        return nn.Linear(kwargs.get("input_size", 5), kwargs.get("output_size", 2))
    if name == "mlp":
        k = {**MLP_SIZES, **kwargs}
        return nn.Sequential(nn.Linear(k["in_features"], k["hidden_dim"]), nn.ReLU(),
                             nn.Linear(k["hidden_dim"], k["out_features"]))
    if name == "convnet":
        return Net(**kwargs)
    if name == "alexnet":
        return AlexNet(**kwargs)
    raise ValueError(f"unknown model {name=}")


def _fixture(name: str, x_shape: tuple[int, ...], store_weights: bool, **kwargs) -> dict[str, np.ndarray]:
    import torch

    torch.manual_seed(SEED)
    model = torch_model(name, **kwargs)
    if name == "linear":  # torch's nn.Linear keys are weight/bias; the tutorial's Model holds it as `fc`
        model = torch.nn.ModuleDict({"fc": model})
        forward = lambda x: model["fc"](x)  # noqa: E731
    else:
        forward = model
    if not store_weights:
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        model.load_state_dict({k: torch.from_numpy(v) for k, v in recipe_state_dict(shapes).items()})
    model.eval()
    rng = np.random.default_rng(SEED + 1)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    out = forward(torch.from_numpy(x))
    n_out = out.shape[-1]
    y = rng.integers(0, n_out, size=x_shape[0])
    logp = out if name == "convnet" else torch.log_softmax(out, dim=1)
    torch.nn.functional.nll_loss(logp, torch.from_numpy(y), reduction="sum").backward()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    fx = dict(x=x, y=y.astype(np.int32), out=out.detach().numpy())
    fx.update({f"grad/{k}": g for k, g in grads.items() if store_weights or k in GRAD_KEYS[name]})
    if store_weights:
        fx.update({f"sd/{k}": v for k, v in sd.items()})
    else:
        fx["keys"] = np.array(list(sd))
        fx["shapes"] = np.array([str(tuple(v.shape)) for v in sd.values()])
    if name == "alexnet":
        for h, w in POOL_SIZES:
            px = rng.standard_normal((2, 4, h, w), dtype=np.float32)
            fx[f"pool_x/{h}x{w}"] = px
            fx[f"pool_out/{h}x{w}"] = torch.nn.functional.adaptive_avg_pool2d(
                torch.from_numpy(px), 6).numpy()
    return fx


def main() -> None:
    os.makedirs(FIXTURES, exist_ok=True)
    specs = {
        "linear": dict(x_shape=(8, 5), store_weights=True),
        "mlp": dict(x_shape=(6, MLP_SIZES["in_features"]), store_weights=True),
        "convnet": dict(x_shape=(4, 1, 28, 28), store_weights=False),
        "alexnet": dict(x_shape=(2, 3, 64, 64), store_weights=False, num_classes=ALEXNET_CLASSES),
    }
    for name, spec in specs.items():
        path = os.path.join(FIXTURES, f"{name}.npz")
        np.savez_compressed(path, **_fixture(name, **spec))
        print(f"{path}: {os.path.getsize(path) / 1e3:.1f} kB")


if __name__ == "__main__":
    main()
