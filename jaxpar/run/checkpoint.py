"""Checkpoints: the canonical TrainState, the data position and what the run was, saved atomically with orbax.

A checkpoint is strategy-agnostic: it holds `strategy.unplace(placed)` (params, optimizer state with its step
count -- which drives the lr schedule --, step, and the PRNG key as raw key data), so any strategy and any
process count can resume it with `strategy.init(state)`. Layout of `--checkpoint-dir D` (orbax's):

    D/<step>/state   the TrainState leaves, in jax.tree order, as numpy arrays
    D/<step>/meta    JSON: model, optimizer, leaf names/shapes/dtypes, the data position, the run's config

orbax writes a step into `D/<step>.orbax-checkpoint-tmp-*` and renames it when complete, so a run killed while
saving leaves the previous checkpoints intact; only renamed (complete) steps are ever listed or restored.
Every process calls `save` (orbax's save is collective); the arrays are replicated host copies, which orbax writes
from process 0 only.

One run writes a directory at a time: two runs saving into it at once (train.py started twice on one
--checkpoint-dir, or a --resume while the first still runs) could leave a step that orbax lists as complete but
holds truncated data. So process 0 of a writing run holds an advisory lock (fcntl.flock) on `D/.jaxpar.lock`, a file
holding its pid@host, for as long as it writes (the Checkpointer's life, save_checkpoint's call); a second writer is
refused with a ValueError naming the holder. close() removes the file; the OS drops the lock of a process that
dies (no stale locks: the file it leaves is unlocked and taken over). The lock file is no step: orbax lists
numbered folders only. Without fcntl (Windows), or on a filesystem without locks, nothing is locked.

In research code: `save_checkpoint(dir, strategy.unplace(placed), data=...)` and
`state, data = restore_checkpoint(dir, jaxpar.init_state(model, tx))`. train.py's loop, roughly:
    ckpt = Checkpointer(dir, run_info(cfg, state), resume=cfg.resume)   # checks, and locks an existing dir
    state, position = ckpt.restore(state)                                # when resuming
    ckpt.save(step, strategy.unplace(placed), position); ...; ckpt.close()
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import tempfile
import threading
import zlib
from typing import Any

import jax
import numpy as np

from jaxpar.config import DEFAULT_LR
from jaxpar.step import TrainState

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, the directory is not locked
    fcntl = None

FORMAT = 1  # bump when the layout changes
# train.py's default learning rates before they were torch's (checkpoints of then record none): SGD's was 0.01
LEGACY_DEFAULT_LR = {"sgd": 0.01}
# Config fields that change the trajectory: a resume that changes them still runs, with a printed note
TRAJECTORY_FIELDS = ("dataset", "data_path", "data_dir", "train_split", "seq_len", "batch_size", "lr", "gamma",
                     "seed", "shuffle", "drop_last", "precision", "momentum", "nesterov", "eps", "adam_beta1",
                     "adam_beta2", "weight_decay", "weight_decay_params", "image_size", "lr_schedule", "warmup_steps",
                     "lr_decay_steps", "min_lr", "grad_clip", "loss", "label_smoothing", "dropout", "per_sample",
                     "model_kwargs", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                     "consecutive_hysteresis", "min_loss_scale", "grad_comm_dtype")


def _is_key(a) -> bool:
    return isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def leaf_specs(state: TrainState) -> dict[str, list]:
    """{leaf path: [shape, dtype]} of the state, PRNG keys as their raw uint32 key data."""
    specs = {}
    for path, a in jax.tree_util.tree_flatten_with_path(state)[0]:
        a = jax.random.key_data(a) if _is_key(a) else a
        specs[jax.tree_util.keystr(path)] = [list(a.shape), str(a.dtype)]
    return specs


def run_info(cfg, state: TrainState, n_head: int | None = None, decay_steps: int | None = None,
             activation: str | None = None) -> dict[str, Any]:
    """What a checkpoint records about its run, and what a resuming run must match: besides the flags, a GPT's
    head count (`n_head`) and GELU (`activation`, its activation_function), which no leaf's shape shows, and the
    step the cosine schedule decays to (`decay_steps`, by default the run's last, so a resume with more --steps
    would change it)."""
    params = jax.tree.leaves(state.params)
    return {"format": FORMAT, "model": cfg.model, "optimizer": cfg.optimizer,
            "param_count": int(sum(np.size(a) for a in params)), "leaves": leaf_specs(state),
            "config": dataclasses.asdict(cfg), "n_head": n_head, "decay_steps": decay_steps,
            "activation_function": activation,
            "default_lr": DEFAULT_LR.get(cfg.optimizer) if cfg.lr is None else None}


def to_host(state: TrainState) -> list[np.ndarray]:
    """The state's leaves as host numpy arrays (typed PRNG keys as their key data)."""
    return [np.asarray(jax.random.key_data(a) if _is_key(a) else a) for a in jax.tree.leaves(state)]


