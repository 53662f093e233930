"""Byte-level text: a file or a folder of text, memory-mapped, served as windows of `seq_len` bytes (256 tokens).

    train = load("train", path=None, seq_len=256, seed=0)   # None: the Python standard library's own *.py files
    batch = train.batch(np.arange(8))                       # {"x": int32 [8, 256], "y": x shifted by one}

The corpus is one byte string: a file as it is, or a folder's files (`*.py`, `*.txt`, `*.md`, ... or all files when
none of those) read in sorted order and concatenated into a cache file. It is split by position: the first
1 - HELD_OUT of the bytes train, the rest are held out. A training window i starts at a random offset drawn from
the seed (one fixed draw per index, so the sampler's shuffling and sharding see an ordinary indexed dataset, and
an epoch sees about as many tokens as the training part holds); the held-out part is cut into consecutive
windows, each byte predicted once. Splits: 'train', 'test', and slices of them ('test[:100]', 'train[:10%]').

The default corpus, present on every machine with Python: `sysconfig.get_paths()["stdlib"]`'s `*.py` files,
site-packages left out (Python 3.11: 1,790 files, 31.5 MB).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import re
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

import numpy as np

from jaxpar.data.idx import DataError

VOCAB = 256  # bytes
HELD_OUT = 0.05  # the last 5 % of the corpus, by position
SPLITS = ("train", "test")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".html", ".tex")


class TextError(DataError):
    """The text data is missing or unusable; the message says what to pass instead."""


def stdlib_files() -> list[str]:
    """The standard library's own Python sources, sorted (site-packages and dist-packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if not {"site-packages", "dist-packages"} & set(os.path.relpath(f, root).split(os.sep))]


