"""Build tests/fixtures/gpt.npz: what PyTorch computes for the tiny GPT-2 of tests/test_gpt.py, so the tests need
neither torch nor transformers.

    python tests/make_gpt_fixture.py      # needs torch and transformers; the tests do not

Four models with weights far from the init (N(0, 0.3), LayerNorm scales 1 + N(0, 0.3)): Hugging Face's
GPT2LMHeadModel (`hf`), and the nanoGPT twin (tests/gpt_torch.py) with and without biases (`nanogpt`,
`nanogpt-nobias`), and with nanoGPT's own erf GELU (`nanogpt-gelu`: `nanogpt`'s weights). For each, under
`<case>/`: the state dict (`sd/<key>`, every key torch's state_dict() has),
tokens `x` and torch's eval logits `logits`. Under `grad/`: the gradients (`grad/<key>`) of the mean token
cross-entropy of tokens `y` given `x` for the biased nanoGPT twin, and that `loss`.
"""
from __future__ import annotations

import os

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gpt.npz")
V, T, L, H, C = 64, 16, 2, 4, 32
TINY = dict(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)
# case -> (layout, bias, activation_function: the GELU by transformers' name, jaxpar.models.gpt.ACTIVATIONS)
CASES = {"hf": ("hf", True, "gelu_new"), "nanogpt": ("nanogpt", True, "gelu_new"),
         "nanogpt-nobias": ("nanogpt", False, "gelu_new"), "nanogpt-gelu": ("nanogpt", True, "gelu")}


def tokens(n: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (n, T))


def scramble_torch(model, seed: int):
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3).add_(1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0)
    return model.eval()


def torch_model(layout: str, bias: bool, activation: str = "gelu_new"):
    if layout == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()  # GPT2Config's default bos/eos ids lie outside a 64-token vocabulary
        return scramble_torch(GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_layer=L, n_head=H,
                                                         n_embd=C)), seed=1)
    import gpt_torch

    approximate = {"gelu_new": "tanh", "gelu": "none"}[activation]
    return scramble_torch(gpt_torch.GPT(gpt_torch.GPTConfig(bias=bias, gelu_approximate=approximate, **TINY)), seed=0)


def logits(model, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(x))
    return (out.logits if hasattr(out, "logits") else out).numpy()


def main() -> None:
    import torch

    out = {}
    for case, (layout, bias, activation) in CASES.items():
        model = torch_model(layout, bias, activation)
        x = tokens(seed=len(out))
        out.update({f"{case}/sd/{k}": v.detach().numpy() for k, v in model.state_dict().items()})
        out[f"{case}/x"], out[f"{case}/logits"] = x, logits(model, x)
    twin = torch_model("nanogpt", True)
    x, y = tokens(4, seed=3), tokens(4, seed=4)
    loss = torch.nn.functional.cross_entropy(twin(torch.as_tensor(x)).view(-1, V), torch.as_tensor(y).view(-1))
    loss.backward()
    out.update({f"grad/{k}": p.grad.numpy() for k, p in twin.named_parameters()})
    out.update({"grad/x": x, "grad/y": y, "grad/loss": np.float32(loss.item())})
    tmp = FIXTURE + ".tmp.npz"
    np.savez_compressed(tmp, **out)
    os.replace(tmp, FIXTURE)
    print(f"wrote {FIXTURE}: {len(out)} arrays, {os.path.getsize(FIXTURE) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
