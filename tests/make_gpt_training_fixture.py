"""Train make_gpt_fixture's tiny GPT-2 (Hugging Face's GPT2LMHeadModel, lm_head tied to wte) for STEPS steps in
plain PyTorch under nanoGPT's optimizer, and save the run as tests/fixtures/gpt_training.npz.

    /work/venv/bin/python tests/make_gpt_training_fixture.py      # needs torch and transformers; the tests do not

The model: V=64 tokens, T=16 positions (n_positions = T, so every position's embedding is used), 2 layers x 32
wide, 4 heads, dropout 0 everywhere, so nothing random happens after the initial weights. Those are drawn here
(INIT_STD, not GPT-2's 0.02): weights and biases N(0, 0.2), LayerNorm scales 1 + N(0, 0.2), so that the weight
decay (lr x 0.1 x |w| a step: ~5e-4 at wte's median entry over the run) is far above float32 rounding, a decay on
the biases would show as much as one on the matrices, and the attention is not saturated (scores of order 1).

The optimizer is nanoGPT's configure_optimizers: torch.optim.AdamW(lr LR, betas (0.9, 0.95)) over two groups,
weight_decay 0.1 on the parameters of 2+ dimensions (wte -- which is lm_head.weight, one Parameter -- wpe and every
kernel) and 0 on the others (biases, LayerNorm); clip_grad_norm_(CLIP) between backward and step. Since
GPT2LMHeadModel ties lm_head.weight to wte.weight, named_parameters() / parameters() yield the table once: it gets
the sum of its embedding's and its head's gradients and one decay per step. The loss is the mean token
cross-entropy of the next token over all B x T tokens (nn.CrossEntropyLoss over the flattened logits; checked
against transformers' own loss, `labels=` with `shift_labels=` the targets): batch i is `tokens[i]` [B, T+1],
x = tokens[:, :-1], y = tokens[:, 1:].

The fixture holds the initial state dict `sd/<key>` (every key GPT2LMHeadModel's state_dict() has), the token
batches `tokens` [STEPS, B, T+1] (int32), the final state dict `final/<key>`, each step's loss `loss` [STEPS] (before
that step's update), the gradient norm `grad_norm` [STEPS] (clip_grad_norm_'s, before clipping), and the first
step's gradient of each block's c_attn bias `grad0/<key>` (whose key slice is zero in exact arithmetic).
"""
from __future__ import annotations

import os

import numpy as np

from make_gpt_fixture import C, H, L, T, V

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gpt_training.npz")
SEED = 0
STEPS, B = 4, 4
INIT_STD = 0.2
LR, BETAS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 0.1, 1.0
# train.py's flags for the same run (jaxpar.Config fields): --gamma 1.0 keeps the lr constant
FLAGS = dict(optimizer="adamw", lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=WEIGHT_DECAY,
             weight_decay_params="matrices", grad_clip=CLIP, gamma=1.0)


def torch_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # GPT2Config's default bos/eos ids lie outside a 64-token vocabulary
    cfg = GPT2Config(vocab_size=V, n_positions=T, n_layer=L, n_head=H, n_embd=C, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, summary_first_dropout=0.0)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one Parameter
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, INIT_STD).add_(1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0)
    return model.train()


def batches() -> np.ndarray:
    return np.random.default_rng(SEED + 1).integers(0, V, (STEPS, B, T + 1)).astype(np.int32)


def main() -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    model = torch_model()
    fx = {f"sd/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert sum(p is model.transformer.wte.weight for p in params) == 1  # the tied table is one parameter
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
    tokens = batches()
    losses, norms = [], []
    for seq in tokens:
        x, y = torch.from_numpy(seq[:, :-1]).long(), torch.from_numpy(seq[:, 1:]).long()
        opt.zero_grad(set_to_none=True)
        logits = model(x).logits
        loss = torch.nn.CrossEntropyLoss()(logits.reshape(-1, V), y.reshape(-1))  # the mean over B x T tokens
        with torch.no_grad():  # transformers' own causal-LM loss (shift_labels: the targets as given) is the same
            hf = model(x, labels=y, shift_labels=y).loss
        assert abs(float(hf) - loss.item()) < 1e-6 * loss.item(), (float(hf), loss.item())
        loss.backward()
        assert all(p.grad is not None for p in params)  # every parameter is used
        if not losses:  # the first step's gradient of each fused q|k|v bias, its key slice rounding noise
            fx.update({f"grad0/transformer.h.{i}.attn.c_attn.bias": block.attn.c_attn.bias.grad.numpy().copy()
                       for i, block in enumerate(model.transformer.h)})
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        losses.append(loss.item())
    assert max(norms) > CLIP * 1.05, f"grad norms {norms} never clip at {CLIP}"
    fx.update({f"final/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()})
    fx["tokens"], fx["loss"], fx["grad_norm"] = tokens, np.float32(losses), np.float32(norms)
    moved = {k[3:]: float(np.abs(fx["final/" + k[3:]] - v).max()) for k, v in fx.items() if k.startswith("sd/")}
    print(f"losses {np.round(losses, 4)}, grad norms {np.round(norms, 4)} (clip {CLIP})")
    print(f"moved: min {min(moved.values()):.3g} ({min(moved, key=moved.get)}), max {max(moved.values()):.3g}")
    assert all(v.dtype in (np.float32, np.int32) for v in fx.values()), {k: v.dtype for k, v in fx.items()}
    np.savez_compressed(PATH, **fx)
    print(f"{PATH}: {len(fx)} arrays, {os.path.getsize(PATH) / 1e3:.1f} kB")


if __name__ == "__main__":
    main()
