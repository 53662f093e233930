"""jaxpar's schedule generators against the originals' own per-stage programs, over a grid of sizes.

The programs were recorded by tests/make_schedule_fixture.py (torch.distributed.pipelining's schedule classes run on
fake stages; DeepSpeed's deepspeed/runtime/pipe/schedule.py executed standalone) into fixtures/schedule_programs.json,
which names the torch version and the DeepSpeed commit. No torch here.

Naming: torch writes an action "<stage_index><F|B|I|W><micro-batch>"; under "loop" placement (Interleaved1F1B,
Megatron) stage_index = chunk * S + rank, under "v" (ZBV) chunk 0 of rank r is stage r and chunk 1 is 2S-1-r. DeepSpeed's
instructions carry buffer ids; the fixture holds micro-batch ids there (see the generator).
"""
import json
import pathlib
import re

import pytest

from jaxpar.pipeline import schedule as sch
from jaxpar.pipeline.schedule import Action, Op

DATA = json.loads((pathlib.Path(__file__).parent / "fixtures" / "schedule_programs.json").read_text())
TORCH, DS = DATA["torch"], DATA["deepspeed"]
TORCH_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
TORCH_COMM = {Op.RECV_ACT: "RECV_F", Op.SEND_ACT: "SEND_F", Op.RECV_GRAD: "RECV_B", Op.SEND_GRAD: "SEND_B"}
DS_NAMES = {v: k for k, v in DS["names"].items()}  # fixture abbreviation -> DeepSpeed's instruction class
DS_COMPUTE = {"ForwardPass": Op.F, "BackwardPass": Op.B}
DS_COMM = {Op.RECV_ACT: "RecvActivation", Op.SEND_ACT: "SendActivation", Op.RECV_GRAD: "RecvGrad",
           Op.SEND_GRAD: "SendGrad"}


def torch_cases(name, V=None):
    return [c for c in TORCH["cases"] if c["schedule"] == name and (V is None or c["V"] == V)]


def case_id(c):
    return f"S{c['S']}-M{c['M']}-V{c.get('V', 1)}"


def torch_action(token: str, rank: int, S: int, placement: str = "loop") -> Action:
    """torch's "<stage_index><op><mb>" on ``rank`` as a jaxpar Action (stage = rank, chunk from the placement)."""
    idx, op, mb = TORCH_ACTION.match(token).groups()
    idx = int(idx)
    chunk = idx // S if placement == "loop" else (0 if idx < S else 1)
    assert sch.stage_of(idx, S, placement) == rank, f"torch puts stage_index {idx} on rank {rank}"
    return Action(rank, Op(op), int(mb), chunk)


def torch_programs(case, placement="loop"):
    if "streams" in case:  # single-stage schedules: the compute calls of the executed stream
        rows = [[t for t in stream.split() if t[0].isdigit()] for stream in case["streams"]]
    else:
        rows = [p.split() for p in case["programs"]]
    return [[torch_action(t, r, case["S"], placement) for t in row] for r, row in enumerate(rows)]


def programs(schedule):
    return [schedule.program(s) for s in range(schedule.num_stages)]


def check_against_torch(case, jaxpar_schedule, placement="loop"):
    """jaxpar's programs equal torch's; where torch refuses the size, jaxpar still builds a valid schedule."""
    if "refused" in case:  # documented: jaxpar accepts micro-batch counts that torch refuses
        assert sch.validate(jaxpar_schedule) is jaxpar_schedule
        return
    assert programs(jaxpar_schedule) == torch_programs(case, placement)


# ------------------------------------------------------------------------------------------------- torch: compute
@pytest.mark.parametrize("case", torch_cases("ScheduleGPipe"), ids=case_id)
def test_gpipe_is_torchs(case):
    check_against_torch(case, sch.gpipe(case["S"], case["M"]))


@pytest.mark.parametrize("case", torch_cases("Schedule1F1B"), ids=case_id)
def test_1f1b_is_torchs(case):
    check_against_torch(case, sch.one_f_one_b(case["S"], case["M"]))


@pytest.mark.parametrize("case", torch_cases("_ScheduleForwardOnly"), ids=case_id)
def test_forward_only_is_torchs(case):
    check_against_torch(case, sch.forward_only(case["S"], case["M"]))


@pytest.mark.parametrize("case", [c for c in TORCH["cases"] if c["schedule"] == "ScheduleInterleaved1F1B"
                                  and c["V"] >= 2], ids=case_id)
def test_interleaved_is_torchs(case):
    check_against_torch(case, sch.interleaved_1f1b(case["S"], case["M"], case["V"]))


@pytest.mark.parametrize("case", torch_cases("ScheduleZBVZeroBubble"), ids=case_id)
def test_zbv_is_torchs(case):
    check_against_torch(case, sch.zb_v(case["S"], case["M"]), placement="v")


