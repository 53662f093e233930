"""PyTorch state-dict files (jaxpar.run.weights): .npz, .safetensors and transformers' save_pretrained folders
read back what was written, atomically; an HF folder (its config.json giving the head count) loads as Hugging
Face's GPT2LMHeadModel computes (tests/fixtures/gpt.npz); torch's files need torch; the CLI exports a GPT as a
folder that reads back to the trained model's logits; a GPT's file of any format keeps its head count, which
--init-torch uses (a file without one loads as before); bad files and suffixes get one-line errors."""
from __future__ import annotations

import json
import os
import pickle
import re
import sys
import types

import numpy as np
import pytest
from flax import nnx

from jaxpar.models import gpt
from jaxpar.run import weights

from make_gpt_fixture import H  # noqa: E402  (tests/, the fixture's sizes)
from test_gpt import corpus, fixture, logits_of, scramble  # noqa: F401  (corpus: a pytest fixture)


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.normal(size=(3, 4)).astype(np.float32), "a.bias": rng.normal(size=4).astype(np.float32),
            "steps": np.arange(5, dtype=np.int64), "half": rng.normal(size=(2, 2)).astype(np.float16)}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("name", ["w.npz", "w.safetensors", "hf/"])
def test_each_format_reads_back_what_was_written(tmp_path, name):
    path = os.path.join(tmp_path, name)  # "hf/": a folder, by its trailing separator (pathlib would drop it)
    written = weights.write(state_dict(), path, config={"n_head": 7} if name == "hf/" else None)
    expected = ["config.json", "model.safetensors"] if name == "hf/" else [name]
    assert sorted(os.listdir(path if name == "hf/" else tmp_path)) == expected  # no temporary file left behind
    assert all(os.path.isfile(f) for f in written)
    got, meta = weights.read(path)
    assert_same(got, state_dict())
    # a config.json without activation_function means transformers' GPT2Config default, the tanh GELU
    assert meta == ({"n_head": 7, "activation_function": "gelu_new"} if name == "hf/" else {})
    assert not np.array_equal(state_dict(1)["a.weight"], got["a.weight"])  # the comparison can fail


def test_bfloat16_is_kept_by_safetensors_and_refused_by_npz(tmp_path):
    """np.savez stores bfloat16 (an ml_dtypes type) as raw 2-byte voids: writing one is refused, and so is reading
    such a file, instead of handing the model bytes; safetensors keeps the type."""
    import ml_dtypes

    sd = {"w": np.linspace(-2, 2, 6, dtype=np.float32).astype(ml_dtypes.bfloat16)}
    weights.write(sd, str(tmp_path / "w.safetensors"))
    got = weights.read(str(tmp_path / "w.safetensors"))[0]["w"]
    assert got.dtype == sd["w"].dtype and np.array_equal(got.astype(np.float32), sd["w"].astype(np.float32))
    with pytest.raises(ValueError, match="'w' is bfloat16, which .npz files do not keep.*write .safetensors"):
        weights.write(sd, str(tmp_path / "w.npz"))
    np.savez(tmp_path / "raw.npz", **sd)
    assert np.load(tmp_path / "raw.npz")["w"].dtype.kind == "V"  # what the refusal guards against
    with pytest.raises(ValueError, match="'w' holds raw bytes.*as float32 or as .safetensors"):
        weights.read(str(tmp_path / "raw.npz"))
    assert sorted(os.listdir(tmp_path)) == ["raw.npz", "w.safetensors"]


