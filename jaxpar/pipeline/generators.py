"""The schedule generators: per-stage programs of compute actions, clocked into grids by `from_programs`.

    gpipe        every stage forwards all micro-batches, then backwards them              (GPipe, torch ScheduleGPipe)
    1f1b         warm-up forwards, then one forward / one backward, then the rest        (DeepSpeed TrainSchedule)
    interleaved  1F1B over V model chunks per stage                                       (Megatron, torch Interleaved1F1B)
    zbh1         1F1B, the backward split into I and W, stage s's first s W's deferred    (ZB-H1, its authors' Megatron)
    zbv          two chunks per stage in a V (down the stages, back up), I and W split   (ZB-V, torch's ZBV)
    forward      forwards only, for evaluation                                            (torch _ScheduleForwardOnly)

    defer_wgrad(schedule)   any of them with every weight gradient moved to the flush, after the stage's last input
                            gradient ("<name>+dw"; Megatron defers the output layer's, defer_embedding_wgrad_compute)
"""
from __future__ import annotations

from jaxpar.pipeline.schedule import Action, Op, Schedule, _check_args, from_programs


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


def forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1, placement: str = "loop") -> Schedule:
    """Inference: every stage forwards the micro-batches in order (chunk by chunk); no backward, no optimizer.
    ``placement`` as the training schedule's (zbv's "v"), so the same stages hold the same chunks."""
    _check_args(num_stages, num_microbatches, virtual_stages)
    M, V = num_microbatches, virtual_stages
    return from_programs([[_f(s, m, c) for c in range(V) for m in range(M)] for s in range(num_stages)],
                         name="forward", num_microbatches=M, virtual_stages=V, backward="", placement=placement)


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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023) as its authors run it in Megatron-LM (sail-sg/zero-bubble-pipeline-
    parallelism, the ZB-H1 quick implementation; PaddlePaddle's ``pipeline_scheduler_ZBH1`` defers the same W's):
    1F1B's order, with the backward split into I (input gradient, sent upstream at once) and W (weight gradient).
    Stage s defers the W's of its first s micro-batches; the steady state's other backwards are an I at once
    followed by its own W (one B to the engine); from the steady state's last backward on, through the cool-down,
    each I is followed by the oldest deferred W instead, and the W's still deferred run after the last I, in the
    ticks where 1F1B's stage s waits for gradients. Stage 0 defers nothing. Every stage holds at most min(S, M)
    micro-batches between F and W (1F1B holds S - s on stage s). Bubble with F = I = W (analysis.COSTS):
    (S-1) / (3M + S-1) for M >= S, against 1F1B's (S-1) / (M + S-1).
    """
    _check_args(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    programs = []
    for s in range(S):
        warmup = min(S - s - 1, M)
        program, deferred = [_f(s, m) for m in range(warmup)], []

        def backward(m: int, split: bool, release: bool) -> None:
            program.append(Action(s, Op.I, m))
            if not split:
                program.append(Action(s, Op.W, m))
                return
            deferred.append(m)
            if release:  # the oldest deferred W
                program.append(Action(s, Op.W, deferred.pop(0)))

        for i in range(M - warmup):  # steady state: a forward, then the oldest backward
            program.append(_f(s, warmup + i))
            last = i == M - warmup - 1
            backward(i, split=s > 0 and (i < s or last), release=last and i >= s)
        for m in range(M - warmup, M):  # cool-down
            backward(m, split=s > 0, release=m >= s)
        programs.append(program + [Action(s, Op.W, m) for m in deferred])
    return from_programs(programs, name="zbh1", num_microbatches=M, backward="IW")


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"; torch's
    ScheduleZBVZeroBubble): two model chunks per stage in the "v" placement -- chunk 0 of stage s is virtual stage
    s, chunk 1 is 2S-1-s -- so stage 0 holds the first and the last chunk (inputs and loss on one device) and
    stage S-1 passes its chunk 0's output to its own chunk 1 without a transfer. Backward split into I and W.

    Stage s's program, as torch builds it (n = max(M, 2S-1), then the actions of micro-batches >= M dropped):
    2(S-s)-1 chunk-0 forwards; s pairs (F chunk 1, F chunk 0); S-s triples (F, I, W of chunk 1); then, while
    forwards remain, (F0, I0, W0, F1, I1, W1); the cool-down: s pairs (I0, I1), S-s pairs (I0, W0), the
    remaining W's of chunk 1, then of chunk 0. A stage holds at most 2S chunk activations (half a stage each)
    between F and W: 1F1B's S full stages. With M >= 2S-1 every stage idles S-1 ticks of 6M+S-1 (one chunk action
    per tick): (S-1) / (6M+S-1), half ZB-H1's bubble in time at the same memory; smaller M still validate.
    """
    _check_args(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    n = max(M, 2 * S - 1)
    programs = []
    for s in range(S):
        prog: list[Action] = []
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

        def put(op: Op, chunk: int, key: str, advance: bool = True) -> None:
            prog.append(Action(s, op, cnt[key], chunk))
            cnt[key] += advance

        for _ in range(2 * (S - s) - 1):
            put(Op.F, 0, "f0")
        for _ in range(s):
            put(Op.F, 1, "f1")
            put(Op.F, 0, "f0")
        for _ in range(S - s):
            put(Op.F, 1, "f1")
            put(Op.I, 1, "b1", advance=False)
            put(Op.W, 1, "b1")
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
            if cnt["f0"] < n:
                put(Op.F, 0, "f0")
            put(Op.I, 0, "b0", advance=False)
            put(Op.W, 0, "b0")
            put(Op.F, 1, "f1")
            put(Op.I, 1, "b1", advance=False)
            put(Op.W, 1, "b1")
        cnt["w0"], cnt["w1"] = cnt["b0"], cnt["b1"]
        for _ in range(s):
            put(Op.I, 0, "b0")
            put(Op.I, 1, "b1")
        for _ in range(S - s):
            put(Op.I, 0, "b0")
            put(Op.W, 0, "w0")
        while cnt["w1"] < cnt["b1"]:
            put(Op.W, 1, "w1")
        while cnt["w0"] < cnt["b0"]:
            put(Op.W, 0, "w0")
        programs.append([a for a in prog if a.microbatch < M])
    return from_programs(programs, name="zbv", num_microbatches=M, virtual_stages=2, backward="IW", placement="v")


def defer_wgrad(schedule: Schedule) -> Schedule:
    """`schedule` with every weight gradient deferred to the pipeline's flush: each fused backward B becomes its
    input gradient I, in place, and every W goes to the end of its stage's program -- chunk by chunk in the order
    their I's ran, micro-batches in order -- named ``"<name>+dw"``.

    Megatron-LM defers the output layer's weight-gradient GEMMs this way (``defer_embedding_wgrad_compute``). Here
    it is every layer's: the engine runs a stage's W's of one chunk as ONE call over their micro-batches' rows
    joined (jaxpar.pipeline.stage.PartFns.weight_grads), so each weight-gradient product sums the micro-batches in
    its contraction instead of adding each one's gradient into an accumulator. The price: a stage holds what W
    needs (every layer's input and output gradient) for all M micro-batches until the flush, GPipe's activation
    memory (analysis.peak_inflight gives M). Training schedules only."""
    if not schedule.training:
        raise ValueError(f"defer_wgrad({schedule.name!r}): a forward-only schedule has no weight gradients to "
                         "defer; pass a training schedule (gpipe, 1f1b, interleaved, zbh1, zbv).")
    programs = []
    for s in range(schedule.num_stages):
        prog = schedule.program(s)
        inputs = [Action(s, Op.I, a.microbatch, a.chunk) if a.op is Op.B else a for a in prog if a.op is not Op.W]
        chunks = list(dict.fromkeys(a.chunk for a in inputs if a.op is Op.I))  # in the order their I's first ran
        weights = sorted((a for a in prog if a.op in (Op.B, Op.W)), key=lambda a: (chunks.index(a.chunk),
                                                                                  a.microbatch))
        programs.append(inputs + [Action(s, Op.W, a.microbatch, a.chunk) for a in weights])
    name = schedule.name if schedule.name.endswith("+dw") else f"{schedule.name}+dw"  # deferred twice: the same
    return from_programs(programs, name=name, num_microbatches=schedule.num_microbatches,
                         virtual_stages=schedule.virtual_stages, backward="IW", placement=schedule.placement)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zbh1": zb_h1,
             "zbv": zb_v, "forward": forward_only}


def make(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name: gpipe, 1f1b, zbh1, interleaved or forward (the last two take virtual_stages),
    zbv (two chunks per stage, V placement: virtual_stages must be 2); a training schedule's name + "+dw" (as
    defer_wgrad names it): that schedule with its W's at the flush."""
    if isinstance(name, str) and name.endswith("+dw") and name != "+dw":
        return defer_wgrad(make(name.removesuffix("+dw"), num_stages, num_microbatches, virtual_stages))
    if not isinstance(name, str) or name not in SCHEDULES:  # None (a config left unset) raised AttributeError
        raise ValueError(f"schedule {name!r} is not known (--schedule); use one of {', '.join(sorted(SCHEDULES))}.")
    _check_args(num_stages, num_microbatches, virtual_stages)
    if name == "zbv":
        if virtual_stages != 2:
            raise ValueError(f"zbv runs two chunks per stage (its V); got {virtual_stages=}; pass virtual_stages=2")
        return zb_v(num_stages, num_microbatches)
    if name == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)
    if name == "forward":
        return forward_only(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"{virtual_stages=} needs model chunks, which {name!r} does not have; "
                         f"use name='interleaved' or virtual_stages=1")
    return SCHEDULES[name](num_stages, num_microbatches)
