"""Record the originals' per-stage pipeline programs as tests/fixtures/schedule_programs.json.

    /work/venv/bin/python tests/make_schedule_fixture.py --deepspeed-git PATH/TO/DeepSpeed[/.git] [--rev HEAD]
    /work/venv/bin/python tests/make_schedule_fixture.py --deepspeed-file PATH/TO/schedule.py --deepspeed-commit SHA

Needs torch (2.13 when this was written; the version lands in the file) and DeepSpeed's
deepspeed/runtime/pipe/schedule.py, read from a DeepSpeed git directory at ``--rev`` or from a file. DeepSpeed itself is
not imported: that one file is pure Python, and it is executed standalone under stub parent packages that provide the
one name it imports (``deepspeed.runtime.utils.call_to_str``, copied below). The tests (test_schedule_originals.py)
read the JSON only.

What is recorded, for a grid of stages S, micro-batches M (M < S, M == S, M not a multiple of S) and chunks V:

  torch   the schedules of torch.distributed.pipelining with a twin in jaxpar, built by torch's own classes on fake
          stage objects (no process group: the constructors read only num_stages, group_size, group_rank,
          stage_index, submod).
          - ScheduleGPipe, Schedule1F1B, _ScheduleForwardOnly (single-stage schedules): their ``_step_microbatches``
            is run as is, the fake stage logging every call it gets -- get_fwd_recv_ops(i), forward_one_chunk(i),
            get_fwd_send_ops(i), get_bwd_recv_ops(i), backward_one_chunk(i), get_bwd_send_ops(i) -- as torch's
            action names RECV_F/F/SEND_F/RECV_B/B/SEND_B (a recv or send logged only where a real stage has a peer:
            no RECV_F on the first stage, ...). That is the order torch executes (their ``pipeline_order`` IR is
            only drawn; Schedule1F1B's IR starts the last rank at F1, see ``ir_differs``).
          - ScheduleInterleaved1F1B (V = 1, 2, 3), ScheduleInterleavedZeroBubble (ZB1P, V = 1 only: jaxpar's zbh1 is
            compared on its F and I order), ScheduleZBVZeroBubble (V = 2, style "v"): the ``pipeline_order`` their
            constructors compute for every rank (``_calculate_single_rank_operations``), idle slots (None) dropped,
            each action as torch writes it: "<stage_index><F|B|I|W><micro-batch>".
          A size torch refuses is recorded as ``{"refused": "<exception>: <message>"}``.
  deepspeed  TrainSchedule (1F1B) and InferenceSchedule (forward only): each stage's ``steps()`` as one string,
          steps joined by "|", a step's instructions by spaces (an empty step is ""), each instruction abbreviated
          (``names`` in the file: ForwardPass -> F, RecvGrad -> RG, ...) and followed by its micro-batch id. TrainSchedule is subclassed only to make
          ``_buffer_idx`` the identity, so every buffer instruction's argument is its micro-batch id (DeepSpeed
          passes ``_buffer_idx(micro_batch_id)`` / ``_buffer_idx(prev_micro_batch_id)``). InferenceSchedule's
          buffers alternate 0/1, so its micro-batch ids are put in from the step: ``micro_batch_id = step_id -
          self.stage_id`` (InferenceSchedule.steps), and SendActivation sends ``micro_batch_id - 1``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import types

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
OUT = os.path.join(FIXTURES, "schedule_programs.json")
DS_PATH = "deepspeed/runtime/pipe/schedule.py"


def micro_batch_counts(S: int) -> list[int]:
    """M < S, M == S, M not a multiple of S, and a few multiples; torch's interleaved refuses some of them."""
    if S == 8:
        return [1, 3, 7, 8, 9, 16, 17]
    return sorted({1, 2, 3, S - 1, S, S + 1, 2 * S - 1, 2 * S, 2 * S + 1, 3 * S, 4 * S + 2} - {0})


GRID = [(S, M) for S in (2, 3, 4, 8) for M in micro_batch_counts(S)]


# --------------------------------------------------------------------------------------------------------- torch
class FakeStage:
    """What torch's schedule classes read of a _PipelineStageBase, logging the calls of ``_step_microbatches``."""

    def __init__(self, rank: int, group_size: int, num_stages: int, stage_index: int):
        self.group_rank, self.group_size, self.num_stages = rank, group_size, num_stages
        self.stage_index = stage_index
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.log: list[str] = []

    def _comm(self, name: str, i: int, has_peer: bool) -> list:
        if has_peer:
            self.log.append(f"{name}{i}")
        return []  # no P2P ops: torch's _batch_p2p / _sorted_batch_p2p return at once on an empty list

    def get_fwd_recv_ops(self, i):
        return self._comm("RECV_F", i, not self.is_first)

    def get_fwd_send_ops(self, i):
        return self._comm("SEND_F", i, not self.is_last)

    def get_bwd_recv_ops(self, i):
        return self._comm("RECV_B", i, not self.is_last)

    def get_bwd_send_ops(self, i):
        return self._comm("SEND_B", i, not self.is_first)

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{i}")

    def backward_one_chunk(self, i, **kwargs):
        self.log.append(f"{self.stage_index}B{i}")

    def perform_reduce_grad(self, n):
        pass


