"""torchrun for jaxpar: start K processes per node with the rendezvous environment; they live and die together.

    python -m jaxpar.launch --nproc-per-node 2 train.py --cpu-devices 2 --strategy ddp
    python -m jaxpar.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
        --nproc-per-node 4 train.py --strategy ddp            # and --node-rank 1 on the second machine

Each process gets MASTER_ADDR, MASTER_PORT, WORLD_SIZE = nnodes * nproc_per_node, RANK = node_rank *
nproc_per_node + local_rank, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= NODE_RANK) and RESTART_COUNT, which
jaxpar.run.distributed.initialize() reads, and torchrun's other names for a script written for it (ROLE_RANK,
ROLE_WORLD_SIZE, GROUP_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID;
not torchrun's OMP_NUM_THREADS=1, which XLA:CPU does not read). Every output line is prefixed with `[rank r]`.
When a process fails, the others get SIGTERM, then SIGKILL after --term-timeout seconds, and the launcher exits with the failing
status (128 + signal for a killed one) within seconds: a rank stuck in a collective never hangs the job.
With --max-restarts R the whole group is restarted up to R times; a restart appends --resume (train.py continues from
its last checkpoint) only when the script's --checkpoint-dir got a newer checkpoint during this launch, so a folder
that held an earlier run's checkpoints is never continued unasked. Exit status 2 (a usage error: argparse's, or
train.py's one-line refusals) is not restarted, since every attempt would repeat it; the others get USAGE_GRACE_S
to leave by themselves first (every rank refuses, and train.py's ranks leave together). SIGINT / SIGTERM to the launcher
stop every process the same way (a second one SIGKILLs them at once); on Linux the processes are also killed
(SIGKILL) when the launcher dies, even of SIGKILL: no checkpoint is saved then (JAX's runtime catches SIGTERM, and a
rank waiting in a collective for a dead peer never sees it).
A script that is not a file (with -m, a module whose top-level package is not on the path) and a --master-port
already in use on this node are refused in one line before any process starts; a --master-addr that does not
resolve, or on --node-rank 0 is not this machine's, is warned about. A rank that JAX aborts because not every
process joined in time (its C++ fatal log, DEADLINE_EXCEEDED on RegisterTask) gets one line at the end that says
which nodes to start (or what is wrong with --master-addr). When several ranks fail, the first to end is named.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Sequence


def parser() -> argparse.ArgumentParser:
    """torchrun's options, under its dashed names and (as torchrun takes them too) its underscored ones."""
    from jaxpar.cli import OneLineParser  # one-line usage errors, as train.py's

    p = OneLineParser(prog="python -m jaxpar.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the run (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0,
                   help="this node's index in [0, nnodes) (default 0)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="coordinator port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the group this many times on failure")
    p.add_argument("--term-timeout", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script", help="the training script (or module with -m), e.g. train.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def check(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node} and --nnodes {args.nnodes} must be >= 1.")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes}).")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts} must be >= 0.")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ValueError(f"--master-port {args.master_port} must be a TCP port in 1..65535; pick one, or leave it out "
                         "on one node (a free one is chosen).")
    if not args.term_timeout >= 0:
        raise ValueError(f"--term-timeout {args.term_timeout} must be >= 0 (seconds between SIGTERM and SIGKILL).")
    if args.module and not _top_level_module_found(args.script):
        raise ValueError(f"the module {args.script!r} is not found (from {os.getcwd()}): no "
                         f"{args.script.split('.')[0]!r} on the path; give the module's dotted name as python -m "
                         "takes it (run from the folder that holds it, or add it to PYTHONPATH), or a script's path "
                         "without -m.")
    if not args.module and not os.path.isfile(args.script):
        raise ValueError(f"the script {args.script!r} is not a file (from {os.getcwd()}); give the training script's "
                         "path, e.g. train.py, or a module with -m (python -m jaxpar.launch -m pkg.train).")


def _top_level_module_found(name: str) -> bool:
    """Whether python -m `name`, started here, finds its top-level package or module (`name`'s first part; found
    without importing anything, so a missing submodule of a package that is there is left to the rank to report)."""
    import importlib.machinery
    import importlib.util

    top = name.split(".")[0]
    if not top:
        return False  # python -m refuses a relative name
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):
        return False
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None  # the rank's sys.path[0]


def is_local(addr: str) -> bool:
    """Whether `addr` names this machine (a socket can bind to it)."""
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def check_port(args: argparse.Namespace) -> None:
    """Refuse a --master-port that something on this node already listens on, when the coordinator runs here."""
    if args.nnodes > 1 and not (args.node_rank == 0 and is_local(args.master_addr)):
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the coordinator
        try:
            s.bind(("", args.master_port))
        except OSError:
            fix = ("leave --master-port out (a free one is chosen)" if args.nnodes == 1 else
                   "pass the same one to every node")
            raise ValueError(f"--master-port {args.master_port} is in use on {args.master_addr}; pick another port "
                             f"or {fix}.") from None