def from_host(template: TrainState, leaves: list[np.ndarray]) -> TrainState:
    """Rebuild a TrainState shaped like `template` from host leaves (key data rewrapped as typed keys)."""
    flat, treedef = jax.tree.flatten(template)
    out = [jax.random.wrap_key_data(np.asarray(v), impl=jax.random.key_impl(t)) if _is_key(t) else
           jax.numpy.array(v) for t, v in zip(flat, leaves)]  # jax arrays, as init_state gives
    return jax.tree.unflatten(treedef, out)


def checksums(leaves: list[np.ndarray]) -> list[int]:
    """CRC-32 of each leaf's bytes: kept in the meta at save, compared at restore, so a checkpoint whose data
    changed on disk after it was written (a flipped byte restored silently, a QA finding) reads as damaged."""
    return [zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) for a in leaves]


def finite(leaves: list[np.ndarray]) -> bool:
    """True when every floating-point leaf is finite (a state worth saving)."""
    return all(bool(np.isfinite(a).all()) for a in leaves if np.issubdtype(a.dtype, np.floating))


def _probe(directory: str) -> None:
    """Create and remove a file in `directory`: the only reliable writability test (os.access lies to root)."""
    fd, name = tempfile.mkstemp(prefix=".jaxpar-probe-", dir=directory)
    os.close(fd)
    os.remove(name)


def writable_dir(path: str, flag: str) -> None:
    """Raise a ValueError unless `path` is, or could be created as, a writable directory. Writes nothing lasting."""
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == target else f"lies under the file {existing!r}"
        raise ValueError(f"{flag} {path!r} {what}, but it must be a directory; pass a directory path.")
    try:
        _probe(existing)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} is not writable ({e.strerror} in {existing!r}); "
                         "pass a directory this user can write to.") from None