def test_a_write_that_fails_leaves_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / "w.npz")
    weights.write(state_dict(0), path)

    def half_then_crash(sd, tmp):
        with open(tmp, "wb") as f:
            f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(weights, "_write_npz", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        weights.write(state_dict(1), path)
    assert os.listdir(tmp_path) == ["w.npz"]
    assert_same(weights.read(path)[0], state_dict(0))


def hf_folder(path, sd: dict, config: dict, shards: int = 1) -> None:
    """What transformers' save_pretrained writes: model.safetensors (or shards and their index) and config.json,
    made here with the safetensors library itself (not jaxpar's writer)."""
    from safetensors.numpy import save_file

    os.makedirs(path)
    keys = sorted(k for k in sd if k != "lm_head.weight")  # save_pretrained leaves the tied head out
    if shards == 1:
        save_file({k: sd[k] for k in keys}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(np.array_split(np.array(keys), shards)):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: sd[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_hugging_face_folder_loads_as_gpt2lmheadmodel_computes(tmp_path, shards):
    sd, x, want = fixture("hf")
    config = {"model_type": "gpt2", "n_head": H, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    hf_folder(tmp_path / "hf", sd, config, shards)
    got, meta = weights.read(str(tmp_path / "hf"))
    assert meta == {k: config[k] for k in ("n_head", "activation_function", "layer_norm_epsilon")}
    gpt.check_hf_config(meta, "the folder")
    model = gpt.from_torch_state_dict(got, n_head=meta["n_head"])
    np.testing.assert_allclose(logits_of(model, x), want, rtol=1e-5, atol=1e-5)
    wrong_heads = gpt.from_torch_state_dict(got, n_head=H // 2)
    assert np.abs(logits_of(wrong_heads, x) - want).max() > 1e-2  # the head count matters: config.json's is used


@pytest.mark.parametrize("field, value, message", [
    ("activation_function", "relu", "activation_function='relu'.*runs a GELU"),
    ("layer_norm_epsilon", 1e-6, "layer_norm_epsilon=1e-06.*1e-05"),
    # GPT2Attention's other scalings (stanford-crfm's GPT-2s divide by the layer index too): loaded silently before,
    # logits 1.65 and 2.69 from transformers' in a QA run
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=True.*scales the attention scores"),
    ("scale_attn_weights", False, "scale_attn_weights=False.*scales the attention scores"),
    # an MLP of another width (GPT2Config's n_inner): the fix said to build the model from the state dict (a QA run)
    ("n_inner", 96, r"n_inner=96, but jaxpar's GPT.*4 x n_embd = 192 wide"),
])
def test_a_config_json_of_another_architecture_is_refused(field, value, message):
    for act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"):
        gpt.check_hf_config({"activation_function": act, "layer_norm_epsilon": 1e-5}, "ok")
    gpt.check_hf_config({"n_inner": 192, "n_embd": 48}, "ok")
    with pytest.raises(ValueError, match=message):
        gpt.check_hf_config({field: value, "n_embd": 48}, "--init-torch 'x'")


def test_torch_files_need_torch_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    (tmp_path / "w.pt").write_bytes(b"whatever")
    for call in (lambda: weights.check_writable(str(tmp_path / "out.bin")),
                 lambda: weights.read(str(tmp_path / "w.pt")),
                 lambda: weights.write(state_dict(), str(tmp_path / "out.pth"))):
        with pytest.raises(ValueError, match="needs torch.*pip install torch, or use .npz or .safetensors"):
            call()
    assert sorted(os.listdir(tmp_path)) == ["w.pt"]


class FakeTensor:
    """A fake torch tensor: a numpy array (float32 or 'bfloat16'); at module level, so pickle keeps it."""

    def __init__(self, a, dtype=None):
        self.a, self.dtype = a, dtype or str(a.dtype)

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return FakeTensor(self.a.astype(np.float32))

    def numpy(self):
        assert self.dtype != "bfloat16", "numpy() of a bfloat16 tensor fails in torch"
        return self.a


def fake_torch():
    """Just enough of torch for weights' torch files: tensors that hold a numpy array, save / load by pickle."""
    def save(obj, path):
        with open(path, "wb") as f:
            pickle.dump(obj, f)

    def load(path, map_location=None, weights_only=True):
        with open(path, "rb") as f:
            return pickle.load(f)

    return types.SimpleNamespace(Tensor=FakeTensor, bfloat16="bfloat16", from_numpy=FakeTensor, save=save, load=load)


@pytest.fixture
def torch_or_fake(monkeypatch):
    """torch where it is installed, else fake_torch() in its place: the torch-file tests run either way."""
    try:
        import torch
    except ImportError:
        torch = fake_torch()
        monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_torch_objects_become_numpy_state_dicts():
    torch = fake_torch()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    plain, meta = weights._from_torch({"w": torch.Tensor(w), "b": torch.Tensor(w[0], "bfloat16")}, "p", "--x", torch)
    assert meta == {} and plain["w"] is w and plain["b"].dtype == np.float32
    ckpt = {"model": {"w": torch.Tensor(w)}, "model_args": {"n_head": 6, "n_layer": 2}}  # jaxpar's older exports
    nano, meta = weights._from_torch(ckpt, "ckpt.pt", "--init-torch", torch)
    assert list(nano) == ["w"] and meta == {"n_head": 6}
    ckpt.update(iter_num=9, config={"beta2": 0.95})  # what nanoGPT's train.py saves beside: its model runs nn.GELU()
    meta = weights._from_torch(ckpt, "ckpt.pt", "--init-torch", torch)[1]
    assert meta == {"n_head": 6, "source": "nanogpt-train"} and gpt.implied_activation(meta) == "gelu"
    ckpt["jaxpar"] = {"activation_function": "gelu_new"}  # jaxpar's export of a tanh-GELU GPT says so beside
    meta = weights._from_torch(ckpt, "ckpt.pt", "--init-torch", torch)[1]
    assert meta["activation_function"] == "gelu_new" and gpt.implied_activation(meta) is None
    with pytest.raises(ValueError, match="entry 'step' is a int, not a tensor; save model.state_dict"):
        weights._from_torch({"w": torch.Tensor(w), "step": 3}, "p", "--init-torch", torch)
    with pytest.raises(ValueError, match="holds a list, not a state dict"):
        weights._from_torch([w], "p", "--init-torch", torch)


def test_bad_paths_get_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    cases = [(lambda: weights.read(str(tmp_path / "none.npz")), "does not exist"),
             (lambda: weights.read(str(tmp_path / "empty")), "folder without model.safetensors"),
             (lambda: weights.read(str(tmp_path / "bad.npz")), "could not be read as .npz.*np.savez"),
             (lambda: weights.check_writable(str(tmp_path / "w.h5")), "suffix '.h5'.*names no state-dict format"),
             (lambda: weights.check_writable(f"{tmp_path}/hf/"), "is a folder.*only a GPT"),
             (lambda: weights.check_writable(str(tmp_path / "no" / "w.npz")), "does not exist")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            call()
        assert "\n" not in str(e.value)
    weights.check_writable(f"{tmp_path}/hf/", folder_ok=True)
    assert sorted(os.listdir(tmp_path)) == ["bad.npz", "empty"]  # checks write nothing
    with pytest.raises(ValueError, match="no biases.*--torch-layout nanogpt"):
        gpt.hf_config(gpt.GPTConfig.named("gpt-nano", bias=False))
    for vocab, special in ((256, None), (50257, 50256), (50304, 50256)):  # <|endoftext|> only where the ids hold it
        config = gpt.hf_config(gpt.GPTConfig.named("gpt-nano", vocab_size=vocab))
        assert config["bos_token_id"] == config["eos_token_id"] == special, vocab


def test_cli_exports_a_gpt_as_a_hf_folder_and_starts_from_it(tmp_path, corpus):  # noqa: F811
    from jaxpar import cli
    from jaxpar.config import Config
    from jaxpar.data import datasets
    from jaxpar.run import trainer

    folder = str(tmp_path / "hf") + "/"
    summary = cli.main(["--model", "gpt-nano", "--dataset", "text", "--data-path", corpus, "--seq-len", "16",
                        "--batch-size", "8", "--steps", "2", "--optimizer", "adamw", "--lr", "1e-2", "--eval-split",
                        "", "--export-torch", folder, "--quiet"])
    with open(folder + "config.json") as f:
        config = json.load(f)
    assert {k: config[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")} == \
        {"n_layer": 3, "n_head": 3, "n_embd": 48, "vocab_size": 256, "n_positions": 16}
    assert config["activation_function"] == "gelu_new" and config["architectures"] == ["GPT2LMHeadModel"]
    trained = gpt.GPT(gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16), rngs=nnx.Rngs(0))
    nnx.update(trained, summary["state"].params)
    x = np.random.default_rng(0).integers(0, 256, (2, 16))
    data = datasets.load("text", "train", data_path=corpus, seq_len=16)
    loaded = trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=folder), data)
    np.testing.assert_array_equal(logits_of(loaded, x), logits_of(trained, x))
    config["n_head"] = 4  # the folder's config.json decides the head count over the config name's 3
    with open(folder + "config.json", "w") as f:
        json.dump(config, f)
    assert trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=folder), data).config.n_head == 4
    with pytest.raises(ValueError, match="--n-head 3 differs from the n_head=4.*drop --n-head"):
        trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=folder, n_head=3), data)


def test_a_gpt_without_biases_is_refused_a_folder_before_training(tmp_path, corpus, capsys):  # noqa: F811
    """nanoGPT's bias=False has no transformers GPT2Config: --export-torch out/ says so before any step runs."""
    from jaxpar import cli

    nobias = gpt.GPT(gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16, bias=False), rngs=nnx.Rngs(0))
    weights.write(nobias.torch_state_dict("nanogpt"), str(tmp_path / "nobias.npz"))
    argv = ["--model", "gpt-nano", "--init-torch", str(tmp_path / "nobias.npz"), "--dataset", "text",
            "--data-path", corpus, "--seq-len", "16", "--batch-size", "8", "--steps", "1", "--eval-split", "",
            "--quiet", "--metrics-out", str(tmp_path / "m.jsonl")]
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--export-torch", f"{tmp_path}/hf/"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "no biases (bias=False)" in err, err
    assert sorted(os.listdir(tmp_path)) == ["corpus.py", "nobias.npz"]  # nothing written: no metrics, no folder
    summary = cli.main(argv + ["--export-torch", str(tmp_path / "out.npz"), "--torch-layout", "nanogpt"])
    assert summary["steps"] == 1 and not gpt.config_from_state_dict(weights.read(str(tmp_path / "out.npz"))[0],
                                                                     n_head=3).bias


