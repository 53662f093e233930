"""What a run tells: JSON lines for --metrics-out, a throughput clock, and the --report table.

--metrics-out records (one JSON object per line, each with an "event"):

    {"event": "start",   "strategy", "model", "devices", "processes", "describe", "step", "config": {...}}
    {"event": "step",    "step", "epoch", "loss", "train_loss", "samples_per_s", "step_time_s"}   # every --log-every
    {"event": "epoch",   "epoch", "step", "partial", "train_loss", "eval_loss", "eval_accuracy"}  # each epoch's end
    {"event": "stopped", "step", "signal", "checkpoint"}                                          # SIGTERM / SIGINT
    {"event": "diverged", "step", "loss", "checkpoint"}                                           # NaN / inf loss
    {"event": "summary", ...the run summary's numbers...}

"loss" is that step's mean loss, "train_loss" the mean over the epoch so far, "samples_per_s" and "step_time_s"
cover the steps since the previous record (warm-up steps, evaluation and saves left out: see Clock). An "epoch"
record with "partial": true is the end of a run that --steps ended mid-epoch: its train loss covers the epoch so
far, its evaluation the weights at that step.

A file holds one record per epoch and per step, across --resume too: a resumed run first drops the records of
steps after its checkpoint's (an earlier run's that it trains again: a crash after the last save), and an epoch's
record replaces that epoch's partial one (a run stopped by --steps mid-epoch, then resumed), the file rewritten
atomically. bench/plot.py reads these files.
"""
from __future__ import annotations

import json
import math
import os
import stat
import sys
import tempfile
import time
from typing import Any, Iterable


class MetricsWriter:
    """JSON lines written to `path`: a fresh run starts the file anew (a note on stderr when it held records), a
    resumed run (`append`) continues it; a no-op without a path. The file is opened at `begin()` -- train.py calls
    it once the first step has run, so a run refused while its step is traced leaves an earlier run's file as it
    was -- and the records before it wait in memory; `close()` writes them unless told to drop them.

    `resumed_at` (a resumed run's checkpoint step) keeps the file one record per step and per epoch: at `begin()`
    the records of later steps (an earlier run's, past its last save, that this run trains again) are dropped, and
    an "epoch" record drops an earlier partial record of its epoch ("partial": true, a run that --steps ended
    mid-epoch) when it is written. The file is then rewritten whole: a temporary file in its folder, os.replace'd.
    A last line with no newline (a run killed while writing it) is dropped then too."""

    def __init__(self, path: str | None, append: bool = False, resumed_at: int | None = None):
        self.path, self.append, self.f, self.pending = path, append or resumed_at is not None, None, []
        self.resumed_at = resumed_at
        self.partial: set = set()  # the epochs whose record in the file is a partial one

    def begin(self) -> None:
        if not self.path or self.f is not None:
            return
        if not self.append and os.path.isfile(self.path) and os.path.getsize(self.path):
            print(f"jaxpar: note: --metrics-out {self.path} held an earlier run's records; this run (no --resume) "
                  "starts it anew. Pass another file to keep both.", file=sys.stderr)
        if self.append and os.path.isfile(self.path):
            self._keep(lambda r: self.resumed_at is None or _step_of(r) is None or _step_of(r) <= self.resumed_at)
        self.f = open(self.path, "a" if self.append else "w")
        pending, self.pending = self.pending, []
        for record in pending:
            self.write(record)

    def write(self, record: dict) -> None:
        if self.path and self.f is None:
            self.pending.append(record)
        elif self.f:
            if record.get("event") == "epoch" and record.get("epoch") in self.partial:  # superseded
                self.f.close()
                self._keep(lambda r: not (r.get("event") == "epoch" and r.get("partial")
                                          and r.get("epoch") == record["epoch"]))
                self.f = open(self.path, "a")
            if record.get("event") == "epoch" and record.get("partial"):
                self.partial.add(record.get("epoch"))
            # strict JSON (RFC 8259 has no NaN/Infinity; JSON.parse, pandas' engines and jq<1.7 reject them): a
            # value that is not a finite number (samples_per_s before any timed step, an fp16 epoch of skips) is null
            self.f.write(json.dumps(_finite(record), default=_plain, allow_nan=False) + "\n")
            self.f.flush()

    def _keep(self, keep) -> None:
        """Rewrite the (closed) file with the records `keep` accepts; lines that are not a JSON object stay, but a
        torn last line (no newline) goes. Atomic: a temporary file in the same folder, os.replace'd. Notes which
        epochs the kept records hold partially."""
        with open(self.path) as f:
            lines = f.readlines()
        kept, self.partial = [], set()
        for i, line in enumerate(lines):
            if not line.endswith("\n"):  # the last line, cut short: a run killed while writing it
                continue
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            if isinstance(r, dict) and not keep(r):
                continue
            if isinstance(r, dict) and r.get("event") == "epoch":
                (self.partial.add if r.get("partial") else self.partial.discard)(r.get("epoch"))
            kept.append(line)
        if len(kept) == len(lines):
            return
        folder = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".metrics-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, stat.S_IMODE(os.stat(self.path).st_mode))
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def close(self, keep_pending: bool = True) -> None:
        """Close the file; records not yet written go to it (`begin()` first), or are dropped (keep_pending=False:
        the run failed before its first step, and the file stays as it was)."""
        if keep_pending and self.pending:
            self.begin()
        self.pending = []
        if self.f:
            self.f.close()
            self.f = None


