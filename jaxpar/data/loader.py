"""One epoch of host batches in the sampler's order, optionally placed on devices ahead of time.

`put` (e.g. `strategy.put_batch`, which device_puts with the step's sharding) runs on a background thread
`prefetch` batches ahead of the consumer: the analog of DataLoader(pin_memory=True) + .to(non_blocking=True).
The sampler's offset advances only as the consumer receives batches, so `sampler.state_dict()` taken after
k batches resumes exactly at batch k, however far the thread has run ahead. Rows that are the sampler's
wrap-around padding (`sampler.real()` False) get mask 0: N processes then train on exactly one process's samples.

    for batch in Loader(train_set, 64, sampler, put=strategy.put_batch):
        state, metrics = strategy.step(state, batch)
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

import numpy as np

from jaxpar.batch import Rows
from jaxpar.data.sampler import DistributedSampler

_END = object()  # the producer's last message


class _Failure:
    """An exception raised on the producer thread, carried to the consumer to be re-raised there."""

    def __init__(self, error: BaseException):
        self.error = error

_POLL_S = 0.05  # how often a blocked producer checks whether the consumer has gone
_JOIN_S = 1.0  # how long a closing consumer waits for a put() in flight (the thread is a daemon anyway)


class Loader:
    """Iterates batches (jaxpar.batch.Rows: `dataset.batch(idx)`, the ids are the sample indices) of `batch_size`
    rows (this process's share) from `sampler`'s offset to the end of its epoch; yields `put(rows)` when `put`
    is given. The mask is 1 on real samples and 0 on the sampler's wrap-around padding (copies that pad the epoch
    to a multiple of the process count): per-sample losses drop them, as they drop pad_rows' rows, and a loss that
    sees whole shards (per_sample=False: BatchNorm) refuses them in put_batch, as it refuses pad_rows' rows."""

    def __init__(self, dataset: Any, batch_size: int, sampler: DistributedSampler, *, drop_last: bool = False,
                 put: Callable[[dict], Any] | None = None, prefetch: int = 2):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"{batch_size=} must be an integer >= 1; use this process's share of the batch.")
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
            raise ValueError(f"{prefetch=} must be an integer >= 0 (0: call put on the consumer's thread).")
        if not callable(getattr(dataset, "batch", None)) or not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset is a {type(dataset).__name__}, which has no batch(idx) method and len(); pass a "
                            "jaxpar.Dataset (jaxpar.load(...)) or an object with both, e.g. "
                            "jaxpar.Dataset(x, y, num_classes, name).")
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"sampler is a {type(sampler).__name__}, not a jaxpar.DistributedSampler; pass "
                            "jaxpar.DistributedSampler(len(dataset), num_replicas, rank).")
        if sampler.num_samples != len(dataset):
            raise ValueError(f"the sampler covers {sampler.num_samples} samples but the dataset has "
                             f"{len(dataset)}; build the sampler with len(dataset).")
        self.dataset, self.batch_size, self.sampler = dataset, int(batch_size), sampler
        self.drop_last, self.put, self.prefetch = drop_last, put, int(prefetch)

    def __len__(self) -> int:
        """Batches left in this epoch from where the sampler's next pass starts (all of them at 0)."""
        rest = len(self.sampler) - self.sampler.start
        return rest // self.batch_size if self.drop_last else -(-rest // self.batch_size)

    def gather(self, idx: np.ndarray, mask: np.ndarray | None = None) -> Rows:
        """The host batch of global indices `idx` (`dataset.batch(idx)`), each row's id its sample index;
        `mask` (1 real, 0 padding) defaults to all ones."""
        data = self.dataset.batch(idx)
        mask = np.ones(len(idx), np.float32) if mask is None else np.asarray(mask, np.float32)
        if mask.shape != (len(idx),):
            raise ValueError(f"mask has shape {mask.shape} but idx has {len(idx)} rows; pass one mask value per row.")
        return Rows(data, mask, idx.astype(np.int32))

    def plan(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rest of the epoch from the sampler's offset: (indices, mask) per batch, the mask 0 where the
        sampler's position is wrap-around padding (sampler.real()). A plan only: nothing advances."""
        batches = self.sampler.batch_plan(self.batch_size, self.drop_last)
        real = self.sampler.real()[self.sampler.start:].astype(np.float32)
        starts = np.cumsum([0] + [len(idx) for idx in batches])
        return [(idx, real[lo:lo + len(idx)]) for idx, lo in zip(batches, starts)]

    def __iter__(self) -> Iterator[Any]:
        self.sampler.begin_pass()
        plan = self.plan()
        if self.put is None or self.prefetch == 0:
            for idx, mask in plan:
                batch = self.gather(idx, mask)
                batch = batch if self.put is None else self.put(batch)
                self.sampler.offset += len(idx)
                yield batch
        else:
            yield from self._threaded(plan)
        self.sampler.end_pass()  # ran to the epoch's end: iterating again gives the whole epoch, as torch's

    def _threaded(self, plan: list[tuple[np.ndarray, np.ndarray]]) -> Iterator[Any]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def send(item: Any) -> bool:  # False once the consumer has gone
            while not stop.is_set():
                try:
                    q.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for idx, mask in plan:
                    if stop.is_set() or not send((idx, self.put(self.gather(idx, mask)))):
                        return
                send(_END)
            except BaseException as e:  # noqa: BLE001 -- re-raised on the consumer's thread
                send(_Failure(e))

        thread = threading.Thread(target=produce, name="jaxpar-loader", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                idx, batch = item
                self.sampler.offset += len(idx)  # consumed: only now does the position move
                yield batch
        finally:  # normal end, an error, or the consumer broke out (generator closed)
            stop.set()
            thread.join(_JOIN_S)
