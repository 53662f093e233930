"""What a run tells: JSON lines for --metrics-out, a throughput clock, and the --report table.

--metrics-out records (one JSON object per line, each with an "event"):

    {"event": "start",   "strategy", "model", "devices", "processes", "describe", "step", "config": {...}}
    {"event": "step",    "step", "epoch", "loss", "train_loss", "samples_per_s", "step_time_s"}   # every --log-every
    {"event": "epoch",   "epoch", "step", "train_loss", "eval_loss", "eval_accuracy"}             # each epoch's end
    {"event": "stopped", "step", "signal", "checkpoint"}                                          # SIGTERM / SIGINT
    {"event": "diverged", "step", "loss", "checkpoint"}                                           # NaN / inf loss
    {"event": "summary", ...the run summary's numbers...}

"loss" is that step's mean loss, "train_loss" the mean over the epoch so far, "samples_per_s" and "step_time_s"
cover the steps since the previous record (the first, compiling step excluded). bench/plot.py reads these files.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Iterable


class MetricsWriter:
    """JSON lines appended to `path` (a resumed run continues the same file); a no-op without a path."""

    def __init__(self, path: str | None):
        self.f = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self.f:
            self.f.write(json.dumps(record, default=_plain) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None


def _plain(x: Any) -> Any:
    """JSON for numpy / JAX scalars and anything else: a number when it is one, else its str."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


class Clock:
    """Steps, samples and seconds, excluding the first (compiling) step; `window()` since the last call."""

    def __init__(self):
        self.t0 = self.t_mark = None
        self.steps = self.samples = self.w_steps = self.w_samples = 0

    def tick(self, samples: float) -> None:
        """Call after a step whose results were read back (so its time is really spent)."""
        now = time.perf_counter()
        if self.t0 is None:  # the first step compiles: time counts from its end
            self.t0 = self.t_mark = now
            return
        self.steps, self.samples = self.steps + 1, self.samples + samples
        self.w_steps, self.w_samples = self.w_steps + 1, self.w_samples + samples

    def window(self) -> dict[str, float]:
        """samples_per_s and step_time_s since the previous window (NaN before any timed step)."""
        now = time.perf_counter()
        dt = now - self.t_mark if self.t_mark is not None else 0.0
        out = _rates(self.w_samples, self.w_steps, dt)
        self.t_mark, self.w_steps, self.w_samples = now, 0, 0
        return out

    def total(self) -> dict[str, float]:
        dt = time.perf_counter() - self.t0 if self.t0 is not None else 0.0
        return _rates(self.samples, self.steps, dt)


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
    from jaxpar import memory

    return memory.memory_report(None if devices is None else list(devices))


def table(summary: dict, strategy_report: dict, mem: list[dict] | None = None) -> str:
    """The --report table: one `name  value` row per line, memory one row per device, then the strategy's own
    report entries (communication from the cost model and the compiled HLO, pipeline bubble, ...)."""
    rows = [("strategy", summary.get("strategy")), ("describe", summary.get("describe")),
            ("devices", summary.get("devices")), ("processes", summary.get("processes")),
            ("precision", summary.get("precision")), ("steps", summary.get("steps")),
            ("samples/s", summary.get("samples_per_s")),
            ("step time", f"{summary['step_time_s'] * 1e3:.2f} ms" if _num(summary.get("step_time_s")) else "-")]
    for r in mem or []:
        live = f"live {_mib(r.get('live_bytes'))}"
        peak = f", allocator peak {_mib(r['peak_bytes'])}" if r.get("peak_bytes") is not None else ""
        rows.append((f"memory {r['device']}", live + peak))
    for k, v in strategy_report.items():
        if k not in ("memory", "devices"):
            rows.append((k.replace("_", " "), _value(v)))
    width = max(len(k) for k, _ in rows)
    line = "-" * min(width + 2 + max(len(_value(v)) for _, v in rows), 100)
    return "\n".join(["run report", line] + [f"{k:<{width}}  {_value(v)}" for k, v in rows] + [line])


def _num(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
