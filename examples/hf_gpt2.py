"""GPT-2 between Hugging Face transformers and jaxpar, both ways, checked by logits. Needs torch and transformers
(the test suite does not: tests/test_weights.py reads a save_pretrained folder made with safetensors alone).

    python examples/hf_gpt2.py [OUT_DIR]      # default /tmp/jaxpar-hf-gpt2

A small GPT2LMHeadModel (3 layers x 48 wide, 4 heads: a head count no jaxpar config name has, so it must come
from the files) is saved four ways: save_pretrained as safetensors and as pytorch_model.bin, torch.save of its
state dict, and a ckpt.pt as nanoGPT's train.py saves one ({"model": nanoGPT's keys, "model_args": {...},
"iter_num", "config"}). Each loads in jaxpar with
logits equal to transformers' (float32 rounding): the ckpt.pt as nanoGPT runs it, with its erf GELU (nn.GELU()),
so against transformers' activation_function="gelu" on the same weights. Then train.py starts from each, takes one
SGD step at lr 1e-30 (the weights unchanged) and exports a folder, a .pt and a .safetensors; transformers loads
each back (the folder by from_pretrained, its config.json naming the GELU) with the original's logits.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINEARS = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # HF Conv1D [in, out] <-> nanoGPT nn.Linear [out, in]


def main(out: str) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import jaxpar
    from jaxpar.run import weights

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_head=4, n_embd=48, vocab_size=256, n_positions=64)).eval()
    with torch.no_grad():  # weights far from the init (logits of order 10), so that every weight and the GELU matter
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3).add_(1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0)
    hf.save_pretrained(f"{out}/hf_safetensors")
    hf.save_pretrained(f"{out}/hf_bin", safe_serialization=False)
    torch.save(hf.state_dict(), f"{out}/state_dict.pt")
    nano = {k: v.t().contiguous() if k.endswith(LINEARS) else v for k, v in hf.state_dict().items()
            if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    torch.save({"model": nano, "model_args": dict(n_layer=3, n_head=4, n_embd=48, block_size=64, bias=True,
                                                  vocab_size=256, dropout=0.0),
                "iter_num": 0, "config": {}}, f"{out}/ckpt.pt")  # as nanoGPT's train.py saves one
    x = torch.randint(0, 256, (2, 32))
    erf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_head=4, n_embd=48, vocab_size=256, n_positions=64,
                                     activation_function="gelu")).eval()  # what nanoGPT computes of these weights
    erf.load_state_dict(hf.state_dict())
    with torch.no_grad():
        wants = {"gelu_new": hf(x).logits.numpy(), "gelu": erf(x).logits.numpy()}
    configs = {"gelu_new": hf.config, "gelu": erf.config}
    apart = np.abs(wants["gelu"] - wants["gelu_new"]).max()
    print(f"the two GELUs on these weights: logits {apart:.2e} apart")
    assert apart > 1e-3, apart  # a load with the wrong GELU would fail the checks below

    rows = []
    for src in ("hf_safetensors", "hf_bin", "state_dict.pt", "ckpt.pt"):
        sd, meta = weights.read(f"{out}/{src}")
        act = jaxpar.models.gpt.activation_of(meta) or jaxpar.models.gpt.implied_activation(meta) or "gelu_new"
        model = jaxpar.from_torch_state_dict("gpt-nano", sd, n_head=meta.get("n_head", 4), activation_function=act)
        heads = f"n_head {meta['n_head']} from the files" if "n_head" in meta else "n_head 4 given (not in the file)"
        rows.append((f"jaxpar reads {src}", f"{heads}, {act}",
                     np.abs(np.asarray(model(x.numpy())) - wants[act]).max()))
    for src in ("hf_safetensors", "hf_bin", "ckpt.pt"):
        act = "gelu" if src == "ckpt.pt" else "gelu_new"  # nanoGPT's ckpt.pt runs the erf GELU
        stem = "from_" + src.replace(".", "_")
        for dst in (f"{stem}/", f"{stem}.pt", f"{stem}.safetensors"):
            run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", "gpt-nano",
                                  "--init-torch", f"{out}/{src}", "--dataset", "text", "--seq-len", "32", "--steps",
                                  "1", "--batch-size", "4", "--optimizer", "sgd", "--lr", "1e-30", "--eval-split", "",
                                  "--quiet", "--export-torch", f"{out}/{dst}"], capture_output=True, text=True)
            if run.returncode:
                rows.append((f"train.py {src} -> {dst}", "FAILED", run.stderr.strip().splitlines()[-1]))
                continue
            if dst.endswith("/"):
                back = GPT2LMHeadModel.from_pretrained(f"{out}/{dst}").eval()
            else:
                back = GPT2LMHeadModel(configs[act]).eval()
                sd = {k: torch.from_numpy(v) for k, v in weights.read(f"{out}/{dst}")[0].items()}
                missing, unexpected = back.load_state_dict(sd, strict=False)
                assert not unexpected and all(k.endswith("attn.bias") for k in missing), (missing, unexpected)
            with torch.no_grad():
                rows.append((f"train.py {src} -> {dst}, loaded by transformers",
                             f"ok, {back.config.activation_function}",
                             np.abs(back(x).logits.numpy() - wants[act]).max()))
    print("| step | result | max abs logit difference from GPT2LMHeadModel's |\n|---|---|---:|")
    for name, result, diff in rows:
        print(f"| {name} | {result} | {diff if isinstance(diff, str) else f'{diff:.2e}'} |")
    bad = [name for name, _, diff in rows if isinstance(diff, str) or diff > 1e-4]
    assert not bad, f"these differ from transformers' logits (or failed): {bad}"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/jaxpar-hf-gpt2")
