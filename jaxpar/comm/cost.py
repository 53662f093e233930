"""What an all-reduce costs: a model per algorithm, and what the compiled HLO really sends.

Model (N devices, S bytes per device; "sent" counts bytes leaving a device, "master" is the busiest one):

    algorithm          steps      sent = received per device        master (root) sent = received
    ring               2(N-1)     2(N-1)/N x S  (the lower bound)   same
    reduce_broadcast   2(N-1)     S                                 (N-1) x S
    all_to_all         N-1        (N-1) x S                         same
    psum               2(N-1)     as ring: XLA picks the algorithm  same   (source "xla")

`hlo_collectives` lists the collective ops of an HLO text; `hlo_bytes_per_device` adds up what each device
sends: a collective-permute of S bytes sends S from every source device of its pairs (exact); XLA's own
collectives (all-reduce, all-gather, reduce-scatter, all-to-all) are charged their ring cost (a model).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import jax
import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")


class CommCost(NamedTuple):
    """Modelled traffic of one all-reduce of `nbytes` per device over `num_devices`."""

    algorithm: str
    num_devices: int
    nbytes: int
    steps: int  # sequential communication rounds (ppermutes)
    sent_per_device: float  # a non-root device; received is the same
    master_sent: float  # the busiest device (the root for reduce_broadcast); received is the same
    source: str  # "model": our ppermute schedule; "xla": XLA chooses, reported as a ring

    def time(self, latency_s: float, bandwidth_bytes_per_s: float) -> float:
        """Alpha-beta estimate: steps x latency + the busiest device's bytes / link bandwidth."""
        return self.steps * latency_s + self.master_sent / bandwidth_bytes_per_s


def comm_cost(algorithm: str, num_devices: int, nbytes: int, itemsize: int | None = None) -> CommCost:
    """The model above; with `itemsize` the ring's bytes are exact: N chunks of ceil(elements / N) elements."""
    n, s = num_devices, nbytes
    if n < 1 or s < 0:
        raise ValueError(f"num_devices={n} must be >= 1 and nbytes={s} >= 0; pass a device count and a size.")
    if n == 1:
        return CommCost(algorithm, n, s, 0, 0, 0, "xla" if algorithm == "psum" else "model")
    if algorithm in ("ring", "psum"):
        padded = itemsize is not None and algorithm == "ring"  # XLA's own all-reduce needs no padding
        chunk = -(-(s // itemsize) // n) * itemsize if padded else s / n
        sent = 2 * (n - 1) * chunk
        return CommCost(algorithm, n, s, 2 * (n - 1), sent, sent, "xla" if algorithm == "psum" else "model")
    if algorithm == "reduce_broadcast":
        return CommCost(algorithm, n, s, 2 * (n - 1), s, (n - 1) * s, "model")
    if algorithm == "all_to_all":
        return CommCost(algorithm, n, s, n - 1, (n - 1) * s, (n - 1) * s, "model")
    raise ValueError(f"algorithm={algorithm!r} has no cost model; use ring, reduce_broadcast, all_to_all or psum.")


def bus_bandwidth(algbw: float, num_devices: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(N-1)/N, comparable across device counts."""
    return algbw * 2 * (num_devices - 1) / num_devices


# ---- the compiled HLO -----------------------------------------------------------------------------------------

class Collective(NamedTuple):
    """One buffer moved by one collective op of an HLO module (a combined op gives one record per buffer)."""

    name: str  # the HLO instruction name; records of one combined op share it
    kind: str  # one of KINDS (async -start/-done pairs are reported once, as the plain kind)
    shape: tuple[int, ...]  # the op's result buffer (all-gather: gathered; reduce-scatter: this device's part)
    dtype: str  # HLO element type: f32, bf16, u16, ...
    nbytes: int
    pairs: tuple[tuple[int, int], ...]  # collective-permute (source, target); () for the others
    groups: tuple[tuple[int, ...], ...]  # replica groups; () means all devices


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start|-done)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _split_top(text: str) -> list[str]:
    """'(a, (b, c), d)' -> ['a', '(b, c)', 'd']; a plain type -> [itself]."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for j, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            parts.append(text[start:j].strip())
            start = j + 1
    return [p for p in parts if p]


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(text)
            if dt in DTYPE_BYTES]


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", line)
    if m:
        return tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([\d,\s]*)\}", m[1]))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)  # iota form
    if not m:
        return ()
    shape, dims = [int(v) for v in m[1].split(",")], [int(v) for v in m[2].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m[3]:
        ids = ids.transpose([int(v) for v in m[3].split(",")])
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape[0], -1))


def _text(hlo) -> str:
    if isinstance(hlo, str):
        return hlo
    if isinstance(hlo, jax.stages.Lowered):  # as emitted, before XLA's passes (combiners, dtype widening)
        return hlo.as_text(dialect="hlo")
    return hlo.as_text()  # Compiled: what runs


def hlo_collectives(hlo) -> list[Collective]:
    """The collectives of `hlo`: HLO text, a `jax.stages.Compiled` (what runs) or a `Lowered` (as emitted).

    XLA's combiners merge independent all-reduces into one op with a tuple result: such an op gives one
    record per buffer, all with the op's `name`, so `len({c.name for c in ...})` counts the ops themselves.
    """
    out = []
    for line in _text(hlo).splitlines():
        m = _OP.match(line)
        if not m or m[4] == "-done":
            continue
        name, result, kind, start = m[1], m[2], m[3], m[4]
        parts = _split_top(result)
        if start and kind in ("collective-permute", "all-gather"):
            parts = _split_top(parts[1]) if len(parts) > 1 else parts  # (operands, results, context...)
        pairs = re.search(r"source_target_pairs=\{([\d,{}\s]*)\}", line)
        pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),\s*(\d+)\}", pairs[1])) if pairs else ()
        groups = _groups(line)
        for dt, shape in (a for p in parts for a in _arrays(p)):
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dt]
            out.append(Collective(name, kind, shape, dt, nbytes, pairs, groups))
    return out