GPT_FILES = ("w.npz", "w.safetensors", "w.pt")


@pytest.mark.parametrize("layout", ["hf", "nanogpt"])
def test_a_gpt_file_keeps_the_head_count_its_weights_do_not_show(tmp_path, corpus, layout,  # noqa: F811
                                                                  torch_or_fake):
    """6 heads where gpt-nano's config says 3: every format's file says 6, which --init-torch uses (the same
    logits), refusing a --n-head that differs; written without it, the file loads with the config's 3 heads as
    before -- another function of the same weights."""
    from jaxpar.config import Config
    from jaxpar.data import datasets
    from jaxpar.run import trainer

    cfg = gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16, n_head=6)
    model = scramble(gpt.GPT(cfg, rngs=nnx.Rngs(0)), seed=1)
    sd, x = model.torch_state_dict(layout), np.random.default_rng(0).integers(0, 256, (2, 16))
    want = logits_of(model, x)
    data = datasets.load("text", "train", data_path=corpus, seq_len=16)
    three_d = dict(model="gpt-nano", dataset="text", strategy="pipeline", num_stages=2, tensor_parallel=2)
    tp = dict(model="gpt-nano", dataset="text", strategy="tp", tensor_parallel=2)
    for settings in (three_d, tp):  # before any model is built
        with pytest.raises(ValueError, match="--model gpt-nano has 3 heads, which --tensor-parallel 2 does not split"):
            trainer.validate(Config(**settings))
    for name in GPT_FILES:
        path = str(tmp_path / name)
        weights.write(sd, path, meta=gpt.file_meta(cfg), nanogpt=layout == "nanogpt")
        assert weights.read(path)[1] == {"n_head": 6, "activation_function": "gelu_new"}
        loaded = trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=path), data)
        assert loaded.config.n_head == 6, name
        np.testing.assert_array_equal(logits_of(loaded, x), want)
        for settings in (three_d, tp):  # 6 heads split over 2 tensor ranks (the config's 3 do not)
            trainer.validate(Config(**settings, init_torch=path))
        refused = f"--n-head 3 differs from the n_head=6 --init-torch {re.escape(repr(path))}.*drop --n-head"
        with pytest.raises(ValueError, match=refused):
            trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=path, n_head=3), data)
        weights.write(sd, path)  # as files written by others: no head count
        assert weights.read(path)[1] == {}
        plain = trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=path), data)
        assert plain.config.n_head == 3, name
        assert np.abs(logits_of(plain, x) - want).max() > 1e-2  # the head count changes the function


