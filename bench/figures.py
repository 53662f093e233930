"""Draw the README's pictures from jaxpar's own code (matplotlib: `pip install -e ".[plot]"`).

    python bench/figures.py --out docs/img                          # everything (the loss runs take a few minutes)
    python bench/figures.py --out docs/img --only ring,schedules    # no training: seconds
    python bench/figures.py --out docs/img --only loss --reuse      # redraw from the runs already in --runs-dir

ring        ring_allreduce.png: the 2(N-1) steps of jaxpar.comm.collectives.ring_all_reduce on N=4 devices, simulated
            on symbolic chunks ("a0+b0") with the chunk indices the device code uses, checked against its numpy
            twin ring_all_reduce_ref run on the same symbols.
schedules   schedule_{gpipe,1f1b,interleaved,zbh1,zbv}.png: jaxpar.pipeline.schedule.render of S=4 stages, M=8
            micro-batches (V=2 chunks for interleaved); the titles give bubble_fraction and peak_inflight.
loss        loss_curves.png: train.py in one subprocess per strategy (each simulates its own 8 CPU devices),
            the "step" records of their --metrics-out files on one chart, and below it each run's gap to
            single per step (log scale).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("ring", "schedules", "loss")
DPI = 100


# ---- ring all-reduce ---------------------------------------------------------------------------------------

class Chunk:
    """A symbolic chunk value: the per-device chunks added into it, in the order they were added ("a0+b0")."""
    __slots__ = ("terms",)

    def __init__(self, terms: tuple[str, ...]):
        self.terms = terms

    def __add__(self, other):
        return self if isinstance(other, int) and other == 0 else Chunk(self.terms + other.terms)

    __radd__ = __add__  # np.zeros(..., object) starts buffers at int 0

    def __eq__(self, other):
        return isinstance(other, Chunk) and self.terms == other.terms

    def __repr__(self) -> str:
        return "+".join(self.terms)


def ring_steps(n: int = 4) -> list[dict]:
    """The ring all-reduce step by step: [{phase, step, sent[i] (chunk index device i sends), held[i][j]}].

    ``held[i][j]`` is what device i holds for chunk j after the step. Device i's input is chunks ``a0..`` for
    i=0, ``b0..`` for i=1, ... The chunk indices are ring_all_reduce's: reduce-scatter step k (from 0) sends the
    running sum of chunk (i-k) and adds the own chunk (i-k-1) to what arrives; all-gather step k forwards
    chunk (i+1-k) and receives chunk (i-k). The end state must be ring_all_reduce_ref's, term for term.
    """
    from jaxpar.comm.collectives import ring_all_reduce_ref

    xs = np.empty((n, n), object)
    for i in range(n):
        for j in range(n):
            xs[i, j] = Chunk((f"{chr(ord('a') + i)}{j}",))
    held = [[xs[i, j] for j in range(n)] for i in range(n)]
    steps = [{"phase": "start", "step": 0, "sent": [None] * n, "held": [row[:] for row in held]}]
    acc = [held[i][i] for i in range(n)]
    for k in range(n - 1):  # reduce-scatter
        sent = [(i - k) % n for i in range(n)]
        assert all(held[i][sent[i]] == acc[i] for i in range(n))  # the cell drawn as sent is what moves
        acc = [acc[(i - 1) % n] + held[i][(i - k - 1) % n] for i in range(n)]  # _shift, then + chunk(i-k-1)
        for i in range(n):
            held[i][(i - k - 1) % n] = acc[i]
        steps.append({"phase": "reduce-scatter", "step": k + 1, "sent": sent, "held": [r[:] for r in held]})
    got = acc  # device i: the complete sum of chunk (i+1) mod n
    assert all(len(held[i][(i + 1) % n].terms) == n for i in range(n))
    for k in range(n - 1):  # all-gather
        sent = [(i + 1 - k) % n for i in range(n)]
        assert all(held[i][sent[i]] == got[i] for i in range(n))
        got = [got[(i - 1) % n] for i in range(n)]
        for i in range(n):
            held[i][(i - k) % n] = got[i]
        steps.append({"phase": "all-gather", "step": k + 1, "sent": sent, "held": [r[:] for r in held]})
    ref = ring_all_reduce_ref(xs)
    if [[ref[i, j] for j in range(n)] for i in range(n)] != held:
        raise AssertionError(f"the simulated ring ends at {held}, ring_all_reduce_ref at {ref.tolist()}: "
                             f"update ring_steps to ring_all_reduce's chunk schedule")
    return steps


def _cell_text(c: Chunk) -> str:
    """'a0+b0+c0+d0' in lines of at most two terms, so a cell stays narrow."""
    t = c.terms
    return "\n+".join("+".join(t[i:i + 2]) for i in range(0, len(t), 2))


def _ring_panel(ax, n: int, state: dict, prev: dict | None, chunk_labels: bool) -> None:
    from matplotlib.patches import FancyArrowPatch, Rectangle

    w, gap, h = 1.0, 0.5, 1.0
    x0 = [i * (w + gap) for i in range(n)]
    sent = state["sent"]
    for i in range(n):
        for j in range(n):
            c = state["held"][i][j]
            new = prev is not None and c != prev["held"][i][j]
            full = len(c.terms) == n
            face = "#b7e4b0" if full else "#ffd8a8" if len(c.terms) > 1 else "white"
            is_sent = sent[i] == j
            ax.add_patch(Rectangle((x0[i], j), w, h, facecolor=face, zorder=1,
                                   edgecolor="#1f5fbf" if is_sent else "0.45", linewidth=2.2 if is_sent else 0.7))
            ax.text(x0[i] + w / 2, j + h / 2, _cell_text(c), ha="center", va="center", zorder=2,
                    fontsize=7.5, fontweight="bold" if new else "normal", linespacing=1.0)
        if sent[i] is not None:  # to the right neighbour; the last device's arrow wraps round to device 0
            y = sent[i] + h / 2
            start, end = x0[i] + w, (x0[i + 1] if i + 1 < n else x0[-1] + w + gap * 0.9)
            ax.add_patch(FancyArrowPatch((start, y), (end, y), arrowstyle="-|>", mutation_scale=9,
                                         color="#1f5fbf", lw=1.4, shrinkA=0, shrinkB=0, zorder=3))
            if i + 1 == n:
                ax.add_patch(FancyArrowPatch((-gap * 0.9, y), (0, y), arrowstyle="-|>", mutation_scale=9,
                                             color="#1f5fbf", lw=1.4, shrinkA=0, shrinkB=0, zorder=3,
                                             linestyle=(0, (2, 1.5))))
    ax.set_xlim(-gap, x0[-1] + w + gap)
    ax.set_ylim(n, 0)
    ax.set_xticks([x + w / 2 for x in x0], [f"dev {i}" for i in range(n)], fontsize=8)
    ax.set_yticks([j + h / 2 for j in range(n)], [f"chunk {j}" if chunk_labels else "" for j in range(n)],
                  fontsize=8)
    ax.tick_params(length=0)
    ax.xaxis.tick_top()
    for side in ax.spines.values():
        side.set_visible(False)


def _index(offset: int) -> str:
    """'i', 'i+1' or 'i-2': a chunk index relative to the device index i."""
    return "i" if offset == 0 else f"i{offset:+d}"


def draw_ring(path: str, n: int = 4) -> str:
    """ring_allreduce.png: start + reduce-scatter steps in the top row, a key + all-gather steps below."""
    from matplotlib.figure import Figure

    steps = ring_steps(n)
    fig = Figure(figsize=(13.5, 5.8))
    axes = fig.subplots(2, n, gridspec_kw=dict(hspace=0.5, wspace=0.2))
    order = [steps[0]] + steps[1:n] + [None] + steps[n:]
    for p, (ax, state) in enumerate(zip(axes.flat, order)):
        if state is None:
            ax.axis("off")
            ax.text(0.0, 1.0, "how to read it", fontsize=9.5, fontweight="bold", va="top", transform=ax.transAxes)
            ax.text(0.0, 0.86,
                    "columns: devices, rows: chunks\n"
                    "blue box + arrow: the chunk a\n"
                    "device sends to its right\n"
                    f"neighbour (dev {n - 1} sends to dev 0)\n"
                    "bold: just received (and added)\n"
                    "orange: a partial sum\n"
                    f"green: summed over all {n} devices\n"
                    f"chunk indices are mod {n}\n\n"
                    f"{2 * (n - 1)} steps, each moving 1/{n} of\nthe buffer per device",
                    fontsize=8.5, va="top", transform=ax.transAxes, linespacing=1.3)
            continue
        prev = steps[steps.index(state) - 1] if state["phase"] != "start" else None
        _ring_panel(ax, n, state, prev, chunk_labels=p in (0, n + 1))
        k = state["step"] - 1
        if state["phase"] == "reduce-scatter":
            title = (f"reduce-scatter step {k + 1} of {n - 1}\n"
                     f"dev i sends chunk {_index(-k)}, gets chunk {_index(-k - 1)}")
        elif state["phase"] == "all-gather":
            title = f"all-gather step {k + 1} of {n - 1}\ndev i sends chunk {_index(1 - k)}, gets chunk {_index(-k)}"
        else:
            title = f"start: dev i holds its own x\nin {n} chunks (dev 0's: a0..a{n - 1})"
        ax.set_title(title, fontsize=9, pad=16)
    fig.suptitle(f"ring all-reduce on N={n} devices, as jaxpar.comm.collectives.ring_all_reduce runs it: "
                 f"reduce-scatter (top), then all-gather (bottom)", fontsize=11.5, y=1.0)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


# ---- pipeline schedules ------------------------------------------------------------------------------------

SCHEDULE_FIGURES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2))  # (name, chunks), S=4, M=8


def draw_schedules(out: str, stages: int = 4, micro_batches: int = 8) -> list[str]:
    from jaxpar.pipeline import schedule

    paths = []
    for name, v in SCHEDULE_FIGURES:
        s = schedule.validate(schedule.make(name, stages, micro_batches, v))
        peaks = schedule.peak_inflight(s)
        chunks = f", V={v} chunks per stage" if v > 1 else ""
        unit = f" (each 1/{v} of a stage's)" if v > 1 else ""
        costs = f" ({schedule.bubble_fraction(s, schedule.COSTS):.1%} with B = I + W)" if s.backward == "B" else ""
        title = (f"{name}: S={stages} stages, M={micro_batches} micro-batches{chunks}; {s.num_ticks} ticks, "
                 f"bubble {schedule.bubble_fraction(s):.1%}{costs}\n"
                 f"peak in-flight activations per stage: {peaks}{unit}")
        paths.append(schedule.render(s, os.path.join(out, f"schedule_{name}.png"), title=title, dpi=DPI))
    return paths


# ---- loss curves -------------------------------------------------------------------------------------------

LOSS_RUNS = {  # strategy -> its own flags; every run shares LOSS_COMMON
    "single": [],
    "ddp": ["--allreduce", "ring"],
    "dp": [],
    "pipeline": ["--num-stages", "2", "--micro-batches", "4", "--schedule", "1f1b"],
}
LOSS_COMMON = ["--cpu-devices", "8", "--model", "convnet", "--dataset", "synthetic", "--train-split", "train[:3200]",
               "--eval-split", "test[:1000]", "--batch-size", "64", "--epochs", "1", "--log-every", "1", "--quiet"]


def train_runs(runs_dir: str, reuse: bool = False) -> list[str]:
    """One train.py process per strategy (a process fixes its simulated device count at JAX's start)."""
    runs_dir = os.path.abspath(runs_dir)  # the processes run in the repository root
    os.makedirs(runs_dir, exist_ok=True)
    paths = []
    for strategy, flags in LOSS_RUNS.items():
        path = os.path.join(runs_dir, f"{strategy}.jsonl")
        paths.append(path)
        if reuse and os.path.exists(path):
            continue
        if os.path.exists(path):
            os.remove(path)
        cmd = [sys.executable, "train.py", "--strategy", strategy, *LOSS_COMMON, *flags, "--metrics-out", path]
        print("$", " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    return paths


def _step_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r.get("event") == "step"}


def draw_loss(run_paths: list[str], path: str, tol: float = 1e-5) -> str:
    """Top: every run's training loss per step, drawn thick to thin so curves on top of each other all show.
    Bottom: |loss - single's loss| per step, log scale; the title says up to which step it stays below ``tol``.

    bench/plot.py's plot_loss draws the same records, but with a fixed title and equal lines (the last run
    drawn hides the others) and no gap panel; this keeps its readers and labels.
    """
    from matplotlib.figure import Figure
    from plot import read_jsonl, run_labels

    labels = run_labels(run_paths)
    runs = {labels[p]: read_jsonl(p) for p in run_paths}
    base = _step_losses(runs["single"])
    fig = Figure(figsize=(8, 6))
    ax, gap_ax = fig.subplots(2, 1, sharex=True, gridspec_kw=dict(height_ratios=[2.2, 1], hspace=0.3))
    styles = [dict(lw=7, alpha=0.3), dict(lw=3.5), dict(lw=2, ls="--"), dict(lw=1, ls=":", marker=".", ms=4)]
    gaps = {}
    for i, (label, records) in enumerate(runs.items()):
        steps = sorted(_step_losses(records).items())
        ax.plot([s for s, _ in steps], [v for _, v in steps], color=f"C{i}", label=label, **styles[i % len(styles)])
        evals = [(r["step"], r["eval_loss"]) for r in records if r.get("event") == "epoch" and "eval_loss" in r]
        if evals:
            ax.plot(*zip(*evals), "s", color=f"C{i}", ms=10 - 2 * i, mfc="none", mew=1.5)
        if label != "single":
            gaps[label] = {s: abs(v - base[s]) for s, v in steps}
            gap_ax.semilogy(list(gaps[label]), [max(g, 1e-9) for g in gaps[label].values()], "o-", ms=3,
                            color=f"C{i}", lw=1, label=label)
    agree = min(next((s for s, g in sorted(gs.items()) if g > tol), max(gs) + 1) for gs in gaps.values()) - 1
    last = max(max(gs) for gs in gaps.values())
    worst = max(max(gs.values()) for gs in gaps.values())
    start = next(r for r in runs["single"] if r.get("event") == "start")["config"]
    ax.set(ylabel="training loss per step\n(squares: eval loss)")
    ax.set_title(f"{start['model']} on {start['dataset']} data, {start['optimizer']}, global batch "
                 f"{start['batch_size']}, 8 simulated CPU devices:\nevery strategy takes the single-device step, so "
                 f"the curves lie on top of each other", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    gap_ax.axhline(tol, color="0.5", lw=0.8, ls="--")
    gap_ax.set(xlabel="step", ylabel="|loss - single's|")
    gap_ax.set_ylim(1e-9 / 2, max(worst, tol) * 5)
    gap_ax.grid(alpha=0.3, which="major")
    gap_ax.set_title(f"gap to single (0 drawn at 1e-9): within {tol:.0e} through step {agree}, float32 rounding"
                     + (f"; then the rounding\ndifferences compound, to {worst:.0e} by step {last}" if agree < last
                        else ""), fontsize=9)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(prog="bench/figures.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/img", help="output folder (default: docs/img)")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--runs-dir", default="runs/figures", help="where the loss runs write their JSON lines")
    p.add_argument("--reuse", action="store_true", help="plot the loss runs already in --runs-dir, train none")
    args = p.parse_args(argv)
    only = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = sorted(set(only) - set(GROUPS))
    if unknown:
        p.error(f"--only {args.only!r}: {unknown} unknown; use a comma-separated subset of {','.join(GROUPS)}")
    os.makedirs(args.out, exist_ok=True)
    written = []
    if "ring" in only:
        written.append(draw_ring(os.path.join(args.out, "ring_allreduce.png")))
    if "schedules" in only:
        written += draw_schedules(args.out)
    if "loss" in only:
        written.append(draw_loss(train_runs(args.runs_dir, args.reuse), os.path.join(args.out, "loss_curves.png")))
    for w in written:
        print(w, f"{os.path.getsize(w) / 1024:.0f} KB")
    return written


if __name__ == "__main__":
    main()
