"""Batches as the engine carries them: the user's pytree, which rows are real, and each row's sample id.

A user batch is any pytree whose leaves share a leading batch axis: images, token ids, masks, several inputs
(`{"x": ..., "y": ...}`, a tuple, a dataclass registered as a pytree). Every strategy turns it into `Rows`
through the helpers here, so every strategy pads, masks and shards the same way:

    rows = as_rows(batch, ids)          # host arrays; mask 1 on every row
    rows = pad_rows(rows, 64)           # to 64 rows: copies of row 0 with mask 0 (finite values, no NaN risk)

`ids` are what a row's random draws derive from (jaxpar.objective): the loader passes each sample's dataset
index; by default a row's position in the global batch. Padding rows are exact copies of a real row, so a loss
that is finite on real data stays finite on them; the mask then removes them from every sum.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxpar.types import PyTree


class Rows(NamedTuple):
    """A batch with its bookkeeping: `data` (the user's pytree), `mask` float32 [B] (1 real, 0 padding), `ids`
    int32 [B] (sample ids: RNG draws derive from them, so they do not depend on how the batch is split)."""

    data: PyTree
    mask: Any
    ids: Any

    @property
    def size(self) -> int:
        return int(np.shape(self.mask)[0])


def num_rows(batch: PyTree, what: str = "batch") -> int:
    """The common leading size of every leaf of `batch`; ValueError naming the leaves that disagree."""
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(b, Mapping) for b in batch) and \
            len({tuple(sorted(b)) for b in batch}) == 1:  # torch's samples before default_collate
        keys = ", ".join(map(repr, sorted(batch[0])))
        many = f"{len(batch)} dicts with the same keys" if len(batch) > 1 else "1 dict with keys"
        raise ValueError(f"the {what} is a {type(batch).__name__} of {many} ({keys}): "
                         f"samples, not a batch; stack them into one dict of arrays with a leading batch axis, "
                         "{k: np.stack([s[k] for s in samples]) for k in samples[0]} (torch's default_collate).")
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not flat:
        raise ValueError(f"the {what} has no arrays; pass a pytree of arrays with a leading batch axis, "
                         "e.g. {'x': x, 'y': y}.")
    sizes = {}
    for path, leaf in flat:
        kind = np.asarray(leaf).dtype.kind if isinstance(leaf, (str, bytes, np.ndarray)) else None
        if kind in ("U", "S", "O"):  # text (or Python objects): nothing a device holds
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} holds "
                             f"{'text' if kind != 'O' else 'Python objects'}, not numbers; every leaf needs a numeric "
                             "array with a leading batch axis: encode text as token ids first.")
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} holds typed PRNG keys, which the "
                             "batch's host arrays cannot hold; pass their raw data, jax.random.key_data(keys), and "
                             "jax.random.wrap_key_data(...) them back inside the loss.")
        shape = np.shape(leaf)
        if not shape and any(isinstance(k, jax.tree_util.SequenceKey) for k in path):
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path)} is a Python scalar inside a list: the {what} "
                             "holds Python lists, which are pytrees; convert each to an array (np.asarray).")
        if not shape:
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar; every leaf needs a "
                             "leading batch axis (give it shape [B, ...]).")
        sizes.setdefault(shape[0], jax.tree_util.keystr(path) or "<root>")
    if len(sizes) > 1:
        listing = ", ".join(f"{name} has {n}" for n, name in sizes.items())
        raise ValueError(f"the {what}'s leaves disagree on the batch size ({listing}); every leaf needs the same "
                         "leading axis, one entry per sample.")
    n = next(iter(sizes))
    if n == 0:
        raise ValueError(f"the {what} has 0 rows; pass at least one row (drop an empty last batch).")
    return n


def as_rows(batch: PyTree | Rows, ids: Any = None, *, offset: int = 0) -> Rows:
    """`batch` as host Rows (mask 1 everywhere); `ids` default to ``offset + arange(B)``. Rows pass through."""
    if isinstance(batch, Rows):
        return batch
    n = num_rows(batch)
    data = jax.tree.map(np.asarray, batch)
    if ids is None:
        ids = np.arange(offset, offset + n, dtype=np.int32)
    ids = np.asarray(ids, np.int32)
    if ids.shape != (n,):
        raise ValueError(f"ids has shape {ids.shape} but the batch has {n} rows; pass one id per row.")
    return Rows(data, np.ones(n, np.float32), ids)


def pad_rows(rows: Rows, n: int) -> Rows:
    """`rows` (host) padded to `n` rows with copies of row 0 whose mask is 0."""
    have = rows.size
    if n < have:
        raise ValueError(f"cannot pad {have} rows down to {n}; pad to a size >= the batch.")
    if n == have:
        return rows
    take = np.concatenate([np.arange(have), np.zeros(n - have, np.int64)])
    data = jax.tree.map(lambda a: np.asarray(a)[take], rows.data)
    mask = np.concatenate([np.asarray(rows.mask, np.float32), np.zeros(n - have, np.float32)])
    return Rows(data, mask, np.asarray(rows.ids, np.int32)[take])


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def share_of(batch_size: int | None, processes: int, multiple: int) -> int | None:
    """The rows each process pads its batch to under a global `batch_size`: ceil(batch_size / processes) rounded
    up to `multiple` (its devices x micro-batches), one shape every step (one compile); None without a batch_size."""
    return None if batch_size is None else round_up(-(-batch_size // processes), multiple)


def padded_size(n: int, who: str, batch_size: int | None, multiple: int, processes: int = 1) -> int:
    """The rows this process's batch of `n` is padded to: its share of `batch_size` (`share_of`), or without one
    `n` rounded up to `multiple`. ValueError, before any padding or placing, for a batch above that share (one
    process took it without a word: a second shape, a second compile, a batch larger than declared), or for several
    processes without a batch_size (their shapes must agree). `who` names the strategy; every strategy that pads
    to a batch_size (DDP, ZeRO, tensor parallelism, the pipeline) checks through here."""
    if batch_size is None:
        if processes > 1:
            raise ValueError(f"{who}.put_batch across {processes} processes needs batch_size= (each process pads its "
                             "rows to its share of the global batch, so that every process holds one shape); pass "
                             "the global batch size as batch_size= (--batch-size).")
        return round_up(n, multiple)
    share = share_of(batch_size, processes, multiple)
    if n > share:
        here, whose = ("", f"batch_size={batch_size}") if processes == 1 else \
            (" on this process", f"its share of batch_size={batch_size} over {processes} processes")
        raise ValueError(f"{who}.put_batch got a batch of {n} rows{here}, more than the {share} that {whose} pads "
                         f"every batch to (one shape, one compile); pass at most {share} rows"
                         f"{here.replace('this', 'each')}, or build the strategy with batch_size={n * processes} or "
                         "more (--batch-size).")
    return share


def split_rows(rows: Rows, k: int) -> Rows:
    """Every leaf [B, ...] -> [k, B/k, ...]: k consecutive micro-batches (B must divide by k)."""
    b = jax.tree.leaves(rows.mask)[0].shape[0]
    if b % k:
        raise ValueError(f"{b} rows do not split into {k} equal micro-batches; pad the batch to a multiple of {k}.")
    return jax.tree.map(lambda a: a.reshape(k, b // k, *a.shape[1:]), rows)


def check_unpadded(rows: Rows, why: str) -> None:
    """ValueError when host `rows` hold padding: batch-mode objectives (BatchNorm) see every row of a shard."""
    mask = np.asarray(rows.mask)
    if not mask.all():
        raise ValueError(f"{int((mask == 0).sum())} padding rows would reach a loss that sees whole shards ({why}); "
                         "give every step a batch the devices (x micro-batches) divide (train.py: --drop-last keeps "
                         "the last one full), or, for a model without BatchNorm, use per_sample=True.")