@pytest.mark.parametrize("kind", ["hf folder", "ckpt.pt", "w.safetensors", "w.npz"])
def test_the_gelu_a_file_names_is_the_one_that_runs(tmp_path, corpus, kind, torch_or_fake):  # noqa: F811
    """A GPT with nanoGPT's erf GELU: named by a Hugging Face folder's config.json, implied by a ckpt.pt of nanoGPT's
    train.py (its model.py runs nn.GELU() only), recorded by jaxpar's export. --init-torch runs that GELU (the same
    logits; the tanh one on the same weights is another function); it refuses an --activation-function that
    differs from a named GELU, and takes one over the implied GELU (a default, not a record)."""
    from jaxpar.config import Config
    from jaxpar.data import datasets
    from jaxpar.run import trainer

    cfg = gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16, activation_function="gelu")
    model = scramble(gpt.GPT(cfg, rngs=nnx.Rngs(0)), seed=1)
    x = np.random.default_rng(0).integers(0, 256, (2, 16))
    want = logits_of(model, x)
    tanh = gpt.from_torch_state_dict(model.torch_state_dict("hf"), n_head=cfg.n_head)
    assert tanh.config.activation_function == "gelu_new" and np.abs(logits_of(tanh, x) - want).max() > 1e-4
    path = str(tmp_path / kind.split()[-1])
    if kind == "hf folder":
        weights.write(model.torch_state_dict("hf"), path + "/", config=gpt.hf_config(cfg))
    elif kind == "ckpt.pt":  # as nanoGPT's train.py saves it: model_args, iter_num, config, no GELU named
        torch = torch_or_fake
        torch.save({"model": {k: torch.from_numpy(np.array(v)) for k, v in model.torch_state_dict("nanogpt").items()},
                    "model_args": gpt.model_args(cfg), "iter_num": 0, "config": {}}, path)
    else:
        weights.write(model.torch_state_dict("hf"), path, meta=gpt.file_meta(cfg))
    data = datasets.load("text", "train", data_path=corpus, seq_len=16)
    loaded = trainer.gpt_model(Config(model="gpt-nano", dataset="text", init_torch=path), data)
    assert loaded.config.activation_function == "gelu"
    np.testing.assert_array_equal(logits_of(loaded, x), want)
    flagged = Config(model="gpt-nano", dataset="text", init_torch=path, activation_function="gelu_new")
    if kind == "ckpt.pt":  # implied, not named: the flag wins
        np.testing.assert_array_equal(logits_of(trainer.gpt_model(flagged, data), x), logits_of(tanh, x))
        return
    refused = f"--activation-function gelu_new differs from the activation_function=gelu --init-torch .*drop --act"
    with pytest.raises(ValueError, match=refused):
        trainer.gpt_model(flagged, data)