def test_interleaved_with_one_chunk_is_1f1b_not_torchs_interleaved():
    """jaxpar's interleaved_1f1b(V=1) is 1F1B (as in Megatron, which runs V=1 without interleaving; the CLI refuses
    V=1, docs/concepts.md). torch's Interleaved1F1B with one stage per rank warms rank r up with min(2(S-1-r), M)
    forwards where 1F1B takes S-1-r, so its program differs from 1F1B's exactly on the ranks with 0 < S-1-r < M-1:
    recorded, and held to that, not matched."""
    flat = {(c["S"], c["M"]): c for c in torch_cases("Schedule1F1B") if "refused" not in c}
    n = 0
    for case in torch_cases("ScheduleInterleaved1F1B", V=1):
        S, M = case["S"], case["M"]
        mine = programs(sch.interleaved_1f1b(S, M, 1))
        assert mine == programs(sch.one_f_one_b(S, M))
        if (S, M) in flat:
            assert mine == torch_programs(flat[(S, M)])
        if "refused" not in case:
            theirs = torch_programs(case)
            assert [r for r in range(S) if mine[r] != theirs[r]] == [r for r in range(S) if 0 < S - 1 - r < M - 1]
            n += 1
    assert n >= 20


def _zb_view(progs):
    return [[(a.op, a.microbatch) for a in p if a.op is not Op.W] for p in progs]


@pytest.mark.parametrize("case", torch_cases("ScheduleInterleavedZeroBubble", V=1), ids=case_id)
def test_zbh1_is_torchs_zb1p_but_for_which_w_runs(case):
    """torch has no ZB-H1; its ZB1P with one stage per rank (ScheduleInterleavedZeroBubble) is the nearest. jaxpar's
    zbh1 has its ops in the same slots -- the 1F1B order of F and I, and a W at the same places, stage s holding back
    min(s, M) of them -- but picks another micro-batch for some W's: torch runs the oldest waiting W (FIFO), jaxpar
    each I's own W through the steady state and the deferred ones in the cool-down (the paper's authors' Megatron
    ZB-H1, docs/concepts.md "ZB-H1 zero-bubble schedule"; an I followed by its own W runs as one B call)."""
    S, M = case["S"], case["M"]
    z = sch.zb_h1(S, M)
    if "refused" in case:
        assert sch.validate(z) is z
        return
    mine, theirs = programs(z), torch_programs(case)
    assert _zb_view(mine) == _zb_view(theirs)
    assert [[a.op for a in p] for p in mine] == [[a.op for a in p] for p in theirs]
    for s, p in enumerate(theirs):  # torch's W's: oldest first
        assert [a.microbatch for a in p if a.op is Op.W] == list(range(M))
        first_w = next(i for i, a in enumerate(p) if a.op is Op.W)
        assert sum(a.op is Op.I for a in p[:first_w]) - 1 == min(s, M - 1)
    # equal up to M = S (no stage has a steady-state I of its own to follow); beyond, every stage s >= 1 differs
    assert [s for s in range(S) if mine[s] != theirs[s]] == (list(range(1, S)) if M > S else [])


# ----------------------------------------------------------------------------------------- torch: communication
def jaxpar_stream(schedule, s, names, load=None):
    """Stage s's instruction stream from add_communication, as torch or DeepSpeed names it (compute as torch)."""
    out = []
    for ins in sch.stage_program(sch.add_communication(schedule), s):
        for a in ins:
            if a.op in names:
                out.append(f"{names[a.op]}{a.microbatch}")
            elif a.op in sch.COMPUTE:
                out.append(f"{a.stage}{a.op.value}{a.microbatch}")
    return out


@pytest.mark.parametrize("name,make", [("ScheduleGPipe", sch.gpipe), ("Schedule1F1B", sch.one_f_one_b),
                                       ("_ScheduleForwardOnly", sch.forward_only)])
def test_send_recv_order_is_torchs(name, make):
    """Each stage's receives, computes and sends in torch's executed order (loads aside: torch has none)."""
    n = 0
    for case in torch_cases(name):
        if "refused" in case:
            continue
        s_ = make(case["S"], case["M"])
        for s, stream in enumerate(case["streams"]):
            assert jaxpar_stream(s_, s, TORCH_COMM) == stream.split(), (case_id(case), s)
            n += 1
    assert n >= 40


# --------------------------------------------------------------------------------------------------- DeepSpeed
def ds_steps(case):
    """Each stage's steps as [[(DeepSpeed class name, micro-batch or None), ...], ...]."""
    def parse(tok):
        m = re.match(r"^([A-Z]+)(\d*)$", tok)
        return DS_NAMES[m.group(1)], int(m.group(2)) if m.group(2) else None
    return [[[parse(t) for t in step.split()] for step in stage.split("|")] for stage in case["steps"]]