def writable_file(path: str, flag: str) -> None:
    """Raise a ValueError unless `path` can be written as a file: its folder exists and is writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory, but it must be a file; pass a file path.")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: its folder {folder!r} does not exist; create it first or pass "
                         "a path in an existing folder.")
    try:
        _probe(folder)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} is not writable ({e.strerror} in {folder!r}); "
                         "pass a path this user can write to.") from None


LOCK_FILE = ".jaxpar.lock"  # in the checkpoint directory: a dot-name, which orbax never takes for a step
RULE = "two runs writing at once can leave a step that lists as complete but holds truncated data"


class _Lock:
    """Process 0's exclusive advisory lock on `directory`/LOCK_FILE (flock, LOCK_EX | LOCK_NB), held until
    release() (or the process ends: the OS drops it). `refused`: the holder ("pid@host") when another open file
    holds it, else None. Other processes of a run take nothing (they must not refuse their own run's directory)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd: int | None = None
        self.refused: str | None = None
        if fcntl is None or jax.process_index() != 0:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its holder wrote its pid@host (or is about to)
                self.refused = os.read(fd, 256).decode(errors="replace").strip() or "a process not named yet"
                os.close(fd)
                return
            except OSError:  # a filesystem without locks: go on unlocked, as on Windows
                os.close(fd)
                return
            try:  # the holder before us may have removed the file (release): lock the file that is there now
                same = os.path.samestat(os.stat(self.path), os.fstat(fd))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.remove(self.path)  # while still locked: a waiter that opened it sees another (or no) file
            except OSError:
                pass
            os.close(fd)


def _take_lock(directory: str, what: str, fix: str, attempt: bool = True) -> _Lock | None:
    """Lock `directory` for this run when `attempt` (process 0 takes it; another process's _Lock holds nothing), or
    raise a one-line ValueError naming the holder. With several processes all follow process 0 (one small
    all-gather; the call is collective): all hold a _Lock when it tried, and all raise when it was refused.
    Returns None when process 0 did not try (no `attempt`)."""
    lock = _Lock(directory) if attempt else None
    took, refused = lock is not None, lock is not None and lock.refused is not None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        took, refused = (bool(v) for v in multihost_utils.process_allgather(np.array([took, refused], np.int32))[0])
    path = os.path.join(directory, LOCK_FILE)
    if refused:
        holder = lock.refused if lock is not None else None
        if lock is not None:
            lock.release()
        if holder is None:  # not process 0: name the holder when this process sees the same file
            try:
                with open(path, errors="replace") as f:
                    holder = f.read(256).strip() or None
            except OSError:
                pass
        raise ValueError(f"{what} {directory!r} is in use by another run ({holder or 'another process'} holds its "
                         f"lock {path!r}): one directory takes one writing run at a time, since {RULE}; {fix}.")
    if not took:
        return None
    return lock if lock is not None else _Lock(directory)  # another process's: holds nothing


def _manager(directory: str, keep: int | None = None, read_only: bool = False):
    import logging

    import orbax.checkpoint as ocp

    if read_only:  # orbax warns "Given directory is read only" for every reader (a choice here, not news), and
        # "Metadata file does not exist" several times for a damaged step folder, which jaxpar names in one line
        logging.getLogger("absl").addFilter(_ReadOnlyNote())
    options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep, create=not read_only,
                                           read_only=read_only, cleanup_tmp_directories=not read_only,
                                           save_interval_steps=0 if read_only else 1)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


class _ReadOnlyNote:
    def filter(self, record) -> bool:
        return not any(note in str(record.msg) for note in ("read only", "Metadata file does not exist"))

    def __eq__(self, other) -> bool:  # one filter however many readers (logging skips equal filters)
        return isinstance(other, _ReadOnlyNote)

    __hash__ = object.__hash__


def latest_step(directory: str) -> int | None:
    """The step of the newest COMPLETE checkpoint in `directory`, or None (also for a missing directory)."""
    if not os.path.isdir(directory):
        return None
    return _manager(directory, read_only=True).latest_step()


def read_meta(directory: str, step: int) -> dict:
    """The JSON record saved with checkpoint `step`."""
    import orbax.checkpoint as ocp

    try:
        return _manager(directory, read_only=True).restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # a foreign or damaged step folder
        raise ValueError(f"--checkpoint-dir {directory!r}: step {step} has no readable jaxpar metadata ({e}); "
                         "pass another --checkpoint-dir or remove that step's folder.") from None


def first_gap(saved: dict, now: dict) -> str:
    """The first leaf whose (shape, dtype) differs between two leaf_specs, or that only one of them has."""
    return next((k for k in now if saved.get(k) != now[k]), None) or next(k for k in saved if k not in now)