def test_gpt_files_stay_what_other_readers_take(tmp_path, torch_or_fake, monkeypatch):
    """The head count rides beside the weights: np.load sees only the state dict, safetensors' metadata keeps
    "format": "pt" (transformers' check), a Hugging Face-layout .pt is a plain state dict, a nanoGPT-layout one
    nanoGPT's ckpt.pt (GPTConfig(**model_args) in its sample.py); read-only arrays reach torch as writable copies
    (torch.from_numpy warns of read-only ones)."""
    cfg = gpt.GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    args = gpt.model_args(cfg)
    assert set(args) == {"n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout"}  # nanoGPT's
    sd = model.torch_state_dict("hf")
    for v in sd.values():
        v.flags.writeable = False  # as jax's arrays are
    from_numpy = torch_or_fake.from_numpy

    def writable_only(a):  # torch warns of a read-only array, once per process: here every time, as an error
        assert a.flags.writeable, "torch.from_numpy of a read-only array"
        return from_numpy(a)

    monkeypatch.setattr(torch_or_fake, "from_numpy", writable_only)
    for name in GPT_FILES:
        weights.write(sd, str(tmp_path / name), meta=gpt.file_meta(cfg))
    weights.write(model.torch_state_dict("nanogpt"), str(tmp_path / "ckpt.pt"), meta=gpt.file_meta(cfg), nanogpt=True)
    with np.load(tmp_path / "w.npz") as f:
        assert sorted(f) == sorted(sd)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), framework="numpy") as f:
        assert f.metadata()["format"] == "pt" and json.loads(f.metadata()["n_head"]) == 2
    plain = torch_or_fake.load(str(tmp_path / "w.pt"), map_location="cpu", weights_only=True)
    assert sorted(plain) == sorted(sd)
    ckpt = torch_or_fake.load(str(tmp_path / "ckpt.pt"), map_location="cpu", weights_only=True)
    assert sorted(ckpt) == ["jaxpar", "model", "model_args"] and ckpt["model_args"] == args  # the GELU beside them
    assert ckpt["jaxpar"] == {"activation_function": "gelu_new"} and sorted(ckpt["model"]) == sorted(sd)
    assert weights.read(str(tmp_path / "ckpt.pt"))[1] == {"n_head": 2, "activation_function": "gelu_new"}


def test_a_head_count_that_is_not_one_is_refused(tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "w.safetensors")
    save_file(state_dict(), path, metadata={"format": "pt", "n_head": "six"})
    with pytest.raises(ValueError, match="says n_head='six', which is not a head count.*pass --n-head") as e:
        weights.read(path)
    assert "\n" not in str(e.value)


