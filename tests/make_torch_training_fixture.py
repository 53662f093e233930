"""Train the MLP and the linear model in plain PyTorch for STEPS steps under each of train.py's optimizer settings,
and save the runs as tests/fixtures/torch_training.npz.

    /work/venv/bin/python tests/make_torch_training_fixture.py      # needs torch; the tests do not

Each case of CASES is a model and the train.py flags (jaxpar.Config fields) of a run; this script writes torch's
side of them from torch's own API: torch.optim.SGD / Adam / AdamW / Adadelta with torch's defaults, parameter
groups without decay on biases for --weight-decay-params matrices (nanoGPT's configure_optimizers), StepLR(step_size
1, gamma) stepped once an "epoch" of STEPS_PER_EPOCH batches, nanoGPT's get_lr written into the param groups before
each step for --lr-schedule cosine, and clip_grad_norm_ between backward and step for --grad-clip. A flag a case
leaves out has torch's default, except --gamma: no StepLR unless a case gives one (train.py's default 0.7 is the
MNIST example's; tests/test_torch_training.py passes --gamma 1.0 for the constant-rate cases). The loss is
nn.CrossEntropyLoss (the mean over the batch). The models have no dropout and every parameter is used, so nothing
random happens after the initial weights.

The fixture holds, per model, the initial state dict `<model>/sd/<key>`, the batches `<model>/x` [STEPS, BATCH,
features] and `<model>/y` [STEPS, BATCH] (int32); per case, the parameters after the last step
`case/<name>/sd/<key>` and the loss of each step `case/<name>/loss` [STEPS] (before that step's update).
"""
from __future__ import annotations

import math
import os

import numpy as np

from make_torch_fixtures import FIXTURES, MLP_SIZES, torch_model

PATH = os.path.join(FIXTURES, "torch_training.npz")
SEED = 0
STEPS = 6
STEPS_PER_EPOCH = 2  # StepLR steps its gamma every 2 batches: the lr of the 6 steps is lr x (1, 1, g, g, g^2, g^2)
BATCH = 8
LINEAR_SIZES = dict(input_size=5, output_size=2)
MODELS = {"mlp": MLP_SIZES, "linear": LINEAR_SIZES}
NANOGPT = dict(optimizer="adamw", lr=1e-2, adam_beta2=0.95, weight_decay=0.1, weight_decay_params="matrices",
               lr_schedule="cosine", warmup_steps=2, lr_decay_steps=4, grad_clip=0.5)
# name: (model, train.py flags). Learning rates larger than torch's defaults where those would move the weights by
# less than ~1e-2 in 6 steps. Decays large enough that each changes the result by far more than 1e-4.
CASES = {
    "sgd": ("mlp", dict(optimizer="sgd", lr=0.1)),
    "sgd_momentum": ("mlp", dict(optimizer="sgd", lr=0.1, momentum=0.9)),
    "sgd_nesterov": ("mlp", dict(optimizer="sgd", lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_weight_decay": ("mlp", dict(optimizer="sgd", lr=0.1, momentum=0.5, weight_decay=0.2)),
    "sgd_steplr": ("mlp", dict(optimizer="sgd", lr=0.2, momentum=0.9, gamma=0.5)),
    "sgd_clip": ("mlp", dict(optimizer="sgd", lr=0.1, momentum=0.9, grad_clip=0.2)),
    "adam": ("mlp", dict(optimizer="adam", lr=1e-2)),
    "adam_l2": ("mlp", dict(optimizer="adam", lr=1e-2, weight_decay=0.5)),
    "adam_l2_matrices": ("mlp", dict(optimizer="adam", lr=1e-2, weight_decay=0.5, weight_decay_params="matrices")),
    "adam_betas_eps": ("mlp", dict(optimizer="adam", lr=1e-2, adam_beta1=0.8, adam_beta2=0.95, eps=1e-2)),
    "adamw": ("mlp", dict(optimizer="adamw", lr=1e-2)),  # torch's default decay, 0.01
    "adamw_decay": ("mlp", dict(optimizer="adamw", lr=1e-2, weight_decay=0.5)),
    "adamw_matrices": ("mlp", dict(optimizer="adamw", lr=1e-2, weight_decay=0.5, weight_decay_params="matrices")),
    "adamw_steplr": ("mlp", dict(optimizer="adamw", lr=1e-2, weight_decay=0.5, gamma=0.5)),
    "nanogpt": ("mlp", NANOGPT),  # AdamW, betas (0.9, 0.95), decay on matrices, warmup + cosine, clip
    "adadelta": ("linear", dict(optimizer="adadelta")),  # torch's defaults: lr 1.0, rho 0.9, eps 1e-6
    "adadelta_weight_decay": ("linear", dict(optimizer="adadelta", weight_decay=0.5)),
    "adadelta_eps_steplr": ("mlp", dict(optimizer="adadelta", eps=1e-4, gamma=0.5)),
}


def nanogpt_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's train.py get_lr(it), as written there (it = the iteration, 0 for the first update)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def build(name: str):
    """The torch twin of jaxpar's model `name` (make_torch_fixtures' models; the linear one under the tutorial's
    key `fc`) and its forward function."""
    import torch

    torch.manual_seed(SEED)
    model = torch_model(name, **MODELS[name])
    if name == "linear":
        model = torch.nn.ModuleDict({"fc": model})
        return model, lambda x: model["fc"](x)
    return model, model


def optimizer(model, flags: dict):
    """torch.optim's optimizer for the flags, the parameters in one group, or (--weight-decay-params matrices) in
    nanoGPT's two: those of 2+ dimensions with the decay, the others without."""
    import torch

    name = flags["optimizer"]
    lr = flags.get("lr", 1.0 if name == "adadelta" else 1e-3)
    decay = flags.get("weight_decay", 0.01 if name == "adamw" else 0.0)
    params = list(model.parameters())
    if flags.get("weight_decay_params", "all") == "matrices":
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": decay}]
    betas = (flags.get("adam_beta1", 0.9), flags.get("adam_beta2", 0.999))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=flags.get("momentum", 0.0),
                               nesterov=flags.get("nesterov", False))
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=flags.get("eps", 1e-8))
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=flags.get("eps", 1e-8))
    if name == "adadelta":
        return torch.optim.Adadelta(groups, lr=lr, eps=flags.get("eps", 1e-6))
    raise ValueError(f"optimizer={name!r} has no torch twin here")