def _step_of(record: dict) -> int | None:
    """The step a record belongs to: its "step" (a summary's "steps"); None for a record without one."""
    step = record.get("step", record.get("steps"))
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _finite(x: Any) -> Any:
    """`x` with every float that is NaN or infinite (in dicts and lists too) replaced by None."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if not isinstance(x, (str, int, float, bool, type(None))):
        plain = _plain(x)
        return None if isinstance(plain, float) and not math.isfinite(plain) else plain
    return x


def _plain(x: Any) -> Any:
    """JSON for numpy / JAX scalars and anything else: a number when it is one, else its str."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


class Clock:
    """Steps, samples and seconds of training steps only. Not timed: the first `warmup` steps of each batch size
    (the first compiles: a strategy that does not pad compiles the last, smaller batch again; the second ran 2-3x
    slower than the rest with nothing compiled, in a review's ConvNet runs on CPU) and, after `skip()`, the time
    spent since the last step (evaluation, checkpoint saves). `window()` covers the steps since its last call,
    `total()` the whole run."""

    def __init__(self, warmup: int = 2):
        self.mark, self.warmup, self.seen = None, warmup, {}
        self.steps = self.samples = self.seconds = 0
        self.w_steps = self.w_samples = self.w_seconds = 0

    def tick(self, samples: float) -> None:
        """Call after a step whose results were read back (so its time is really spent)."""
        now = time.perf_counter()
        if self.seen.get(samples, 0) >= self.warmup and self.mark is not None:
            dt = now - self.mark
            self.steps, self.samples, self.seconds = self.steps + 1, self.samples + samples, self.seconds + dt
            self.w_steps, self.w_samples, self.w_seconds = self.w_steps + 1, self.w_samples + samples, self.w_seconds + dt
        self.seen[samples] = self.seen.get(samples, 0) + 1
        self.mark = now

    def skip(self) -> None:
        """Leave the time since the last step out (call after work that is not training)."""
        self.mark = time.perf_counter()

    def window(self) -> dict[str, float]:
        """samples_per_s and step_time_s since the previous window (NaN before any timed step)."""
        out = _rates(self.w_samples, self.w_steps, self.w_seconds)
        self.w_steps = self.w_samples = self.w_seconds = 0
        return out

    def total(self) -> dict[str, float]:
        return _rates(self.samples, self.steps, self.seconds)


def _rates(samples: float, steps: int, dt: float) -> dict[str, float]:
    ok = steps > 0 and dt > 0
    return {"samples_per_s": samples / dt if ok else math.nan, "step_time_s": dt / steps if ok else math.nan}


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f} MiB"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_value(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)) and v and not isinstance(v[0], dict):
        return ", ".join(_value(x) for x in v)
    return str(v)


def memory_rows(strategy_report: dict, devices: Iterable | None = None) -> list[dict]:
    """Per-device memory: the strategy's own measurement when it made one, else the live bytes now."""
    if strategy_report.get("memory"):
        return list(strategy_report["memory"])
    from jaxpar.run import memory

    return memory.memory_report(None if devices is None else list(devices))


def _communication(r: dict) -> list[tuple[str, Any]]:
    """Rows for the communication a strategy reports: modelled (cost model) and measured (compiled HLO)."""
    rows = []
    ddp = f"; {r['model_vs_ddp']:.3f}x DDP's all-reduce" if "model_vs_ddp" in r else ""
    if "model_collectives" in r:  # ZeRO: traffic by collective kind
        kinds = ", ".join(f"{k} {_mib(v)}" for k, v in r["model_collectives"].items())
        rows.append(("comm/step, cost model",
                     f"{_mib(r['model_bytes_sent_per_device'])} sent per device ({kinds}){ddp}"))
    elif "model_bytes_sent_per_device" in r:
        rows.append(("comm/step, cost model", f"{_mib(r['model_bytes_sent_per_device'])} sent per device in "
                     f"{r.get('model_steps_per_step', '?')} collective steps ({r.get('allreduce', '?')}, "
                     f"{r.get('buckets', '?')} buckets)"))
    if "hlo_bytes_sent_per_device" in r:
        kinds = ", ".join(f"{n} {k}" for k, n in r.get("hlo_collectives", {}).items()) or "no collectives"
        vs = f"; {r['hlo_vs_ddp']:.3f}x DDP's all-reduce" if "hlo_vs_ddp" in r else ""
        rows.append(("comm/step, compiled HLO", f"{_mib(r['hlo_bytes_sent_per_device'])} sent per device; {kinds}{vs}"))
    if "bubble_fraction" in r:
        rows.append(("pipeline bubble", f"{100 * r['bubble_fraction']:.1f} % of {r.get('ticks', '?')} ticks "
                     f"({r.get('schedule', '?')})"))
    return rows


