"""A strict reader (and writer) for the IDX files MNIST ships as: `train-images-idx3-ubyte[.gz]`, ...

Format: 2 zero bytes, a type code (0x08 = uint8, ...), the number of dimensions n, n big-endian uint32
sizes, then the values, big-endian, row-major. Every check names the file, what was expected and the fix.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

# split name -> (images stem, labels stem); each file may also end in .gz
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX type code -> big-endian numpy dtype
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_FIX = "re-download it (e.g. from the MNIST mirrors; check MD5SUMS) or pass another --data-dir"


class DataError(ValueError):
    """A dataset that cannot be loaded: missing, unprepared, truncated or malformed data."""


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except FileNotFoundError as e:
        raise DataError(f"IDX file {str(path)!r} does not exist; {_FIX}.") from e
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError; truncated gzip -> EOFError
        raise DataError(f"IDX file {str(path)!r} is not a readable{' gzip' * (path.suffix == '.gz')} file "
                        f"({type(e).__name__}: {e}); {_FIX}.") from e


def read_idx(path: str | Path, ndim: int | None = None) -> np.ndarray:
    """The array stored in one IDX file (gzipped when the name ends in .gz), in native byte order.

    `ndim` checks the number of dimensions (3 for images, 1 for labels). Raises DataError on a bad magic
    number, an unknown type code, or a payload whose length is not exactly the product of the sizes.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"IDX file {str(path)!r} has {len(raw)} bytes, expected a 4-byte magic number "
                        f"at least; the file is truncated: {_FIX}.")
    zero, code, n = int.from_bytes(raw[:2], "big"), raw[2], raw[3]
    if zero != 0 or code not in _DTYPES:
        raise DataError(f"IDX file {str(path)!r} has magic number 0x{raw[:4].hex()}, expected 0x0000TTNN with "
                        f"type TT in {[f'{c:02x}' for c in _DTYPES]} (e.g. 0x00000803 for uint8 images); "
                        f"it is not an IDX file: {_FIX}.")
    if ndim is not None and n != ndim:
        raise DataError(f"IDX file {str(path)!r} has {n} dimensions, expected {ndim}; check that images and "
                        f"labels files are not swapped or {_FIX}.")
    header = 4 + 4 * n
    if len(raw) < header:
        raise DataError(f"IDX file {str(path)!r} has {len(raw)} bytes, expected a {header}-byte header for "
                        f"{n} dimensions; the file is truncated: {_FIX}.")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(n))
    dtype = np.dtype(_DTYPES[code])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "followed by extra bytes"
        raise DataError(f"IDX file {str(path)!r} has {len(raw)} bytes, expected {expected} for shape {shape} "
                        f"of {dtype.name}; the file is {what}: {_FIX}.")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write `array` as an IDX file (gzipped when the name ends in .gz): the inverse of read_idx."""
    array = np.asarray(array)
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _DTYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"{array.dtype=} has no IDX type code; use one of {sorted(map(str, codes))}")
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    data = header + array.astype(_DTYPES[code]).tobytes()
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def find_idx(folder: str | Path, stem: str) -> Path | None:
    """`folder/stem` or `folder/stem.gz`, whichever exists (the raw file first), else None."""
    for name in (stem, stem + ".gz"):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def has_idx(folder: str | Path | None) -> bool:
    """Whether `folder` holds any of the standard MNIST IDX files."""
    return folder is not None and any(find_idx(folder, s) for pair in IDX_FILES.values() for s in pair)


def read_mnist_split(folder: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, H, W], labels uint8 [N]) of the split `train` or `test` from an IDX folder."""
    if split not in IDX_FILES:
        raise DataError(f"{split=} has no IDX files; an MNIST IDX folder holds the splits {list(IDX_FILES)}.")
    stems = IDX_FILES[split]
    paths = [find_idx(folder, s) for s in stems]
    if None in paths:
        missing = [s for s, p in zip(stems, paths) if p is None]
        raise DataError(f"the {split!r} split needs {missing} (or .gz) in {str(folder)!r}, which has none; "
                        f"add those files, pick a split the folder has (e.g. 'test[:8000]'), or use "
                        f"--dataset synthetic.")
    images, labels = read_idx(paths[0], ndim=3), read_idx(paths[1], ndim=1)
    if len(images) != len(labels):
        raise DataError(f"{str(paths[0])!r} has {len(images)} images but {str(paths[1])!r} has {len(labels)} "
                        f"labels, expected the same count; {_FIX}.")
    return images, labels
