"""Where the stages live and how values move between them: one process by ``jax.device_put``, across processes
by a two-sided ``ppermute`` program on a mesh of the sender's and the receiver's devices (gloo on CPU).

Stage s owns the DATA column ``mesh.devices[:, s]`` of the (DATA, PIPE) mesh, all in one process; its arrays are
"rows" (sharded over its D devices by rows), "rep" (replicated) or "local" (one slice per device, a leading axis
of D). A cross-process transfer is a collective both processes must run, in the same order: the engine posts
every cross-process message of a tick in one global order, which every process derives from the schedule
(jaxpar.pipeline.engine), to the process's one courier thread (`post`), which runs them one at a time. The
two-sided programs declare each side's buffer "replicated" over the pair axis although the sides differ (the
sender's value, the receiver's zeros): with check_vma off, ppermute moves the sender's shards to the receiver's
devices and nothing is sliced or reassembled. Roughly::

    mesh2 = Mesh([[sender devices], [receiver devices]], ("pair", DATA))
    out = shard_map(lambda x: ppermute(x, "pair", [(0, 1)]), mesh2, P(DATA), P(DATA))(value or zeros)
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import DATA, PIPE, TENSOR, stage_fix

PAIR, PROC = "pair", "proc"


@lru_cache(maxsize=None)
def _pair_program(devices: tuple, moves: tuple | None, spec: P, tensor: int = 1):
    """Over the pair axis of Mesh([side 0 devs, side 1 devs]), on a list of buffers: buffer k moved from side 0 to
    side 1 if moves[k], else from 1 to 0 (one program for all: one collective launch); moves None: each summed
    over both sides. Each side's devices are a DATA line, or with tensor T > 1 a (DATA, TENSOR) grid, and the
    buffers lie on it as `spec` says (rows over DATA, whole, or a tensor-split weight): every device exchanges its
    own piece with the device at the same position on the other side."""
    axes = (PAIR, DATA) if tensor == 1 else (PAIR, DATA, TENSOR)
    shape = (2, -1) if tensor == 1 else (2, -1, tensor)
    mesh = Mesh(np.array(devices, dtype=object).reshape(shape), axes)
    if moves is None:
        body = lambda xs: lax.psum(xs, PAIR)  # noqa: E731
    else:
        body = lambda xs: [lax.ppermute(x, PAIR, [(0, 1)] if fwd else [(1, 0)]) for x, fwd in zip(xs, moves)]  # noqa
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False))


@lru_cache(maxsize=None)
def _proc_program(devices: tuple):
    mesh = Mesh(np.array(devices, dtype=object), (PROC,))
    fn = jax.shard_map(lambda x: lax.psum(x, PROC), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return mesh, jax.jit(fn)


def _alone(fn, arrays):
    """Run a cross-process program by itself: its inputs ready first (so XLA runs it now, in this thread, rather
    than later on a compute thread) and its outputs waited for. XLA:CPU runs programs when their inputs are ready,
    not in dispatch order; this way each process's gloo collectives run one at a time, in the order called."""
    return jax.block_until_ready(fn(jax.block_until_ready(arrays)))


