"""PyTorch state-dict files: what `--init-torch` reads and `--export-torch` writes.

    state_dict, meta = read(path)          # {torch key: numpy array}, {"n_head": ...} where the file says it
    write(state_dict, path, config=...)    # atomically: a temporary file in the same folder, then renamed

The format follows the path:
- `.npz`: numpy's, under torch's keys (no torch needed);
- `.safetensors`: Hugging Face's (transformers' `save_pretrained` writes `model.safetensors`);
- `.pt`, `.pth`, `.bin`: `torch.save` / `torch.load(weights_only=True)`, which need torch. A nanoGPT checkpoint
  (`ckpt.pt`: {"model": state dict, "model_args": {...}}) reads as its model, with its `n_head`;
- a folder written by `save_pretrained` (model.safetensors or pytorch_model.bin, or their sharded index) reads
  with its config.json, whose `n_head` is the head count. `write` to a folder gives the same layout, with the
  `config` it is passed as config.json, so `GPT2LMHeadModel.from_pretrained(folder)` loads it.

A file keeps `write`'s `meta` (a GPT's: nanoGPT's model_args and its GELU, jaxpar.models.gpt.file_meta),
whose `n_head` and `activation_function` -- which no weight's shape shows -- `read` returns: in a .safetensors
file's metadata (each value JSON, as a string: {"format": "pt", "n_head": "6", ...}); in a .npz file's zip
comment (JSON: np.load ignores it); in a torch file as nanoGPT's ckpt.pt, {"model": state dict, "model_args":
nanoGPT's fields of meta, "jaxpar": the rest}, where `nanogpt`, else as the state dict's `_metadata` (torch's own
attribute, which load_state_dict ignores under a key no module has) at key "jaxpar". Files without it read as
before, with no n_head. `read` also says where a ckpt.pt comes from when nanoGPT's train.py saved it
(meta["source"] = "nanogpt-train": it holds iter_num and config), whose model runs the erf GELU.
"""
from __future__ import annotations

import collections
import json
import os
import re
import zipfile
from typing import Any, Mapping

import numpy as np

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SUFFIXES = (".npz", ".safetensors", *TORCH_SUFFIXES)
# save_pretrained's weight files, in the order transformers looks for them
FOLDER_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
META = ("n_head", "activation_function")  # what `read` returns of a file's meta: what no weight's shape shows
# nanoGPT's model_args (its GPTConfig's fields): a ckpt.pt keeps the rest of `write`'s meta under TORCH_META_KEY
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
# a ckpt.pt that nanoGPT's train.py saved holds these beside "model" and "model_args" (jaxpar's exports do not):
# `read` says so as meta["source"] = "nanogpt-train", the GELU it implies being the model's business
NANOGPT_TRAIN_KEYS = ("iter_num", "config")
TORCH_META_KEY = "jaxpar"  # the key of `meta` in a torch state dict's _metadata (no module of a model is named so)
FORMATS = ("a .npz (numpy), .safetensors (Hugging Face's), .pt / .pth / .bin (torch.save; needs torch) file, or a "
           "folder written by transformers' save_pretrained")


def is_folder(path: str) -> bool:
    """Whether `path` names a folder: an existing one, or a path ending in the separator."""
    return os.path.isdir(path) or path.endswith(("/", os.sep))


def read(path: str, flag: str = "--init-torch") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(the state dict as numpy arrays under torch's keys, what the file says of the model: `n_head` and
    `activation_function` where a config.json, a nanoGPT checkpoint or `write`'s meta gives them, and a
    config.json's `layer_norm_epsilon` and attention scaling)."""
    if os.path.isdir(path):
        return _read_folder(path, flag)
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} does not exist; pass {FORMATS}.")
    suffix = _suffix(path, flag)
    if suffix in TORCH_SUFFIXES:
        torch = _torch(flag, path)
        return _from_torch(_guarded(lambda: torch.load(path, map_location="cpu", weights_only=True), path, flag),
                           path, flag, torch)
    state_dict, meta = _guarded(lambda: _read_npz(path) if suffix == ".npz" else _read_safetensors(path), path,
                                flag)
    return state_dict, _meta(meta, path, flag)


def check_writable(path: str, flag: str = "--export-torch", folder_ok: bool = False) -> None:
    """A ValueError, before any work, unless `write` can write `path`: a known suffix (or a folder where
    `folder_ok`), torch importable for torch's files, the folder existing and writable."""
    from jaxpar.run.checkpoint import writable_file

    if is_folder(path):
        if not folder_ok:
            raise ValueError(f"{flag} {path!r} is a folder, which only a GPT in Hugging Face's layout is written as "
                             "(save_pretrained's model.safetensors + config.json); pass a file path ending in "
                             f"{', '.join(SUFFIXES)}.")
        parent = os.path.dirname(os.path.abspath(path.rstrip("/" + os.sep)))
        writable_file(os.path.join(parent, "probe"), flag)  # the folder's parent: the folder itself may be new
        if os.path.isdir(path):
            writable_file(os.path.join(path, "probe"), flag)
        return
    suffix = _suffix(path, flag)
    if suffix in TORCH_SUFFIXES:
        _torch(flag, path)
    writable_file(path, flag)


