"""torch.utils.data.DistributedSampler's index plan, plus a resumable position within the epoch.

Each epoch: a permutation of range(num_samples) (or range order without shuffle), padded by wrap-around to
a multiple of num_replicas (or trimmed with drop_last), then every num_replicas-th index from `rank`:

    indices = perm(seed, epoch) + perm[:padding]      # or perm[:total_size] with drop_last
    mine = indices[rank::num_replicas]                # all ranks get len(self) indices

The wrap-around copies are padding: `real()` marks them (positions p >= num_samples of the padded order), and
jaxpar.data.loader.Loader gives those rows mask 0, so N processes train on exactly the samples one process does
(torch trains the copies a second time).
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np


def _check_int(name: str, value: Any, low: int, rule: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer {rule}; {fix}")
    return int(value)


def _seed(value: Any, fix: str) -> int:
    """A seed torch.Generator.manual_seed takes: an int in [-2**63, 2**64)."""
    seed = _check_int("seed", value, -2**63, "in [-2**63, 2**64) (torch's manual_seed)", fix)
    if seed >= 2**64:
        raise ValueError(f"seed={value!r} must be an integer in [-2**63, 2**64) (torch's manual_seed); {fix}")
    return seed


class DistributedSampler:
    """Which samples this rank reads, epoch by epoch, and how far into the epoch it is (`offset`).
    `num_samples`: the dataset's length, or the dataset itself (torch's first argument). `num_replicas` and
    `rank` default, as torch's do to the process group's, to jax.process_count() and jax.process_index().

    With shuffle=False the indices equal torch's exactly. With shuffle=True the permutation comes from
    numpy's Generator seeded by (seed, epoch): torch draws randperm from a torch.Generator seeded with
    seed + epoch, whose stream numpy cannot reproduce, so shuffled orders differ from torch's (but have
    the same structure: one permutation per epoch, shared by all ranks, padded and strided the same way).

    Beyond torch: `offset` counts this rank's samples already consumed in the current epoch;
    `batches()` (and jaxpar.data.loader.Loader) advance it, `state_dict()` / `load_state_dict()` carry it, so a
    run resumes mid-epoch at the next unseen batch. A pass that ran to the epoch's end leaves the next pass over
    the same epoch (no set_epoch, or set_epoch(same)) to start over, as torch re-iterates it; a position loaded
    from a state_dict is kept. `real()` tells this rank's wrap-around padding from its
    real samples, so padding can be masked out (weight 0) instead of trained twice.
    """

    def __init__(self, num_samples: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if hasattr(num_samples, "__len__") and not isinstance(num_samples, (str, bytes)) and not (
                isinstance(num_samples, np.ndarray) and num_samples.ndim == 0):  # an array dataset: its rows
            num_samples = len(num_samples)  # torch's DistributedSampler(dataset, ...)
        self.num_samples = _check_int("num_samples", num_samples, 0, ">= 0", "pass the dataset's length (an int) "
                                     "or the dataset itself.")  # torch's takes an empty one: no indices
        if num_replicas is None or rank is None:  # torch's: the process group's (here jax.distributed's) size, rank
            import jax

            from jaxpar.run import distributed

            group = distributed.detect()
            if group is not None and not jax.distributed.is_initialized():  # else JAX would start as one process
                raise ValueError(f"DistributedSampler(num_replicas={num_replicas}, rank={rank}) reads the process "
                                 f"count and index from jax.distributed, which this process (one of "
                                 f"{group.num_processes or 'several'}, by {group.source}'s variables) has not joined "
                                 "yet; call jaxpar.run.distributed.initialize() (or jax.distributed.initialize()) "
                                 "first, as torch needs init_process_group, or pass num_replicas and rank.")
            num_replicas = jax.process_count() if num_replicas is None else num_replicas
            rank = jax.process_index() if rank is None else rank
        self.num_replicas = _check_int("num_replicas", num_replicas, 1, ">= 1",
                                       "use the number of processes (jax.process_count()).")
        self.rank = _check_int("rank", rank, 0, f"in [0, {num_replicas=})",
                               "use this process's index (jax.process_index()).")
        if self.rank >= self.num_replicas:
            raise ValueError(f"{rank=} must be in [0, {num_replicas=}); use this process's index "
                             f"(jax.process_index()) and the process count as num_replicas.")
        self.seed = _seed(seed, "pass e.g. seed=0.")
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.epoch, self.offset = 0, 0
        self._ran_out = False  # a pass reached the epoch's end: the next pass starts over (torch's re-iteration)
        if self.drop_last and self.num_samples % self.num_replicas:
            self.per_replica = math.ceil((self.num_samples - self.num_replicas) / self.num_replicas)  # torch's
        else:
            self.per_replica = math.ceil(self.num_samples / self.num_replicas)
        self.total_size = self.per_replica * self.num_replicas

    def __len__(self) -> int:
        """Samples per rank per epoch (torch's len(sampler)), whatever the offset."""
        return self.per_replica

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; a different epoch starts at offset 0, the same one keeps it
        (so `load_state_dict(s); set_epoch(s["epoch"])` resumes where s left off)."""
        epoch = _check_int("epoch", epoch, 0, ">= 0", "count epochs from 0.")
        if epoch != self.epoch:
            self.epoch, self.offset, self._ran_out = epoch, 0, False

    @property
    def start(self) -> int:
        """Where the next pass begins: `offset`, or 0 once a pass ran to the epoch's end."""
        return 0 if self._ran_out else self.offset

    def begin_pass(self) -> None:
        """A pass starts (batches(), Loader): from `start`."""
        self.offset, self._ran_out = self.start, False

    def end_pass(self) -> None:
        """A pass ran to the epoch's end: the next one over the same epoch starts over."""
        self._ran_out = True

    def indices(self) -> np.ndarray:
        """This rank's whole epoch of indices (int64 [len(self)]), ignoring the offset."""
        n = self.num_samples
        key = (self.seed % 2**64, self.epoch)  # numpy's seeds are >= 0: an int64 seed read as its uint64 bits
        order = np.random.default_rng(key).permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last:
            order = order[:self.total_size]
        elif self.total_size > n:  # wrap around, repeating the whole list when padding exceeds it (torch)
            padding = self.total_size - n
            order = np.concatenate([order, np.tile(order, math.ceil(padding / n))[:padding]])
        return order[self.rank:self.total_size:self.num_replicas]

    def real(self) -> np.ndarray:
        """bool [len(self)], aligned with indices(): False at this rank's wrap-around padding (positions
        rank + k*num_replicas >= num_samples of the padded epoch order, copies of samples another position
        holds), True elsewhere. Over all ranks the True positions hold every sample exactly once (without
        drop_last; with it there is no padding and all are True). Ignores the offset, like indices()."""
        return np.arange(self.rank, self.total_size, self.num_replicas) < self.num_samples

    def __iter__(self) -> Iterator[int]:
        """The indices not yet consumed this epoch (from `start`); iterating does not advance it."""
        return iter(self.indices()[self.start:].tolist())

    def batch_plan(self, batch_size: int, drop_last: bool = False) -> list[np.ndarray]:
        """The rest of the epoch from `start` cut into batches of `batch_size` (the last one shorter,
        or dropped with drop_last). A plan only: nothing advances."""
        batch_size = _check_int("batch_size", batch_size, 1, ">= 1", "use this process's batch size.")
        rest = self.indices()[self.start:]
        stop = len(rest) - len(rest) % batch_size if drop_last else len(rest)
        return [rest[i:i + batch_size] for i in range(0, stop, batch_size)]

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[np.ndarray]:
        """batch_plan's batches, advancing `offset` as each one is handed out (i.e. consumed)."""
        self.begin_pass()
        for batch in self.batch_plan(batch_size, drop_last):
            self.offset += len(batch)
            yield batch
        self.end_pass()

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch, offset, seed, and the settings the offset is relative to."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples,
                "num_replicas": self.num_replicas, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`'s epoch, offset and seed. The settings that define the epoch's indices must
        match (any rank's state fits: all ranks consume in step)."""
        missing = [k for k in ("epoch", "offset") if k not in state]  # a KeyError, after the seed and epoch were set
        if missing:
            raise ValueError(f"the sampler state lacks {missing} (it has {sorted(state)}); pass a state from "
                             "DistributedSampler.state_dict().")
        for key in ("num_samples", "num_replicas", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"state {key}={state[key]!r} differs from this sampler's {key}="
                                 f"{getattr(self, key)!r}, so its offset means other samples; resume with the "
                                 f"same data, process count and flags, or start the epoch over (set_epoch).")
        self.seed = _seed(state.get("seed", self.seed), "pass a state from state_dict().")
        self.epoch = _check_int("epoch", state["epoch"], 0, ">= 0", "pass a state from state_dict().")
        offset = state["offset"]
        self.offset = _check_int("offset", offset, 0, f"in [0, {len(self)}]", "pass a state from state_dict().")
        self._ran_out = False  # a finished epoch loaded stays finished: the run goes on with the next
        if self.offset > len(self):
            raise ValueError(f"{offset=} must be in [0, {len(self)}] (samples per rank per epoch); pass a state "
                             f"from state_dict() of a sampler over the same data.")