def _folder_files(path: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
    text = [f for f in files if f.endswith(TEXT_SUFFIXES)]
    skipped = [f for f in files if f not in set(text)] if text else []
    if skipped:  # say so: a folder of .cpp (or .jsonl) files beside a few .h (or a README.md) would train on those
        _note_skipped(path, len(text), len(skipped), sum(os.path.getsize(f) for f in skipped),
                      os.path.relpath(skipped[0], path))
    return text or files


@functools.cache  # once a run: each split's load reads the folder
def _note_skipped(path: str, n_text: int, n_skipped: int, size: int, example: str) -> None:
    print(f"jaxpar: --data-path {path!r}: reading its {n_text} file(s) ending in {', '.join(TEXT_SUFFIXES)}; "
          f"skipping {n_skipped} other(s), {size:,} bytes (e.g. {example!r}); pass a folder holding only the files to "
          "train on, or one file.", file=sys.stderr)


def corpus(path: str | None = None) -> np.ndarray:
    """The whole corpus as uint8, memory-mapped: a file itself, or a folder's (or the stdlib's) files concatenated
    once into a cache file under the temp dir (named by the files' paths, sizes and times; written atomically)."""
    if path is not None and os.path.isfile(path):
        if os.path.getsize(path) == 0:
            raise TextError(f"--data-path {path!r} is empty; pass a file or folder of text.")
        return np.memmap(path, np.uint8, mode="r")
    if path is not None and not os.path.isdir(path):
        raise TextError(f"--data-path {path!r} is neither a file nor a folder; pass text (a file, or a folder of "
                        "files), or leave it out for the Python standard library's sources.")
    files = stdlib_files() if path is None else _folder_files(path)
    if not files:
        raise TextError(f"--data-path {path!r} holds no files; pass a folder with text files in it.")
    stamp = hashlib.sha1("\n".join(f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in files).encode())
    cache = os.path.join(tempfile.gettempdir(), f"jaxpar-text-{stamp.hexdigest()[:16]}.bin")
    if not os.path.exists(cache):
        part = f"{cache}.{os.getpid()}.part"
        with open(part, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    out.write(src.read())
        os.replace(part, cache)  # atomic: other processes see the whole file or none
    if os.path.getsize(cache) == 0:
        raise TextError(f"the files of {path or 'the standard library'!r} are all empty; pass text.")
    return np.memmap(cache, np.uint8, mode="r")


def unigram_bits(data: np.ndarray) -> float:
    """The entropy of the byte frequencies, in bits per byte: what a model knowing only them would score."""
    p = np.bincount(np.asarray(data), minlength=VOCAB) / len(data)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


@dataclass(frozen=True, eq=False)
class TextDataset:
    """Windows of `seq_len` bytes of `data` starting at `starts`; `batch(idx)` -> {"x", "y"} int32 [len(idx), T]."""

    data: np.ndarray  # uint8, the whole corpus (memory-mapped)
    starts: np.ndarray  # int64 [N] window offsets into data
    seq_len: int
    name: str
    split: str
    unigram_bits: float  # of the whole corpus
    vocab_size: int = VOCAB
    num_classes = None  # targets are token sequences, not class labels

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        rows = np.asarray(self.data[self.starts[np.asarray(idx)][:, None] + np.arange(self.seq_len + 1)], np.int32)
        return {"x": rows[:, :-1], "y": rows[:, 1:]}

    @property
    def tokens(self) -> int:
        return len(self) * self.seq_len


def parse_split(spec: str, sizes: dict[str, int]) -> tuple[str, int, int]:
    """(split, lo, hi) of 'train', 'test', or a slice such as 'test[:100]', 'train[10%:20%]', 'test[-50:]'.

    tfds's rules (tensorflow_datasets.core.splits, without importing it): a slice is in percent when either bound
    is ('train[1:10%]' is 1 % to 10 %, as tfds reads it), a percent bound lies in [-100, 100] and is rounded to the
    closest window, an absolute bound's magnitude is at most the split's size ('test[:8000]' of 500 windows is
    refused, as tfds refuses it, not cut to the 500 there are)."""
    m = re.fullmatch(r"(\w+)(?:\[(-?\d+(?:\.\d*)?%?)?:(-?\d+(?:\.\d*)?%?)?\])?", spec.strip())
    if not m or m.group(1) not in sizes:
        raise TextError(f"split {spec!r} is not valid for text; use 'train', 'test', or a slice of one such as "
                        "'test[:100]' or 'train[:10%]' (windows).")
    name, n = m.group(1), sizes[m.group(1)]
    pct = any(b is not None and b.endswith("%") for b in m.group(2, 3))
    if m.group(0).count("[") and m.group(2) is None and m.group(3) is None:
        raise TextError(f"split {spec!r} is not valid for text: a slice needs a bound (tfds's rule); use {name!r} "
                        "for all of it.")

    def bound(s, default):
        if s is None:
            return default
        v = float(s.rstrip("%"))
        if pct:
            if not -100 <= v <= 100:
                raise TextError(f"split {spec!r}: the percent bound {s!r} must be in [-100%, 100%] (tfds's rule); "
                                f"use e.g. '{name}[:10%]'.")
            v = int(round(v * n / 100))
        elif "." in s:
            raise TextError(f"split {spec!r}: the bound {s!r} is a fraction of a window; use whole windows, or a "
                            f"percent such as '{name}[:12.5%]'.")
        elif abs(v) > n:
            raise TextError(f"split {spec!r}: the bound {s} lies beyond the {n} windows {name!r} has (tfds refuses "
                            f"an out-of-range slice too); use a bound in [-{n}, {n}], or a percent such as "
                            f"'{name}[:10%]'.")
        v = int(v)
        return v + n if v < 0 else v

    lo, hi = bound(m.group(2), 0), bound(m.group(3), n)
    if hi <= lo:
        raise TextError(f"split {spec!r} selects no windows ({name} has {n} windows of --seq-len tokens); choose a "
                        "non-empty slice.")
    return name, lo, hi


def load(split: str = "train", path: str | None = None, seq_len: int = 256, seed: int = 0) -> TextDataset:
    """The `split` of the byte corpus at `path` (None: the standard library), in windows of `seq_len` bytes."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise TextError(f"--seq-len {seq_len!r} must be an int >= 1 (the window length in bytes).")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:  # numpy's SeedSequence's rule
        raise TextError(f"{seed=} must be an integer >= 0 (the training windows' numpy seed); pass e.g. seed=0.")
    data = corpus(path)
    n_train = int(len(data) * (1 - HELD_OUT))
    n_test = len(data) - n_train
    what = path or "the standard library's sources"
    # only the part this split reads must hold a window: a run that skips evaluation (--eval-split '') or carves
    # its validation from train ('train[90%:]') never reads the held-out part (it was refused for a short one)
    part = re.match(r"\s*(\w+)", split)
    part = part.group(1) if part else None
    if part in SPLITS and (n_train if part == "train" else n_test) < seq_len + 1:
        share = 1 - HELD_OUT if part == "train" else HELD_OUT
        need = math.ceil((seq_len + 1) / share)
        how = (f"the held-out last {HELD_OUT:.0%} holds {n_test}" if part == "test" else
               f"the training part (the first {1 - HELD_OUT:.0%}) holds {n_train}")
        fix = "or a shorter --seq-len" + ("; or validate on a slice of train, which reads no held-out part "
                                          "(--train-split 'train[:90%]' --eval-split 'train[90%:]')"
                                          if part == "test" else "")
        raise TextError(f"{what} has {len(data)} bytes: {how}, too few for one window of --seq-len {seq_len} "
                        f"({seq_len + 1} bytes with its last target); pass at least {need} bytes of text, {fix}.")
    sizes = {"train": (n_train - 1) // seq_len, "test": (n_test - 1) // seq_len}
    name, lo, hi = parse_split(split, sizes)
    if name == "train":
        # windows at random offsets (nanoGPT's get_batch), a slice's drawn inside ITS bytes: windows lo..hi-1 of the
        # part start in [lo L, hi L], so train[:90%] and train[90%:] share at most the byte between them (as a target
        # on one side, an input on the other); drawn over the whole part they shared 71 % of the held-out slice's
        # targets (a QA finding). The whole part draws as before.
        b_lo, b_hi = lo * seq_len, n_train if hi == sizes["train"] else hi * seq_len + 1
        rng = np.random.default_rng([seed, 0x7E47] if (lo, hi) == (0, sizes["train"]) else [seed, 0x7E47, lo, hi])
        starts = rng.integers(b_lo, b_hi - seq_len, hi - lo, dtype=np.int64)  # the last byte is a target
    else:
        starts = n_train + seq_len * np.arange(lo, hi, dtype=np.int64)
    return TextDataset(data, starts, seq_len, "text", split, unigram_bits(data))