def ds_cases(name):
    return [c for c in DS["cases"] if c["schedule"] == name]


@pytest.mark.parametrize("case", ds_cases("TrainSchedule") + ds_cases("InferenceSchedule"), ids=lambda c:
                         f"{c['schedule']}-S{c['S']}-M{c['M']}")
def test_deepspeed_program(case):
    """TrainSchedule's ForwardPass / BackwardPass order on every stage is jaxpar's 1F1B; InferenceSchedule's is
    forward_only's; each has as many steps as jaxpar's grid has ticks, 2(M+S-1) and M+S-1."""
    S, M = case["S"], case["M"]
    mine = sch.one_f_one_b(S, M) if case["schedule"] == "TrainSchedule" else sch.forward_only(S, M)
    theirs = [[Action(s, DS_COMPUTE[n], m) for step in stage for n, m in step if n in DS_COMPUTE]
              for s, stage in enumerate(ds_steps(case))]
    assert programs(mine) == theirs
    assert all(len(stage) == mine.num_ticks for stage in ds_steps(case))


@pytest.mark.parametrize("name,make", [("TrainSchedule", sch.one_f_one_b), ("InferenceSchedule", sch.forward_only)])
def test_deepspeed_send_recv_between_the_same_computes(name, make):
    """add_communication's sends and receives fall between the same two computes as DeepSpeed's: a receive right
    before its compute, a send after its compute and before the stage's next one. DeepSpeed defers each send to
    the next step (its sends block, and even and odd stages order a step's send and receive oppositely so that
    neighbours pair up), so within one gap the order of a send and a receive may differ: compared as sets."""
    def gaps(stream):
        out, cur = [], []
        for t in stream:
            if t[0].isdigit():
                out.append((frozenset(cur), t))
                cur = []
            else:
                cur.append(t)
        return out + [(frozenset(cur), None)]

    comm = {op: DS["names"][n] for op, n in DS_COMM.items()}
    for case in ds_cases(name):
        mine = make(case["S"], case["M"])
        for s, steps in enumerate(ds_steps(case)):
            theirs = [f"{s}{DS_COMPUTE[n].value}{m}" if n in DS_COMPUTE else f"{DS['names'][n]}{m}"
                      for step in steps for n, m in step if n in DS_COMPUTE or n in DS_COMM.values()]
            assert gaps(jaxpar_stream(mine, s, comm)) == gaps(theirs), (case_id(case), s)


# ------------------------------------------------------------------------------------------ the test can fail
def test_the_fixture_tells_the_schedules_apart():
    """The comparisons above could not pass by accident: the grid holds sizes where torch's GPipe and 1F1B programs
    differ (every M >= 2, S >= 2 torch accepts), where interleaving, ZB-V and DeepSpeed's 1F1B differ from GPipe, and
    where torch refuses sizes; the grid is the one the generator wrote."""
    gpipe = {(c["S"], c["M"]): torch_programs(c) for c in torch_cases("ScheduleGPipe")}
    n = 0
    for c in torch_cases("Schedule1F1B"):
        if "refused" not in c and c["M"] >= 2:
            assert torch_programs(c) != gpipe[(c["S"], c["M"])], case_id(c)
            assert programs(sch.one_f_one_b(c["S"], c["M"])) != programs(sch.gpipe(c["S"], c["M"]))
            n += 1
    assert n >= 20
    for c in ds_cases("TrainSchedule"):
        if c["M"] >= 2:
            theirs = [[Action(s, DS_COMPUTE[n], m) for step in st for n, m in step if n in DS_COMPUTE]
                      for s, st in enumerate(ds_steps(c))]
            assert theirs != programs(sch.gpipe(c["S"], c["M"])), case_id(c)
    refused = {c["schedule"] for c in TORCH["cases"] if "refused" in c}
    assert refused == {"Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"}
    assert {(c["S"], c["M"]) for c in torch_cases("ScheduleInterleaved1F1B", V=2) if "refused" not in c
            and c["M"] % c["S"]} >= {(4, 5), (8, 9)}  # torch's flex rounds: M not a multiple of S, accepted
    assert [tuple(x) for x in DATA["grid"]] == sorted({(c["S"], c["M"]) for c in TORCH["cases"]})
    assert len(DS["commit"]) == 40 and TORCH["version"].startswith("2.")
    # one action moved breaks the comparison
    case = next(c for c in torch_cases("ScheduleZBVZeroBubble") if (c["S"], c["M"]) == (4, 8))
    theirs = torch_programs(case, "v")
    theirs[1][3], theirs[1][4] = theirs[1][4], theirs[1][3]
    assert programs(sch.zb_v(4, 8)) != theirs