def write(state_dict: Mapping[str, np.ndarray], path: str, flag: str = "--export-torch",
          config: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
          nanogpt: bool = False) -> list[str]:
    """Write `state_dict` to `path` (file or folder, as `read` takes them); returns the files written. Each file
    goes to a temporary name in its folder first and is renamed when complete, so a crash leaves no half file.

    `config`: a folder's config.json. `meta`: what a file keeps beside the weights (JSON scalars; see the module's
    notes; a GPT's: jaxpar.models.gpt.file_meta), `read` returning its n_head and activation_function. `nanogpt`:
    a torch file is nanoGPT's ckpt.pt, {"model": state dict, "model_args": meta's nanoGPT fields, "jaxpar": the
    rest}, which nanoGPT's sample.py loads."""
    if is_folder(path):
        os.makedirs(path, exist_ok=True)
        written = [_atomic(os.path.join(path, "model.safetensors"),
                           lambda tmp: _write_safetensors(state_dict, tmp))]
        if config is not None:
            text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
            written.append(_atomic(os.path.join(path, "config.json"), lambda tmp: _write_text(tmp, text)))
        return written
    suffix = _suffix(path, flag)
    meta = dict(meta or {})
    if suffix == ".safetensors":
        return [_atomic(path, lambda tmp: _write_safetensors(state_dict, tmp, meta))]
    if suffix == ".npz":  # numpy's own dtypes only: np.savez would store bfloat16 as raw bytes (dtype V2)
        _numpy_dtypes_only(state_dict, path, flag, ())
        return [_atomic(path, lambda tmp: _write_npz_and_meta(state_dict, tmp, meta))]
    torch = _torch(flag, path)
    _numpy_dtypes_only(state_dict, path, flag, ("bfloat16",))
    tensors, converted = collections.OrderedDict(), {}
    for key, value in state_dict.items():  # one tensor per array: tied weights (lm_head = wte) share a storage
        if id(value) not in converted:  # a writable copy: torch warns on read-only arrays (jax's)
            converted[id(value)] = _to_torch(np.array(value, order="C"), torch)
        tensors[key] = converted[id(value)]
    if nanogpt and meta:  # nanoGPT's GPTConfig(**model_args) takes its own fields only
        obj = {"model": tensors, "model_args": {k: v for k, v in meta.items() if k in NANOGPT_ARGS}}
        if set(meta) - set(NANOGPT_ARGS):
            obj[TORCH_META_KEY] = {k: v for k, v in meta.items() if k not in NANOGPT_ARGS}
    else:
        obj = tensors
        if meta:
            tensors._metadata = collections.OrderedDict({TORCH_META_KEY: meta})
    return [_atomic(path, lambda tmp: torch.save(obj, tmp))]


# -- reading ------------------------------------------------------------------------------------------------

_TORCH_SAVE = "a state dict saved by torch.save(model.state_dict(), path) (a whole pickled module is not read)"
_EXPECTED = {".npz": "a file np.savez wrote", ".safetensors": "a file safetensors wrote (save_pretrained, save_file)",
             ".pt": _TORCH_SAVE, ".pth": _TORCH_SAVE, ".bin": _TORCH_SAVE}


def _suffix(path: str, flag: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{flag} {path!r} has the suffix {suffix or '(none)'!r}, which names no state-dict format; "
                         f"pass {FORMATS}.")
    return suffix


def _torch(flag: str, path: str):
    try:
        import torch
    except ImportError:
        raise ValueError(f"{flag} {path!r} is a torch file, which needs torch (not installed here); pip install "
                         "torch, or use .npz or .safetensors, which need no torch.") from None
    return torch