def _refusal(e: Exception) -> dict:
    return {"refused": f"{type(e).__name__}: {e}"}


def torch_single(cls, S: int, M: int) -> dict:
    """A PipelineScheduleSingle's executed call order on every rank."""
    streams, ir_differs = [], False
    for rank in range(S):
        stage = FakeStage(rank, S, S, rank)
        try:
            sched = cls(stage, M)
        except Exception as e:  # noqa: BLE001 -- the refusal is the record
            return _refusal(e)
        sched._initialize_stage = lambda *a, **k: None  # shape inference needs real tensors; it computes nothing
        sched._step_microbatches()
        streams.append(" ".join(stage.log))
        if sched.pipeline_order is not None:
            ir = [str(a) for a in sched.pipeline_order[rank] if a is not None and "REDUCE" not in str(a)]
            ir_differs |= ir != [t for t in stage.log if t[0].isdigit()]
    out = {"streams": streams}
    if ir_differs:
        out["ir_differs"] = True
    return out


def torch_multi(cls, S: int, M: int, V: int, style: str = "loop") -> dict:
    """A _PipelineScheduleRuntime's pipeline_order on every rank, idle slots dropped."""
    def index(rank, chunk):
        return 2 * S - 1 - rank if style == "v" and chunk % 2 else chunk * S + rank

    stages = [FakeStage(0, S, S * V, index(0, c)) for c in range(V)]
    try:
        sched = cls(stages, M)
    except Exception as e:  # noqa: BLE001
        return _refusal(e)
    return {"programs": [" ".join(str(a) for a in sched.pipeline_order[r] if a is not None) for r in range(S)]}


def record_torch() -> dict:
    import torch
    import torch.distributed.pipelining.schedules as ts

    cases = []
    for S, M in GRID:
        for name, cls in (("ScheduleGPipe", ts.ScheduleGPipe), ("Schedule1F1B", ts.Schedule1F1B),
                          ("_ScheduleForwardOnly", ts._ScheduleForwardOnly)):
            cases.append({"schedule": name, "S": S, "M": M, "V": 1, **torch_single(cls, S, M)})
        for V in ((1, 2) if S == 8 else (1, 2, 3)):
            cases.append({"schedule": "ScheduleInterleaved1F1B", "S": S, "M": M, "V": V,
                          **torch_multi(ts.ScheduleInterleaved1F1B, S, M, V)})
        cases.append({"schedule": "ScheduleInterleavedZeroBubble", "S": S, "M": M, "V": 1,
                      **torch_multi(ts.ScheduleInterleavedZeroBubble, S, M, 1)})
        cases.append({"schedule": "ScheduleZBVZeroBubble", "S": S, "M": M, "V": 2,
                      **torch_multi(ts.ScheduleZBVZeroBubble, S, M, 2, style="v")})
    return {"version": torch.__version__, "file": "torch/distributed/pipelining/schedules.py", "cases": cases}


# ----------------------------------------------------------------------------------------------------- DeepSpeed
def call_to_str(base, *args, **kwargs):
    """deepspeed/runtime/utils.py's call_to_str, copied: the one name schedule.py imports."""
    name = f'{base}('
    if args:
        name += ', '.join(repr(arg) for arg in args)
        if kwargs:
            name += ', '
    if kwargs:
        name += ', '.join(f'{key}={repr(arg)}' for key, arg in kwargs.items())
    name += ')'
    return name


def load_deepspeed_schedule(source: str, filename: str) -> types.ModuleType:
    """Execute DeepSpeed's schedule.py as deepspeed.runtime.pipe.schedule under stub parent packages."""
    for pkg in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.pipe"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        sys.modules[pkg] = mod
    utils = types.ModuleType("deepspeed.runtime.utils")
    utils.call_to_str = call_to_str
    sys.modules["deepspeed.runtime.utils"] = utils
    mod = types.ModuleType("deepspeed.runtime.pipe.schedule")
    mod.__package__, mod.__file__ = "deepspeed.runtime.pipe", filename
    sys.modules[mod.__name__] = mod
    exec(compile(source, filename, "exec"), mod.__dict__)
    return mod