_SHOWN = {"memory", "devices", "processes", "model_bytes_sent_per_device", "model_steps_per_step", "hlo_bytes_sent_per_device",
          "hlo_collectives", "bubble_fraction", "ticks", "model_collectives", "model_vs_ddp", "hlo_vs_ddp",
          "held_memory"}


def _held_memory(r: dict) -> list[tuple[str, Any]]:
    """Rows for the bytes a strategy holds per device (ZeRO): measured, and the ZeRO paper's formula beside them."""
    m = r.get("held_memory")
    if not m:
        return []
    paper = m["paper"]
    rows = [("memory/device, held", f"params {_mib(m['params'])} + gradients {_mib(m['gradients'])} + optimizer "
             f"{_mib(m['optimizer'])} = {_mib(m['total'])} (live arrays; gradients: compiled outputs)"),
            ("memory/device, ZeRO paper", f"{_mib(paper['total'])} = {paper['formula']} (Psi={m['num_params']:,}, "
             f"N={r.get('devices', '?')}); held / paper = {m['total'] / paper['total']:.4f}")]
    if m.get("model_state"):
        rows.append(("memory/device, model state", f"{_mib(m['model_state'])} (frozen weights, statistics, RNG "
                     "streams: whole on every device, at every stage)"))
    if m.get("step_temp") is not None:
        rows.append(("memory/device, step temps", f"{_mib(m['step_temp'])} (the compiled step's temporaries)"))
    return rows


def memory_fields(strategy_report: dict) -> dict:
    """The held-memory numbers of a strategy report as flat summary fields (bytes per device), for --metrics-out."""
    m = strategy_report.get("held_memory")
    if not m:
        return {}
    return {"memory_params_bytes": m["params"], "memory_gradients_bytes": m["gradients"],
            "memory_optimizer_bytes": m["optimizer"], "memory_held_bytes": m["total"],
            "memory_model_state_bytes": m.get("model_state"),
            "memory_paper_bytes": m["paper"]["total"], "memory_paper_formula": m["paper"]["formula"]}


def table(summary: dict, strategy_report: dict, mem: list[dict] | None = None) -> str:
    """The --report table: one `name  value` row per line. Run, throughput, memory per device (devices holding
    nothing left out), communication per step (cost model and compiled HLO), pipeline bubble, then the rest of
    the strategy's report."""
    step_time = summary.get("step_time_s")
    rows = [("strategy", summary.get("strategy")), ("describe", summary.get("describe")),
            ("devices", strategy_report.get("devices", summary.get("devices"))),
            ("processes", summary.get("processes")), ("precision", summary.get("precision")),
            ("steps", summary.get("steps")), ("samples/s", summary.get("samples_per_s")),
            ("step time", f"{step_time * 1e3:.2f} ms" if _num(step_time) else "-")]
    if "tokens_per_s" in summary:  # language models (jaxpar.run.flops): throughput in tokens, MFU where a peak is known
        rows.append(("tokens/s", summary["tokens_per_s"]))
    if "model_tflops" in summary:
        mfu = f"{100 * summary['mfu']:.1f} % of {summary['peak_tflops']:g} TFLOP/s per device" if "mfu" in summary \
            else "- (no peak known for this device: pass --peak-tflops)"
        rows += [("model TFLOP/s", summary["model_tflops"]), ("MFU", mfu)]
    for r in mem or []:
        if r.get("live_bytes") or r.get("peak_bytes"):
            peak = f", allocator peak {_mib(r['peak_bytes'])}" if r.get("peak_bytes") is not None else ""
            rows.append((f"memory {r['device']}", f"live {_mib(r.get('live_bytes'))}{peak}"))
    rows += _held_memory(strategy_report)
    rows += _communication(strategy_report)
    rows += [(k.replace("_", " "), v) for k, v in strategy_report.items() if k not in _SHOWN]
    rows = [(k, _value(v)) for k, v in rows]
    width = max(len(k) for k, _ in rows)
    line = "-" * min(width + 2 + max(len(v) for _, v in rows), 100)
    indent = "\n" + " " * (width + 2)  # multi-line values (a bucket plan) stay in the value column
    return "\n".join(["run report", line] + [f"{k:<{width}}  {v.replace(chr(10), indent)}" for k, v in rows] + [line])


def _num(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