def _guarded(load, path: str, flag: str):
    """load(), with the library's own errors (a corrupt or foreign file) turned into one line naming the fix."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001  (numpy, safetensors and torch each raise their own kinds)
        suffix = os.path.splitext(path)[1].lower()
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # torch's messages: many lines, terminal bold
        first = (text.splitlines() or [""])[0][:200]
        raise ValueError(f"{flag} {path!r} could not be read as {suffix} ({type(e).__name__}: {first}); pass "
                         f"{_EXPECTED[suffix]}.") from None


def _read_npz(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path) as f:
        out = dict(f)
    raw = [k for k, v in out.items() if v.dtype.kind == "V"]
    if raw:  # what np.savez makes of bfloat16 and other ml_dtypes arrays: bytes without their type
        raise ValueError(f"{raw[0]!r} holds raw bytes ({out[raw[0]].dtype}), as np.savez stores bfloat16; save it "
                         "as float32 or as .safetensors")
    with zipfile.ZipFile(path) as z:
        comment = z.comment.decode("utf-8", "replace")
    try:  # write's meta; another writer's comment, if any, is not JSON of a dict and says nothing
        meta = json.loads(comment) if comment else {}
    except ValueError:
        meta = {}
    return out, meta if isinstance(meta, dict) else {}


def _read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})


def _meta(raw: Mapping[str, Any], path: str, flag: str) -> dict[str, Any]:
    """The META entries of a file's meta, checked: a head count is an int >= 1, an activation_function a name
    (safetensors keeps each as a JSON string; which names a GPT runs, its config checks)."""
    out = {}
    for key in META:
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if key == "activation_function":
            if not isinstance(value, str):
                raise ValueError(f"{flag} {path!r} says {key}={raw[key]!r}, which is not a name (gelu_new, gelu); "
                                 f"rewrite the file with {key} a name, or without it.")
            out[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{flag} {path!r} says {key}={raw[key]!r}, which is not a head count (an int >= 1); "
                             f"rewrite the file with {key} a positive int, or without it and pass --n-head.")
        out[key] = int(value)
    return out


def _from_torch(obj: Any, path: str, flag: str, torch) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A loaded torch object as (numpy state dict, meta): a state dict, or nanoGPT's checkpoint around one."""
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):  # nanoGPT's ckpt.pt (write's: its meta beside)
        meta = _meta({**(obj.get("model_args") or {}), **(obj.get(TORCH_META_KEY) or {})}, path, flag)
        if all(k in obj for k in NANOGPT_TRAIN_KEYS):
            meta["source"] = "nanogpt-train"
        obj = obj["model"]
    else:  # a state dict: write's meta in torch's _metadata, if any
        meta = _meta((getattr(obj, "_metadata", None) or {}).get(TORCH_META_KEY) or {}, path, flag)
    if not isinstance(obj, Mapping):
        raise ValueError(f"{flag} {path!r} holds a {type(obj).__name__}, not a state dict; save "
                         "model.state_dict() (torch.save(model.state_dict(), path)).")
    out = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{flag} {path!r}: entry {key!r} is a {type(value).__name__}, not a tensor; save "
                             "model.state_dict() alone.")
        value = value.detach().cpu()
        out[key] = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return out, meta


def _read_folder(path: str, flag: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    found = next((name for name in FOLDER_FILES if os.path.isfile(os.path.join(path, name))), None)
    if found is None:
        raise ValueError(f"{flag} {path!r} is a folder without {' or '.join(FOLDER_FILES)}; pass the folder "
                         "save_pretrained wrote, or a weights file.")
    if found.endswith(".index.json"):  # sharded: the index maps each key to its shard
        with open(os.path.join(path, found)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state_dict = {}
        for shard in shards:
            state_dict.update(read(os.path.join(path, shard), flag)[0])
    else:
        state_dict = read(os.path.join(path, found), flag)[0]
    meta = {}
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            hf = json.load(f)
        meta = {k: hf[k] for k in ("n_head", "activation_function", "layer_norm_epsilon", "scale_attn_weights",
                                   "scale_attn_by_inverse_layer_idx") if k in hf}
        meta.setdefault("activation_function", "gelu_new")  # transformers' GPT2Config default
    return state_dict, meta


# -- writing ------------------------------------------------------------------------------------------------

def _atomic(path: str, save) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.tmp{os.getpid()}{suffix}")  # the suffix kept: np.savez would add .npz
    try:
        save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _numpy_dtypes_only(state_dict: Mapping[str, np.ndarray], path: str, flag: str, allowed: tuple) -> None:
    """ValueError naming the first array of an extension dtype (ml_dtypes: bfloat16, float8...) not in `allowed`."""
    for key, value in state_dict.items():
        dtype = np.asarray(value).dtype
        if dtype.kind == "V" and dtype.name not in allowed:
            raise ValueError(f"{flag} {path!r}: {key!r} is {dtype.name}, which {os.path.splitext(path)[1]} files do "
                             "not keep (np.savez would store raw bytes); write .safetensors, which keeps it, or "
                             "cast the state dict to float32.")


def _to_torch(value: np.ndarray, torch):
    if value.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: the same bits as torch's
        return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def _write_npz(state_dict: Mapping[str, np.ndarray], path: str) -> None:
    np.savez(path, **state_dict)


def _write_npz_and_meta(state_dict: Mapping[str, np.ndarray], path: str, meta: Mapping[str, Any]) -> None:
    """np.savez's file with `meta` as JSON in its zip comment, which np.load ignores: the entries stay the state
    dict's."""
    _write_npz(state_dict, path)
    if meta:
        with zipfile.ZipFile(path, "a") as z:
            z.comment = json.dumps(dict(meta), sort_keys=True).encode()


def _write_safetensors(state_dict: Mapping[str, np.ndarray], path: str,
                       meta: Mapping[str, Any] | None = None) -> None:
    from safetensors.numpy import save_file

    # metadata format "pt": transformers' from_pretrained reads a safetensors file only when it says so
    metadata = {k: json.dumps(v) for k, v in (meta or {}).items() if k != "format"} | {"format": "pt"}
    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, path, metadata=metadata)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
