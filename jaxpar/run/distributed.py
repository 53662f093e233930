"""Joining a multi-process run with jax.distributed: JAX's own settings, torchrun's environment, or a cluster's.

Where the settings come from, first match wins:

    JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES, JAX_PROCESS_ID)   JAX's own variables
    MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (LOCAL_RANK)          torchrun / jaxpar.launch;
                                                                     RANK = node_rank * nproc_per_node + local_rank
    Slurm (srun), Open MPI (mpirun), Kubernetes indexed jobs         jax.distributed.initialize()'s own detection

and nothing at all (or a world of one) is a single process: no-op. The coordinator is JAX's (gRPC); the
collectives are XLA's: gloo or MPI on CPU (set before the backend starts), NCCL on GPUs.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import zlib
from typing import Mapping, NamedTuple

import numpy as np

CPU_COLLECTIVES = ("gloo", "mpi")
JOIN_TIMEOUT = 300  # seconds every process waits for the others to join (JAX's default); JAXPAR_JOIN_TIMEOUT


class Rendezvous(NamedTuple):
    """How this process joins: `source` names where it came from; None fields are left to JAX to detect."""

    source: str  # "jax" | "torch" | "slurm" | "ompi" | "k8s"
    coordinator: str | None = None  # host:port of process 0's coordinator
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None  # the GPUs this process takes; None: JAX's choice (all it sees)


VISIBLE_DEVICES = ("JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def local_device_ids(env: Mapping[str, str]) -> list[int] | None:
    """[LOCAL_RANK] when torchrun / jaxpar.launch started several processes on this node and nothing chose their
    GPUs (torch's convention: rank r calls torch.cuda.set_device(LOCAL_RANK)); JAX would give every process every
    GPU of the node. None otherwise (one process per node, or the environment names the devices)."""
    several = "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env and _int(env, "LOCAL_WORLD_SIZE") > 1
    if not several or any(env.get(name) for name in VISIBLE_DEVICES):
        return None
    return [_int(env, "LOCAL_RANK")]


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} must be an integer; fix the launcher's environment.") from None


def detect(env: Mapping[str, str] | None = None) -> Rendezvous | None:
    """The rendezvous `env` describes, or None for a single process."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS"):
        n = _int(env, "JAX_NUM_PROCESSES") if "JAX_NUM_PROCESSES" in env else None
        pid = _int(env, "JAX_PROCESS_ID") if "JAX_PROCESS_ID" in env else None
        return None if n == 1 else Rendezvous("jax", env["JAX_COORDINATOR_ADDRESS"], n, pid)
    if "WORLD_SIZE" in env and ("RANK" in env or "LOCAL_RANK" in env):
        world = _int(env, "WORLD_SIZE")
        if world <= 1:
            return None
        if "RANK" in env:
            rank = _int(env, "RANK")
        else:  # rank = node_rank * nproc_per_node + local_rank
            node_key = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
            node = _int(env, node_key) if node_key in env else 0
            rank = _int(env, "LOCAL_RANK") + (node * _int(env, "LOCAL_WORLD_SIZE") if node else 0)
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world}); fix the launcher's environment.")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise ValueError(f"WORLD_SIZE={world} needs {name} (process 0's address and port); set it or "
                                 "start the processes with python -m jaxpar.launch.")
        return Rendezvous("torch", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", world, rank, local_device_ids(env))
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return Rendezvous("slurm")
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return Rendezvous("ompi")
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:  # an indexed Job, as JAX expects
        return Rendezvous("k8s")
    return None


def initialize(cfg=None, env: Mapping[str, str] | None = None) -> Rendezvous | None:
    """Join the run the environment describes (before JAX's backend starts); returns how, or None if alone.

    `cfg.cpu_collectives` (gloo | mpi) picks XLA:CPU's cross-process collectives. Calling it again is a no-op.
    """
    import jax

    rdv = detect(env)
    if rdv is None or jax.distributed.is_initialized():
        return rdv
    collectives = getattr(cfg, "cpu_collectives", None) or "gloo"
    if collectives not in CPU_COLLECTIVES:
        raise ValueError(f"cpu_collectives={collectives!r} is not known; use one of {', '.join(CPU_COLLECTIVES)}.")
    jax.config.update("jax_cpu_collectives_implementation", collectives)
    where = f" at {rdv.coordinator}" if rdv.coordinator else ""
    timeout = _int(os.environ, "JAXPAR_JOIN_TIMEOUT") if os.environ.get("JAXPAR_JOIN_TIMEOUT") else JOIN_TIMEOUT
    print(f"jaxpar: process {rdv.process_id if rdv.process_id is not None else '?'} of "
          f"{rdv.num_processes or '?'} joining the group{where} (from {rdv.source}'s launch variables); JAX waits up "
          f"to {timeout} s (JAXPAR_JOIN_TIMEOUT) for every process, then aborts with DEADLINE_EXCEEDED if one has not "
          "joined",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(coordinator_address=rdv.coordinator, num_processes=rdv.num_processes,
                                   process_id=rdv.process_id, local_device_ids=rdv.local_device_ids,
                                   initialization_timeout=timeout)
    except Exception as e:  # JAX's gRPC errors that reach Python (a missing peer aborts in C++ instead: the
        # line above says what it waits for): one line that says which setting to fix
        text = str(e)
        if "Failed to start RPC server" in text or "Failed to add port" in text:
            raise ValueError(f"the coordinator could not listen on {rdv.coordinator} (the port is in use); pick "
                             "another --master-port (MASTER_PORT), or leave it out of jaxpar.launch.") from None
        if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
            raise ValueError(f"not every one of the {rdv.num_processes or 'expected'} processes joined{where} "
                             f"within {timeout} s (JAXPAR_JOIN_TIMEOUT); start every node (--nnodes, each --node-rank "
                             "once) with the same --master-addr and --master-port.") from None
        raise
    per = collections.Counter(d.process_index for d in jax.devices())
    _barrier("jaxpar_backends_up", timeout)
    if len(set(per.values())) > 1:  # a global batch split by process would not line up with the devices
        counts = ", ".join(f"process {p} has {n}" for p, n in sorted(per.items()))
        raise ValueError(f"every process must have the same number of devices, but {counts}; pass the same "
                         "--cpu-devices (or make as many accelerators visible) on every node.")
    return rdv


def _barrier(name: str, timeout_s: float) -> None:
    """Every process here before any goes on. A process that raises and exits takes the coordination service (process
    0's) with it, and a peer still starting its backend then failed inside JAX's gRPC ("Connection reset by peer")
    instead of printing the same one-line refusal (seen under load in the device-count check)."""
    try:
        from jax._src import distributed as jax_distributed  # the client behind jax.distributed.initialize
        client = jax_distributed.global_state.client
    except (ImportError, AttributeError):
        return
    if client is not None:
        client.wait_at_barrier(name, int(timeout_s * 1000))


# flags that may differ between processes: paths (each node may mount the same files elsewhere) and what only
# process 0 writes or prints
PER_PROCESS = ("data_dir", "data_path", "init_torch", "export_torch", "metrics_out", "checkpoint_dir", "report",
               "log_every", "quiet", "print_shapes")


def check_same_config(cfg) -> None:
    """ValueError naming the flags whose values differ between the processes: every process must run the same
    command (a different --seed or --lr on one node trains another model without a word); paths and process 0's
    outputs (PER_PROCESS) may differ. No-op alone."""
    import jax

    if jax.process_count() == 1:
        return
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_PROCESS}
    every = _every_process([zlib.crc32(repr(v).encode()) & 0x7FFFFFFF for v in fields.values()])
    differ = [name for i, name in enumerate(fields) if len(set(every[:, i].tolist())) > 1]
    if differ:
        flags = ", ".join("--" + n.replace("_", "-") for n in differ)
        here = ", ".join(f"{n}={fields[n]!r}" for n in differ[:3])
        raise ValueError(f"the processes were started with different flags: {flags} (this is process "
                         f"{jax.process_index()}, with {here}); start every process with the same command.")


def check_same_data(**sizes: int) -> None:
    """ValueError unless every process loaded data of the same sizes (`sizes`: name -> count; -1 for none): the
    per-process paths (--data-path, --data-dir) may differ, their contents may not. A shorter file on one process
    gave it fewer steps, and the others waited in the step's collectives for it without a word (a QA finding).
    No-op alone."""
    import jax

    if jax.process_count() == 1:
        return
    every = _every_process(list(sizes.values()))
    differ = [name for i, name in enumerate(sizes) if len(set(every[:, i].tolist())) > 1]
    if differ:
        seen = "; ".join(f"{n}: " + ", ".join(str(int(v)) for v in every[:, list(sizes).index(n)]) for n in differ)
        raise ValueError(f"the processes loaded different data ({seen} samples, process 0 first); give every "
                         "process the same files (--data-path, --data-dir).")


def _every_process(values: list[int]) -> np.ndarray:
    """[processes, len(values)]: each process's `values` (int32), process 0 first."""
    import jax
    from jax.experimental import multihost_utils

    mine = np.array(values, np.int32)
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(values))