def test_endoftext_is_named_only_by_a_vocabulary_that_holds_its_id():
    """<|endoftext|> is id 50256: a vocabulary of exactly 50,256 ids (0 to 50,255) does not hold it, so its
    config.json names no bos/eos id (transformers would warn on every load); one id more does."""
    for vocab, special in ((50256, None), (50257, 50256)):
        config = gpt.hf_config(gpt.GPTConfig.named("gpt-nano", vocab_size=vocab))
        assert config["bos_token_id"] == config["eos_token_id"] == special, vocab


def test_a_torch_file_keeps_the_tied_head_as_wtes_storage(tmp_path, torch_or_fake):
    """lm_head.weight is wte's copy in the state dict (the same array): a torch file stores it once, as
    torch.save(model.state_dict()) of a tied GPT2LMHeadModel does -- the loaded head and wte share one storage, and
    the file is not the table's bytes larger again (GPT-2: 154 MB)."""
    cfg = gpt.GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8)
    sd = gpt.GPT(cfg, rngs=nnx.Rngs(0)).torch_state_dict("hf")
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    weights.write(sd, str(tmp_path / "w.pt"))
    loaded = torch_or_fake.load(str(tmp_path / "w.pt"), map_location="cpu", weights_only=True)
    head, wte = loaded["lm_head.weight"], loaded["transformer.wte.weight"]
    assert head is wte or head.untyped_storage().data_ptr() == wte.untyped_storage().data_ptr()
    table = np.zeros((1024, 64), np.float32)  # 256 KiB
    weights.write({"transformer.wte.weight": table, "lm_head.weight": table}, str(tmp_path / "t.pt"))
    assert os.path.getsize(tmp_path / "t.pt") < 1.5 * table.nbytes


def test_only_a_checkpoint_with_nanogpts_train_keys_is_taken_for_nanogpts_train():
    """meta["source"] = "nanogpt-train" (whose model runs the erf GELU) needs both of what nanoGPT's train.py saves
    beside the model, iter_num and config: a checkpoint of another trainer holding one of them is not taken for
    it, so its GPT keeps the default tanh GELU."""
    torch = fake_torch()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    for extra in ({"iter_num": 9}, {"config": {"beta2": 0.95}}):
        ckpt = {"model": {"w": torch.Tensor(w)}, "model_args": {"n_head": 6}, **extra}
        meta = weights._from_torch(ckpt, "ckpt.pt", "--init-torch", torch)[1]
        assert meta == {"n_head": 6} and gpt.implied_activation(meta) is None, extra
    ckpt = {"model": {"w": torch.Tensor(w)}, "model_args": {"n_head": 6}, "iter_num": 9, "config": {}}
    assert weights._from_torch(ckpt, "ckpt.pt", "--init-torch", torch)[1]["source"] == "nanogpt-train"


def test_a_head_count_of_true_or_zero_is_refused(tmp_path):
    """JSON's true is not a head count (Python's bool is an int, 1): a file whose meta says n_head=true, or 0, is
    refused in one line, never read as a GPT of one head."""
    from safetensors.numpy import save_file

    path = str(tmp_path / "w.safetensors")
    for value in ("true", "0"):
        save_file(state_dict(), path, metadata={"format": "pt", "n_head": value})
        with pytest.raises(ValueError, match=f"says n_head='{value}', which is not a head count") as e:
            weights.read(path)
        assert "\n" not in str(e.value)
    save_file(state_dict(), path, metadata={"format": "pt", "n_head": "3"})
    assert weights.read(path)[1] == {"n_head": 3}


def test_each_hugging_face_gelu_name_runs_the_gelu_transformers_computes():
    """transformers' gelu_new, gelu_pytorch_tanh and gelu_fast are the tanh GELU (gelu_fast writes sqrt(2 / pi) as
    0.7978845608), its gelu the erf one: each name a config.json or file gives runs the GELU that computes it."""
    import math

    import jax

    x = np.linspace(-5, 5, 201)
    tanh = 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
    erf = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert np.abs(tanh - erf).max() > 1e-4  # the two forms differ by more than the tolerance
    for name, want in (("gelu_new", tanh), ("gelu_pytorch_tanh", tanh), ("gelu_fast", tanh), ("gelu", erf)):
        act = gpt.activation_of({"activation_function": name})
        got = jax.nn.gelu(np.float32(x), approximate=gpt.ACTIVATIONS[act])
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=name)
