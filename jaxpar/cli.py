"""Train a model with one of jaxpar's parallel strategies.

    python train.py --cpu-devices 8 --strategy ddp --epochs 1                 # 8 simulated CPU devices
    python train.py --strategy single --model convnet --dataset mnist --data-dir ../shared/data/mnist \
        --train-split 'test[:8000]' --eval-split 'test[8000:]' --epochs 2 --batch-size 64 --optimizer adadelta --lr 1.0
    python train.py --cpu-devices 8 --strategy dp --model linear --batch-size 30 --print-shapes --steps 4
    python train.py --cpu-devices 4 --strategy pipeline --num-stages 2 --micro-batches 8 --schedule 1f1b
    python -m jaxpar.launch --nproc-per-node 2 train.py --cpu-devices 2 --strategy ddp    # 2 processes

Every flag maps to a field of jaxpar.Config (jaxpar/config.py says what each means). A user error prints one
line naming the value, the rule and the fix, and exits with status 2 before anything is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxpar.config import Config


def _shown(default) -> str:
    """A default as --help prints it: strings with whitespace (the sample prompt's newline) quoted."""
    return repr(default) if isinstance(default, str) and (not default or default != default.strip()) else str(default)


NEGATED = {"shuffle": "--no-shuffle", "overlap": "--no-overlap",  # booleans that default to on
            "parallel_output": "--no-parallel-output"}


def _field_help() -> dict[str, str]:
    """Each Config field's trailing comment in jaxpar/config.py: the one place a flag's meaning is written."""
    import inspect
    import re

    from jaxpar import config

    return dict(re.findall(r"^\s+(\w+): [^=]+=[^#\n]+#\s*(.+)$", inspect.getsource(config), re.M))


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, as every other refusal here (argparse prints its whole usage block
    first: 47 lines for train.py, once per rank under the launcher), naming the closest flag to an unknown one and
    --help; exit status 2, as argparse's."""

    def error(self, message: str):
        import difflib

        fix = f"{self.prog} --help lists every flag"
        unknown = message.split("unrecognized arguments: ", 1)[1].split() if "unrecognized arguments: " in message \
            else []
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        close = [c for u in unknown if u.startswith("--")
                 for c in difflib.get_close_matches(u.split("=", 1)[0], flags, n=1, cutoff=0.75)]
        if close:
            fix = f"did you mean {close[0]}? ({fix})"
        self.exit(2, f"{self.prog}: error: {message}; {fix}.\n")


def parser() -> argparse.ArgumentParser:
    prog = "jaxpar-train" if os.path.basename(sys.argv[0]) == "jaxpar-train" else "train.py"  # the console script
    p = OneLineParser(prog=prog, description="jaxpar: parallel training strategies in JAX.", allow_abbrev=False)
    defaults, helps = Config(), _field_help()
    for f in dataclasses.fields(Config):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name in NEGATED:
            p.add_argument(NEGATED[f.name], dest=f.name, action="store_false", help=f"turn off: {helps.get(f.name, f.name)}")
        elif isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=helps.get(f.name))
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0].split("|")[0].strip(), str)
            p.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=f"{helps.get(f.name, '')} (default: {_shown(default)})")
    return p


def parse(argv=None) -> Config:
    """argv -> Config (argparse exits with status 2 on malformed flags)."""
    return Config(**vars(parser().parse_args(argv)))


def main(argv=None) -> dict:
    """Parse, set up devices, train; returns the run summary. User errors exit with status 2."""
    from jaxpar.run.hostmem import tune_host_allocator

    tune_host_allocator()  # the CPU fast path, before JAX allocates anything: see jaxpar/run/hostmem.py
    cfg = parse(argv)
    from jaxpar.run import devices  # importing JAX does not start its backend yet
    from jaxpar.run import trainer  # importing JAX does not start its backend yet

    try:
        trainer.validate(cfg)  # the flags alone, before joining a group that a refusal here would leave waiting
        devices.setup(cfg)  # simulated CPU devices and jax.distributed, before JAX's backend starts
        return trainer.run(cfg)
    except ValueError as e:  # user errors: one line, exit status 2 (as argparse does)
        print(f"train.py: error: {e}", file=sys.stderr)
        _leave(2)
    except trainer.Diverged as e:  # the loss went NaN: the last good checkpoint is kept
        print(f"train.py: stopped: {e}", file=sys.stderr)
        _leave(1)
    except BaseException as e:  # any other failure: its traceback, then out (see _leave)
        if isinstance(e, SystemExit) or not _joined():
            raise
        import traceback

        traceback.print_exc()
        _leave(1)


def _joined() -> bool:
    """Whether this process joined a jax.distributed group (python -m jaxpar.launch)."""
    import jax

    return jax.distributed.is_initialized()


USAGE_WAIT_S = 5.0  # how long a refusing process waits for its peers to refuse too before it leaves


def _leave(code: int) -> None:
    """Exit with `code`. A process in a jax.distributed group leaves at once (os._exit, output flushed): a normal
    exit runs JAX's shutdown barrier, where a rank that failed alone waited 300 s for the others, which wait in the
    step's collectives for it, before both aborted and the launcher blamed the wrong rank (a QA finding). The
    launcher sees this exit status and stops the others within seconds.

    A usage error (status 2) after joining is the same on every process (they run one command on the same data), so
    the processes first meet at a barrier (up to USAGE_WAIT_S) and process 0, whose coordination service the others
    poll, leaves last: when it left first, the peers still on their way to the same refusal died in JAX's C++
    ("the JAX distributed service detected fatal errors") with a stack trace around the one line (QA 50)."""
    if _joined():
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 2:
            _leave_together()
        os._exit(code)
    raise SystemExit(code) from None


def _leave_together() -> None:
    import time

    import jax

    from jaxpar.run.distributed import _barrier

    try:
        _barrier("jaxpar_usage_error", USAGE_WAIT_S)
    except Exception:  # a refusal of this process alone: the others are elsewhere, leave now
        return
    if jax.process_index() == 0:
        time.sleep(0.5)  # the peers' os._exit first, while the service they poll still runs


if __name__ == "__main__":
    main()
