"""Flat shards: which device owns which parameter elements under ZeRO, computed once as plain data.

    plan = shard_plan(params, num_devices=8, groups=[[3, 2], [1, 0]])   # outside jit, printable
    flat_NxS = pack(plan, leaves)                  # device r's shard is row r (host or traced arrays)
    leaves = unpack(plan, flat_NxS)                # the inverse, padding dropped
    piece = reduce_scatter_group(group_buffer(plan, g, grads), DATA)   # inside shard_map: my part of group g
    leaves = unpack(plan, lax.all_gather(my_shard, DATA))              # every leaf again

The layout: the leaves are cut into GROUPS (a list of leaf indices each); a group's leaves are raveled,
concatenated in that order and padded with zeros to a multiple of N, so group g has N x c_g elements and device
r owns its slice [r c_g, (r+1) c_g). A device's shard is its slices of every group, concatenated: S = sum c_g
elements, the same on every device, so an equal-chunk reduce-scatter of one group's buffer hands each device
exactly its slice, and one all-gather of the shards returns every group. One group holding every leaf is
DeepSpeed's stage 1/2 layout (one flat buffer, padded, one contiguous partition per rank); one group per
bucket gives each bucket's reduce-scatter equal chunks (DeepSpeed instead reduces each bucket slice to the rank
owning it); one group per leaf is stage 3's (each parameter split into N `ds_tensor` pieces of ceil(numel/N)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.comm import collectives
from jaxpar.comm.buckets import LeafInfo, leaf_infos
from jaxpar.comm.overlap import zero_after
from jaxpar.types import PyTree


class Group(NamedTuple):
    """Leaves sharded together: `size` real elements, `chunk` per device (size padded to N, / N), at `offset`
    in every device's shard."""

    leaves: tuple[int, ...]
    size: int
    chunk: int
    offset: int


@dataclass(frozen=True)
class ShardPlan:
    """Groups of leaves, each split evenly over `num_devices`; see the module docstring."""

    groups: tuple[Group, ...]
    leaves: tuple[LeafInfo, ...]
    num_devices: int

    @property
    def shard_size(self) -> int:
        """Elements per device (S)."""
        return sum(g.chunk for g in self.groups)

    @property
    def num_elements(self) -> int:
        """Real (unpadded) elements over all groups."""
        return sum(g.size for g in self.groups)

    @property
    def itemsize(self) -> int:
        """Bytes per element (the parameters' one dtype)."""
        return np.dtype(self.leaves[0].dtype).itemsize if self.leaves else 4

    @property
    def padding(self) -> int:
        """Zeros added so every group divides by N: N x S - elements."""
        return self.num_devices * self.shard_size - self.num_elements

    def __str__(self) -> str:
        n, s = self.num_devices, self.shard_size
        rows = [f"ShardPlan: {len(self.groups)} groups of {len(self.leaves)} leaves over {n} devices: "
                f"{self.num_elements:,} elements + {self.padding:,} padding, {s:,} per device",
                f"{'group':>6} {'elements':>12} {'per device':>11}  leaves"]
        for k, g in enumerate(self.groups):
            names = ", ".join(self.leaves[i].name for i in g.leaves)
            rows.append(f"{k:>6} {g.size:>12,} {g.chunk:>11,}  {names if len(names) < 90 else names[:87] + '...'}")
        return "\n".join(rows)


def _numel(info: LeafInfo) -> int:
    return math.prod(info.shape)


def shard_plan(params: PyTree, num_devices: int, groups: Sequence[Sequence[int]] | None = None) -> ShardPlan:
    """The plan for the leaves of `params` (flatten order) over `num_devices`; `groups` lists leaf indices
    (default: one group of every leaf in flatten order). Every leaf must be in exactly one group."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1; pass the size of the DATA mesh.")
    infos = leaf_infos(params)
    groups = [list(range(len(infos)))] if groups is None else [[int(i) for i in g] for g in groups]
    listed = sorted(i for g in groups for i in g)
    if listed != list(range(len(infos))) or not all(groups):
        raise ValueError(f"groups={groups} must list each of the {len(infos)} leaf indices once, in non-empty "
                         "groups; build them from a bucket plan or one leaf each.")
    dtypes = {infos[i].dtype for i in listed}
    if len(dtypes) > 1:
        raise ValueError(f"the parameters mix dtypes {sorted(dtypes)}; ZeRO shards one flat vector of one dtype: "
                         "keep the trained parameters in one dtype (float32 master weights; 16-bit compute by train.py's "
                         "--precision, or Objective.of(..., compute_dtype=jnp.bfloat16) in the library).")
    out, offset = [], 0
    for g in groups:
        size = sum(_numel(infos[i]) for i in g)
        chunk = -(-size // num_devices)
        out.append(Group(tuple(g), size, chunk, offset))
        offset += chunk
    return ShardPlan(tuple(out), infos, num_devices)


def group_buffer(plan: ShardPlan, k: int, leaves: Sequence[Any]) -> jax.Array:
    """Group k's leaves (`leaves` indexes every leaf of the plan) raveled, concatenated and zero-padded: [N c_k]."""
    g = plan.groups[k]
    parts = [jnp.ravel(leaves[i]) for i in g.leaves]
    pad = plan.num_devices * g.chunk - g.size
    if pad:
        parts.append(jnp.zeros((pad,), parts[0].dtype))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def pack(plan: ShardPlan, leaves: Sequence[Any], xp=jnp) -> Any:
    """Every leaf into the [N, S] layout (row r: device r's shard). `xp=np` keeps it on the host."""
    n, rows = plan.num_devices, []
    for g in plan.groups:
        flat = xp.concatenate([xp.ravel(xp.asarray(leaves[i])) for i in g.leaves] +
                              [xp.zeros((n * g.chunk - g.size,), xp.asarray(leaves[g.leaves[0]]).dtype)])
        rows.append(flat.reshape(n, g.chunk))
    return xp.concatenate(rows, axis=1)


