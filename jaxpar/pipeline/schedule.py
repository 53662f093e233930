"""Pipeline schedules as data: DeepSpeed's instruction vocabulary, torch.distributed.pipelining's compact actions.

Pure Python (no JAX), computed once outside jit. Each stage's PROGRAM -- its compute actions in order, as
DeepSpeed's ``TrainSchedule.steps()`` yields them -- runs through a unit-time clock that respects the data
dependencies; the clock yields the GRID ``grid[t][s]``: the compute action of stage s at tick t (None = bubble).
Roughly (``print(one_f_one_b(2, 3))``)::

    tick      0   1   2   3   4   5   6   7
    stage 0   F0  F1  .   B0  F2  B1  .   B2
    stage 1   .   F0  B0  F1  B1  F2  B2  .

Time model: every F and every B of one stage (chunk) takes one tick, a stage runs one compute action per tick,
and a value produced at tick t can be used at tick t+1 or later. Interleaved (Megatron) schedules: stage s holds
V model chunks; chunk c of stage s is the VIRTUAL stage v = c*S + s, so activations travel the ring
S-1 -> 0 between chunks. ``add_communication`` adds sends/receives, loads, the gradient reduction and the
optimizer step to per-tick instruction lists (``steps[t][s]``); ``validate`` checks numbered rules and dry-runs
those lists for deadlock; jaxpar.strategies.pipeline lowers ``table()`` into a scan over ticks.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections import Counter
from typing import NamedTuple, Sequence

from jaxpar.pipeline.render import grid_text, render  # noqa: F401  (text grid, PNG timeline)


class Op(enum.Enum):
    """Instruction kinds (DeepSpeed's names in comments); the value is the short letter(s) used in reprs."""
    LOAD = "L"            # LoadMicroBatch (inputs on the first virtual stage, labels on the last)
    F = "F"               # ForwardPass
    B = "B"               # BackwardPass
    SEND_ACT = "SA"       # SendActivation (to the next virtual stage)
    RECV_ACT = "RA"       # RecvActivation (from the previous virtual stage)
    SEND_GRAD = "SG"      # SendGrad (to the previous virtual stage)
    RECV_GRAD = "RG"      # RecvGrad (from the next virtual stage)
    REDUCE_GRADS = "RED"  # ReduceTiedGrads + ReduceGrads (data-parallel all-reduce)
    OPT = "OPT"           # OptimizerStep


IDLE, FORWARD, BACKWARD = 0, 1, 2  # op codes of table()
RULES = {
    1: "each (stage, micro-batch, chunk) has exactly one F and one B",
    2: "F runs before B of the same (stage, micro-batch, chunk)",
    3: "a virtual stage forwards a micro-batch strictly after the previous virtual stage forwarded it",
    4: "a virtual stage backwards a micro-batch strictly after the next virtual stage backwarded it",
    5: "at most one compute action per stage per tick, in that stage's row",
    6: "the per-stage programs with blocking receives run to completion (no deadlock, every send received)",
}
_ACTION_RE = re.compile(r"^(\d+)([A-Z]+)(\d*)(?:c(\d+))?$")


class Action(NamedTuple):
    """One instruction: ``Action(1, Op.F, 3)`` prints ``1F3`` (stage 1, forward, micro-batch 3).

    ``chunk`` is the model chunk (interleaved schedules) and prints as a suffix when non-zero: ``1F3c1``.
    REDUCE_GRADS / OPT have no micro-batch: ``1RED``, ``1OPT``.
    """
    stage: int
    op: Op
    microbatch: int | None = None
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.stage}{self.cell}"

    __str__ = __repr__

    @property
    def cell(self) -> str:
        """The repr without the stage, as printed in grids: ``F3``, ``B0c1``."""
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.op.value}{mb}" + (f"c{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of repr: ``Action.parse("1F3c1") == Action(1, Op.F, 3, 1)``."""
        m = _ACTION_RE.match(text.strip())
        if not m or m.group(2) not in {op.value for op in Op}:
            raise ValueError(f"{text=} is not an action; write stage, op letters {[op.value for op in Op]}, "
                             f"micro-batch[, c chunk], e.g. '1F3c1'")
        stage, letters, mb, chunk = m.groups()
        return cls(int(stage), Op(letters), int(mb) if mb else None, int(chunk or 0))


class ScheduleError(ValueError):
    """A schedule breaks rule ``rule`` (see RULES); the message carries the grid with the offending cells marked."""

    def __init__(self, rule: int, detail: str, grid: str = "", cells: Sequence[tuple[int, int]] = ()):
        self.rule, self.detail, self.cells = rule, detail, list(cells)
        super().__init__(f"rule {rule} ({RULES[rule]}) violated: {detail}" + (f"\n{grid}" if grid else ""))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a table of ticks x stages.

    ``grid[t][s]``: compute Action (F or B) of stage s at tick t, None for a bubble.
    ``steps[t][s]``: every instruction of stage s at tick t, in order (just the compute action until
    ``add_communication`` adds loads, sends, receives, the gradient reduction and the optimizer step).
    An edited grid: ``dataclasses.replace(schedule, grid=new_grid, steps=())`` re-derives ``steps``.
    """
    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    grid: tuple[tuple[Action | None, ...], ...]
    steps: tuple[tuple[tuple[Action, ...], ...], ...] = ()

    def __post_init__(self):
        if not self.steps:
            object.__setattr__(self, "steps", tuple(tuple((a,) if a else () for a in row) for row in self.grid))

    @property
    def num_ticks(self) -> int:
        return len(self.grid)

    def table(self, idle: tuple[int, int, int] = (IDLE, 0, 0)) -> list[list[tuple[int, int, int]]]:
        """``table()[t][s] = (op_code, microbatch, chunk)`` ints for the executor.

        op_code: 0 idle, 1 forward, 2 backward (IDLE, FORWARD, BACKWARD). Idle cells are ``idle``, (0, 0, 0) by
        default, so that gathers indexed by micro-batch / chunk stay in range; the op code masks them.
        """
        code = {Op.F: FORWARD, Op.B: BACKWARD}
        return [[idle if a is None else (code[a.op], a.microbatch, a.chunk) for a in row] for row in self.grid]

    def __str__(self) -> str:
        return grid_text(self)


def _virtual(a: Action, S: int) -> int:
    return a.chunk * S + a.stage


def _at(v: int, op: Op, mb: int | None, S: int) -> Action:
    """The action ``op`` of micro-batch ``mb`` on virtual stage v."""
    return Action(v % S, op, mb, v // S)


def _deps(a: Action, S: int, V: int) -> list[Action]:
    """Compute actions that must run at an earlier tick than ``a`` (rules 2-4)."""
    v = _virtual(a, S)
    if a.op is Op.F:
        return [_at(v - 1, Op.F, a.microbatch, S)] if v > 0 else []
    own = Action(a.stage, Op.F, a.microbatch, a.chunk)
    return [own, _at(v + 1, Op.B, a.microbatch, S)] if v < S * V - 1 else [own]


def _check_args(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    for label, x in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                     ("virtual_stages", virtual_stages)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{label}={x!r} must be an int >= 1; pass a positive count")


_COMPUTE = (Op.F, Op.B)


def _check_once(where: dict[Action, list], S: int, M: int, V: int, fail) -> None:
    """Rule 1 over ``where`` = {compute action: the places it occurs}; ``fail(rule, detail, places)`` raises."""
    for a, places in where.items():
        if len(places) > 1 or a.microbatch not in range(M) or a.chunk not in range(V):
            fail(1, f"{a!r} occurs {len(places)} times (micro-batches 0..{M - 1}, chunks 0..{V - 1})", places)
    for a in (Action(s, op, m, c) for s in range(S) for m in range(M) for c in range(V) for op in _COMPUTE):
        if a not in where:
            fail(1, f"{a!r} never runs", [])


def _check_programs(programs: Sequence[Sequence[Action]], M: int, V: int) -> None:
    """Rules 5 and 1 on the programs before clocking them (a missing action would read as a deadlock)."""
    def fail(rule: int, detail: str, places):
        text = "\n".join(f"stage {s}: " + " ".join(map(repr, p)) for s, p in enumerate(programs))
        raise ScheduleError(rule, detail, text)

    where: dict[Action, list] = {}
    for s, prog in enumerate(programs):
        for i, a in enumerate(prog):
            if a.stage != s or a.op not in _COMPUTE:
                fail(5, f"program of stage {s} holds {a!r}: programs hold F/B actions of their own stage", [])
            where.setdefault(a, []).append(i)
    _check_once(where, len(programs), M, V, fail)


def from_programs(programs: Sequence[Sequence[Action]], *, name: str = "custom",
                  num_microbatches: int | None = None, virtual_stages: int = 1) -> Schedule:
    """Clock per-stage compute programs into a grid: each tick, every stage runs its next action if all its
    dependencies ran at earlier ticks (as soon as possible), else idles. Raises ScheduleError rule 6 on deadlock."""
    S, V = len(programs), virtual_stages
    M = num_microbatches or 1 + max((a.microbatch or 0 for p in programs for a in p), default=0)
    _check_programs(programs, M, V)
    done: dict[Action, int] = {}
    pc, grid = [0] * S, []
    while any(pc[s] < len(programs[s]) for s in range(S)):
        t = len(grid)
        nxt = [programs[s][pc[s]] if pc[s] < len(programs[s]) else None for s in range(S)]
        row = tuple(a if a and all(done.get(d, t) < t for d in _deps(a, S, V)) else None for a in nxt)
        if not any(row):
            stuck = Schedule(name, S, M, V, tuple(grid) + (tuple(nxt),))
            waits = "; ".join(f"stage {a.stage} waits at {a!r} for {[d for d in _deps(a, S, V) if d not in done]}"
                              for a in nxt if a)
            raise ScheduleError(6, f"deadlock at tick {t} (marked: the action each stage is stuck at): {waits}",
                                grid_text(stuck, [(t, a.stage) for a in nxt if a]), [(t, a.stage) for a in nxt if a])
        for a in row:
            if a:
                done[a] = t
                pc[a.stage] += 1
        grid.append(row)
    return Schedule(name, S, M, V, tuple(grid))


def _f(s: int, m: int, c: int = 0) -> Action:
    return Action(s, Op.F, m, c)


def _b(s: int, m: int, c: int = 0) -> Action:
    return Action(s, Op.B, m, c)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage forwards all micro-batches, then backwards them (holds M activations)."""
    _check_args(num_stages, num_microbatches)
    M = num_microbatches
    return from_programs([[_f(s, m) for m in range(M)] + [_b(s, m) for m in range(M)] for s in range(num_stages)],
                         name="gpipe", num_microbatches=M)


def _one_f_one_b_program(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward / one backward, then the remaining backwards."""
    w = min(warmup, len(fwd))
    steady = [a for i in range(len(fwd) - w) for a in (fwd[w + i], bwd[i])]
    return fwd[:w] + steady + bwd[len(fwd) - w:]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (DeepSpeed TrainSchedule, PipeDream-flush): stage s warms up with S-s-1 forwards, then alternates
    1 forward / 1 backward, then cools down; holds at most S-s activations."""
    _check_args(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    return from_programs([_one_f_one_b_program([_f(s, m) for m in range(M)], [_b(s, m) for m in range(M)], S - s - 1)
                          for s in range(S)], name="1f1b", num_microbatches=M)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: V model chunks per stage; any M >= 1 (Megatron itself needs S | M).

    Micro-batches go in max(1, M // S) consecutive groups whose sizes differ by at most one (larger first), so
    every group holds >= S of them when M >= S (groups of exactly S when S divides M, as in Megatron). Forward
    order on every stage: for each group, for chunk 0..V-1, the group's micro-batches; backward order: the same
    with chunks V-1..0. Stage s warms up with 2*(S-s-1) + (V-1)*G forwards (G = the first group's size), then
    alternates 1F/1B. Ticks: 2*max(V*M + S-1, V*S + M-1) (the second when M < S: one micro-batch alone must
    cross all V*S virtual stages). ``virtual_stages=1`` returns ``one_f_one_b``.
    """
    _check_args(num_stages, num_microbatches, virtual_stages)
    S, M, V = num_stages, num_microbatches, virtual_stages
    if V == 1:
        return one_f_one_b(S, M)
    n = max(1, M // S)
    sizes = [M // n + (i < M % n) for i in range(n)]
    groups = [range(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(n)]
    programs = []
    for s in range(S):
        fwd = [_f(s, m, c) for grp in groups for c in range(V) for m in grp]
        bwd = [_b(s, m, c) for grp in groups for c in reversed(range(V)) for m in grp]
        programs.append(_one_f_one_b_program(fwd, bwd, 2 * (S - s - 1) + (V - 1) * sizes[0]))
    return from_programs(programs, name="interleaved", num_microbatches=M, virtual_stages=V)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def make(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b" or "interleaved" (the only one taking virtual_stages > 1)."""
    if name not in SCHEDULES:
        raise ValueError(f"{name=} is not a schedule; use one of {sorted(SCHEDULES)}")
    _check_args(num_stages, num_microbatches, virtual_stages)
    if name == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"{virtual_stages=} needs model chunks, which {name!r} does not have; "
                         f"use name='interleaved' or virtual_stages=1")
    return SCHEDULES[name](num_stages, num_microbatches)


def add_communication(schedule: Schedule) -> Schedule:
    """Per-tick instruction lists with communication, like DeepSpeed's ``steps()``.

    Roughly, on stage s at tick t with compute action F/B of micro-batch m on virtual stage v:
    ``[LOAD m if v is first or last (inputs / labels), RECV_ACT m if v > 0, F m, SEND_ACT m if v is not last]``;
    ``[RECV_GRAD m if v is not last, B m, SEND_GRAD m if v > 0]``; the last tick of every stage ends with
    ``REDUCE_GRADS, OPT``. Derived from the grid only, so applying it twice gives the same schedule.
    """
    S, V = schedule.num_stages, schedule.virtual_stages
    last = S * V - 1
    steps = []
    for t, row in enumerate(schedule.grid):
        out = []
        for s, a in enumerate(row):
            ins = []
            if a is not None:
                m, c, v = a.microbatch, a.chunk, _virtual(a, S)
                if a.op is Op.F:
                    ins += [Action(s, Op.LOAD, m, c)] if v in (0, last) else []
                    ins += [Action(s, Op.RECV_ACT, m, c)] if v > 0 else []
                    ins += [a] + ([Action(s, Op.SEND_ACT, m, c)] if v < last else [])
                else:
                    ins += ([Action(s, Op.RECV_GRAD, m, c)] if v < last else []) + [a]
                    ins += [Action(s, Op.SEND_GRAD, m, c)] if v > 0 else []
            if t == schedule.num_ticks - 1:
                ins += [Action(s, Op.REDUCE_GRADS), Action(s, Op.OPT)]
            out.append(tuple(ins))
        steps.append(tuple(out))
    return dataclasses.replace(schedule, steps=tuple(steps))


def stage_program(schedule: Schedule, stage: int) -> list[list[Action]]:
    """Stage ``stage``'s instruction stream: one list per tick (empty when idle), as DeepSpeed's ``steps()``."""
    if not 0 <= stage < schedule.num_stages:
        raise ValueError(f"{stage=} must be in [0, {schedule.num_stages}); the schedule has that many stages")
    return [list(row[stage]) for row in schedule.steps]


_MESSAGES = {Op.SEND_ACT: ("send", "act", 1), Op.RECV_ACT: ("recv", "act", 0),
             Op.SEND_GRAD: ("send", "grad", -1), Op.RECV_GRAD: ("recv", "grad", 0)}


def _message_key(a: Action, S: int) -> tuple[str, tuple[str, int, int]] | None:
    """(direction, (kind, receiving virtual stage, micro-batch)) of a send / receive; None otherwise."""
    if a.op not in _MESSAGES:
        return None
    direction, kind, hop = _MESSAGES[a.op]
    return direction, (kind, _virtual(a, S) + hop, a.microbatch)


def _sender(recv: Action, S: int) -> Action:
    """The send that a receive waits for."""
    _, (kind, v, m) = _message_key(recv, S)
    return _at(v - 1, Op.SEND_ACT, m, S) if kind == "act" else _at(v + 1, Op.SEND_GRAD, m, S)


def _dry_run(schedule: Schedule) -> None:
    """Rule 6: run each stage's instruction stream in order; a receive blocks until its send has run."""
    S = schedule.num_stages
    streams = [[(t, a) for t, row in enumerate(schedule.steps) for a in row[s]] for s in range(S)]
    pc, in_flight = [0] * S, Counter()
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pc[s] < len(streams[s]):
                msg = _message_key(streams[s][pc[s]][1], S)
                if msg and msg[0] == "recv":
                    if not in_flight[msg[1]]:
                        break  # blocking receive: its send has not run yet
                    in_flight[msg[1]] -= 1
                elif msg:
                    in_flight[msg[1]] += 1  # sends are buffered: they never block
                pc[s] += 1
                progress = True
    stuck = [streams[s][pc[s]] for s in range(S) if pc[s] < len(streams[s])]
    if stuck:
        waits = "; ".join(f"stage {a.stage} blocks at {a!r} (tick {t}) waiting for {_sender(a, S)!r}" for t, a in stuck)
        cells = [(t, a.stage) for t, a in stuck]
        raise ScheduleError(6, f"deadlock: {waits}", grid_text(schedule, cells), cells)
    left = sorted(k for k, n in in_flight.items() if n)
    if left:
        raise ScheduleError(6, f"sends never received (kind, virtual stage, micro-batch): {left}", grid_text(schedule))


def validate(schedule: Schedule) -> Schedule:
    """Check RULES 5, 1, then 2-4 tick by tick, then 6; return the schedule or raise ScheduleError.

    Rule 6 dry-runs ``schedule.steps`` if they hold communication, else ``add_communication(schedule).steps``.
    """
    S, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages

    def fail(rule: int, detail: str, cells):
        raise ScheduleError(rule, detail, grid_text(schedule, cells), cells)

    if len(schedule.steps) != schedule.num_ticks:
        fail(5, f"{len(schedule.steps)} instruction ticks for {schedule.num_ticks} grid ticks", [])
    where: dict[Action, list[tuple[int, int]]] = {}
    for t, row in enumerate(schedule.grid):
        if len(row) != S or len(schedule.steps[t]) != S:
            fail(5, f"tick {t} has {len(row)} grid cells and {len(schedule.steps[t])} instruction lists "
                    f"for {S} stages", [])
        for s, a in enumerate(row):
            compute = [x for x in schedule.steps[t][s] if x.op in _COMPUTE]
            if (a is not None and (a.stage != s or a.op not in _COMPUTE)) or compute != ([a] if a else []):
                fail(5, f"stage {s} at tick {t}: grid cell {a!r}, compute instructions {compute}", [(t, s)])
            if a is not None:
                where.setdefault(a, []).append((t, s))
    _check_once(where, S, M, V, fail)
    tick = {a: cells[0][0] for a, cells in where.items()}
    for a, t in sorted(tick.items(), key=lambda kv: kv[1]):
        for d in _deps(a, S, V):  # a B's own F comes first, so a swapped F/B reads as rule 2
            if tick[d] >= t:
                rule = 3 if a.op is Op.F else 2 if d.op is Op.F else 4
                fail(rule, f"{a!r} at tick {t} must follow {d!r} at tick {tick[d]}", [(t, a.stage)])
    has_comm = any(x.op not in _COMPUTE for row in schedule.steps for ins in row for x in ins)
    _dry_run(schedule if has_comm else add_communication(schedule))
    return schedule


def bubble_fraction(schedule: Schedule) -> float:
    """Idle compute slots / (stages x ticks), measured from the grid.

    Every slot is one F or B of one stage chunk, so with V chunks a slot is 1/V of a full stage's forward or
    backward. GPipe and 1F1B give (S-1)/(M+S-1); interleaved gives (S-1)/(V*M+S-1) when M >= S, and
    (V*(S-M) + M-1)/(V*S + M-1) when M < S (no gain at M = 1: one micro-batch crosses all V*S chunks alone).
    """
    idle = sum(a is None for row in schedule.grid for a in row)
    return idle / (schedule.num_stages * schedule.num_ticks)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most (micro-batch, chunk) activations held at once (forward ran, backward not yet).

    With V chunks each one is 1/V of a full stage's activations. 1F1B: min(S - s, M) on stage s; GPipe: M.
    """
    peaks = []
    for s in range(schedule.num_stages):
        held = peak = 0
        for row in schedule.grid:
            held += {Op.F: 1, Op.B: -1}.get(getattr(row[s], "op", None), 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


class Transfer(NamedTuple):
    """A value produced by ``src`` at ``send_tick`` and consumed by ``dst`` at ``use_tick`` (> send_tick)."""
    kind: str  # "act" (F output to the next virtual stage) or "grad" (B input-grad to the previous one)
    src: Action
    dst: Action
    send_tick: int
    use_tick: int


def transfers(schedule: Schedule) -> list[Transfer]:
    """Every stage-to-stage value (S = 1 interleaved ones included: chunk to chunk on one stage), by send tick.

    ``use_tick - send_tick`` is 1 when the consumer runs at the next tick, more when the value must be buffered.
    """
    S, V = schedule.num_stages, schedule.virtual_stages
    tick = {a: t for t, row in enumerate(schedule.grid) for a in row if a}
    out = []
    for a, t in tick.items():
        v = _virtual(a, S)
        if a.op is Op.F and v < S * V - 1:
            dst = _at(v + 1, Op.F, a.microbatch, S)
            out.append(Transfer("act", a, dst, t, tick[dst]))
        elif a.op is Op.B and v > 0:
            dst = _at(v - 1, Op.B, a.microbatch, S)
            out.append(Transfer("grad", a, dst, t, tick[dst]))
    return sorted(out, key=lambda x: (x.send_tick, x.src.stage))


def buffer_slots(schedule: Schedule, kind: str | None = None) -> list[int]:
    """Per stage, the most values received but not yet consumed at the start of any tick (``kind`` "act",
    "grad" or None for both): a value sent at tick t occupies a slot at ticks t+1 .. use_tick."""
    if kind not in (None, "act", "grad"):
        raise ValueError(f"{kind=} must be 'act', 'grad' or None (both)")
    xs = [x for x in transfers(schedule) if kind in (None, x.kind)]
    return [max([sum(x.send_tick < k <= x.use_tick for x in xs if x.dst.stage == s)
                 for k in range(schedule.num_ticks)] + [0]) for s in range(schedule.num_stages)]
