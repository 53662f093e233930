"""Draw PNGs from jaxpar's JSON-lines outputs (matplotlib: `pip install -e ".[plot]"`).

    python train.py --strategy single --metrics-out runs/single.jsonl ...   # one file per run
    python train.py --cpu-devices 8 --strategy ddp --metrics-out runs/ddp.jsonl ...
    python bench/plot.py --out plots runs/single.jsonl runs/ddp.jsonl      # loss.png, grad_norm.png, throughput.png
    python bench/plot.py --out plots --allreduce allreduce.jsonl           # allreduce_busbw.png
    python bench/plot.py --out plots --schedule 1f1b --stages 4 --micro-batches 8   # pipeline_1f1b.png

Inputs:
- run files: train.py --metrics-out records (see jaxpar/report.py): "step" records give the loss curve and the
  gradient norm before clipping (x = step), "epoch" records the eval loss (a "partial" one, of a run --steps ended
  mid-epoch, at the step it stopped), the last "summary" record the throughput. A resumed run's file holds one
  record per step and per epoch (train.py replaces what the resumed run writes again).
  The run's label is its strategy (from the "start" record), or the file name when two runs share a strategy.
  A file holding several runs (several "start" records not written by --resume) is drawn as one line per run,
  "LABEL run i/n", each with its own throughput bar.
- all-reduce file: JSON lines {"algorithm": str, "bytes": int (message size per device), "busbw": float
  (GB/s, NCCL-tests' bus bandwidth = algbw * 2(n-1)/n)}; other keys are ignored. Lines without these keys
  (a header, say) are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSON-lines file (blank lines skipped)."""
    with open(path) as f:
        return [{k: float("nan") if v is None else v for k, v in json.loads(line).items()}  # null: no number
                for line in f if line.strip()]


def split_runs(records: list[dict]) -> list[list[dict]]:
    """The runs of one file, each a list of records: every "start" record of a run not resumed (no --resume in
    its config) opens a new run; a resumed run's records continue the run before it."""
    runs: list[list[dict]] = []
    for r in records:
        if r.get("event") == "start" and not (runs and (r.get("config") or {}).get("resume")):
            runs.append([])
        if not runs:
            runs.append([])
        runs[-1].append(r)
    return runs


def load_runs(paths: list[str]) -> dict[str, list[dict]]:
    """{label: records}, one entry per run: a file holding several runs (fresh starts appended by an older
    train.py) gives each its own entry, labelled "LABEL run i/n", never one spliced curve."""
    labels, out = run_labels(paths), {}
    for p in paths:
        runs = split_runs(read_jsonl(p))
        for i, records in enumerate(runs):
            out[labels[p] if len(runs) == 1 else f"{labels[p]} run {i + 1}/{len(runs)}"] = records
    return out


def run_labels(paths: list[str]) -> dict[str, str]:
    """{path: label}: the strategy of the run, or the file's stem when that label is taken twice."""
    strategies = {}
    for p in paths:
        start = next((r for r in read_jsonl(p) if r.get("event") == "start"), {})
        strategies[p] = start.get("strategy") or os.path.splitext(os.path.basename(p))[0]
    counts = defaultdict(int)
    for s in strategies.values():
        counts[s] += 1
    return {p: s if counts[s] == 1 else f"{s} ({os.path.splitext(os.path.basename(p))[0]})"
            for p, s in strategies.items()}


