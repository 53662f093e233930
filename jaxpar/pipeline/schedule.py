"""Pipeline schedules as data: DeepSpeed's instruction vocabulary, torch.distributed.pipelining's compact actions.

Pure Python (no JAX), computed once outside jit. Each stage's PROGRAM -- its compute actions in order, as
DeepSpeed's ``TrainSchedule.steps()`` yields them -- runs through a unit-time clock that respects the data
dependencies; the clock yields the GRID ``grid[t][s]``: the compute action of stage s at tick t (None = bubble).
Roughly (``print(one_f_one_b(2, 3))``)::

    tick      0   1   2   3   4   5   6   7
    stage 0   F0  F1  .   B0  F2  B1  .   B2
    stage 1   .   F0  B0  F1  B1  F2  B2  .

Compute actions: F (forward), B (the whole backward), or B split in two as the zero-bubble schedules do (torch's
names): I (the input gradient, sent upstream at once) and W (the weight gradient, which nothing waits for and
which can fill a bubble). A schedule's ``backward`` says which: "B", "IW", or "" (forward-only: inference).
Time model of the grid: every compute action takes one tick; `jaxpar.pipeline.analysis.simulate` replays the
programs with other costs (F=1, B=2, I=W=1, the zero-bubble paper's) to compare fused and split backwards.
Interleaved (Megatron) schedules: stage s holds V model chunks; chunk c of stage s is the VIRTUAL stage
v = c*S + s ("loop" placement), so activations travel the ring S-1 -> 0 between chunks. The "v" placement (ZB-V,
torch's style="v") runs the odd chunks back up: chunk 1 of stage s is v = 2S-1-s, so stage S-1 holds the two
middle virtual stages (no transfer between them) and stage 0 the first and the last. ``add_communication`` adds sends,
receives, loads, the gradient reduction and the optimizer step to per-tick instruction lists (``steps[t][s]``);
``validate`` checks the numbered RULES and dry-runs those lists for deadlock; jaxpar.pipeline.engine runs them.
The generators (gpipe, 1f1b, interleaved, zbh1, forward) live in jaxpar.pipeline.generators and the analysis
(bubble, memory, transfers) in jaxpar.pipeline.analysis; both are re-exported here.
"""
from __future__ import annotations

import dataclasses
import enum
import numbers
import re
from collections import Counter
from typing import NamedTuple, Sequence

from jaxpar.pipeline.render import grid_text, render  # noqa: F401  (text grid, PNG timeline)


class Op(enum.Enum):
    """Instruction kinds (DeepSpeed's names in comments); the value is the short letter(s) used in reprs."""
    LOAD = "L"            # LoadMicroBatch (inputs on the first virtual stage, labels on the last)
    F = "F"               # ForwardPass
    B = "B"               # BackwardPass (input and weight gradients together)
    I = "I"               # noqa: E741  backward, input gradient only (zero-bubble's B, torch's "I")
    W = "W"               # backward, weight gradient only (zero-bubble's W, torch's "W")
    SEND_ACT = "SA"       # SendActivation (to the next virtual stage)
    RECV_ACT = "RA"       # RecvActivation (from the previous virtual stage)
    SEND_GRAD = "SG"      # SendGrad (to the previous virtual stage)
    RECV_GRAD = "RG"      # RecvGrad (from the next virtual stage)
    REDUCE_GRADS = "RED"  # ReduceTiedGrads + ReduceGrads (data-parallel all-reduce)
    OPT = "OPT"           # OptimizerStep


IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4  # op codes of table()
COMPUTE = (Op.F, Op.B, Op.I, Op.W)
BACKWARDS = {"B": (Op.B,), "IW": (Op.I, Op.W), "": ()}  # schedule.backward -> its backward actions
RULES = {
    1: "each (stage, micro-batch, chunk) has exactly one F and one backward: B, or I and W (none when forward-only)",
    2: "F runs before B or I of the same (stage, micro-batch, chunk), and I before W",
    3: "a virtual stage forwards a micro-batch strictly after the previous virtual stage forwarded it",
    4: "a virtual stage backwards a micro-batch strictly after the next virtual stage backwarded it",
    5: "at most one compute action per stage per tick, in that stage's row",
    6: "the per-stage programs with blocking receives run to completion (no deadlock, every send received, each "
       "receive at a later tick than its send)",
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

    ``grid[t][s]``: compute Action of stage s at tick t, None for a bubble.
    ``steps[t][s]``: every instruction of stage s at tick t, in order (just the compute action until
    ``add_communication`` adds loads, sends, receives, the gradient reduction and the optimizer step).
    ``backward``: "B" (fused backward), "IW" (split: input then weight gradient) or "" (forward-only).
    An edited grid: ``dataclasses.replace(schedule, grid=new_grid, steps=())`` re-derives ``steps``.
    """
    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    grid: tuple[tuple[Action | None, ...], ...]
    steps: tuple[tuple[tuple[Action, ...], ...], ...] = ()
    backward: str = "B"
    placement: str = "loop"  # where chunk c of stage s sits in the model: see virtual()

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward={self.backward!r} must be 'B' (fused), 'IW' (split) or '' (forward-only)")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} must be one of {PLACEMENTS}")
        if not self.steps:
            object.__setattr__(self, "steps", tuple(tuple((a,) if a else () for a in row) for row in self.grid))

    @property
    def num_ticks(self) -> int:
        return len(self.grid)

    @property
    def training(self) -> bool:
        return self.backward != ""

    def table(self, idle: tuple[int, int, int] = (IDLE, 0, 0)) -> list[list[tuple[int, int, int]]]:
        """``table()[t][s] = (op_code, microbatch, chunk)`` ints: 0 idle, 1 F, 2 B, 3 I, 4 W; idle cells ``idle``."""
        code = {Op.F: FORWARD, Op.B: BACKWARD, Op.I: INPUT_GRAD, Op.W: WEIGHT_GRAD}
        return [[idle if a is None else (code[a.op], a.microbatch, a.chunk) for a in row] for row in self.grid]

    def program(self, stage: int) -> list[Action]:
        """Stage ``stage``'s compute actions in order (its row of the grid without the bubbles)."""
        return [row[stage] for row in self.grid if row[stage] is not None]

    def __str__(self) -> str:
        return grid_text(self)


PLACEMENTS = ("loop", "v")


def virtual(a: Action, S: int, placement: str = "loop") -> int:
    """The virtual stage of ``a``: chunk * S + stage ("loop"); "v" counts the odd chunks back, chunk * S + S-1 -
    stage, so the model runs down the stages and back up (ZB-V)."""
    if placement == "v" and a.chunk % 2:
        return a.chunk * S + S - 1 - a.stage
    return a.chunk * S + a.stage


def stage_of(v: int, S: int, placement: str = "loop") -> int:
    """The stage holding virtual stage v: virtual() inverted."""
    chunk, r = divmod(v, S)
    return S - 1 - r if placement == "v" and chunk % 2 else r


def at(v: int, op: Op, mb: int | None, S: int, placement: str = "loop") -> Action:
    """The action ``op`` of micro-batch ``mb`` on virtual stage v."""
    return Action(stage_of(v, S, placement), op, mb, v // S)


def deps(a: Action, S: int, V: int, backward: str = "B", placement: str = "loop") -> list[Action]:
    """Compute actions that must run at an earlier tick than ``a`` (rules 2-4)."""
    v, m = virtual(a, S, placement), a.microbatch
    if a.op is Op.F:
        return [at(v - 1, Op.F, m, S, placement)] if v > 0 else []
    if a.op is Op.W:
        return [Action(a.stage, Op.I, m, a.chunk)]
    own = Action(a.stage, Op.F, m, a.chunk)
    grad = Op.I if backward == "IW" else Op.B
    return [own, at(v + 1, grad, m, S, placement)] if v < S * V - 1 else [own]


def _check_args(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    for label, x in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                     ("virtual_stages", virtual_stages)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{label}={x!r} must be an int >= 1; pass a positive count")


def _check_once(where: dict[Action, list], S: int, M: int, V: int, backward: str, fail) -> None:
    """Rule 1 over ``where`` = {compute action: the places it occurs}; ``fail(rule, detail, places)`` raises."""
    ops = (Op.F,) + BACKWARDS[backward]
    for a, places in where.items():
        if len(places) > 1 or a.microbatch not in range(M) or a.chunk not in range(V) or a.op not in ops:
            fix = (f"keep one {a!r} and make the other cells None (a bubble)" if len(places) > 1 else
                   f"remove it, or build the schedule with num_microbatches={a.microbatch + 1} or more"
                   if a.microbatch not in range(M) else
                   f"remove it, or build the schedule with virtual_stages={a.chunk + 1} or more"
                   if a.chunk not in range(V) else
                   f"remove it, or build the schedule with backward="
                   f"{'IW' if a.op in (Op.I, Op.W) else 'B' if a.op is Op.B else ''!r}")
            fail(1, f"{a!r} occurs {len(places)} times (micro-batches 0..{M - 1}, chunks 0..{V - 1}, "
                    f"ops {'/'.join(o.value for o in ops)}); {fix}", places)
    for a in (Action(s, op, m, c) for s in range(S) for m in range(M) for c in range(V) for op in ops):
        if a not in where:
            fail(1, f"{a!r} never runs; add it to stage {a.stage}'s row at a tick after its dependencies (or "
                    f"build the schedule for fewer micro-batches than {M})", [])


def _check_programs(programs: Sequence[Sequence[Action]], M: int, V: int, backward: str) -> None:
    """Rules 5 and 1 on the programs before clocking them (a missing action would read as a deadlock)."""
    def fail(rule: int, detail: str, places):
        text = "\n".join(f"stage {s}: " + " ".join(map(repr, p)) for s, p in enumerate(programs))
        raise ScheduleError(rule, detail, text)

    where: dict[Action, list] = {}
    for s, prog in enumerate(programs):
        for i, a in enumerate(prog):
            if a.stage != s or a.op not in COMPUTE:
                fail(5, f"program of stage {s} holds {a!r}: programs hold compute actions of their own stage", [])
            where.setdefault(a, []).append(i)
    _check_once(where, len(programs), M, V, backward, fail)


def from_programs(programs: Sequence[Sequence[Action]], *, name: str = "custom",
                  num_microbatches: int | None = None, virtual_stages: int = 1, backward: str | None = None,
                  placement: str = "loop") -> Schedule:
    """Clock per-stage compute programs into a grid: each tick, every stage runs its next action if all its
    dependencies ran at earlier ticks (as soon as possible), else idles. Raises ScheduleError rule 6 on deadlock.
    ``backward`` None: read off the programs ("IW" if they hold I or W, "B" if B, else "")."""
    S, V = len(programs), virtual_stages
    ops = {a.op for p in programs for a in p}
    if backward is None:
        backward = "IW" if ops & {Op.I, Op.W} else "B" if Op.B in ops else ""
    M = num_microbatches or 1 + max((a.microbatch or 0 for p in programs for a in p), default=0)
    _check_programs(programs, M, V, backward)
    done: dict[Action, int] = {}
    pc, grid = [0] * S, []
    while any(pc[s] < len(programs[s]) for s in range(S)):
        t = len(grid)
        nxt = [programs[s][pc[s]] if pc[s] < len(programs[s]) else None for s in range(S)]
        row = tuple(a if a and all(done.get(d, t) < t for d in deps(a, S, V, backward, placement)) else None
                    for a in nxt)
        if not any(row):
            stuck = Schedule(name, S, M, V, tuple(grid) + (tuple(nxt),), backward=backward, placement=placement)
            waits = "; ".join(f"stage {a.stage} waits at {a!r} for "
                              f"{[d for d in deps(a, S, V, backward, placement) if d not in done]}"
                              for a in nxt if a)
            cells = [(t, a.stage) for a in nxt if a]
            raise ScheduleError(6, f"deadlock at tick {t} (marked: the action each stage is stuck at): {waits}",
                                grid_text(stuck, cells), cells)
        for a in row:
            if a:
                done[a] = t
                pc[a.stage] += 1
        grid.append(row)
    return Schedule(name, S, M, V, tuple(grid), backward=backward, placement=placement)


def add_communication(schedule: Schedule) -> Schedule:
    """Per-tick instruction lists with communication, like DeepSpeed's ``steps()``.

    Roughly, on stage s at tick t with compute action F/B/I/W of micro-batch m on virtual stage v:
    ``[LOAD m if v is first or last (inputs / labels), RECV_ACT m if v > 0, F m, SEND_ACT m if v is not last]``;
    ``[RECV_GRAD m if v is not last, B (or I) m, SEND_GRAD m if v > 0]``; ``[W m]``; the last tick of every
    stage ends with ``REDUCE_GRADS, OPT`` (training schedules). Derived from the grid only, so applying it twice
    gives the same schedule.
    """
    S, V = schedule.num_stages, schedule.virtual_stages
    last = S * V - 1
    steps = []
    for t, row in enumerate(schedule.grid):
        out = []
        for s, a in enumerate(row):
            ins = []
            if a is not None:
                m, c, v = a.microbatch, a.chunk, virtual(a, S, schedule.placement)
                if a.op is Op.F:
                    ins += [Action(s, Op.LOAD, m, c)] if v in (0, last) else []
                    ins += [Action(s, Op.RECV_ACT, m, c)] if v > 0 else []
                    ins += [a] + ([Action(s, Op.SEND_ACT, m, c)] if v < last else [])
                elif a.op in (Op.B, Op.I):
                    ins += ([Action(s, Op.RECV_GRAD, m, c)] if v < last else []) + [a]
                    ins += [Action(s, Op.SEND_GRAD, m, c)] if v > 0 else []
                else:
                    ins += [a]
            if t == schedule.num_ticks - 1 and schedule.training:
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


def message(a: Action, S: int, placement: str = "loop") -> tuple[str, tuple[str, int, int]] | None:
    """(direction, (kind, receiving virtual stage, micro-batch)) of a send / receive; None otherwise."""
    if a.op not in _MESSAGES:
        return None
    direction, kind, hop = _MESSAGES[a.op]
    return direction, (kind, virtual(a, S, placement) + hop, a.microbatch)


def _sender(recv: Action, S: int, placement: str = "loop") -> Action:
    """The send that a receive waits for."""
    _, (kind, v, m) = message(recv, S, placement)
    return at(v - 1, Op.SEND_ACT, m, S, placement) if kind == "act" else at(v + 1, Op.SEND_GRAD, m, S, placement)


def _dry_run(schedule: Schedule) -> None:
    """Rule 6: run each stage's instruction stream in order; a receive blocks until its send has run."""
    S, place = schedule.num_stages, schedule.placement
    streams = [[(t, a) for t, row in enumerate(schedule.steps) for a in row[s]] for s in range(S)]
    pc, in_flight = [0] * S, Counter()
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pc[s] < len(streams[s]):
                msg = message(streams[s][pc[s]][1], S, place)
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
        waits = "; ".join(f"stage {a.stage} blocks at {a!r} (tick {t}) waiting for {_sender(a, S, place)!r}"
                          for t, a in stuck)
        cells = [(t, a.stage) for t, a in stuck]
        raise ScheduleError(6, f"deadlock: {waits}", grid_text(schedule, cells), cells)
    left = sorted(k for k, n in in_flight.items() if n)
    if left:
        raise ScheduleError(6, f"sends never received (kind, virtual stage, micro-batch): {left}", grid_text(schedule))
    sent: dict[tuple, int] = {}  # each message's first send tick; the engine walks the ticks in order
    for t, row in enumerate(schedule.steps):
        for ins in row:
            for a in ins:
                msg = message(a, S, place)
                if msg and msg[0] == "send":
                    sent.setdefault(msg[1], t)
    for t, row in enumerate(schedule.steps):
        for ins in row:
            for a in ins:
                msg = message(a, S, place)
                if msg and msg[0] == "recv" and sent[msg[1]] >= t:
                    cells = [(t, a.stage)]
                    raise ScheduleError(6, f"{a!r} at tick {t} receives before {_sender(a, S, place)!r} sends at tick "
                                           f"{sent[msg[1]]}: the ticks run in order, so a receive must come at a later "
                                           "tick than its send; move it after the send (add_communication places it "
                                           "at its consumer's tick)", grid_text(schedule, cells), cells)


def _check_table(schedule: Schedule) -> None:
    """ScheduleError (rule 5, without the grid, which cannot be drawn) unless the counts are ints >= 1 and every tick
    holds one cell per stage, each an Action or None, and one list of Actions per stage."""
    S = schedule.num_stages
    for name in ("num_stages", "num_microbatches", "virtual_stages"):
        v = getattr(schedule, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ScheduleError(5, f"{name}={v!r} must be an int >= 1; pass a positive count")
    for t, row in enumerate(schedule.grid):
        if len(row) != S:
            raise ScheduleError(5, f"tick {t} has {len(row)} grid cells for {S} stages; give every tick one cell per "
                                   "stage (None for a bubble)")
        for s, a in enumerate(row):
            if a is not None and not isinstance(a, Action):
                raise ScheduleError(5, f"stage {s} at tick {t} holds {a!r}, not an Action or None; write it as "
                                       f"Action.parse('{s}{a}') (stage, op, micro-batch)")
    for t, row in enumerate(schedule.steps):
        for s, ins in enumerate(row):
            bad = [x for x in ins if not isinstance(x, Action)]
            if bad:
                raise ScheduleError(5, f"stage {s}'s instructions at tick {t} hold {bad[0]!r}, not an Action; "
                                       "build them with Action(...) or Action.parse")


def validate(schedule: Schedule) -> Schedule:
    """Check RULES 5, 1, then 2-4 tick by tick, then 6; return the schedule or raise ScheduleError.

    Rule 6 dry-runs ``schedule.steps`` if they hold communication, else ``add_communication(schedule).steps``.
    """
    S, M, V, bw = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages, schedule.backward

    def fail(rule: int, detail: str, cells):
        raise ScheduleError(rule, detail, grid_text(schedule, cells), cells)

    _check_table(schedule)
    if len(schedule.steps) != schedule.num_ticks:
        fail(5, f"{len(schedule.steps)} instruction ticks for {schedule.num_ticks} grid ticks; after editing the "
                "grid, re-derive the instructions: dataclasses.replace(schedule, grid=new_grid, steps=())", [])
    where: dict[Action, list[tuple[int, int]]] = {}
    for t, row in enumerate(schedule.grid):
        if len(row) != S or len(schedule.steps[t]) != S:
            fail(5, f"tick {t} has {len(row)} grid cells and {len(schedule.steps[t])} instruction lists "
                    f"for {S} stages; give every tick one cell and one list per stage", [])
        for s, a in enumerate(row):
            compute = [x for x in schedule.steps[t][s] if x.op in COMPUTE]
            if (a is not None and (a.stage != s or a.op not in COMPUTE)) or compute != ([a] if a else []):
                fail(5, f"stage {s} at tick {t}: grid cell {a!r}, compute instructions {compute}; a cell holds "
                        "one compute action of its own stage, and its instructions that action alone: re-derive "
                        "them with dataclasses.replace(schedule, grid=new_grid, steps=())", [(t, s)])
            if a is not None:
                where.setdefault(a, []).append((t, s))
    _check_once(where, S, M, V, bw, fail)
    tick = {a: cells[0][0] for a, cells in where.items()}
    for a, t in sorted(tick.items(), key=lambda kv: kv[1]):
        # a backward's own F comes first, so a swapped F/B reads as rule 2
        for d in deps(a, S, V, bw, schedule.placement):
            if tick[d] >= t:
                rule = 3 if a.op is Op.F else 2 if d.op is Op.F or a.op is Op.W else 4
                fail(rule, f"{a!r} at tick {t} must follow {d!r} at tick {tick[d]}; move {a!r} to a tick after "
                           f"{tick[d]} (or {d!r} before {t})", [(t, a.stage)])
    _dry_run(with_communication(schedule))
    return schedule


def with_communication(schedule: Schedule) -> Schedule:
    """The schedule as it runs: as written if its steps hold communication (loads, sends, receives), else with
    ``add_communication``'s."""
    has_comm = any(x.op not in COMPUTE for row in schedule.steps for ins in row for x in ins)
    return schedule if has_comm else add_communication(schedule)


# the generators and the analysis, importable from here as before
from jaxpar.pipeline.analysis import (COSTS, UNIT, Transfer, bubble_fraction, buffer_slots,  # noqa: E402,F401
                                      peak_inflight, simulate, transfers)
from jaxpar.pipeline.generators import (SCHEDULES, defer_wgrad, forward_only, gpipe,  # noqa: E402,F401
                                        interleaved_1f1b, make, one_f_one_b, zb_h1, zb_v)
