"""Datasets as host arrays: `load(name, split)` -> Dataset(x, y); `dataset.batch(indices)` -> {"x", "y"}.

Sources: `synthetic` (generated from the seed, no download), `mnist` (a folder of IDX files, or tfds),
`cifar10` (tfds), `npz` (bring your own x / y arrays), `text` (bytes of a file or folder in windows of
`seq_len`, jaxpar.data.text; default the Python standard library's sources). Every source takes tfds split
syntax ('train', 'test[:8000]', 'train[10%:20%]', 'train[:-1000]', 'train+test'; text: one slice).
Preprocessing follows the PyTorch examples: MNIST (x/255 - 0.1307) / 0.3081; CIFAR and AlexNet inputs the
ImageNet mean/std, resized to `image_size` (AlexNet: 64 by default); `linear` / `mlp` get flat vectors [N, F].
A user's model (`model=None`) gets the arrays as stored: images normalised as above, float arrays as they are,
integer arrays (token ids) and any targets (float, [N, T] tokens) untouched.

A dataset is anything with ``len(dataset)`` and ``dataset.batch(indices) -> pytree`` (the rows of those sample
indices); the loader and the evaluation use only these two.

    train = load("mnist", "test[:8000]", data_dir="../shared/data/mnist")
    train.x.shape, train.y.shape, train.num_classes   # (8000, 28, 28, 1), (8000,), 10
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from jaxpar.data.idx import IDX_FILES, DataError, has_idx, read_mnist_split

DATASETS = ("synthetic", "mnist", "cifar10", "npz", "text")
MODELS = ("linear", "mlp", "convnet", "alexnet")  # built-in models: they decide shapes and preprocessing
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ALEXNET_IMAGE_SIZE = 64  # DeepSpeed's AlexNet tutorial uses 224
SYNTHETIC_SIZES = {"train": 60000, "test": 10000}  # CIFAR-shaped (model alexnet): 50000 / 10000
_CHUNK = 1000  # synthetic samples are drawn in chunks seeded by (seed, split, chunk): slices are cheap
_FIX_DATA = "pass --data-dir DIR (or set TFDS_DATA_DIR) to prepared data, or use --dataset synthetic"

Rows = Callable[[str, int, int], tuple[np.ndarray, np.ndarray]]  # (split, lo, hi) -> (x, y) rows lo:hi


@dataclass(frozen=True, eq=False)
class Dataset:
    """x [N, ...] (float32 normalised images or vectors, or integer tokens), y [N, ...] targets: int32 labels in
    [0, num_classes) for classification (num_classes None for other targets)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int | None
    name: str
    split: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # more per-row arrays (an npz's "mask"), by name

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The rows of sample indices `idx` as the batch pytree {"x", "y", **extra}."""
        return {"x": self.x[idx], "y": self.y[idx], **{k: v[idx] for k, v in self.extra.items()}}


def load(name: str, split: str = "train", *, data_dir: str | None = None, data_path: str | None = None,
         model: str | None = "convnet", image_size: int | None = None, seed: int = 0, seq_len: int = 256) -> Dataset:
    """The `split` (tfds syntax) of dataset `name`, shaped and normalised for `model`.

    data_dir: for mnist a folder of IDX files (train-*/t10k-*, .gz or not) or else the tfds data dir (as
    for cifar10; None: TFDS_DATA_DIR or ~/tensorflow_datasets). data_path: the .npz for `npz`. seed: the
    synthetic data's (and text's window offsets). seq_len: text's window length in bytes. Raises DataError (a
    ValueError) when the data is missing, unprepared or malformed.
    """
    if name not in DATASETS:
        raise ValueError(f"{name=} is not a dataset; use one of {DATASETS}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:  # numpy's SeedSequence's rule
        raise ValueError(f"{seed=} must be an integer >= 0 (the synthetic data's and text windows' numpy seed); "
                         "pass e.g. seed=0.")
    if name == "text":  # token windows: no model-specific shaping
        from jaxpar.data import text

        return text.load(split, data_path, seq_len=seq_len, seed=seed)
    if model is not None and model not in MODELS:
        raise ValueError(f"{model=} is not a built-in model; use one of {MODELS}, or None for a user's model")
    if image_size is not None and image_size < 1:
        raise ValueError(f"{image_size=} must be >= 1 (or None for the model's default)")
    extra = {}
    if name == "synthetic":
        x, y, num_classes = _synthetic(split, model, seed)
    elif name == "npz":
        x, y, num_classes, extra = _npz(split, data_path)
    elif name == "mnist" and has_idx(data_dir):
        names = tuple(IDX_FILES)
        read = functools.cache(lambda s: read_mnist_split(data_dir, s))
        x, y = select(split, names, lambda s: len(read(s)[1]), lambda s, lo, hi: tuple(a[lo:hi] for a in read(s)))
        num_classes = 10
    else:
        x, y = _tfds(name, split, data_dir)
        num_classes = 10
    if num_classes is not None and y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{name} {split!r} has labels in [{y.min()}, {y.max()}], expected [0, {num_classes}); "
                        f"fix the labels of the data.")
    if num_classes is None and model is not None:
        raise DataError(f"{name} {split!r} has targets of shape {y.shape[1:]} and dtype {y.dtype}, but --model "
                        f"{model} classifies: it needs integer labels [N]; use a --model MODULE:NAME of your own "
                        "(with --loss) for other targets.")
    normalise = name != "npz" or x.dtype == np.uint8  # float npz images are taken as already normalised
    x = _prepare(x, model, image_size, normalise, f"{name} {split!r}")
    y = y.astype(np.int32) if num_classes is not None else y
    return Dataset(x, y, None if num_classes is None else int(num_classes), name, split, extra)


def select(spec: str, names: tuple[str, ...], count: Callable[[str], int], rows: Rows) -> tuple[np.ndarray, ...]:
    """The rows a tfds split spec selects, e.g. 'train[10%:20%]+test[:-1000]', concatenated.

    `count(split)` is the size of a named split, `rows(split, lo, hi)` its rows lo:hi. Parsing and rounding
    are tfds's own (`ReadInstruction.from_spec(...).to_absolute(...)`, pure Python); a plain split name needs no
    tfds (a GPU image without it reads --dataset npz/text at 'train' and 'test').
    """
    if spec in names:
        out = rows(spec, 0, count(spec))
    else:
        out = _tfds_select(spec, names, count, rows)
    if len(out[1]) == 0:
        raise DataError(f"split {spec!r} selects no samples; choose a non-empty slice such as 'test[:8000]'.")
    return out


def _tfds_select(spec: str, names: tuple[str, ...], count: Callable[[str], int], rows: Rows) -> tuple:
    """select's rows for a spec with slices or several splits, through tfds's parser."""
    from tensorflow_datasets.core import splits as tfds_splits

    class Infos(dict):  # split name -> SplitInfo-like, looked up (and so loaded) only when referenced
        def __getitem__(self, s):
            return SimpleNamespace(num_examples=count(s), shard_lengths=[count(s)])

    try:
        instructions = tfds_splits.ReadInstruction.from_spec(spec).to_absolute(Infos.fromkeys(names))
    except DataError:
        raise
    except (ValueError, NotImplementedError) as e:
        raise DataError(f"split {spec!r} is not valid here ({' '.join(str(e).split())}); the splits are "
                        f"{list(names)}: use tfds syntax, e.g. 'train', 'test[:8000]', 'train[10%:20%]', "
                        "'train[:-1000]'.") from e
    parts = [rows(a.splitname, a.from_ or 0, count(a.splitname) if a.to is None else a.to) for a in instructions]
    return parts[0] if len(parts) == 1 else tuple(np.concatenate(p) for p in zip(*parts))


def resize(x: np.ndarray, size: int, chunk: int = 512) -> np.ndarray:
    """Bilinear resize of images [N, H, W, C] to [N, size, size, C]: half-pixel centres, antialiased when
    shrinking (== jax.image.resize(x, ..., "linear")); per chunk one GEMM over W and one stacked over H."""
    n, h, w, c = x.shape
    rh, rw = _linear_weights(h, size), _linear_weights(w, size)
    out = np.empty((n, size, size, c), np.float32)
    for s in range(0, n, chunk):  # chunks keep the temporaries small (and their memory reused)
        b = np.ascontiguousarray(x[s:s + chunk].transpose(0, 3, 1, 2), dtype=np.float32)  # [m, C, H, W]
        m = len(b)
        t = np.matmul(rh, (b.reshape(m * c * h, w) @ rw.T).reshape(m * c, h, size))  # [m * C, size, size]
        out[s:s + m] = t.reshape(m, c, size, size).transpose(0, 2, 3, 1)
    return out


def _linear_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] interpolation weights: a triangle kernel, widened by n_in / n_out when shrinking."""
    scale = n_out / n_in
    centres = (np.arange(n_out) + 0.5) / scale - 0.5
    w = np.maximum(0.0, 1 - np.abs(np.arange(n_in)[None, :] - centres[:, None]) / max(1.0, 1 / scale))
    return (w / w.sum(1, keepdims=True)).astype(np.float32)