# DeepSpeed's instruction classes as the fixture writes them: "<abbreviation><micro-batch>", steps joined by "|"
DS_NAMES = {"LoadMicroBatch": "LOAD", "ForwardPass": "F", "BackwardPass": "B", "SendActivation": "SA",
            "RecvActivation": "RA", "SendGrad": "SG", "RecvGrad": "RG", "ReduceTiedGrads": "RTG",
            "ReduceGrads": "RDG", "OptimizerStep": "OPT"}


def _instr(ins, mb: int | None) -> str:
    """One instruction: its abbreviated class name, then its micro-batch (buffer instructions only)."""
    if not hasattr(ins, "buffer_id"):
        return DS_NAMES[ins.name]
    return f"{DS_NAMES[ins.name]}{ins.buffer_id if mb is None else mb}"


def record_deepspeed(ds: types.ModuleType) -> list[dict]:
    class TrainByMicroBatch(ds.TrainSchedule):
        def _buffer_idx(self, micro_batch_id):  # identity: each buffer instruction names its micro-batch
            assert self._valid_micro_batch(micro_batch_id)
            return micro_batch_id

    cases = []
    for S, M in GRID:
        steps = ["|".join(" ".join(_instr(i, None) for i in cmds) for cmds in TrainByMicroBatch(M, S, s).steps())
                 for s in range(S)]
        cases.append({"schedule": "TrainSchedule", "S": S, "M": M, "steps": steps})
        steps = []
        for s in range(S):
            row = []
            for step_id, cmds in enumerate(ds.InferenceSchedule(M, S, s).steps()):
                m = step_id - s  # InferenceSchedule.steps: micro_batch_id = step_id - self.stage_id
                row.append(" ".join(_instr(i, m - 1 if i.name == "SendActivation" else m) for i in cmds))
            steps.append("|".join(row))
        cases.append({"schedule": "InferenceSchedule", "S": S, "M": M, "steps": steps})
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-git", help="a DeepSpeed git directory (a checkout or a bare mirror)")
    ap.add_argument("--rev", default="HEAD", help="the revision of --deepspeed-git to read (default HEAD)")
    ap.add_argument("--deepspeed-file", help="deepspeed/runtime/pipe/schedule.py as a file")
    ap.add_argument("--deepspeed-commit", help="the commit --deepspeed-file comes from (recorded)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if args.deepspeed_git:
        git = ["git", "-C", args.deepspeed_git]
        commit = subprocess.check_output(git + ["rev-parse", f"{args.rev}^{{commit}}"], text=True).strip()
        source = subprocess.check_output(git + ["show", f"{commit}:{DS_PATH}"], text=True)
        version = subprocess.check_output(git + ["show", f"{commit}:version.txt"], text=True).strip()
        changed = subprocess.check_output(git + ["log", "-1", "--format=%H", commit, "--", DS_PATH], text=True).strip()
    elif args.deepspeed_file:
        if not args.deepspeed_commit:
            ap.error("--deepspeed-file needs --deepspeed-commit (it is recorded in the fixture)")
        commit, source = args.deepspeed_commit, open(args.deepspeed_file).read()
        version = changed = None
    else:
        ap.error("pass --deepspeed-git DIR or --deepspeed-file FILE --deepspeed-commit SHA")
    ds = load_deepspeed_schedule(source, DS_PATH)
    data = {
        "about": "per-stage pipeline programs as torch.distributed.pipelining and DeepSpeed build them; written by "
                 "tests/make_schedule_fixture.py, read by tests/test_schedule_originals.py",
        "grid": [[S, M] for S, M in GRID],
        "torch": record_torch(),
        "deepspeed": {"repository": "github.com/deepspeedai/DeepSpeed", "commit": commit, "version.txt": version,
                      "file_last_changed_in": changed, "file": DS_PATH,
                      "sha256": hashlib.sha256(source.encode()).hexdigest(), "names": DS_NAMES, "cases": record_deepspeed(ds)},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:  # one case per line: diffs stay readable
        f.write("{\n")
        items = list(data.items())
        for k, (key, val) in enumerate(items):
            sep = "," if k < len(items) - 1 else ""
            if isinstance(val, dict) and "cases" in val:
                head = {kk: vv for kk, vv in val.items() if kk != "cases"}
                f.write(f"{json.dumps(key)}: {json.dumps(head)[:-1]}, \"cases\": [\n")
                f.write(",\n".join(json.dumps(c) for c in val["cases"]))
                f.write(f"\n]}}{sep}\n")
            else:
                f.write(f"{json.dumps(key)}: {json.dumps(val)}{sep}\n")
        f.write("}\n")
    json.load(open(args.out))  # well-formed
    n = sum(len(v["cases"]) for v in (data["torch"], data["deepspeed"]))
    print(f"wrote {args.out}: {n} cases, {os.path.getsize(args.out) / 1024:.0f} kB (torch {data['torch']['version']}, "
          f"DeepSpeed {commit[:12]})")


if __name__ == "__main__":
    main()