def train(name: str, flags: dict, batches) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """STEPS steps of plain PyTorch training: the final state dict and each step's loss."""
    import torch

    model, forward = build(name)
    opt = optimizer(model, flags)
    lr = opt.param_groups[0]["lr"]
    gamma = flags.get("gamma", 1.0)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma) if gamma != 1.0 else None
    cosine = flags.get("lr_schedule") == "cosine"
    clip = flags.get("grad_clip", 0.0)
    losses = []
    for it, (x, y) in enumerate(batches):
        if cosine:  # nanoGPT's loop: the lr of iteration `it` set before its forward
            rate = nanogpt_lr(it, lr, flags.get("warmup_steps", 0), flags.get("lr_decay_steps", STEPS),
                              flags.get("min_lr", lr / 10))
            for group in opt.param_groups:
                group["lr"] = rate
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.CrossEntropyLoss()(forward(torch.from_numpy(x)), torch.from_numpy(y).long())
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())  # every parameter is used
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip * 1.05, f"{name}: grad norm {float(norm)} does not clip at {clip}"
        opt.step()
        losses.append(loss.item())
        if step_lr is not None and (it + 1) % STEPS_PER_EPOCH == 0:
            step_lr.step()  # the end of an epoch
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return sd, np.asarray(losses, np.float32)


def main() -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(SEED + 2)
    fx, data = {}, {}
    for name in MODELS:
        model, forward = build(name)
        features = next(model.parameters()).shape[1]
        classes = forward(torch.zeros(1, features)).shape[-1]
        x = rng.standard_normal((STEPS, BATCH, features), dtype=np.float32)
        y = rng.integers(0, classes, size=(STEPS, BATCH)).astype(np.int32)
        data[name] = list(zip(x, y))
        fx[f"{name}/x"], fx[f"{name}/y"] = x, y
        fx.update({f"{name}/sd/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()})
    for case, (name, flags) in CASES.items():
        sd, losses = train(name, flags, data[name])
        fx.update({f"case/{case}/sd/{k}": v for k, v in sd.items()})
        fx[f"case/{case}/loss"] = losses
        moved = max(float(np.max(np.abs(v - fx[f"{name}/sd/{k}"]))) for k, v in sd.items())
        print(f"{case:24s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, moved {moved:.3g}")
    assert all(v.dtype in (np.float32, np.int32) for v in fx.values())
    os.makedirs(FIXTURES, exist_ok=True)
    np.savez_compressed(PATH, **fx)
    print(f"{PATH}: {os.path.getsize(PATH) / 1e3:.1f} kB")


if __name__ == "__main__":
    main()