def unpack(plan: ShardPlan, flat_NxS: Any) -> list:
    """The leaves (in flatten order) from the [N, S] layout (an all-gather of the shards, or `pack`'s output)."""
    out: list = [None] * len(plan.leaves)
    for g in plan.groups:
        flat = flat_NxS[:, g.offset:g.offset + g.chunk].reshape(-1)
        start = 0
        for i in g.leaves:
            size = _numel(plan.leaves[i])
            out[i] = flat[start:start + size].reshape(plan.leaves[i].shape)
            start += size
    return out


def pieces(plan: ShardPlan, shard: jax.Array) -> list[jax.Array]:
    """A device's shard [S] cut into its piece of each group, in group order."""
    return [shard[g.offset:g.offset + g.chunk] for g in plan.groups]


def my_piece(buffer: jax.Array, num_devices: int, axis_name) -> jax.Array:
    """This device's slice of a group buffer [N c] that every device holds whole (after an all-reduce)."""
    return buffer.reshape(num_devices, -1)[lax.axis_index(axis_name)]


def reduce_scatter_group(buffer: jax.Array, axis_name) -> jax.Array:
    """Sum of a group buffer [N c] over `axis_name`, each device keeping its slice [c]: one reduce-scatter."""
    return collectives.reduce_scatter(buffer, axis_name, 0)


def all_gather_shards(shard: jax.Array, axis_name) -> jax.Array:
    """Every device's shard [S], stacked [N, S] on every device: one all-gather (`unpack` gives the leaves)."""
    return collectives.all_gather(shard, axis_name)


def shard_of_values(plan: ShardPlan, values: Sequence[float], axis_name, dtype) -> jax.Array:
    """This device's shard [S] of the flat vector holding values[i] on every element of leaf i (0 on the padding),
    built from the positions of the shard alone: no array the size of the leaves is formed (a per-element mask,
    e.g. the weight decay's rule or which elements belong to replicated leaves)."""
    out = []
    for g in plan.groups:
        ends = np.cumsum([_numel(plan.leaves[i]) for i in g.leaves])
        table = jnp.asarray([values[i] for i in g.leaves] + [0.0], dtype)
        positions = lax.axis_index(axis_name) * g.chunk + jnp.arange(g.chunk)
        out.append(table[jnp.searchsorted(jnp.asarray(ends), positions, side="right")])
    return jnp.concatenate(out)


def shard_of(plan: ShardPlan, leaves: Sequence[Any], axis_name) -> jax.Array:
    """This device's shard [S] of leaves every device holds whole (no communication: slices of each group)."""
    return jnp.concatenate([my_piece(group_buffer(plan, k, leaves), plan.num_devices, axis_name)
                            for k in range(len(plan.groups))])


# ---- stage 2: each group reduce-scattered from inside the backward ----------------------------------------

def _reduce_hook(k: int, plan: ShardPlan, axis_name):
    """identity(leaves, carrier, token) whose backward reduce-scatters group k's cotangents into the carrier's."""

    @jax.custom_vjp
    def hook(leaves, carrier, token):
        return leaves, token

    def fwd(leaves, carrier, token):
        return (leaves, token), None

    def bwd(_, cts):
        ct_leaves, ct_token = cts
        named = dict(zip(plan.groups[k].leaves, ct_leaves))
        piece = reduce_scatter_group(group_buffer(plan, k, named) + ct_token.astype(ct_leaves[0].dtype), axis_name)
        return None, piece, zero_after(piece)

    hook.defvjp(fwd, bwd)
    return hook


def hook_groups(leaves: list, carriers: list, plan: ShardPlan, axis_name) -> list:
    """`leaves` wrapped group by group (last group first, so the backward meets group 0 first and the token
    orders the reduce-scatters 0, 1, ...); the gradient w.r.t. carrier k is this device's piece of group k."""
    out, token = list(leaves), jnp.zeros((), jnp.float32)
    for k in reversed(range(len(plan.groups))):
        idx = plan.groups[k].leaves
        wrapped, token = _reduce_hook(k, plan, axis_name)([leaves[i] for i in idx], carriers[k], token)
        for i, w in zip(idx, wrapped):
            out[i] = w
    return out
