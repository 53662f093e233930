"""Structural tests of jaxpar.pipeline.schedule: schedules as data, no devices."""
import ast
import dataclasses
import pathlib
import sys
from fractions import Fraction

import pytest

from jaxpar.pipeline import schedule as sch
from jaxpar.pipeline.schedule import Action, Op, ScheduleError

STAGES, MICROBATCHES = (1, 2, 3, 4), (1, 2, 3, 4, 8)
GENERATORS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
ONE_F_ONE_B_2x3 = """\
tick      0   1   2   3   4   5   6   7
stage 0   F0  F1  .   B0  F2  B1  .   B2
stage 1   .   F0  B0  F1  B1  F2  B2  ."""


def acts(text):
    return [Action.parse(x) for x in text.split()]


def with_grid(schedule, rows):
    """The schedule with a hand-edited grid (rows of cell texts, '.' = bubble); steps re-derived."""
    grid = tuple(tuple(None if c == "." else Action.parse(f"{s}{c}") for s, c in enumerate(row.split()))
                 for row in rows)
    return dataclasses.replace(schedule, grid=grid, steps=())


def bubble(schedule):
    idle = sum(a is None for row in schedule.grid for a in row)
    return Fraction(idle, schedule.num_stages * schedule.num_ticks)


@pytest.mark.parametrize("name,V", GENERATORS)
@pytest.mark.parametrize("S", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_every_generator_validates(name, V, S, M):
    s = sch.make(name, S, M, V)
    assert sch.validate(s) is s
    sch.validate(sch.add_communication(s))
    assert (s.num_stages, s.num_microbatches, s.virtual_stages) == (S, M, V)
    for st in range(S):  # each stage runs every (micro-batch, chunk) forward and backward once
        assert sum(row[st] is not None for row in s.grid) == 2 * M * V
    assert [len(r) for r in s.table()] == [S] * s.num_ticks


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_bubble_gpipe_1f1b(name, S, M):
    s = sch.make(name, S, M)
    assert s.num_ticks == 2 * (M + S - 1)
    assert bubble(s) == Fraction(S - 1, M + S - 1)
    assert sch.bubble_fraction(s) == pytest.approx((S - 1) / (M + S - 1))


@pytest.mark.parametrize("V", [2, 3, 4])
@pytest.mark.parametrize("S", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES + (5, 6, 7))
def test_bubble_interleaved(V, S, M):
    s = sch.interleaved_1f1b(S, M, V)
    assert s.num_ticks == 2 * max(V * M + S - 1, V * S + M - 1)
    expected = Fraction(S - 1, V * M + S - 1) if M >= S else Fraction(V * (S - M) + M - 1, V * S + M - 1)
    assert bubble(s) == expected
    flat = sch.one_f_one_b(S, M)
    if S >= 2 and M >= 2:  # interleaving pays off once there are two micro-batches and two stages
        assert sch.bubble_fraction(s) < sch.bubble_fraction(flat)
    else:
        assert sch.bubble_fraction(s) == pytest.approx(sch.bubble_fraction(flat))


def test_interleaved_with_one_chunk_is_1f1b():
    assert sch.make("interleaved", 3, 4, 1).grid == sch.one_f_one_b(3, 4).grid


def test_interleaved_megatron_order():
    # S | M: groups of S micro-batches, chunk 0 then chunk 1 forwards, warm-up 2*(S-s-1) + (V-1)*S on stage s
    s = sch.interleaved_1f1b(2, 4, 2)
    prog0 = [a for row in s.grid for a in row[:1] if a]
    assert prog0[:6] == acts("0F0 0F1 0F0c1 0F1c1 0F2 0B0c1")
    assert [a for row in s.grid for a in row[1:] if a][:5] == acts("1F0 1F1 1F0c1 1B0c1 1F1c1")


@pytest.mark.parametrize("S", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_peak_inflight(S, M):
    assert sch.peak_inflight(sch.one_f_one_b(S, M)) == [min(S - s, M) for s in range(S)]
    assert sch.peak_inflight(sch.gpipe(S, M)) == [M] * S
    assert sch.peak_inflight(sch.one_f_one_b(S, M))[0] <= S


def test_grid_text_and_table():
    s = sch.one_f_one_b(2, 3)
    assert sch.grid_text(s) == str(s) == ONE_F_ONE_B_2x3
    assert s.table()[:3] == [[(1, 0, 0), (0, 0, 0)], [(1, 1, 0), (1, 0, 0)], [(0, 0, 0), (2, 0, 0)]]
    assert s.table(idle=(0, -1, -1))[0][1] == (0, -1, -1)
    assert sch.interleaved_1f1b(2, 2, 2).table()[2][0] == (sch.FORWARD, 0, 1)
    marked = sch.grid_text(s, (3, 0)).splitlines()
    assert ">B0<" in marked[1] and marked[-1].strip() == "^"
    assert marked[-1].index("^") == marked[0].index(" 3 ") + 1


def test_transfers_and_buffer_slots():
    s = sch.one_f_one_b(2, 3)
    assert [(x.kind, repr(x.src), repr(x.dst), x.send_tick, x.use_tick) for x in sch.transfers(s)][:3] == [
        ("act", "0F0", "1F0", 0, 1), ("act", "0F1", "1F1", 1, 3), ("grad", "1B0", "0B0", 2, 3)]
    assert sch.buffer_slots(s, "act") == [0, 1]
    assert sch.buffer_slots(s, "grad") == [1, 0]
    assert sch.buffer_slots(s) == [1, 1]
    assert sch.buffer_slots(sch.gpipe(3, 4), "act") == [0, 1, 1]  # consumed at the next tick
    assert sch.buffer_slots(sch.one_f_one_b(1, 4)) == [0]
    one = sch.interleaved_1f1b(1, 2, 2)  # F0 F0c1 B0c1 F1 B0 F1c1 B1c1 B1: chunk to chunk on one stage
    assert [(x.send_tick, x.use_tick) for x in sch.transfers(one)] == [(0, 1), (2, 4), (3, 5), (6, 7)]
    assert sch.buffer_slots(one) == [2]  # gradient 0 (ticks 3-4) overlaps activation 1 (ticks 4-5)
    for x in sch.transfers(sch.interleaved_1f1b(4, 8, 2)):
        assert x.use_tick > x.send_tick
    with pytest.raises(ValueError, match="kind="):
        sch.buffer_slots(s, "activation")


def test_action_repr_and_parse():
    assert repr(Action(1, Op.F, 3)) == "1F3" == str(Action(1, Op.F, 3))
    assert repr(Action(1, Op.B, 3, 1)) == "1B3c1"
    assert repr(Action(0, Op.OPT)) == "0OPT" and repr(Action(2, Op.SEND_ACT, 0)) == "2SA0"
    for a in [Action(1, Op.F, 3), Action(0, Op.RECV_GRAD, 2, 3), Action(4, Op.REDUCE_GRADS), Action(0, Op.LOAD, 7)]:
        assert Action.parse(repr(a)) == a
    for bad in ("F3", "1X3"):
        with pytest.raises(ValueError, match=f"text='{bad}' is not an action"):
            Action.parse(bad)


def test_add_communication():
    c = sch.add_communication(sch.one_f_one_b(2, 3))
    assert c.grid == sch.one_f_one_b(2, 3).grid and sch.add_communication(c) == c
    assert sch.stage_program(c, 0) == [acts(x) for x in [
        "0L0 0F0 0SA0", "0L1 0F1 0SA1", "", "0RG0 0B0", "0L2 0F2 0SA2", "0RG1 0B1", "", "0RG2 0B2 0RED 0OPT"]]
    assert sch.stage_program(c, 1)[1:3] == [acts("1L0 1RA0 1F0"), acts("1B0 1SG0")]
    ring = sch.add_communication(sch.interleaved_1f1b(2, 2, 2))  # stage 1 chunk 0 -> stage 0 chunk 1
    flat = [a for row in ring.steps for ins in row for a in ins]
    assert Action(1, Op.SEND_ACT, 0, 0) in flat and Action(0, Op.RECV_ACT, 0, 1) in flat
    assert Action(0, Op.LOAD, 0, 0) in flat and Action(1, Op.LOAD, 0, 1) in flat  # inputs, labels
    with pytest.raises(ValueError, match="stage=2"):
        sch.stage_program(c, 2)


def test_swapped_backward_fails_rule_2():
    s = sch.one_f_one_b(2, 3)
    bad = with_grid(s, ["F0 .", "F1 B0", ". F0", "B0 F1", "F2 B1", "B1 F2", ". B2", "B2 ."])
    with pytest.raises(ScheduleError) as e:
        sch.validate(bad)
    assert e.value.rule == 2 and e.value.cells == [(1, 1)]
    msg = str(e.value).splitlines()
    assert msg[0].startswith("rule 2 (F runs before B") and "1B0 at tick 1" in msg[0]
    assert ">B0<" in msg[3] and msg[3].startswith("stage 1") and msg[-1].strip() == "^"


@pytest.mark.parametrize("rows,rule", [
    (["F0 F0", ". B0", "B0 ."], 3),            # stage 1 forwards at the same tick as stage 0
    (["F0 .", ". F0", "B0 B0"], 4),            # stage 0 backwards at the same tick as stage 1
    (["F0 .", ". F0", ". B0", "B0 .", "B0 ."], 1),  # a backward twice
    (["F0 .", ". F0", ". B0"], 1),             # a backward missing
    (["F0 .", ". F0", ". B0", "B0 .", ". F1"], 1),  # micro-batch out of range
])
def test_rules_1_3_4(rows, rule):
    with pytest.raises(ScheduleError, match=f"^rule {rule} ") as e:
        sch.validate(with_grid(sch.gpipe(2, 1), rows))
    assert e.value.rule == rule


def test_rule_5_wrong_stage_and_stale_steps():
    s = sch.gpipe(2, 1)
    grid = list(s.grid)
    grid[0] = (Action(1, Op.F, 0), None)
    with pytest.raises(ScheduleError, match="^rule 5 "):
        sch.validate(dataclasses.replace(s, grid=tuple(grid), steps=()))
    with pytest.raises(ScheduleError, match="^rule 5 "):  # steps that disagree with the grid
        sch.validate(dataclasses.replace(s, grid=tuple(reversed(s.grid))))


def test_malformed_tables_get_a_schedule_error_not_a_python_one():
    """A tick with fewer cells than stages, a cell written as the grid prints it ("F0"), a count of 0: each is one
    ScheduleError naming the tick, cell or count (they were IndexError / AttributeError, or accepted; QA 51)."""
    base = sch.one_f_one_b(2, 2)
    grid = [list(row) for row in base.grid]
    cases = [(grid + [[None]], r"tick 6 has 1 grid cells for 2 stages; give every tick one cell per stage"),
             (grid + [["F0", None]], r"stage 0 at tick 6 holds 'F0', not an Action or None; write it as "
                                     r"Action.parse\('0F0'\)")]
    for rows, match in cases:
        with pytest.raises(ScheduleError, match=match):
            sch.validate(dataclasses.replace(base, grid=tuple(map(tuple, rows)), steps=()))
    with pytest.raises(ScheduleError, match=r"num_stages=0 must be an int >= 1; pass a positive count"):
        sch.validate(sch.Schedule("empty", 0, 1, 1, ()))
    with pytest.raises(ScheduleError, match=r"stage 1's instructions at tick 0 hold 'x', not an Action"):
        sch.validate(dataclasses.replace(base, steps=((base.steps[0][0], ("x",)),) + base.steps[1:]))
    assert sch.validate(base) is base


def test_instruction_lists_that_do_not_match_the_grid_in_shape_are_rule_5():
    """steps with a tick more than the grid (an extra forward the engine would run), a tick less, or a tick with a
    list for a stage that does not exist: each is rule 5, not accepted (the dry run reads only stages 0..S-1) and not
    an IndexError."""
    c = sch.add_communication(sch.gpipe(2, 1))
    assert c.num_ticks == 4
    extra_tick = c.steps + (((Action(0, Op.F, 0),), ()),)
    with pytest.raises(ScheduleError, match=r"^rule 5 .*: 5 instruction ticks for 4 grid ticks"):
        sch.validate(dataclasses.replace(c, steps=extra_tick))
    with pytest.raises(ScheduleError, match=r"^rule 5 .*: 3 instruction ticks for 4 grid ticks"):
        sch.validate(dataclasses.replace(c, steps=c.steps[:-1]))
    third_stage = (c.steps[0] + ((Action(2, Op.F, 0),),),) + c.steps[1:]
    with pytest.raises(ScheduleError, match=r"^rule 5 .*: tick 0 has 2 grid cells and 3 instruction lists for 2 "
                                            r"stages"):
        sch.validate(dataclasses.replace(c, steps=third_stage))
    assert sch.validate(c) is c


def test_a_chunk_the_schedule_does_not_have_is_rule_1():
    """An action of chunk 1 in a schedule of one chunk per stage is rule 1 (named with the chunks allowed), not a
    deadlock found later by the dry run (its receive from virtual stage 1 has no sender)."""
    rows = ["F0 .", ". F0", ". B0", "B0 .", "F0c1 ."]
    with pytest.raises(ScheduleError, match=r"^rule 1 .*0F0c1 occurs 1 times \(micro-batches 0..0, chunks 0..0,"):
        sch.validate(with_grid(sch.gpipe(2, 1), rows))


def test_dry_run_detects_deadlock():
    c = sch.add_communication(sch.one_f_one_b(2, 3))
    steps = [list(map(list, row)) for row in c.steps]
    steps[0][0].insert(0, steps[3][0].pop(0))  # stage 0 waits for gradient 0 before sending activation 0
    bad = dataclasses.replace(c, steps=tuple(tuple(map(tuple, row)) for row in steps))
    with pytest.raises(ScheduleError, match=r"^rule 6 .*stage 0 blocks at 0RG0 \(tick 0\) waiting for 1SG0; "
                                            r"stage 1 blocks at 1RA0 \(tick 1\) waiting for 0SA0\n") as e:
        sch.validate(bad)  # each blocked receive names the send it waits for: a gradient from v+1, an activation v-1
    assert e.value.cells == [(0, 0), (1, 1)]
    assert ">F0<" in str(e.value)
    steps = [list(map(list, row)) for row in c.steps]
    steps[3][0].pop(0)  # gradient 0 is sent but never received
    with pytest.raises(ScheduleError, match="^rule 6 .*never received"):
        sch.validate(dataclasses.replace(c, steps=tuple(tuple(map(tuple, row)) for row in steps)))


def test_programs_that_deadlock():
    # stage 0 waits for 1B0 before forwarding 1; stage 1 waits for 0F1 before its B0
    with pytest.raises(ScheduleError, match="^rule 6 .*deadlock at tick 1") as e:
        sch.from_programs([acts("0F0 0B0 0F1 0B1"), acts("1F1 1F0 1B0 1B1")])
    assert e.value.cells == [(1, 0), (1, 1)]
    with pytest.raises(ScheduleError, match="^rule 1 .*0B1 never runs"):
        sch.from_programs([acts("0F0 0F1 0B0"), acts("1F0 1F1 1B0 1B1")])
    with pytest.raises(ScheduleError, match=r"^rule 5 .*program of stage 0 holds 1F0: programs hold compute actions "
                                            r"of their own stage"):
        sch.from_programs([acts("1F0 0B0"), acts("1F0 1B0")])
    with pytest.raises(ScheduleError, match=r"^rule 1 .*0I0 never runs"):  # a W alone reads as a split backward
        sch.from_programs([acts("0F0 0W0"), acts("1F0 1W0")])
    custom = sch.from_programs([acts("0F0 0F1 0B0 0B1"), acts("1F0 1B0 1F1 1B1")])
    assert sch.validate(custom).num_ticks == 6


def test_render_png(tmp_path):
    for s in (sch.one_f_one_b(4, 8), sch.interleaved_1f1b(2, 4, 2)):
        path = tmp_path / f"{s.name}.png"
        assert sch.render(s, str(path)) == str(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_render_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install jaxpar\[plot\]"):
        sch.render(sch.gpipe(2, 2), str(tmp_path / "x.png"))


@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 2), "schedule 'pipedream' is not known"),
    (("1f1b", 0, 2), "num_stages=0 must be an int >= 1"),
    (("gpipe", 2, 0), "num_microbatches=0"),
    (("1f1b", 2, "4"), "num_microbatches='4'"),
    (("1f1b", True, 4), "num_stages=True"),
    (("interleaved", 2, 4, 0), "virtual_stages=0"),
    (("gpipe", 2, 4, 2), "virtual_stages=2 .*use name='interleaved'"),
])
def test_make_argument_errors(args, match):
    with pytest.raises(ValueError, match=match):
        sch.make(*args)