def check_compatible(meta: dict, info: dict, directory: str) -> list[str]:
    """Raise a ValueError when checkpoint `meta` belongs to another model or optimizer; return notes on changes
    of the config fields that alter the trajectory (the run goes on, but will not match the original)."""
    where = f"--checkpoint-dir {directory!r} holds a checkpoint of"
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where} format {meta.get('format')!r}, but this jaxpar reads format {FORMAT}; "
                         "pass another --checkpoint-dir.")
    if meta["model"] is None:
        raise ValueError(f"{where} a state that jaxpar.save_checkpoint wrote, not a train.py run; restore it with "
                         "jaxpar.restore_checkpoint, or pass another --checkpoint-dir.")
    if meta["model"] != info["model"]:
        raise ValueError(f"{where} model {meta['model']!r} ({meta['param_count']:,} params), not "
                         f"--model {info['model']!r}; pass --model {meta['model']} or another --checkpoint-dir.")
    if meta["optimizer"] != info["optimizer"]:
        raise ValueError(f"{where} optimizer {meta['optimizer']!r}, not --optimizer {info['optimizer']!r}; "
                         f"pass --optimizer {meta['optimizer']} or another --checkpoint-dir.")
    old, new = meta.get("config", {}), info["config"]
    same_decay = None not in (meta.get("decay_steps"), info["decay_steps"]) and \
        meta["decay_steps"] == info["decay_steps"]  # --lr-decay-steps given as the old run's own end: the same
    def shown(f, v, default_lr):  # a flag left at its default reads so (None would look like a value)
        return repr(v) if v is not None else f"the default ({default_lr})" if f == "lr" and default_lr else "unset"

    changed = [f"--{f.replace('_', '-')} was {shown(f, old[f], meta.get('default_lr'))}, now "
               f"{shown(f, new.get(f), info.get('default_lr'))}" for f in TRAJECTORY_FIELDS
               if f in old and old[f] != new.get(f) and not (f == "lr_decay_steps" and same_decay)]
    if "lr" in old and old["lr"] is None and new.get("lr") is None:  # both at the default: did it change?
        was = meta.get("default_lr", LEGACY_DEFAULT_LR.get(meta["optimizer"], info.get("default_lr")))
        if None not in (was, info.get("default_lr")) and was != info["default_lr"]:
            changed.append(f"the default --lr was {was}, now {info['default_lr']} (torch's); pass --lr {was} to "
                           "continue its trajectory")
    if None not in (meta.get("n_head"), info["n_head"]) and meta["n_head"] != info["n_head"]:
        raise ValueError(f"{where} a GPT with {meta['n_head']} heads, not {info['n_head']}: the head count changes "
                         f"what its weights compute; pass --n-head {meta['n_head']} or another --checkpoint-dir.")
    # a GPT's GELU (checkpoints from before the choice existed ran the tanh form: they record a head count only)
    act = meta.get("activation_function", "gelu_new" if meta.get("n_head") is not None else None)
    if None not in (act, info.get("activation_function")) and act != info["activation_function"]:
        raise ValueError(f"{where} a GPT with the {act} GELU, not {info['activation_function']}: the GELU changes "
                         f"what its weights compute; pass --activation-function {act} or another --checkpoint-dir.")
    saved, now = meta["leaves"], info["leaves"]
    if saved != now:
        diff = first_gap(saved, now)
        flags = f"the flags that differ: {'; '.join(changed)}" if changed else "the data/model flags of that run"
        raise ValueError(f"{where} model {meta['model']!r} with {diff} = {saved.get(diff, 'absent')} (shape, dtype), "
                         f"but this run has {now.get(diff, 'absent')}; pass {flags}, or another --checkpoint-dir.")
    if None not in (meta.get("decay_steps"), info["decay_steps"]) and meta["decay_steps"] != info["decay_steps"]:
        changed.append(f"the cosine schedule decayed to step {meta['decay_steps']}, now {info['decay_steps']}: it "
                       f"ends at the run's last step unless --lr-decay-steps is given; pass --lr-decay-steps "
                       f"{meta['decay_steps']} to keep the original")
    return changed