class Transport:
    """Placement of the S stages of `mesh` (DATA, PIPE) -- or (DATA, PIPE, TENSOR): each stage then a (DATA,
    TENSOR) sub-mesh, its "rows" split over DATA and replicated over TENSOR, its "local" values one per device --
    and the moves between them. `act`: how the values crossing stage boundaries lie ("act"; jaxpar.pipeline.stage's
    act_spec)."""

    def __init__(self, mesh: Mesh, act: P = P(DATA)):
        self.mesh, self.act = mesh, act
        self.S, self.D = mesh.shape[PIPE], mesh.shape[DATA]
        self.T = mesh.shape.get(TENSOR, 1)
        self.me = jax.process_index()
        grids = [mesh.devices[:, s, :] if TENSOR in mesh.axis_names else mesh.devices[:, s] for s in range(self.S)]
        self.devices = [tuple(g.flat) for g in grids]
        self.process = []
        for s, devs in enumerate(self.devices):
            procs = {d.process_index for d in devs}
            if len(procs) > 1:
                raise ValueError(f"stage {s}'s {len(devs)} devices span processes {sorted(procs)}; a stage must "
                                 f"live in one process: {stage_fix(mesh.size, jax.local_device_count(), self.T)}; "
                                 "or DDP for pure data parallelism across processes.")
            self.process.append(procs.pop())
        if TENSOR in mesh.axis_names:
            self.meshes = [Mesh(g, (DATA, TENSOR)) for g in grids]
        else:
            self.meshes = [Mesh(np.array(devs, dtype=object), (DATA,)) for devs in self.devices]
        each = lambda m: P(DATA) if len(m.axis_names) == 1 else P(tuple(m.axis_names))  # noqa: E731
        self.kinds = [{"rows": NamedSharding(m, P(DATA)), "local": NamedSharding(m, each(m)),
                       "rep": NamedSharding(m, P()), "act": NamedSharding(m, self.act)} for m in self.meshes]
        procs = sorted(set(self.process))
        self._zeros: dict = {}
        self._courier: ThreadPoolExecutor | None = None  # the one thread that runs this process's exchanges
        self._posted: list[Future] = []
        self.proc_devices = tuple(next(devs[0] for s, devs in enumerate(self.devices) if self.process[s] == p)
                                  for p in procs)

    def mine(self, stage: int) -> bool:
        return self.process[stage] == self.me

    @property
    def local_stages(self) -> list[int]:
        return [s for s in range(self.S) if self.mine(s)]

    def put(self, value: Any, stage: int, kind: str = "rep") -> Any:
        """`value` onto stage `stage`'s devices (a host value, or an array of another local stage)."""
        return jax.device_put(value, self.kinds[stage][kind])

    def same_process(self, a: int, b: int) -> bool:
        return self.process[a] == self.process[b]

    # -- across processes: both sides call these, in the same order, one at a time ---------------------------

    def _pair(self, a: int, b: int, items: list, moves: tuple | None, spec: P) -> list:
        """One program between stages a (side 0) and b (side 1) over `items`, [(value or None, specs)]: this
        side's buffers (None: zeros, the receiving side's), laid out on the stage as `spec` -> the program's pytrees
        on this side, laid out the same way."""
        mesh, fn = _pair_program(self.devices[a] + self.devices[b], moves, spec, self.T)
        sharding = NamedSharding(mesh, spec)
        mine = a if self.mine(a) else b
        devs = self.devices[mine]
        order = lambda shards: sorted((s for s in shards if s.device in devs), key=lambda s: devs.index(s.device))  # noqa
        arrays, flat, counts = [], [], []
        for value, specs in items:
            leaves = jax.tree.leaves(specs)
            flat += leaves
            counts.append(len(leaves))
            values = jax.tree.leaves(value) if value is not None else [None] * len(leaves)
            for leaf_spec, leaf in zip(leaves, values):
                if leaf is not None:
                    parts = [s.data for s in order(leaf.addressable_shards)]
                else:  # the receiver's side of the buffer: zeros made once (an eager op waits for a busy device)
                    local = NamedSharding(self.meshes[mine], spec).shard_shape(tuple(leaf_spec.shape))
                    key = (mine, local, jnp.dtype(leaf_spec.dtype))
                    if key not in self._zeros:
                        self._zeros[key] = [jax.device_put(np.zeros(local, leaf_spec.dtype), d) for d in devs]
                    parts = self._zeros[key]
                arrays.append(jax.make_array_from_single_device_arrays(leaf_spec.shape, sharding, parts))
        out = iter(_alone(fn, arrays))
        target = NamedSharding(self.meshes[mine], spec)
        result = [jax.make_array_from_single_device_arrays(leaf_spec.shape, target,
                                                           [s.data for s in order(o.addressable_shards)])
                  for leaf_spec, o in zip(flat, out)]
        pos, trees = 0, []
        for (_, specs), n in zip(items, counts):
            trees.append(jax.tree.unflatten(jax.tree.structure(specs), result[pos:pos + n]))
            pos += n
        return trees

    def exchange(self, a: int, b: int, messages: list) -> list:
        """Messages between stages a and b, in other processes, in one program: [(src, value, specs)], src a or
        b, value the sender's (ignored on the receiver). Returns each message's value on this side: what it
        received, or its own buffers where it sent (ignore those)."""
        items = [(value if self.mine(src) else None, specs) for src, value, specs in messages]
        spec = self.act if self.act != P(DATA) else P(DATA) if self.D > 1 else P()
        return self._pair(a, b, items, tuple(src == a for src, _, _ in messages), spec)

    def post(self, a: int, b: int, messages: list) -> Future:
        """`exchange` run on this process's one courier thread, in the order posted (each finished before the
        next starts: `_alone`), so neither side's Python waits for the other. Returns at once; the future's result
        is exchange's list."""
        if self._courier is None:
            self._courier = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-exchange")
        fut = self._courier.submit(self.exchange, a, b, messages)
        self._posted.append(fut)
        return fut

    def drain(self) -> None:
        """Wait for every posted exchange (re-raising its error): no other collective may start before."""
        posted, self._posted = self._posted, []
        for fut in posted:
            fut.result()

    def pair_sum(self, a: int, b: int, value: Any, specs: Any, spec: P = P()) -> Any:
        """The sum of two stages' values (each side passes its own), on both sides (tied gradients): replicated on
        each stage, or laid out as `spec` (a weight split over TENSOR), the same on both."""
        return self._pair(a, b, [(value, specs)], None, spec)[0]

    def put_as(self, value: Any, stage: int, spec: P) -> Any:
        """`value` onto stage `stage`'s devices, laid out as `spec` on its mesh."""
        return jax.device_put(value, NamedSharding(self.meshes[stage], spec))

    @property
    def first_device(self):
        """This process's device for process-level values (the Sums vector, gathered state)."""
        return next(d for d in self.proc_devices if d.process_index == self.me)

    def all_processes_sum(self, tree: Any) -> Any:
        """The sum over processes of a pytree of arrays (each passes its own; zeros where it has nothing), on
        this process's first device."""
        tree = jax.device_put(tree, self.first_device)
        if len(self.proc_devices) == 1:
            return tree
        mesh, fn = _proc_program(self.proc_devices)
        sharding = NamedSharding(mesh, P())
        arrays = jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(a.shape, sharding, [a]), tree)
        return jax.tree.map(lambda a: a.addressable_data(0), _alone(fn, arrays))