def test_no_jax_import():
    root = pathlib.Path(sch.__file__).parent
    for name in ("schedule.py", "render.py", "generators.py", "analysis.py"):
        tree = ast.parse((root / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in mods if m.split(".")[0] in ("jax", "numpy", "flax")}, name


# ---- zero bubble (I and W), forward-only, costs ------------------------------------------------------------

@pytest.mark.parametrize("S", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES + (5,))
def test_zb_h1_validates_and_holds_at_most_s(S, M):
    z = sch.zb_h1(S, M)
    assert sch.validate(z) is z and z.backward == "IW"
    sch.validate(sch.add_communication(z))
    for st in range(S):  # every micro-batch: one F, one I, one W on every stage
        assert sorted(a.op.value for a in z.program(st)) == sorted("FIW" * M)
    assert max(sch.peak_inflight(z)) <= S == max(sch.peak_inflight(sch.one_f_one_b(S, max(M, S))))
    if M >= S:  # the zero-bubble paper's (S-1)(T_F + T_B - T_W) idle per stage, with T_F = T_B = T_W
        assert bubble(z) == Fraction(S - 1, 3 * M + S - 1)
        assert sch.bubble_fraction(z, sch.COSTS) == pytest.approx((S - 1) / (3 * M + S - 1))


def test_zb_h1_bubble_below_1f1b_at_4_stages_8_micro_batches():
    z, o = sch.zb_h1(4, 8), sch.one_f_one_b(4, 8)
    assert sch.bubble_fraction(z) == pytest.approx(3 / 27) and sch.bubble_fraction(o) == pytest.approx(3 / 11)
    # the same clock for both: F = I = W = 1, a fused B = 2 (the grid's clock gives B one tick)
    assert sch.bubble_fraction(z, sch.COSTS) == pytest.approx(3 / 27)
    assert sch.bubble_fraction(o, sch.COSTS) == pytest.approx(3 / 11)
    assert sch.peak_inflight(z) == [4, 4, 4, 4] and sch.peak_inflight(o) == [4, 3, 2, 1]
    # the authors' ZB-H1 (their Megatron-LM fork): 1F1B's order; stage s defers the W's of its first s micro-batches
    # and of its last, the others follow their I at once; in the cool-down each I releases the oldest deferred W
    assert " ".join(a.cell for a in z.program(0)) == \
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7"
    assert " ".join(a.cell for a in z.program(1)) == \
        "F0 F1 F2 I0 F3 I1 W1 F4 I2 W2 F5 I3 W3 F6 I4 W4 F7 I5 W0 I6 W5 I7 W6 W7"
    assert " ".join(a.cell for a in z.program(3)) == \
        "F0 I0 F1 I1 F2 I2 F3 I3 W3 F4 I4 W4 F5 I5 W5 F6 I6 W6 F7 I7 W0 W1 W2 W7"


def test_split_backward_communication_and_rules():
    c = sch.add_communication(sch.zb_h1(2, 2))
    assert sch.stage_program(c, 1)[2] == acts("1I0 1SG0") and sch.stage_program(c, 1)[5] == acts("1W0")
    assert sch.stage_program(c, 0)[3] == acts("0RG0 0I0") and sch.stage_program(c, 0)[-1] == acts("0W1 0RED 0OPT")
    z = sch.zb_h1(2, 1)  # the input gradient goes upstream before the weight gradient is computed
    assert [[a.cell if a else "." for a in row] for row in z.grid] == [["F0", "."], [".", "F0"], [".", "I0"],
                                                                       ["I0", "W0"], ["W0", "."]]
    bad = dataclasses.replace(z, grid=((Action(0, Op.F, 0), None), (None, Action(1, Op.F, 0)),
                                       (None, Action(1, Op.W, 0)), (Action(0, Op.I, 0), Action(1, Op.I, 0)),
                                       (Action(0, Op.W, 0), None)), steps=())
    with pytest.raises(ScheduleError, match="^rule 2 .*1W0 at tick 2 must follow 1I0"):
        sch.validate(bad)  # W before its own I
    mixed = dataclasses.replace(z, grid=z.grid[:4] + ((Action(0, Op.B, 0), None),), steps=())
    with pytest.raises(ScheduleError, match="^rule 1 .*0B0 occurs"):
        sch.validate(mixed)  # a fused B in a split schedule


@pytest.mark.parametrize("S", STAGES + (5,))
@pytest.mark.parametrize("M", MICROBATCHES + (5, 9))
def test_zb_v_validates_and_holds_1f1b_memory(S, M):
    z = sch.zb_v(S, M)
    assert sch.validate(z) is z and sch.validate(sch.add_communication(z))
    assert (z.placement, z.virtual_stages, z.backward) == ("v", 2, "IW")
    for st in range(S):  # every micro-batch: F, I, W of both chunks on every stage
        assert sorted(a.op.value + str(a.chunk) for a in z.program(st)) == sorted(["F0", "I0", "W0", "F1", "I1",
                                                                                     "W1"] * M)
    # at most 2S chunk activations (half a stage each) held: 1F1B's S full stages
    assert max(sch.peak_inflight(z)) <= 2 * S
    if M >= 2 * S - 1:  # S-1 idle ticks per stage of 6M+S-1: half ZB-H1's (S-1)/(3M+S-1) in time
        assert z.num_ticks == 6 * M + S - 1
        assert bubble(z) == Fraction(S - 1, 6 * M + S - 1)
        if S > 1:
            assert sch.bubble_fraction(z, sch.COSTS) < sch.bubble_fraction(sch.zb_h1(S, M), sch.COSTS)


def test_zb_v_is_torchs_program_on_every_rank():
    """Each stage's program as torch 2.13's ScheduleZBVZeroBubble builds it (its
    _calculate_single_rank_operations, written out here; equal for every S <= 5, M <= 12 in a scratch run against
    torch itself): the cool-down's (I, W) pairs of chunk 0 and the W's left to the end; c1 marks chunk 1."""
    torch = {
        (2, 4): ["F0 F1 F2 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 F3 I0 W0 F2c1 I2c1 W2c1 I1 W1 F3c1 I3c1 W3c1 I2 W2 I3 W3",
                 "F0 F0c1 F1 F1c1 I0c1 W0c1 F2 I0 W0 F2c1 I1c1 W1c1 F3 I1 W1 F3c1 I2c1 W2c1 I2 I3c1 I3 W2 W3c1 W3"],
        (4, 8): ["F0 F1 F2 F3 F4 F5 F6 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 F2c1 I2c1 W2c1 F3c1 I3c1 W3c1 F7 I0 W0 F4c1 "
                 "I4c1 W4c1 I1 W1 F5c1 I5c1 W5c1 I2 W2 F6c1 I6c1 W6c1 I3 W3 F7c1 I7c1 W7c1 I4 W4 I5 W5 I6 W6 I7 W7",
                 "F0 F1 F2 F3 F4 F0c1 F5 F1c1 I0c1 W0c1 F2c1 I1c1 W1c1 F3c1 I2c1 W2c1 F6 I0 W0 F4c1 I3c1 W3c1 F7 I1 "
                 "W1 F5c1 I4c1 W4c1 I2 W2 F6c1 I5c1 W5c1 I3 W3 F7c1 I6c1 W6c1 I4 I7c1 I5 W4 I6 W5 I7 W6 W7c1 W7",
                 "F0 F1 F2 F0c1 F3 F1c1 F4 F2c1 I0c1 W0c1 F3c1 I1c1 W1c1 F5 I0 W0 F4c1 I2c1 W2c1 F6 I1 W1 F5c1 I3c1 "
                 "W3c1 F7 I2 W2 F6c1 I4c1 W4c1 I3 W3 F7c1 I5c1 W5c1 I4 I6c1 I5 I7c1 I6 W4 I7 W5 W6c1 W7c1 W6 W7",
                 "F0 F0c1 F1 F1c1 F2 F2c1 F3 F3c1 I0c1 W0c1 F4 I0 W0 F4c1 I1c1 W1c1 F5 I1 W1 F5c1 I2c1 W2c1 F6 I2 W2 "
                 "F6c1 I3c1 W3c1 F7 I3 W3 F7c1 I4c1 W4c1 I4 I5c1 I5 I6c1 I6 I7c1 I7 W4 W5c1 W6c1 W7c1 W5 W6 W7"],
    }
    for (S, M), programs in torch.items():
        z = sch.zb_v(S, M)
        assert [" ".join(a.cell for a in z.program(st)) for st in range(S)] == programs


def test_zb_v_placement():
    S = 3
    assert [sch.virtual(sch.Action(s, Op.F, 0, c), S, "v") for c in (0, 1) for s in range(S)] == [0, 1, 2, 5, 4, 3]
    assert [sch.at(v, Op.F, 0, S, "v").stage for v in range(2 * S)] == [0, 1, 2, 2, 1, 0]
    assert [sch.virtual(sch.Action(s, Op.F, 0, 1), S) for s in range(S)] == [3, 4, 5]  # loop: unchanged
    # more chunks zigzag: the even ones run down the stages, the odd ones back up; stage_of inverts virtual
    assert [sch.virtual(sch.Action(s, Op.F, 0, c), S, "v") for c in range(4) for s in range(S)] == \
        [0, 1, 2, 5, 4, 3, 6, 7, 8, 11, 10, 9]
    assert [sch.stage_of(v, S, "v") for v in range(4 * S)] == [0, 1, 2, 2, 1, 0] * 2
    z = sch.add_communication(sch.zb_v(S, 5))
    crossing = [(x.src.stage, x.dst.stage) for x in sch.transfers(z) if x.kind == "act"]
    assert (2, 2) in crossing and all(abs(a - b) <= 1 for a, b in crossing)  # neighbours only; S-1 keeps its own
    first = [a.cell for a in z.program(0)[:6]]  # stage 0: 2S-1 chunk-0 forwards, then F I W of chunk 1
    assert first == ["F0", "F1", "F2", "F3", "F4", "F0c1"]
    with pytest.raises(ValueError, match="zbv runs two chunks per stage"):
        sch.make("zbv", 2, 4)
    with pytest.raises(ValueError, match="placement='w' must be one of"):
        dataclasses.replace(z, placement="w")
    # a V schedule read as a loop one breaks the rules: the placement is part of the data
    with pytest.raises(ScheduleError):
        sch.validate(dataclasses.replace(sch.zb_v(2, 3), placement="loop"))


@pytest.mark.parametrize("S,M,V", [(1, 1, 1), (3, 4, 1), (2, 3, 2)])
def test_forward_only(S, M, V):
    f = sch.make("forward", S, M, V)
    assert sch.validate(f) is f and not f.training and f.backward == ""
    assert f.num_ticks == V * M + S - 1
    c = sch.add_communication(f)
    ops = {a.op for row in c.steps for ins in row for a in ins}
    assert ops <= {Op.LOAD, Op.F, Op.SEND_ACT, Op.RECV_ACT} and Op.F in ops  # no backward, no optimizer step
    sch.validate(c)
    assert sch.peak_inflight(f) == [1] * S
    with pytest.raises(ScheduleError, match="^rule 1 .*0B0 occurs"):  # a forward-only schedule holds no B
        sch.validate(dataclasses.replace(f, grid=f.grid + ((Action(0, Op.B, 0),) + (None,) * (S - 1),), steps=()))


@pytest.mark.parametrize("name,V", GENERATORS + [("zbh1", 1)])
def test_simulate_with_unit_costs_is_the_grid(name, V):
    s = sch.make(name, 4, 6, V)
    span, total = sch.simulate(s)
    assert total == s.num_ticks
    assert all(span[a][0] == t for t, row in enumerate(s.grid) for a in row if a)
    # a fused backward costing two forwards: 1F1B's and GPipe's bubble fraction stays (S-1)/(M+S-1)
    if name in ("gpipe", "1f1b"):
        assert sch.bubble_fraction(s, sch.COSTS) == pytest.approx(3 / 9)


def test_make_knows_the_new_schedules():
    assert sch.make("zbh1", 2, 3).name == "zbh1" and sch.make("forward", 2, 3).name == "forward"
    assert sch.make("zbv", 2, 3, 2).name == "zbv"
    assert sch.zb_h1(3, 4).table()[3][2] == (sch.INPUT_GRAD, 0, 0)  # the last stage's I0 right after its F0
    assert sch.zb_h1(3, 4).table()[8][2] == (sch.WEIGHT_GRAD, 2, 0)  # W0 and W1 deferred, W2 at once after I2
    assert sch.zb_h1(3, 4).table()[11][2] == (sch.WEIGHT_GRAD, 0, 0)
    with pytest.raises(ValueError, match="virtual_stages=2 needs model chunks"):
        sch.make("zbh1", 2, 4, 2)


def test_simulate_gives_a_fused_backward_its_cost_on_the_time_axis():
    # (QA59) COSTS reach the replay: 1F1B's makespan under F = 1, B = 2 is 3 (M + S - 1), not the grid's 2 (M + S - 1)
    o = sch.one_f_one_b(4, 8)
    span, total = sch.simulate(o, sch.COSTS)
    assert sch.simulate(o)[1] == 22 and total == 33
    assert span[Action(0, Op.B, 0)] == (10.0, 12.0)  # stage 0's first backward waits for 3 downstream B's of 2


def test_zb_h1_with_fewer_micro_batches_than_stages_releases_the_deferred_ws_in_the_cool_down():
    # (QA59) M < S: stage s's cool-down I of micro-batch s (and later) releases the oldest deferred W at once
    z = sch.zb_h1(4, 3)
    assert " ".join(a.cell for a in z.program(1)) == "F0 F1 F2 I0 I1 W0 I2 W1 W2"
    assert z.num_ticks == 13 and sch.bubble_fraction(z, sch.COSTS) == pytest.approx(4 / 13)


def test_transfers_of_a_split_backward_go_from_i_to_the_upstream_i():
    # (QA59) the input gradient is consumed by the previous stage's I (its W waits for nothing downstream)
    z = sch.zb_h1(2, 2)
    assert [(x.kind, repr(x.src), repr(x.dst), x.send_tick, x.use_tick) for x in sch.transfers(z)] == [
        ("act", "0F0", "1F0", 0, 1), ("act", "0F1", "1F1", 1, 3), ("grad", "1I0", "0I0", 2, 3),
        ("grad", "1I1", "0I1", 4, 5)]
    assert sch.buffer_slots(sch.zb_h1(4, 8), "grad") == [1, 1, 1, 0]


# ---- every weight gradient at the flush ---------------------------------------------------------------------

@pytest.mark.parametrize("name,V", GENERATORS + [("zbh1", 1), ("zbv", 2)])
@pytest.mark.parametrize("S", (1, 2, 4))
@pytest.mark.parametrize("M", (1, 3, 8))
def test_defer_wgrad_moves_every_w_after_the_stages_last_input_gradient(name, V, S, M):
    """Each B becomes its I in place and every W follows the stage's last I, chunk by chunk, micro-batches in
    order: the stage's program otherwise unchanged, valid, holding all M micro-batches (GPipe's memory)."""
    base = sch.make(name, S, M, V)
    d = sch.defer_wgrad(base)
    assert sch.validate(sch.add_communication(d)) and d.name == f"{name}+dw" and d.backward == "IW"
    assert (d.num_stages, d.num_microbatches, d.virtual_stages, d.placement) == \
        (base.num_stages, base.num_microbatches, base.virtual_stages, base.placement)
    for st in range(S):
        prog, was = d.program(st), base.program(st)
        n = len([a for a in prog if a.op is Op.I])
        assert n == M * V and all(a.op is Op.W for a in prog[-M * V:])  # every W after the last I
        assert [(a.op, a.microbatch, a.chunk) for a in prog[:-M * V]] == \
            [(Op.I if a.op is Op.B else a.op, a.microbatch, a.chunk) for a in was if a.op is not Op.W]
        ws = [(a.chunk, a.microbatch) for a in prog[-M * V:]]
        chunks = list(dict.fromkeys(a.chunk for a in prog if a.op is Op.I))
        assert ws == sorted(ws, key=lambda cm: (chunks.index(cm[0]), cm[1]))  # one run per chunk
    assert sch.peak_inflight(d) == [M * V] * S  # every (micro-batch, chunk) held until the flush


def test_defer_wgrad_bubble_and_refusal():
    """1F1B at S=2, M=8 with its W's at the flush: under F = I = W = 1 the last stage's I's come back sooner
    than B's and the W's fill the cool-down, so each stage idles 2 of the step's 26 units (1/13) against 1F1B's
    1/9; GPipe the same. A forward-only schedule has nothing to defer."""
    for name in ("1f1b", "gpipe"):
        base, d = sch.make(name, 2, 8), sch.defer_wgrad(sch.make(name, 2, 8))
        assert sch.bubble_fraction(base, sch.COSTS) == pytest.approx(1 / 9)
        assert sch.bubble_fraction(d, sch.COSTS) == pytest.approx(1 / 13)
    assert " ".join(a.cell for a in sch.defer_wgrad(sch.one_f_one_b(2, 3)).program(0)) == \
        "F0 F1 I0 F2 I1 I2 W0 W1 W2"
    with pytest.raises(ValueError, match="forward-only schedule has no weight gradients"):
        sch.defer_wgrad(sch.forward_only(2, 4))
    # the name round-trips: make() builds it back, and deferring twice is deferring once
    d = sch.defer_wgrad(sch.make("zbv", 2, 4, 2))
    assert sch.make("zbv+dw", 2, 4, 2) == d == sch.defer_wgrad(d) and d.name == "zbv+dw"
    with pytest.raises(ValueError, match=r"schedule '\+dw' is not known"):
        sch.make("+dw", 2, 4)


def test_a_receive_at_a_tick_before_its_send_is_refused():
    """The engine walks the ticks in order: a receive placed before its send (which the blocking dry run alone
    would let through) found nothing and raised deep inside a step; validate() refuses it, naming both."""
    from jaxpar.pipeline.schedule import Action, ScheduleError, add_communication, one_f_one_b, validate
    s = add_communication(one_f_one_b(2, 2))
    for recv, src, dst in (("0RG0", 3, 1), ("1RA1", 3, 0)):
        steps = [[list(ins) for ins in row] for row in s.steps]
        steps[src][int(recv[0])].remove(Action.parse(recv))
        steps[dst][int(recv[0])].append(Action.parse(recv))
        bad = dataclasses.replace(s, steps=tuple(tuple(map(tuple, row)) for row in steps))
        with pytest.raises(ScheduleError, match=rf"rule 6 .* {recv} at tick {dst} receives before \dS[AG]\d sends"):
            validate(bad)


def test_rule_1_to_5_errors_say_how_to_fix_the_schedule():
    """Each rule's message ends in the fix for that case: a duplicate (keep one), a micro-batch or chunk the schedule
    was not built for (its count), an op of the other backward kind (the backward to build), a missing action (add
    it to its stage's row), an order rule (which tick to move it to), and instructions out of step with an edited
    grid (re-derive them)."""
    base = sch.gpipe(2, 1)
    cases = [
        (["F0 .", ". F0", ". B0", "B0 .", "F0 ."], r"rule 1 .*0F0 occurs 2 times .*; keep one 0F0 and make the other "
                                                   r"cells None"),
        (["F0 .", ". F0", ". B0", "B0 .", "F1 ."], r"rule 1 .*0F1 occurs 1 times .*; remove it, or build the schedule "
                                                   r"with num_microbatches=2 or more"),
        (["F0 .", ". F0", ". B0", "B0 .", "F0c1 ."], r"rule 1 .*; remove it, or build the schedule with "
                                                     r"virtual_stages=2 or more"),
        (["F0 .", ". F0", ". B0", "B0 .", "W0 ."], r"rule 1 .*0W0 occurs 1 times .*; remove it, or build the schedule "
                                                   r"with backward='IW'"),
        (["F0 .", ". F0", ". B0", ". ."], r"rule 1 .*0B0 never runs; add it to stage 0's row at a tick after its "
                                          r"dependencies"),
        (["F0 .", ". F0", "B0 B0"], r"rule 4 .*0B0 at tick 2 must follow 1B0 at tick 2; move 0B0 to a tick after 2 "
                                    r"\(or 1B0 before 2\)"),
    ]
    for rows, message in cases:
        with pytest.raises(ScheduleError, match="^" + message):
            sch.validate(with_grid(base, rows))
    c = sch.add_communication(base)
    with pytest.raises(ScheduleError, match=r"^rule 5 .*: 3 instruction ticks for 4 grid ticks; after editing the "
                                            r"grid, re-derive the instructions: dataclasses.replace\(schedule, "
                                            r"grid=new_grid, steps=\(\)\)"):
        sch.validate(dataclasses.replace(c, steps=c.steps[:-1]))
    moved = dataclasses.replace(c, grid=(c.grid[1],) + (c.grid[0],) + c.grid[2:])
    with pytest.raises(ScheduleError, match=r"^rule 5 .*compute instructions .*; a cell holds one compute action of "
                                            r"its own stage, .*re-derive them"):
        sch.validate(moved)