def _figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def plot_loss(runs: dict[str, list[dict]], path: str) -> str:
    """Training loss against step (lines) and eval loss at each epoch's end (markers), one colour per run."""
    fig, ax = _figure()
    for i, (label, records) in enumerate(runs.items()):
        color = f"C{i}"
        steps = sorted({r["step"]: r["loss"] for r in records if r.get("event") == "step"}.items())
        if steps:
            ax.plot([s for s, _ in steps], [v for _, v in steps], color=color, label=f"{label} train")
        evals = sorted({r["step"]: r["eval_loss"] for r in records
                        if r.get("event") == "epoch" and "eval_loss" in r}.items())
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], "o--", color=color, label=f"{label} eval")
    ax.set(xlabel="step", ylabel="loss", title="loss per strategy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_grad_norm(runs: dict[str, list[dict]], path: str) -> str:
    """Each step's gradient norm before clipping (the step records' grad_norm), one line per run, log scale:
    where a run spikes, and whether --grad-clip's threshold bites."""
    fig, ax = _figure()
    for i, (label, records) in enumerate(runs.items()):
        steps = sorted({r["step"]: r["grad_norm"] for r in records
                        if r.get("event") == "step" and "grad_norm" in r}.items())
        if steps:
            ax.plot([s for s, _ in steps], [v for _, v in steps], color=f"C{i}", label=label)
    clip = {r["config"].get("grad_clip") for rs in runs.values() for r in rs if r.get("event") == "start"} - {0, None}
    for c in sorted(clip):
        ax.axhline(c, color="grey", linestyle=":", label=f"--grad-clip {c:g}")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="gradient norm (before clipping)", title="gradient norm per strategy")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_throughput(runs: dict[str, list[dict]], path: str) -> str:
    """Samples per second of each run (its summary record), as bars."""
    fig, ax = _figure()
    labels, values = [], []
    for label, records in runs.items():
        summary = next((r for r in reversed(records) if r.get("event") == "summary"), None)
        if summary is not None and summary.get("samples_per_s") == summary.get("samples_per_s"):  # not NaN
            labels.append(label)
            values.append(summary["samples_per_s"])
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, fmt="%.0f")
    ax.set(ylabel="samples / s", title="throughput per strategy")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_busbw(records: list[dict], path: str) -> str:
    """All-reduce bus bandwidth against message size, one line per algorithm (log-2 size axis)."""
    by_algo: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        if {"algorithm", "bytes", "busbw"} <= r.keys():
            by_algo[r["algorithm"]][int(r["bytes"])] = float(r["busbw"])
    if not by_algo:
        raise ValueError("no {'algorithm', 'bytes', 'busbw'} records in the all-reduce file; "
                         "pass the JSON lines bench/allreduce.py writes.")
    fig, ax = _figure()
    for algo, points in sorted(by_algo.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], "o-", label=algo)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="message size per device (bytes)", ylabel="bus bandwidth (GB/s)", title="all-reduce busbw")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int, path: str) -> str:
    """The pipeline timeline of one schedule (jaxpar.pipeline.schedule.render)."""
    from jaxpar.pipeline import schedule

    return schedule.render(schedule.make(name, stages, micro_batches, virtual_stages), path)


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(prog="bench/plot.py", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", help="--metrics-out files of train.py runs")
    p.add_argument("--out", default="plots", help="output folder (default: plots)")
    p.add_argument("--allreduce", help="JSON lines of {algorithm, bytes, busbw} records")
    p.add_argument("--schedule", help="draw this pipeline schedule: gpipe | 1f1b | interleaved")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--virtual-stages", type=int, default=1)
    args = p.parse_args(argv)
    if not (args.runs or args.allreduce or args.schedule):
        p.error("nothing to draw: pass run files, --allreduce FILE or --schedule NAME")
    missing = [f for f in [*args.runs, args.allreduce] if f and not os.path.isfile(f)]
    if missing:
        p.error(f"{missing[0]!r} is not a file; pass train.py's --metrics-out files (a shell pattern that matched "
                "nothing stays as written)")
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.runs:
        runs = load_runs(args.runs)
        written += [plot_loss(runs, os.path.join(args.out, "loss.png")),
                    plot_throughput(runs, os.path.join(args.out, "throughput.png"))]
        if any("grad_norm" in r for rs in runs.values() for r in rs):
            written.append(plot_grad_norm(runs, os.path.join(args.out, "grad_norm.png")))
    if args.allreduce:
        written.append(plot_busbw(read_jsonl(args.allreduce), os.path.join(args.out, "allreduce_busbw.png")))
    if args.schedule:
        out = os.path.join(args.out, f"pipeline_{args.schedule}.png")
        written.append(plot_schedule(args.schedule, args.stages, args.micro_batches, args.virtual_stages, out))
    for w in written:
        print(w)
    return written


if __name__ == "__main__":
    main()
