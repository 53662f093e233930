"""Bytes held per device: what JAX's live arrays occupy, and the allocator's peak where the device has one.

CPU devices keep no allocator statistics (`device.memory_stats()` is None), so the portable measure is the sum
of the live arrays' shards on each device (`jax.live_arrays()`). It counts every buffer Python holds (params,
optimizer state, batches, residuals returned by a forward, gathered outputs), but not the temporaries XLA
allocates inside one compiled call; on GPU `peak_bytes` adds the allocator's high-water mark, which does.
"""
from __future__ import annotations

import gc
import os
from typing import Iterable, Sequence

import jax

Bytes = dict  # {jax.Device: bytes}


def _count(arrays: Iterable, devices: Sequence | None) -> Bytes:
    """{device: bytes of the arrays' shards on it}; a buffer shared by several Array objects counts once."""
    devices = list(jax.devices() if devices is None else devices)
    held, seen = {d: 0 for d in devices}, set()
    for arr in arrays:
        if not isinstance(arr, jax.Array) or arr.is_deleted():
            continue
        for shard in arr.addressable_shards:
            if shard.device not in held:
                continue
            data = shard.data
            key = (shard.device, data.unsafe_buffer_pointer())
            if key not in seen:  # device_put onto the same device gives a new Array over the same buffer
                seen.add(key)
                held[shard.device] += data.nbytes
    return held


def live_bytes(devices: Sequence | None = None) -> Bytes:
    """{device: bytes} of every live JAX array (`jax.live_arrays()`), per device."""
    return _count(jax.live_arrays(), devices)


def tree_bytes(tree, devices: Sequence | None = None) -> Bytes:
    """{device: bytes} held by the arrays of one pytree."""
    return _count(jax.tree.leaves(tree), devices)


def peak_bytes(device) -> int | None:
    """The allocator's peak bytes in use on `device`, or None where it keeps no statistics (CPU)."""
    stats = device.memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def host_bytes() -> int | None:
    """This machine's physical memory in bytes (what CPU devices share), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def diff(after: Bytes, before: Bytes) -> Bytes:
    """{device: after - before} over the devices of `after`."""
    return {d: after[d] - before.get(d, 0) for d in after}


def baseline(devices: Sequence | None = None) -> Bytes:
    """`live_bytes` after a garbage collection: the reference point a measurement is diffed against."""
    gc.collect()
    return live_bytes(devices)


class PeakTracker:
    """Per-device maximum of `live_bytes` over the points where `mark(label)` is called.

    roughly: for each mark: peak[d] = max(peak[d], live_bytes()[d]), where[d] = label of that maximum.
    """

    def __init__(self, devices: Sequence):
        self.devices = list(devices)
        self.peak = {d: 0 for d in self.devices}
        self.where = {d: "" for d in self.devices}

    def mark(self, label: str) -> None:
        for d, b in live_bytes(self.devices).items():
            if b > self.peak[d]:
                self.peak[d], self.where[d] = b, label


def memory_report(devices: Sequence | None = None, live: Bytes | None = None,
                  base: Bytes | None = None) -> list[dict]:
    """One row per device: live bytes (now, or `live`), their change from `base`, and the allocator's peak."""
    devices = list(jax.devices() if devices is None else devices)
    live = live_bytes(devices) if live is None else live
    base = base or {}
    return [{"device": str(d), "live_bytes": live[d], "delta_bytes": live[d] - base.get(d, 0),
             "peak_bytes": peak_bytes(d)} for d in devices]


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:10.3f}"


def format_table(rows: Iterable[dict]) -> str:
    """The rows of `memory_report` as a fixed-width table in MiB (peak '-' where the device keeps no stats)."""
    lines = [f"{'device':<16}{'live MiB':>12}{'delta MiB':>12}{'peak MiB':>12}"]
    for r in rows:
        lines.append(f"{r['device']:<16}{_mib(r['live_bytes']):>12}{_mib(r['delta_bytes']):>12}"
                     f"{_mib(r['peak_bytes']):>12}")
    return "\n".join(lines)