def hlo_num_devices(hlo) -> int | None:
    """`num_partitions` (or `replica_count`) of the module header; None when absent (a Lowered's text)."""
    m = re.search(r"\b(?:num_partitions|replica_count)=(\d+)", _text(hlo).split("\n", 1)[0])
    return int(m[1]) if m else None


def hlo_bytes_per_device(hlo, num_devices: int | None = None, direction: str = "sent") -> list[float]:
    """Bytes each device sends (or receives) over all collectives of `hlo`, indexed by device id.

    collective-permute: exact, its buffer for every source (target) device of its pairs. XLA's collectives,
    per device of a group of g: all-reduce 2(g-1)/g x S, all-gather (g-1)/g x S of the gathered S,
    reduce-scatter (g-1) x its part, all-to-all (g-1)/g x S: the ring costs (a model of XLA's choice).
    """
    if direction not in ("sent", "received"):
        raise ValueError(f"direction={direction!r} must be 'sent' or 'received'.")
    colls = hlo_collectives(hlo)
    n = num_devices or hlo_num_devices(hlo)
    if n is None:
        ids = [d for c in colls for p in c.pairs for d in p] + [d for c in colls for g in c.groups for d in g]
        n = max(ids, default=-1) + 1
        if not n:
            raise ValueError("num_devices=None and the HLO names no device; pass num_devices=N.")
    total = [0.0] * n
    for c in colls:
        if c.kind == "collective-permute":
            for src, dst in c.pairs:
                total[src if direction == "sent" else dst] += c.nbytes
            continue
        for group in c.groups or (tuple(range(n)),):
            g = len(group)
            share = {"all-reduce": 2 * (g - 1) / g * c.nbytes, "all-gather": (g - 1) / g * c.nbytes,
                     "reduce-scatter": (g - 1) * c.nbytes, "all-to-all": (g - 1) / g * c.nbytes}[c.kind]
            for d in group:
                total[d] += share
    return total


def recording_jit(jit, texts: list):
    """`jit` (a jax.jit-like factory) whose functions append their compiled HLO text to `texts`, and to their own
    ``hlo`` list, at each call: set as a Pipeline engine's ``jit`` before its first step, it collects what the
    step's end (the reductions and updates) compiles to, for `hlo_bytes_per_device`. A probe for tests and
    benchmarks, slow per call."""
    def factory(fn, **kw):
        jitted = jit(fn, **kw)

        def call(*args):
            call.hlo.append(jitted.lower(*args).compile().as_text())
            texts.append(call.hlo[-1])
            return jitted(*args)
        call.hlo = []
        return call
    return factory


# ---- ZeRO (jaxpar.strategies.zero) ----------------------------------------------------------------------------

def ring_bytes(kind: str, group: int, nbytes: float) -> float:
    """Bytes one device sends in XLA's collective `kind` over `group` devices, as `hlo_bytes_per_device` charges
    it: all-reduce 2(g-1)/g S and all-gather (g-1)/g S of the whole buffer S; reduce-scatter (g-1) x its part."""
    g = group
    return {"all-reduce": 2 * (g - 1) / g * nbytes, "all-gather": (g - 1) / g * nbytes,
            "reduce-scatter": (g - 1) * nbytes}[kind]


def zero_traffic(stage: int, num_devices: int, group_bytes: list, unit_bytes: list | None = None,
                 reduce: str = "reduce_scatter", frozen_bytes: list = ()) -> dict[str, float]:
    """ZeRO's gradient and parameter traffic per step and device, by collective kind (the metrics' small psum
    left out). `group_bytes`: each shard group's padded bytes (N x chunk x itemsize); `unit_bytes`: stage 3's
    gathered bytes per layer fetch; `frozen_bytes`: its gathered frozen bytes per layer fetch (gathered for the
    forward and the backward, never reduced). With Psi the padded parameter bytes, per device:

        DDP (stage 0)     all-reduce 2(N-1)/N Psi
        stage 1, 2        reduce-scatter (N-1)/N Psi + all-gather (N-1)/N Psi = DDP's volume
        stage 1 all_reduce  all-reduce 2(N-1)/N Psi + all-gather (N-1)/N Psi  = 1.5x
        stage 3           all-gather 2 x (N-1)/N Psi (forward, backward) + reduce-scatter (N-1)/N Psi = 1.5x
    """
    n, total = num_devices, sum(group_bytes)
    if stage == 0:
        return {"all-reduce": sum(ring_bytes("all-reduce", n, b) for b in group_bytes)}
    if stage == 3:
        units = group_bytes if unit_bytes is None else unit_bytes
        return {"all-gather": 2 * sum(ring_bytes("all-gather", n, b) for b in [*units, *frozen_bytes]),
                "reduce-scatter": sum(ring_bytes("reduce-scatter", n, b / n) for b in units)}
    if reduce == "all_reduce":
        out = {"all-reduce": sum(ring_bytes("all-reduce", n, b) for b in group_bytes)}
    else:
        out = {"reduce-scatter": sum(ring_bytes("reduce-scatter", n, b / n) for b in group_bytes)}
    return {**out, "all-gather": ring_bytes("all-gather", n, total)}