def _prepare(x: np.ndarray, model: str | None, image_size: int | None, normalise: bool, what: str) -> np.ndarray:
    """Images uint8 / float [0, 1] -> float32 resized, channel-replicated (AlexNet) and normalised; integer
    arrays other than uint8 images (token ids: uint8 too when the rows are sequences [N, T] and no built-in model
    takes them) pass through."""
    if np.issubdtype(x.dtype, np.integer) and (x.dtype != np.uint8 or (model is None and x.ndim == 2)):
        if model is not None:
            raise DataError(f"{what} holds integer arrays ({x.dtype}, token ids?) but --model {model} takes float "
                            "images or vectors; use a --model MODULE:NAME of your own for token data.")
        return x
    if model is None and x.ndim in (2, 3) and not (x.dtype == np.uint8 and x.ndim == 3):
        return x.astype(np.float32)  # vectors or sequences of vectors: as stored
    if x.ndim == 2:  # vectors
        if model in ("convnet", "alexnet"):
            raise DataError(f"{what} holds vectors {x.shape[1:]} but {model=} takes images; use --model linear "
                            f"or mlp, or store images [N, H, W(, C)].")
        return x.astype(np.float32)
    if (x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3)
            and (model in ("convnet", "alexnet") or x.dtype == np.uint8)):  # 28 or 32 read as channels otherwise
        raise DataError(f"{what} holds images {x.shape[1:]}, channels first ([N, C, H, W], PyTorch's layout), but "
                        f"jaxpar's models and normalisation take channels last ([N, H, W, C]); store "
                        f"x.transpose(0, 2, 3, 1), images {(*x.shape[2:], x.shape[1])}.")
    x = x[..., None] if x.ndim == 3 else x
    if x.dtype == np.uint8:
        x = x.astype(np.float32)
        x /= np.float32(255)
    size = image_size or (ALEXNET_IMAGE_SIZE if model == "alexnet" else None)
    if size and x.shape[1:3] != (size, size):
        x = resize(x, size)
    if model == "alexnet" and x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    x = x.astype(np.float32, copy=False)
    if normalise:
        channels = x.shape[-1]
        mean, std = (MNIST_MEAN, MNIST_STD) if channels == 1 else (IMAGENET_MEAN, IMAGENET_STD)
        if channels not in (1, 3):
            raise DataError(f"{what} has {channels} channels; uint8 images are normalised with 1 (MNIST) or 3 "
                            f"(ImageNet) channels: store float32 images already normalised instead.")
        x -= np.float32(mean)
        x /= np.float32(std)
    if model in ("linear", "mlp"):
        return x.reshape(len(x), -1)
    if model == "convnet" and x.shape[1:] != (28, 28, 1):
        raise DataError(f"{what} gives images {x.shape[1:]} but the ConvNet takes (28, 28, 1) (MNIST); use "
                        f"--model alexnet for other images, or leave --image-size unset.")
    return x