def free_port() -> int:
    """A TCP port nobody listens on right now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_env(args: argparse.Namespace, local_rank: int, restart: int) -> dict[str, str]:
    """The environment of local process `local_rank` (torchrun's variable names)."""
    k = args.nproc_per_node
    return {"MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
            "WORLD_SIZE": str(args.nnodes * k), "RANK": str(args.node_rank * k + local_rank),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(k), "GROUP_RANK": str(args.node_rank),
            "NODE_RANK": str(args.node_rank), "RESTART_COUNT": str(restart), "PYTHONUNBUFFERED": "1",
            # torchrun's own names beside (a script written for torchrun reads these)
            "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
            "TORCHELASTIC_RUN_ID": "none", "ROLE_RANK": str(args.node_rank * k + local_rank),
            "ROLE_WORLD_SIZE": str(args.nnodes * k), "GROUP_WORLD_SIZE": str(args.nnodes)}


def checkpoint_dir(script_args: Sequence[str]) -> str | None:
    """The value of the script's --checkpoint-dir flag, if it has one."""
    for i, a in enumerate(script_args):
        if a == "--checkpoint-dir" and i + 1 < len(script_args):
            return script_args[i + 1]
        if a.startswith("--checkpoint-dir="):
            return a.split("=", 1)[1]
    return None


def newest_checkpoint(script_args: Sequence[str]) -> int | None:
    """The step of the newest complete checkpoint in the run's --checkpoint-dir (None: no flag, or none there)."""
    directory = checkpoint_dir(script_args)
    if directory is None:
        return None
    from jaxpar.run.checkpoint import latest_step

    return latest_step(directory)


def can_resume(script_args: Sequence[str], at_start: int | None = None) -> bool:
    """Whether the run's --checkpoint-dir holds a complete checkpoint newer than `at_start` (the newest when this
    launch started): one this launch wrote, not an earlier run's."""
    newest = newest_checkpoint(script_args)
    return newest is not None and newest != at_start


def command(args: argparse.Namespace, restart: int, at_start: int | None = None) -> list[str]:
    """A restart resumes from the last complete checkpoint this launch wrote (`at_start`: the newest step when it
    started), or starts over when it wrote none; --resume passed by the user is kept as is."""
    script_args = list(args.script_args)
    if restart and "--resume" not in script_args and can_resume(script_args, at_start):
        script_args.append("--resume")
    head = [sys.executable, "-u", "-m", args.script] if args.module else [sys.executable, "-u", args.script]
    return head + script_args


def _parent_death_signal():
    """A preexec_fn that has the child killed when the launcher dies, even of SIGKILL (Linux's PR_SET_PDEATHSIG);
    None elsewhere. SIGKILL, not SIGTERM: JAX's distributed runtime catches SIGTERM (a preemption notice) and goes
    on, and a rank blocked in a collective whose peer is gone would never reach a handler of ours (a QA run saw the
    ranks of a SIGKILLed launcher alive 171 s later). The signal follows the THREAD that starts the child, not the
    process: run() starts every child from the main thread (it must be there for its signal handlers), which ends
    with the launcher."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, sigkill = os.getpid(), int(signal.SIGKILL)

    def set_signal():  # in the child, between fork and exec
        prctl(1, sigkill, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl: no signal would come
            os._exit(128 + signal.SIGKILL)

    return set_signal


# JAX's fatal log when a process gives up waiting for the others at jax.distributed.initialize (C++ aborts the
# process, so jaxpar.run.distributed cannot turn it into a Python error): both markers, on two lines
JOIN_TIMED_OUT = (b"DEADLINE_EXCEEDED", b"CoordinationService/RegisterTask")


def _relay(stream, out, prefix: bytes, lock: threading.Lock, seen: set[bytes]) -> None:
    """Copy `stream` to `out` line by line, each line prefixed (the rank); `seen` collects the JOIN_TIMED_OUT
    markers met."""
    for line in iter(stream.readline, b""):
        seen.update(m for m in JOIN_TIMED_OUT if m in line)
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


DUPLICATE_SIGNAL_S = 0.25  # a stop signal this soon after the first is the same request, not a second Ctrl-C
USAGE_GRACE_S = 2.0  # after a usage error, how long the others get to leave too (they left a barrier together)


class Group:
    """The local processes of one attempt: started together (`start`), stopped together (`stop`, also after a
    start that a Ctrl-C cut short: whatever had started)."""

    def __init__(self, args: argparse.Namespace, restart: int, at_start: int | None = None):
        self.args, self.restart, self.at_start = args, restart, at_start
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[str] = []  # each process's global rank
        self.failure: str | None = None  # "rank R (pid P) was killed by SIGKILL" / "... exited with status C"
        self.threads: list[threading.Thread] = []
        self.seen: list[set[bytes]] = [set() for _ in range(args.nproc_per_node)]  # per local rank, JOIN_TIMED_OUT's
        self.exited_at: dict[int, float] = {}  # local index -> when its process ended (a waiter thread's clock)

    def start(self, stop=lambda: False) -> "Group":
        """Start every local process and its output relays; `stop()` true (a Ctrl-C came): start no more."""
        args, lock = self.args, threading.Lock()
        cmd, on_start = command(args, self.restart, self.at_start), _parent_death_signal()
        prefixes = []
        for local_rank in range(args.nproc_per_node):  # every child forked before its relays start: no relay
            # thread holds an output lock while a preexec_fn runs (which only calls prctl and getppid)
            env = {**os.environ, **rank_env(args, local_rank, self.restart)}
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               preexec_fn=on_start, start_new_session=True))  # its own group
            prefixes.append(f"[rank {env['RANK']}] ".encode())
            self.ranks.append(env["RANK"])
            if stop():
                break
        for i, (proc, prefix, seen) in enumerate(zip(self.procs, prefixes, self.seen)):
            for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_relay, args=(stream, out, prefix, lock, seen), daemon=True)
                t.start()
                self.threads.append(t)
            threading.Thread(target=self._note_exit, args=(i, proc), daemon=True).start()
        return self

    def _note_exit(self, i: int, proc: subprocess.Popen) -> None:
        """When process `i` ends, to the millisecond: its peers fail a moment after it (a collective's closed
        socket), usually within one poll of wait(), which must still name the first, not the lowest rank."""
        proc.wait()
        self.exited_at[i] = time.monotonic()

    def wait(self, poll_s: float = 0.1, stop=lambda: False) -> int | None:
        """0 when every process exits 0; else the first failure's status, the others stopped; None once `stop()`
        (a Ctrl-C or SIGTERM to the launcher)."""
        while True:
            if stop():
                return None
            codes = [p.poll() for p in self.procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            # the first to end is the cause: a SIGKILLed rank 1 was reported as rank 0's status 1 (rank 0's
            # gloo error when it read its loss, within the same 0.1 s poll), the lowest failed rank (a QA finding)
            failed.sort(key=lambda i: self.exited_at.get(i, float("inf")))
            if failed:
                i, code = failed[0], codes[failed[0]]
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                    else f"exited with status {_status(code)}"
                self.failure = f"rank {self.ranks[i]} (pid {self.procs[i].pid}) {how}"
                if _status(code) == 2:  # a usage error: the others refuse too and leave together (cli._leave)
                    deadline = time.monotonic() + USAGE_GRACE_S
                    while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline and not stop():
                        time.sleep(poll_s)
                return _status(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)

    def stop(self, timeout_s: float, hurry=lambda: False) -> None:
        """SIGTERM every live process (group), SIGKILL what is left after `timeout_s` (or as soon as `hurry()`:
        a second Ctrl-C), then reap them."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline and not hurry():
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for t in self.threads:
            t.join(timeout=1.0)

    def join_timed_out(self) -> bool:
        """Whether a process was aborted by JAX for waiting too long for the others to join (after stop())."""
        return any(seen == set(JOIN_TIMED_OUT) for seen in self.seen)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as a shell reports it


def unresolved(addr: str) -> str | None:
    """Why `addr` does not resolve to an address now (getaddrinfo's error), or None when it does."""
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def address_warnings(args: argparse.Namespace) -> list[str]:
    """Warnings about --master-addr before the ranks start: both mistakes make every rank wait out
    JAXPAR_JOIN_TIMEOUT (300 s by default). Not refusals: a cluster's host name may resolve later, and node 0 may
    reach itself through an address it does not hold (a NAT's)."""
    problem = unresolved(args.master_addr)
    if problem:
        return [f"jaxpar.launch: warning: --master-addr {args.master_addr!r} does not resolve now ({problem}); the "
                "ranks keep trying until JAXPAR_JOIN_TIMEOUT, then abort: check the name (node 0's address)."]
    if args.node_rank == 0 and args.nnodes > 1 and not is_local(args.master_addr):
        return [f"jaxpar.launch: warning: this is --node-rank 0, which runs the coordinator, but --master-addr "
                f"{args.master_addr!r} is not an address of this machine; the ranks connect to it and wait until "
                "JAXPAR_JOIN_TIMEOUT: pass this machine's address on every node, or run --node-rank 0 on "
                f"{args.master_addr}."]
    return []


def join_timeout_message(args: argparse.Namespace) -> str:
    """The one line for a group JAX aborted because not every process joined in time."""
    from jaxpar.run.distributed import JOIN_TIMEOUT

    timeout = os.environ.get("JAXPAR_JOIN_TIMEOUT") or JOIN_TIMEOUT
    world = args.nnodes * args.nproc_per_node
    problem = unresolved(args.master_addr)
    if problem:  # no node could reach the coordinator: starting the others would not have helped
        return (f"jaxpar.launch: not every one of the {world} processes joined at {args.master_addr}:"
                f"{args.master_port} within {timeout} s (JAXPAR_JOIN_TIMEOUT): --master-addr {args.master_addr!r} "
                f"does not resolve ({problem}); pass node 0's name or IP address, one that every node resolves.")
    if args.node_rank == 0 and args.nnodes > 1 and not is_local(args.master_addr):
        return (f"jaxpar.launch: not every one of the {world} processes joined at {args.master_addr}:"
                f"{args.master_port} within {timeout} s (JAXPAR_JOIN_TIMEOUT): this --node-rank 0 runs the "
                f"coordinator, but --master-addr {args.master_addr!r} is not an address of this machine; pass this "
                f"machine's address on every node, or run --node-rank 0 on {args.master_addr}.")
    return (f"jaxpar.launch: not every one of the {world} processes joined at {args.master_addr}:{args.master_port} "
            f"within {timeout} s (JAXPAR_JOIN_TIMEOUT), so JAX aborted this node's; start every node (--nnodes "
            f"{args.nnodes}, each --node-rank once) with the same --master-addr and --master-port, or raise "
            "JAXPAR_JOIN_TIMEOUT.")


def run(args: argparse.Namespace) -> int:
    """Run the group, restarting it up to --max-restarts times; the exit status of the last attempt."""
    check(args)
    if args.master_port is None:
        args.master_port = free_port() if args.nnodes == 1 else 29500
    check_port(args)
    for line in address_warnings(args):
        print(line, file=sys.stderr, flush=True)
    if checkpoint_dir(args.script_args) is not None:  # orbax reads it through JAX, whose backend starts here
        import jax

        jax.config.update("jax_platforms", "cpu")  # the launcher's own: never the GPUs its ranks are to use
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)  # each child execs at once
    at_start = newest_checkpoint(args.script_args)  # an earlier run's, which a restart must not resume
    stopping: list[int] = []
    first_at: list[float] = []

    def on_signal(sig, frame):
        now = time.monotonic()
        if stopping and now - first_at[0] < DUPLICATE_SIGNAL_S:
            return  # the same stop request delivered twice (coreutils' timeout signals the launcher and its group)
        first_at[:] = first_at or [now]
        # only noted: the loops below look at it every 0.1 s. Raising from here (a KeyboardInterrupt, as before)
        # could land in an at-fork hook of a starting rank, where Python prints and drops it: the launcher then
        # restarted on and ignored every later signal (a QA finding), or it escaped with a traceback
        stopping.append(sig)
        if len(stopping) == 2:  # a second Ctrl-C while the processes stop: SIGKILL now (stop() sees it)
            print("jaxpar.launch: a second signal: killing every process now", file=sys.stderr, flush=True)

    asked, hurry = (lambda: bool(stopping)), (lambda: len(stopping) > 1)  # noqa: E731
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for restart in range(args.max_restarts + 1):
            if asked():  # e.g. while the last attempt stopped
                return 128 + stopping[0]
            group = Group(args, restart, at_start)
            group.start(asked)
            code = group.wait(stop=asked)
            group.stop(args.term_timeout, hurry)
            if asked():  # the first Ctrl-C (or SIGTERM), wherever it came: the processes stopped, none restarted
                return 128 + stopping[0]
            if code == 0:
                return 0
            if code == 2:
                print("jaxpar.launch: a process failed with status 2, a usage error that every restart would repeat; "
                      "stopped all, not restarting", file=sys.stderr, flush=True)
                return 2
            left = args.max_restarts - restart
            print(f"jaxpar.launch: {group.failure or f'a process failed with status {code}'}; "
                  + (f"restarting all {args.nproc_per_node} ({left} restarts left)" if left else "stopped all"),
                  file=sys.stderr, flush=True)
            if group.join_timed_out():
                print(join_timeout_message(args), file=sys.stderr, flush=True)
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"jaxpar.launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
