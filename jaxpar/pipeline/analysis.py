"""What a schedule costs: bubble, activation memory, transfers -- measured from its grid or replayed with costs.

Pure Python. The grid's clock gives every compute action one tick; ``simulate`` replays each stage's program
with other durations, e.g. COSTS (the zero-bubble paper's T_F = T_B = T_W: F 1, fused B 2, I 1, W 1), so that
schedules with a fused backward and schedules with a split one compare on the same time axis:

    bubble_fraction(one_f_one_b(4, 8), COSTS) == 3/11      # (S-1)/(M+S-1), as on the unit grid
    bubble_fraction(zb_h1(4, 8), COSTS)       == 3/27      # (S-1)/(3M+S-1)
"""
from __future__ import annotations

from typing import NamedTuple

from jaxpar.pipeline.schedule import Action, Op, Schedule, at, deps, virtual

UNIT = {Op.F: 1.0, Op.B: 1.0, Op.I: 1.0, Op.W: 1.0}  # the grid's clock
COSTS = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}  # T_F = T_B = T_W: a fused backward costs two forwards


def simulate(schedule: Schedule, costs: dict | None = None) -> tuple[dict[Action, tuple[float, float]], float]:
    """({action: (start, end)}, makespan): each stage runs its program in order, each action as soon as the
    stage is free and its dependencies have ended. ``costs`` {Op: duration}, default UNIT (the grid itself)."""
    costs = UNIT if costs is None else {**UNIT, **costs}
    S, V, bw = schedule.num_stages, schedule.virtual_stages, schedule.backward
    programs = [schedule.program(s) for s in range(S)]
    pc, free, span = [0] * S, [0.0] * S, {}
    while any(pc[s] < len(programs[s]) for s in range(S)):
        progress = False
        for s in range(S):
            while pc[s] < len(programs[s]):
                a = programs[s][pc[s]]
                ds = deps(a, S, V, bw, schedule.placement)
                if any(d not in span for d in ds):
                    break
                start = max([free[s]] + [span[d][1] for d in ds])
                span[a] = (start, start + costs[a.op])
                free[s], pc[s], progress = start + costs[a.op], pc[s] + 1, True
        if not progress:  # a validated schedule never gets here
            raise ValueError(f"{schedule.name}: the programs deadlock; validate() the schedule first")
    return span, max(free)


def bubble_fraction(schedule: Schedule, costs: dict | None = None) -> float:
    """Idle time / (stages x makespan); ``costs`` None: idle slots of the grid (every action one tick).

    With V chunks a slot is 1/V of a full stage's forward or backward. GPipe and 1F1B give (S-1)/(M+S-1) under
    either clock; interleaved (S-1)/(V*M+S-1) when M >= S; ZB-H1 (S-1)/(3M+S-1) under COSTS when M >= S (with
    fewer micro-batches the chain of one micro-batch's F, I and W through the stages outlasts 3M+S-1, and the
    simulation gives more).
    """
    if costs is None:
        idle = sum(a is None for row in schedule.grid for a in row)
        return idle / (schedule.num_stages * schedule.num_ticks)
    span, total = simulate(schedule, costs)
    busy = sum(end - start for start, end in span.values())
    return 1.0 - busy / (schedule.num_stages * total)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most (micro-batch, chunk) activations held at once (forward ran, B or W not yet).

    With V chunks each one is 1/V of a full stage's activations. 1F1B: min(S - s, M) on stage s; ZB-H1: min(S, M)
    on every stage (a micro-batch is held until its deferred W); GPipe: M; forward-only: 1 (each is passed on and
    dropped).
    """
    if not schedule.training:
        return [1] * schedule.num_stages
    free = Op.B if schedule.backward == "B" else Op.W
    peaks = []
    for s in range(schedule.num_stages):
        held = peak = 0
        for row in schedule.grid:
            op = getattr(row[s], "op", None)
            held += 1 if op is Op.F else -1 if op is free else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


class Transfer(NamedTuple):
    """A value produced by ``src`` at ``send_tick`` and consumed by ``dst`` at ``use_tick`` (> send_tick)."""
    kind: str  # "act" (F output to the next virtual stage) or "grad" (B/I input-grad to the previous one)
    src: Action
    dst: Action
    send_tick: int
    use_tick: int


def transfers(schedule: Schedule) -> list[Transfer]:
    """Every stage-to-stage value (S = 1 interleaved ones included: chunk to chunk on one stage), by send tick.

    ``use_tick - send_tick`` is 1 when the consumer runs at the next tick, more when the value must be buffered.
    """
    S, V, place = schedule.num_stages, schedule.virtual_stages, schedule.placement
    tick = {a: t for t, row in enumerate(schedule.grid) for a in row if a}
    out = []
    for a, t in tick.items():
        v = virtual(a, S, place)
        if a.op is Op.F and v < S * V - 1:
            dst = at(v + 1, Op.F, a.microbatch, S, place)
            out.append(Transfer("act", a, dst, t, tick[dst]))
        elif a.op in (Op.B, Op.I) and v > 0:
            dst = at(v - 1, a.op, a.microbatch, S, place)
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