def all_steps(directory: str) -> list[int]:
    """The steps of every COMPLETE checkpoint in `directory`, newest first (none for a missing directory)."""
    if not os.path.isdir(directory):
        return []
    return sorted(_manager(directory, read_only=True).all_steps(), reverse=True)


def _restore_newest(directory: str, steps: list[int], specs: dict, template: TrainState, verb: str):
    """((step, state, meta) of the newest of `steps` that reads in full with leaves `specs`, or None; the damaged
    steps met before it as (step, why)). Each damaged step skipped for a readable one is named on stderr."""
    import sys

    import orbax.checkpoint as ocp

    abstract = {"leaves": [np.zeros(shape, jax.numpy.dtype(dtype)) for shape, dtype in specs.values()]}
    damaged = []
    for step in steps:
        reader = _manager(directory, read_only=True)
        try:
            out = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many kinds for missing or truncated files
            damaged.append((step, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"))
            _drain_stray_callbacks()
            continue
        finally:
            reader.close()
        sums = out["meta"].get("crc32")  # (checkpoints written before the sums were kept have none)
        read = None if sums is None else checksums(list(out["state"]["leaves"]))
        if read is not None and sums != read:
            wrong = next(i for i, (a, b) in enumerate(zip(sums, read)) if a != b)
            damaged.append((step, f"leaf {list(specs)[wrong]} reads back other bytes than were saved (CRC-32)"))
            continue
        for bad, why in damaged:
            print(f"jaxpar: warning: checkpoint step {bad} in {directory} is damaged ({why}); {verb} step "
                  f"{step}, the newest readable one.", file=sys.stderr)
        return (step, from_host(template, out["state"]["leaves"]), out["meta"]), damaged
    return None, damaged


class _Drop:
    """A stand-in for sys.stderr that drops what it is given and remembers when."""

    def __init__(self):
        import time

        self.last = time.monotonic()

    def write(self, text: str) -> int:
        import time

        self.last = time.monotonic()
        return len(text)

    def flush(self) -> None:
        pass


def _drain_stray_callbacks(quiet: float = 0.3, limit: float = 5.0) -> None:
    """After a failed read: the file reads it had started still finish in tensorstore's threads and call back into
    orbax's event loop, which the failure closed, and Python prints each "RuntimeError: Event loop is closed"
    traceback to sys.stderr (hundreds, for one damaged checkpoint). Wait, sys.stderr dropping writes, until none
    came for `quiet` seconds (at most `limit`): the damaged step is named in one line after."""
    import sys
    import time

    drop, real = _Drop(), sys.stderr
    sys.stderr = drop
    try:
        start = time.monotonic()
        while time.monotonic() - drop.last < quiet and time.monotonic() - start < limit:
            time.sleep(0.05)
    finally:
        sys.stderr = real


def _set_aside(steps: list[int], directory: str) -> None:
    """Rename the damaged step folders that a resume skipped to `<step>.damaged` (process 0; every process waits),
    so that the run's new checkpoints at those steps can be written (orbax writes no step at or below its
    newest) and the damaged files stay for inspection."""
    import sys

    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        for step in steps:
            src = os.path.join(directory, str(step))
            dst = next(f"{src}.damaged{'' if i == 0 else f'.{i}'}" for i in range(1000)
                       if not os.path.exists(f"{src}.damaged{'' if i == 0 else f'.{i}'}"))
            os.rename(src, dst)
            print(f"jaxpar: note: the damaged step {step} is kept as {dst}; the run writes its own step {step} when "
                  "it gets there.", file=sys.stderr)
    multihost_utils.sync_global_devices("jaxpar: damaged checkpoints set aside")


class Checkpointer:
    """The checkpoints of one run in `directory`, locked against other writers (the module's docstring) until
    close(). Construction checks, and writes one thing only: for a `directory` that already exists (a resume, a
    leftover folder), process 0 takes the lock at once, writing the file `directory`/.jaxpar.lock (its pid@host),
    so a second run is refused before any training. For a `directory` that does not exist yet it writes nothing:
    the first `save` creates the folder and takes the lock there. close() releases it and removes that file.
    Resuming takes the newest READABLE checkpoint: a damaged newer one (a disk that lost its files) is named in a
    warning and skipped."""

    FIX = "stop that run, or pass another --checkpoint-dir"

    def __init__(self, directory: str, info: dict, *, resume: bool, keep: int = 2):
        writable_dir(directory, "--checkpoint-dir")
        # an existing folder: locked before anything else, so a second run's refusal comes first
        self._lock = _take_lock(directory, "--checkpoint-dir", self.FIX, attempt=os.path.isdir(directory))
        try:
            self._check(directory, info, resume, keep)
        except BaseException:
            self._release()
            raise

    def _check(self, directory: str, info: dict, resume: bool, keep: int) -> None:
        self.directory, self.info, self.keep = directory, info, keep
        self.steps = all_steps(directory)
        self.latest = self.steps[0] if self.steps else None
        self.notes: list[str] = []  # flags changed since the checkpoint's run: its trajectory changes
        self.ignored: list[str] = []  # flags a resumed run does not read
        if self.latest is not None:
            if not resume:
                raise ValueError(f"--checkpoint-dir {directory!r} already holds checkpoints up to step "
                                 f"{self.latest}; pass --resume to continue that run, or another (empty) "
                                 "--checkpoint-dir to start afresh.")
            meta, errors = None, []
            for step in self.steps:  # the newest whose metadata reads decides compatibility
                try:
                    meta = read_meta(directory, step)
                    break
                except ValueError as e:
                    errors.append(str(e))
            if meta is None:
                raise ValueError(f"--resume: no checkpoint in --checkpoint-dir {directory!r} is readable "
                                 f"({errors[0]}); pass the folder of an intact run, or drop --resume.")
            self.notes = check_compatible(meta, info, directory)
            given = info["config"].get("init_torch")
            if given and meta.get("config", {}).get("init_torch") != given:  # the run's own start: no news
                self.ignored.append(f"--init-torch {given!r} is not read: a resumed run takes its weights from the "
                                    f"checkpoint (step {self.latest}); drop --init-torch, or drop --resume to start "
                                    "from that file")
        elif resume:
            raise ValueError(f"--resume: --checkpoint-dir {directory!r} holds no complete checkpoint to resume; "
                             "drop --resume to start a new run there, or pass the folder of an earlier run.")
        self.saved_step = self.latest
        self._mgr = None

    def restore(self, template: TrainState) -> tuple[TrainState, dict]:
        """(state, data position) of the newest readable checkpoint, the state shaped like `template`; each
        damaged newer step is reported on stderr and skipped."""
        found, damaged = _restore_newest(self.directory, self.steps, self.info["leaves"], template, "resuming from")
        if found is None:
            raise ValueError(f"--resume: every checkpoint in --checkpoint-dir {self.directory!r} is damaged (step "
                             f"{damaged[0][0]}: {damaged[0][1]}); pass the folder of an intact run, or drop --resume.")
        self.latest = self.saved_step = found[0]
        if damaged:
            _set_aside([bad for bad, _ in damaged], self.directory)
        return found[1], found[2]["data"]

    def save(self, step: int, state: TrainState, data: dict) -> bool:
        """Save `state` (canonical layout) and the data position as checkpoint `step`; every process calls it.
        A state with a non-finite parameter is not saved (returns False): the last good checkpoint stays latest."""
        import orbax.checkpoint as ocp

        leaves = to_host(state)
        if not finite(leaves[:len(jax.tree.leaves(state.params))]):
            return False
        if self._mgr is None:
            if self._lock is None:  # a new folder: created here, locked before orbax writes in it
                if jax.process_index() == 0:
                    os.makedirs(self.directory, exist_ok=True)
                self._lock = _take_lock(self.directory, "--checkpoint-dir", self.FIX)
            self._mgr = _manager(self.directory, keep=self.keep)
        meta = {**self.info, "step": int(step), "data": data, "processes": jax.process_count(),
                "crc32": checksums(leaves)}
        if not self._mgr.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave({"leaves": leaves}), meta=ocp.args.JsonSave(meta))):
            # orbax writes no step at or below its newest and says so only by returning False
            raise RuntimeError(f"checkpoint step {step} was not written: --checkpoint-dir {self.directory!r} already "
                               f"holds step {self._mgr.latest_step()}; pass another --checkpoint-dir.")
        self.saved_step = int(step)
        return True

    def close(self) -> None:
        """Wait for the last (asynchronous) save to be complete on disk, then release the directory's lock."""
        try:
            if self._mgr is not None:
                self._mgr.wait_until_finished()
                self._mgr.close()
                self._mgr = None
        finally:
            self._release()

    def _release(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def __del__(self) -> None:  # one never closed (a restore only) must not keep this process's own runs out
        try:
            self._release()
        except Exception:
            pass


def save_checkpoint(directory: str, state: TrainState, *, step: int | None = None, data: Any = None,
                    keep: int | None = None) -> int:
    """Save `state` as checkpoint `step` (default: `state.step`) in `directory`, atomically, and return the step
    once it is on disk. `state` is the canonical TrainState, `strategy.unplace(placed)`: any strategy and process
    count restores it. `data`: anything JSON can hold (a data position, a config), given back by
    `restore_checkpoint`. `keep`: how many of the newest steps to keep (None: all). Every process calls it."""
    import orbax.checkpoint as ocp

    from jaxpar.optim import state_kind

    if not isinstance(state, TrainState):
        raise TypeError(f"save_checkpoint: state is a {type(state).__name__}, not a jaxpar.TrainState; pass "
                        "strategy.unplace(placed), the canonical state every strategy restores.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save_checkpoint: keep={keep!r}, but it must be a whole number >= 1 (the newest steps "
                         "kept) or None (keep all); pass e.g. keep=2.")
    spread = next((jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_flatten_with_path(state)[0]
                   if isinstance(a, jax.Array) and not a.is_fully_addressable), None)
    if spread is not None:  # a placed state across processes: no process holds it whole
        raise TypeError(f"save_checkpoint: state{spread} is spread over processes (a placed state); pass "
                        "strategy.unplace(placed), the canonical state every process holds whole.")
    from jaxpar.strategies.base import check_not_consumed, split_leaf

    check_not_consumed(state, "save_checkpoint")
    split = split_leaf(state)
    if split is not None:  # ZeRO's shards, tensor parallelism's slices (its qkv columns reordered): not the model
        raise TypeError(f"save_checkpoint: state{split} is split over devices (a strategy's placed state, in its "
                        "own layout); pass strategy.unplace(placed), the canonical state every strategy restores.")
    step = int(state.step) if step is None else step
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"save_checkpoint: step={step!r}, but it must be a whole number >= 0; pass step=N or "
                         "leave it out (state.step).")
    writable_dir(directory, "save_checkpoint: directory")
    if os.path.isdir(os.path.join(directory, str(int(step)))):  # orbax's step folder; no manager here: whether a
        # process builds one (with its barriers) must not depend on when another created the folder
        raise ValueError(f"save_checkpoint: {directory!r} already holds step {step}; pass another step, or remove "
                         f"{os.path.join(directory, str(step))!r} first.")
    leaves = to_host(state)  # params first, in tree order
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    bad = next((n for n, a in zip(names, leaves) if not finite([a])), None)
    if bad is not None:
        raise ValueError(f"save_checkpoint: params{bad} is not finite (a diverged step), so step {step} is not "
                         "saved and the last good checkpoint stays the newest; save an earlier state.")
    params = jax.tree.leaves(state.params)
    meta = {"format": FORMAT, "model": None, "optimizer": state_kind(state.opt_state),
            "param_count": int(sum(np.size(a) for a in params)), "leaves": leaf_specs(state), "config": {},
            "n_head": None, "decay_steps": None, "step": int(step), "data": data, "processes": jax.process_count(),
            "crc32": checksums(leaves)}
    try:
        json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"save_checkpoint: data={data!r:.80} is not JSON ({e}); pass dicts, lists, strings, numbers "
                        "and None (numpy scalars as int() or float()).") from None
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
    lock = _take_lock(directory, "save_checkpoint:", "stop that run, or pass another directory")
    try:
        manager = _manager(directory, keep=keep)
        try:
            if not manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave({"leaves": leaves}),
                                                                   meta=ocp.args.JsonSave(meta))):
                raise ValueError(f"save_checkpoint: {directory!r} holds a newer step, {manager.latest_step()}, and "
                                 f"checkpoints go in increasing steps (orbax wrote nothing for step {step}); pass a "
                                 "step above it, or another directory.")
            manager.wait_until_finished()
        finally:
            manager.close()
    finally:
        lock.release()
    return int(step)


