"""Draw a pipeline schedule: the text grid (``grid_text``) and the timeline PNG (``render``, needs matplotlib).

Works on any object with jaxpar.pipeline.schedule.Schedule's fields; matplotlib is imported only inside ``render``.
"""
from __future__ import annotations

from typing import Iterable

_HATCHES = ("", "//", "..", "xx", "\\\\", "++")  # one per model chunk (interleaved schedules)


def grid_text(schedule, mark: tuple[int, int] | Iterable[tuple[int, int]] | None = None) -> str:
    """Rows = stages, columns = ticks, cells ``F3`` / ``B3`` / ``.``; cells in ``mark`` ((tick, stage) pairs)
    print as ``>B3<`` with a caret under their tick column."""
    marks = set() if mark is None else {tuple(mark)} if isinstance(next(iter(mark), None), int) else set(mark)
    T, S = schedule.num_ticks, schedule.num_stages
    w = max([len(a.cell) for row in schedule.grid for a in row if a] + [len(str(T - 1)), 1]) + 2
    lines = [("tick".ljust(9) + "".join(str(t).center(w) for t in range(T))).rstrip()]
    for s in range(S):
        cells = [schedule.grid[t][s].cell if schedule.grid[t][s] else "." for t in range(T)]
        cells = [f">{c}<" if (t, s) in marks else c for t, c in enumerate(cells)]
        lines.append((f"stage {s}".ljust(9) + "".join(c.center(w) for c in cells)).rstrip())
    ticks = {t for t, _ in marks}
    if ticks:
        lines.append((" " * 9 + "".join(("^" if t in ticks else "").center(w) for t in range(T))).rstrip())
    return "\n".join(lines)


def _blend(rgb, toward: float, amount: float) -> tuple[float, float, float]:
    return tuple(c + (toward - c) * amount for c in rgb[:3])


def render(schedule, path: str, *, title: str | None = None, dpi: int = 120) -> str:
    """Draw the timeline as a PNG at ``path`` (like DeepSpeed's pipeline figure) and return ``path``.

    One row per stage (stage 0 on top), one column per tick; each F / B / I / W is a box coloured by
    micro-batch, forward lighter and backward darker (a deferred W light and dotted), labelled like the text grid;
    chunks c > 0 are hatched.
    """
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ImportError("render() draws with matplotlib, an optional extra; install it with "
                          "`pip install jaxpar[plot]` (or use grid_text() for a text grid)") from e
    from jaxpar.pipeline.schedule import Op, bubble_fraction

    T, S, M = schedule.num_ticks, schedule.num_stages, schedule.num_microbatches
    cmap = colormaps["tab10" if M <= 10 else "tab20"]
    fig = Figure(figsize=(max(6.0, 0.5 * T + 1.5), 0.6 * S + 1.4))
    ax = fig.add_subplot()
    for t, row in enumerate(schedule.grid):
        for s, a in enumerate(row):
            if a is None:
                continue
            base = cmap(a.microbatch % cmap.N)
            light = a.op in (Op.F, Op.W)  # F and the deferred W light, B and I (the critical path) dark
            face = _blend(base, 1.0, 0.45 if a.op is Op.F else 0.15) if light else _blend(base, 0.0, 0.3)
            hatch = ".." if a.op is Op.W else _HATCHES[a.chunk % len(_HATCHES)]
            ax.add_patch(Rectangle((t, s), 1, 1, facecolor=face, edgecolor="black", linewidth=0.6, hatch=hatch))
            ax.text(t + 0.5, s + 0.5, a.cell, ha="center", va="center", fontsize=7 if len(a.cell) < 4 else 6,
                    color="black" if light else "white",
                    bbox=dict(boxstyle="square,pad=0.1", facecolor=face, edgecolor="none"))
    ax.set_xlim(0, T)
    ax.set_ylim(S, 0)
    ax.set_xticks([t + 0.5 for t in range(T)], [str(t) for t in range(T)], fontsize=7)
    ax.set_yticks([s + 0.5 for s in range(S)], [f"stage {s}" for s in range(S)])
    ax.set_xlabel("tick")
    ax.set_title(title or f"{schedule.name}: S={S}, M={M}, V={schedule.virtual_stages}, "
                          f"{T} ticks, bubble {bubble_fraction(schedule):.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return str(path)
