"""torchrun for jaxpar: start K processes per node with the rendezvous environment; they live and die together.

    python -m jaxpar.launch --nproc-per-node 2 train.py --cpu-devices 2 --strategy ddp
    python -m jaxpar.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
        --nproc-per-node 4 train.py --strategy ddp            # and --node-rank 1 on the second machine

Each process gets MASTER_ADDR, MASTER_PORT, WORLD_SIZE = nnodes * nproc_per_node, RANK = node_rank *
nproc_per_node + local_rank, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= NODE_RANK) and RESTART_COUNT, which
jaxpar.run.distributed.initialize() reads. Every output line is prefixed with `[rank r]`. When a process fails,
the others get SIGTERM, then SIGKILL after --term-timeout seconds, and the launcher exits with the failing
status (128 + signal for a killed one) within seconds: a rank stuck in a collective never hangs the job.
With --max-restarts R the whole group is restarted (with --resume appended once a checkpoint exists, so train.py continues from its
last checkpoint) up to R times. SIGINT / SIGTERM to the launcher stop every process the same way.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpar.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the run (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes) (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="coordinator port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the group this many times on failure")
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
            "NODE_RANK": str(args.node_rank), "RESTART_COUNT": str(restart), "PYTHONUNBUFFERED": "1"}


def checkpoint_dir(script_args: Sequence[str]) -> str | None:
    """The value of the script's --checkpoint-dir flag, if it has one."""
    for i, a in enumerate(script_args):
        if a == "--checkpoint-dir" and i + 1 < len(script_args):
            return script_args[i + 1]
        if a.startswith("--checkpoint-dir="):
            return a.split("=", 1)[1]
    return None


def can_resume(script_args: Sequence[str]) -> bool:
    """Whether the run's --checkpoint-dir holds a complete checkpoint to resume from."""
    directory = checkpoint_dir(script_args)
    if directory is None:
        return False
    from jaxpar.run.checkpoint import latest_step

    return latest_step(directory) is not None


def command(args: argparse.Namespace, restart: int) -> list[str]:
    """A restart resumes from the last complete checkpoint, or starts over when none was written yet."""
    script_args = list(args.script_args)
    if restart and "--resume" not in script_args and can_resume(script_args):
        script_args.append("--resume")
    head = [sys.executable, "-u", "-m", args.script] if args.module else [sys.executable, "-u", args.script]
    return head + script_args


def _relay(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    """Copy `stream` to `out` line by line, each line prefixed (the rank)."""
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


class Group:
    """The local processes of one attempt: started together, stopped together."""

    def __init__(self, args: argparse.Namespace, restart: int):
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        lock = threading.Lock()
        for local_rank in range(args.nproc_per_node):
            env = {**os.environ, **rank_env(args, local_rank, restart)}
            proc = subprocess.Popen(command(args, restart), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # its own process group: stopped as one
            prefix = f"[rank {env['RANK']}] ".encode()
            for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_relay, args=(stream, out, prefix, lock), daemon=True)
                t.start()
                self.threads.append(t)
            self.procs.append(proc)

    def wait(self, poll_s: float = 0.1) -> int:
        """0 when every process exits 0; else the first failure's status, the others stopped."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return _status(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every live process (group), SIGKILL what is left after `timeout_s`, then reap them."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for t in self.threads:
            t.join(timeout=1.0)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as a shell reports it


def run(args: argparse.Namespace) -> int:
    """Run the group, restarting it up to --max-restarts times; the exit status of the last attempt."""
    check(args)
    if args.master_port is None:
        args.master_port = free_port() if args.nnodes == 1 else 29500
    stopping: list[int] = []

    def on_signal(sig, frame):
        stopping.append(sig)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for restart in range(args.max_restarts + 1):
            group = Group(args, restart)
            try:
                code = group.wait()
            except KeyboardInterrupt:
                group.stop(args.term_timeout)
                return 128 + (stopping[0] if stopping else signal.SIGINT)
            group.stop(args.term_timeout)
            if code == 0:
                return 0
            left = args.max_restarts - restart
            print(f"jaxpar.launch: a process failed with status {code}; "
                  + (f"restarting all {args.nproc_per_node} ({left} restarts left)" if left else "stopped all"),
                  file=sys.stderr, flush=True)
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