def restore_checkpoint(directory: str, template: TrainState, *, step: int | None = None) -> tuple[TrainState, Any]:
    """(state, data) of checkpoint `step` in `directory` (default: the newest readable one; a damaged newer one is
    named on stderr and skipped), shaped like `template` (e.g. `jaxpar.init_state(model, tx)`): leaf for leaf the
    same paths, shapes and dtypes, or a ValueError names the first that differs. Then `strategy.init(state)`."""
    if not isinstance(template, TrainState):
        raise TypeError(f"restore_checkpoint: template is a {type(template).__name__}, not a jaxpar.TrainState; "
                        "pass jaxpar.init_state(model, tx) for the model and optimizer that were saved.")
    steps = all_steps(directory)
    if not steps:
        raise ValueError(f"restore_checkpoint: {directory!r} holds no complete checkpoint; pass the directory "
                         "save_checkpoint (or train.py's --checkpoint-dir) wrote.")
    if step is not None:
        if step not in steps:
            raise ValueError(f"restore_checkpoint: {directory!r} has no complete step {step!r} (it has "
                             f"{sorted(steps)}); pass one of those, or leave step out for the newest.")
        steps = [step]
    now = leaf_specs(template)
    for s in steps:  # the newest whose metadata reads decides what the leaves must be
        try:
            saved = read_meta(directory, s)["leaves"]
            break
        except ValueError:
            continue
    else:
        saved = now  # no metadata readable: _restore_newest names the damage below
    if saved != now:
        diff = first_gap(saved, now)
        raise ValueError(f"restore_checkpoint: {directory!r} holds {diff} = {saved.get(diff, 'absent')} (shape, "
                         f"dtype), but the template has {now.get(diff, 'absent')}; build the template from the model "
                         "and optimizer that were saved.")
    found, damaged = _restore_newest(directory, steps, now, template, "restoring")
    if found is None:
        raise ValueError(f"restore_checkpoint: every checkpoint in {directory!r} is damaged (step {damaged[0][0]}: "
                         f"{damaged[0][1]}); pass the directory of an intact run.")
    return found[1], found[2]["data"]


class StopSignals:
    """While active, SIGTERM and SIGINT only set a flag: the loop saves a checkpoint at the next step boundary and
    ends cleanly (exit status 0: the run stopped in a resumable state; launchers do not count it as a failure).
    A second signal gets the previous handler (SIGINT: KeyboardInterrupt; SIGTERM: the default, exit 143)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __enter__(self) -> "StopSignals":
        if self.enabled:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def agreed(self) -> str | None:
        """The signal's name when this or ANY process got one (all processes must stop at the same step: the
        save is collective); None to go on. One tiny all-gather per step with several processes."""
        if not self.enabled:
            return None
        got = self.received or 0
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            got = int(np.max(multihost_utils.process_allgather(np.int32(got))))
        return signal.Signals(got).name if got else None