# ---------------------------------------------------------------- sources


def _tfds(name: str, split: str, data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8, labels) of a tfds dataset through tfds.data_source (ArrayRecord, no TensorFlow)."""
    import tensorflow_datasets as tfds

    if data_dir is not None and not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir!r} is not a folder; {_FIX_DATA}.")
    kwargs = {"file_format": "array_record"}  # the random-access format data_source reads
    builder = tfds.builder(name, data_dir=data_dir, **kwargs)
    if not builder.is_prepared():
        try:  # offline or without TensorFlow this fails (network error, missing module, ...)
            builder.download_and_prepare()
        except Exception as e:
            idx = (f"; for mnist --data-dir may also be a folder of IDX files ({', '.join(IDX_FILES['train'])}, ...)"
                   if name == "mnist" else "")
            raise DataError(
                f"tfds dataset {name!r} is not prepared in {str(builder.data_dir)!r} and could not be downloaded "
                f"and prepared here ({type(e).__name__}: {e}). Prepare it where there is internet "
                f"(`tfds build {name} --file_format=array_record --data_dir DIR`), then {_FIX_DATA}{idx}.") from e
    # the spec checked as the other sources check it, before tfds reads: an empty or reversed slice is refused in
    # one line (tfds said "Paths sequence can not be of 0 length" or failed in len(): a QA finding)
    sizes = {s: info.num_examples for s, info in builder.info.splits.items()}
    if sizes:  # (tfds.testing.mock_data's builders list no splits)
        select(split, tuple(sizes), sizes.__getitem__, lambda s, lo, hi: (np.empty(0), np.arange(max(0, hi - lo))))
    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir, download=False, builder_kwargs=kwargs)
    except (ValueError, NotImplementedError) as e:  # a bad split, or data prepared as TFRecord only
        raise DataError(f"tfds could not open {name} split {split!r} in {str(builder.data_dir)!r} ({e}); use a "
                        f"split of {list(builder.info.splits)} in tfds syntax, and data prepared with "
                        f"--file_format=array_record.") from e
    n = len(source)
    if n == 0:
        raise DataError(f"split {split!r} of {name} selects no samples; choose a non-empty slice.")
    x, y = np.empty((n, *np.shape(source[0]["image"])), np.uint8), np.empty(n, np.int64)
    many = getattr(source, "__getitems__", None)  # batched reads where the source has them

    def read(keys):
        if many is not None:
            try:
                return many(keys)
            except TypeError:  # tfds.testing.mock_data's default source: its __getitems__ takes other arguments
                pass
        return [source[k] for k in keys]

    for s in range(0, n, 1024):
        keys = list(range(s, min(n, s + 1024)))
        for i, ex in zip(keys, read(keys)):
            x[i], y[i] = ex["image"], ex["label"]
    return x, y


def _npz_arrays(path: str | None) -> dict[str, np.ndarray]:
    if not path:
        raise DataError("--dataset npz needs --data-path FILE.npz holding arrays x and y.")
    try:
        with open(path, "rb") as f:  # np.load reads a .npy (an array, no names) or a pickle too: say what it is
            head = f.read(6)
        if not head.startswith(b"PK"):  # an .npz is a zip archive of .npy files
            what = "it is a .npy array, which names no x and y" if head == b"\x93NUMPY" else f"it starts {head!r}"
            raise DataError(f"--data-path {path!r} is not an .npz (a zip archive of named arrays): {what}; write it "
                            "with np.savez(path, x=..., y=...).")
        with np.load(path) as f:
            return dict(f)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"--data-path {path!r} could not be read as .npz ({e}); write it with "
                        f"np.savez(path, x=..., y=...).") from e


def splits(name: str, *, data_path: str | None = None) -> tuple[str, ...]:
    """The named splits dataset `name` has ('train', and 'test' where there is one)."""
    if name == "npz":
        return ("train", "test") if "x_test" in _npz_arrays(data_path) else ("train",)
    if name == "text":
        return ("train", "test")  # the held-out part of the text, by position
    return ("train", "test")


def _npz(split: str, path: str | None) -> tuple[np.ndarray, np.ndarray, int | None, dict]:
    """x / y from an .npz (split 'train'); optional x_test / y_test (split 'test') and num_classes.

    x: float or uint8 images / vectors, or integer tokens; y: any array with one entry per row of x (integer
    labels [N] make a classification set: num_classes from the array or max label + 1). Any other array NAME
    with one entry per row (a padding "mask") joins the batch under its name; NAME_test is its test split."""
    arrays = _npz_arrays(path)
    pairs = {"train": ("x", "y"), "test": ("x_test", "y_test")}
    for s, (kx, ky) in pairs.items():
        if (kx in arrays) != (ky in arrays) or (s == "train" and kx not in arrays):
            raise DataError(f"{path!r} has arrays {sorted(arrays)}; it needs {kx!r} and {ky!r} together "
                            f"({'required' if s == 'train' else 'optional: the test split'}); write both with "
                            f"np.savez(path, {kx}=..., {ky}=...).")
        if kx not in arrays:
            continue
        x, y = arrays[kx], arrays[ky]
        if x.ndim < 2 or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise DataError(f"{path!r}: {kx} has shape {x.shape} and dtype {x.dtype}; expected [N, ...] rows: "
                            "[N, F] vectors, [N, H, W(, C)] images (uint8 0..255 or float, already normalised), or "
                            "integer tokens [N, T].")
        if len(x) == 0 and split.startswith(s):  # (refused as "selecting no samples", naming a slice to choose)
            raise DataError(f"{path!r}: {kx} has shape {x.shape}, no rows; write the file with at least one sample.")
        if y.ndim < 1 or len(y) != len(x) or not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
            raise DataError(f"{path!r}: {ky} has shape {y.shape} and dtype {y.dtype}; expected numeric targets "
                            f"with one entry per row of {kx} ([{len(x)}, ...]).")
    if "x_test" in arrays and arrays["x_test"].shape[1:] != arrays["x"].shape[1:]:
        raise DataError(f"{path!r}: x_test rows {arrays['x_test'].shape[1:]} differ from x rows "
                        f"{arrays['x'].shape[1:]}; store both splits with the same sample shape.")
    labels = [arrays[ky] for _, ky in pairs.values() if ky in arrays]
    num_classes = None
    if all(a.ndim == 1 and np.issubdtype(a.dtype, np.integer) for a in labels):
        top = max((int(a.max()) for a in labels if a.size), default=0)
        num_classes = top + 1
        if "num_classes" in arrays:
            given = arrays["num_classes"]
            if given.ndim or not np.issubdtype(given.dtype, np.integer) or given < 1:
                raise DataError(f"{path!r}: num_classes is {given!r} (shape {given.shape}, dtype {given.dtype}); "
                                "store it as one integer >= 1, e.g. np.savez(..., num_classes=10).")
            num_classes = int(given)
        if num_classes > 2 ** 31 - 1:  # labels go to the model as int32
            raise DataError(f"{path!r}: labels up to {num_classes - 1} do not fit int32, the labels' type on "
                            "the devices; number the classes from 0 upwards.")
    extras = sorted(k for k in arrays if k not in ("x", "y", "x_test", "y_test", "num_classes")
                    and not k.endswith("_test"))
    for k in extras:
        for s, (kx, _) in pairs.items():
            name = k if s == "train" else f"{k}_test"
            if kx in arrays and (name not in arrays or len(arrays[name]) != len(arrays[kx])):
                raise DataError(f"{path!r}: extra array {k!r} needs {name!r} with one entry per row of {kx} "
                                f"({len(arrays[kx])}); write it, or leave {k!r} out.")
    names = tuple(s for s, (kx, _) in pairs.items() if kx in arrays)
    keys = {s: [*pairs[s], *(k if s == "train" else f"{k}_test" for k in extras)] for s in names}
    out = select(split, names, lambda s: len(arrays[pairs[s][1]]),
                 lambda s, lo, hi: tuple(arrays[k][lo:hi] for k in keys[s]))
    return out[0], out[1], num_classes, dict(zip(extras, out[2:]))


def _synthetic(split: str, model: str, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Glyph images (MNIST- or CIFAR-shaped) or, for `linear`, 5-feature vectors of 2 classes."""
    cifar = model == "alexnet"
    sizes = {"train": 50000, "test": 10000} if cifar else SYNTHETIC_SIZES
    if model == "linear":
        make = functools.partial(_vectors, seed)
    else:
        make = functools.partial(_glyphs, *_glyph_templates(seed, 32 if cifar else 28), 3 if cifar else 1, seed)

    def rows(s: str, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows lo:hi of split s, generated chunk by chunk into one array (fresh memory is slow to touch)."""
        xs = ys = None
        for c in range(lo // _CHUNK, max(lo, hi - 1) // _CHUNK + 1):
            x, y = make(s, c)
            if xs is None:
                xs, ys = np.empty((max(hi - lo, 0), *x.shape[1:]), x.dtype), np.empty(max(hi - lo, 0), y.dtype)
            a, b, o = max(lo, c * _CHUNK), min(hi, (c + 1) * _CHUNK), c * _CHUNK  # rows a:b are in chunk c
            xs[a - lo:b - lo], ys[a - lo:b - lo] = x[a - o:b - o], y[a - o:b - o]
        return xs, ys

    x, y = select(split, tuple(sizes), sizes.__getitem__, rows)
    return x, y, 2 if model == "linear" else 10


def _chunk_rng(seed: int, split: str, chunk: int) -> np.random.Generator:
    """Train and test are disjoint draws: different sub-seeds per split (and per chunk)."""
    return np.random.default_rng([seed, 1 + list(SYNTHETIC_SIZES).index(split), chunk])


def _vectors(seed: int, split: str, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """RandomDataset(5, ...)-shaped: x ~ N(0, 1) [n, 5]; y from a fixed random linear teacher plus noise."""
    teacher = np.random.default_rng([seed, 7]).standard_normal((5, 2)).astype(np.float32)
    r = _chunk_rng(seed, split, chunk)
    x = r.standard_normal((_CHUNK, 5), dtype=np.float32)
    y = np.argmax(x @ teacher + 0.3 * r.standard_normal((_CHUNK, 2), dtype=np.float32), axis=1)
    return x, y


def _glyph_templates(seed: int, size: int, variants: int = 4, shift: int = 4) -> tuple[np.ndarray, ...]:
    """Per class `variants` glyphs of 3 random curved strokes, at every shift in [-shift, shift]^2
    ([10 * variants * (2 shift + 1)^2, size^2]), and a pool of 64 distractor strokes shared by all classes."""
    rng = np.random.default_rng([seed, 7])
    canvas = size + 2 * shift
    base = rng.uniform(-0.33, 0.33, (10, 1, 3, 3, 2)) * size + canvas / 2
    ctrl = base + rng.normal(0, 0.06 * size, (10, variants, 3, 3, 2))
    glyphs = _strokes(ctrl.reshape(-1, 3, 3, 2), canvas, size / 28 * 0.9)
    windows = np.lib.stride_tricks.sliding_window_view(glyphs, (size, size), axis=(1, 2))
    shifted = np.ascontiguousarray(windows.reshape(-1, size * size))  # (class, variant, dy, dx) row-major
    dctrl = rng.uniform(0, size, (64, 1, 3, 2))
    dctrl[:, :, 1:] = dctrl[:, :, :1] + rng.normal(0, 0.15 * size, (64, 1, 2, 2))
    distractors = _strokes(dctrl, size, size / 28 * 0.9).reshape(64, -1)
    return shifted, distractors


def _strokes(ctrl: np.ndarray, size: int, sigma: float, k: int = 12) -> np.ndarray:
    """Images [T, size, size] in [0, 1] of quadratic Bezier strokes ctrl [T, S, 3, 2] (pixel coordinates)."""
    t = np.linspace(0, 1, k)[:, None]
    pts = (1 - t) ** 2 * ctrl[:, :, 0, None] + 2 * (1 - t) * t * ctrl[:, :, 1, None] + t ** 2 * ctrl[:, :, 2, None]
    pts = pts.reshape(len(ctrl), -1, 1, 1, 2).astype(np.float32)
    g = np.arange(size, dtype=np.float32) + 0.5
    d2 = (pts[..., 0] - g[:, None]) ** 2 + (pts[..., 1] - g[None, :]) ** 2
    return np.exp(-d2.min(axis=1) / (2 * sigma ** 2)).astype(np.float32)


def _glyphs(shifted: np.ndarray, distractors: np.ndarray, channels: int, seed: int, split: str,
            chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """One chunk: a random class's glyph (random variant and shift) * intensity jitter, plus a random
    distractor stroke and uniform noise, clipped to [0, 1]; CIFAR-shaped: random colours and background."""
    r, m = _chunk_rng(seed, split, chunk), _CHUNK
    per_class = len(shifted) // 10
    y = r.integers(0, 10, m)
    glyph = shifted[y * per_class + r.integers(0, per_class, m)]
    stroke = distractors[r.integers(0, len(distractors), m)]
    if channels == 1:
        x = glyph * r.uniform(0.5, 1.0, (m, 1)).astype(np.float32)
        x += stroke * r.uniform(0.3, 0.8, (m, 1)).astype(np.float32)
    else:
        colour = lambda lo, hi: r.uniform(lo, hi, (m, 1, channels)).astype(np.float32)  # noqa: E731
        x = colour(0.0, 0.35) + glyph[..., None] * colour(0.4, 1.0) + stroke[..., None] * colour(0.2, 0.6)
    noise = r.integers(0, 256, x.shape, dtype=np.uint8).astype(np.float32)
    x += (noise - np.float32(127.5)) * np.float32(0.7 / 255)
    np.clip(x, 0, 1, out=x)
    side = int(np.sqrt(shifted.shape[1]))
    return x.reshape(m, side, side, channels), y
