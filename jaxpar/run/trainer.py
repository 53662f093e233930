"""The training loop behind train.py: data, model, optimizer and a strategy, run for epochs or steps.

Roughly:
    data, model, tx = ...; strategy = build(model, tx, cfg); placed = strategy.init(state)
    for epoch: for batch in loader(put=strategy.put_batch): placed, metrics = strategy.step(placed, batch)
               evaluate(strategy.unplace(placed).params)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar.config import DEFAULT_LR, Config
from jaxpar.optim import OPTIMIZERS, make_optimizer
from jaxpar.step import TrainState, init_state, make_eval_step
from jaxpar.strategies.base import STRATEGIES, get_builder


def devices_used(strategy) -> int:
    """How many devices (over all processes) the strategy runs on: its mesh, its device list, or one."""
    if getattr(strategy, "mesh", None) is not None:
        return strategy.mesh.devices.size
    return len(getattr(strategy, "devices", [None]))


def validate(cfg: Config) -> None:
    """Reject a bad configuration before any work starts (names, ranges); strategies check their own rules."""
    from jaxpar import models
    from jaxpar.data.datasets import DATASETS
    from jaxpar.precision import PRECISIONS

    choices = {"strategy": STRATEGIES, "model": models.NAMES, "dataset": DATASETS, "optimizer": OPTIMIZERS,
               "precision": PRECISIONS}
    for field, valid in choices.items():
        value = getattr(cfg, field)
        if value not in valid:
            raise ValueError(f"--{field} {value!r} is not known; use one of: {', '.join(valid)}.")
    for field in ("batch_size", "epochs", "eval_batch_size", "log_every"):
        if getattr(cfg, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} {getattr(cfg, field)} must be >= 1; pass a positive count.")
    if cfg.steps is not None and cfg.steps < 1:
        raise ValueError(f"--steps {cfg.steps} must be >= 1 (or leave it out to run whole epochs).")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ValueError(f"--lr {cfg.lr} must be > 0; pass a positive learning rate, or leave it out for the "
                         f"optimizer's default ({DEFAULT_LR[cfg.optimizer]}).")
    if cfg.dataset == "npz" and not cfg.data_path:
        raise ValueError("--dataset npz needs --data-path FILE.npz; pass a file holding arrays x and y "
                         "(np.savez(path, x=..., y=...)).")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR; pass the checkpoint folder of the run to continue.")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every} must be >= 0; pass a step count, or 0 to "
                         "save only at the end and on SIGTERM/SIGINT.")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir DIR to save into.")
    if cfg.checkpoint_keep < 1:
        raise ValueError(f"--checkpoint-keep {cfg.checkpoint_keep} must be >= 1; pass how many complete "
                         "checkpoints to keep.")


def model_kwargs(cfg: Config, x_shape: tuple, num_classes: int) -> dict:
    """The model's constructor arguments for this data: input size and class count."""
    features = int(np.prod(x_shape[1:]))
    if cfg.model == "linear":
        return {"input_size": features, "output_size": num_classes}
    if cfg.model == "mlp":
        return {"in_features": features, "hidden_dim": 128, "out_features": num_classes}
    return {"num_classes": num_classes} if cfg.model == "alexnet" else {}


def make_model(cfg: Config, x_shape: tuple, num_classes: int) -> nnx.Module:
    """The model named by cfg, freshly initialised from the seed or loaded from --init-torch."""
    from jaxpar import models

    kwargs = model_kwargs(cfg, x_shape, num_classes)
    if cfg.init_torch:
        return models.from_torch_state_dict(cfg.model, load_npz(cfg.init_torch, "--init-torch"), **kwargs)
    return models.get(cfg.model, seed=cfg.seed, **kwargs)


def load_npz(path: str, flag: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as f:
            return dict(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path!r} could not be read as .npz ({e}); pass a file written by np.savez.") from e


def make_tx(cfg: Config, steps_per_epoch: int) -> optax.GradientTransformation:
    """The optimizer with StepLR(step_size=1 epoch, gamma) folded into its learning rate."""
    lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
    if cfg.gamma != 1.0:
        lr = optax.exponential_decay(lr, transition_steps=max(steps_per_epoch, 1), decay_rate=cfg.gamma,
                                     staircase=True)
    return make_optimizer(cfg.optimizer, lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def evaluate(eval_step, params, dataset, batch_size: int) -> dict[str, float]:
    """Mean loss and accuracy of `params` over `dataset`, in fixed-size batches (the last one padded, w=0)."""
    n = len(dataset.y)
    totals = np.zeros(3)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        pad = batch_size - len(idx) if n > batch_size else 0
        rows = np.concatenate([idx, np.zeros(pad, idx.dtype)])
        batch = {"x": dataset.x[rows], "y": dataset.y[rows], "idx": rows.astype(np.int32),
                 "w": np.concatenate([np.ones(len(idx)), np.zeros(pad)]).astype(np.float32)}
        aux = eval_step(params, batch)
        totals += [float(aux["loss_sum"]), float(aux["correct"]), float(aux["count"])]
    return {"eval_loss": totals[0] / max(totals[2], 1), "eval_accuracy": totals[1] / max(totals[2], 1)}


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: the run stops, and the last good checkpoint stays the latest."""


def prepare_outputs(cfg: Config, state: TrainState):
    """Check every path the run will write -- checkpoint dir (writable, same model, something to resume), the
    metrics and export files -- before anything is written; returns the Checkpointer (or None)."""
    from jaxpar.run import checkpoint

    ckpt = None
    if cfg.checkpoint_dir:
        ckpt = checkpoint.Checkpointer(cfg.checkpoint_dir, checkpoint.run_info(cfg, state), resume=cfg.resume,
                                       keep=cfg.checkpoint_keep)
    for flag, path in (("--metrics-out", cfg.metrics_out), ("--export-torch", cfg.export_torch)):
        if path:
            checkpoint.writable_file(path, flag)
    return ckpt


def run(cfg: Config, on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Train as `cfg` says and return the summary (also printed as one line by process 0).

    `on_step(step, metrics)` runs after every step (tests use it to send signals at a chosen step).
    """
    from tqdm import tqdm

    from jaxpar.data import datasets as data_lib
    from jaxpar.run import report
    from jaxpar.run.checkpoint import StopSignals
    from jaxpar.data.loader import Loader
    from jaxpar.data.sampler import DistributedSampler

    validate(cfg)
    nproc, rank = jax.process_count(), jax.process_index()
    main_process = rank == 0
    if cfg.batch_size % nproc:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the {nproc} processes; "
                         f"use a multiple of {nproc}.")
    load = lambda split: data_lib.load(cfg.dataset, split, data_dir=cfg.data_dir, data_path=cfg.data_path,  # noqa
                                       model=cfg.model, image_size=cfg.image_size, seed=cfg.seed)
    train_set = load(cfg.train_split)
    eval_set = load(cfg.eval_split) if cfg.eval_split else None
    sampler = DistributedSampler(len(train_set.y), num_replicas=nproc, rank=rank, shuffle=cfg.shuffle,
                                 seed=cfg.seed, drop_last=cfg.drop_last)
    local_batch = cfg.batch_size // nproc
    steps_per_epoch = (len(sampler) // local_batch if cfg.drop_last else math.ceil(len(sampler) / local_batch))
    if steps_per_epoch == 0:
        raise ValueError(f"--batch-size {cfg.batch_size} with --drop-last leaves no batch from "
                         f"{len(train_set.y)} samples; lower the batch size or drop --drop-last.")

    model = make_model(cfg, train_set.x.shape, train_set.num_classes)
    tx = make_tx(cfg, steps_per_epoch)
    graphdef, state = init_state(model, tx, cfg.seed)
    strategy = get_builder(cfg.strategy)(model, tx, cfg)  # validates the strategy's own rules
    ckpt = prepare_outputs(cfg, state)
    position = {"loss_sum": 0.0, "count": 0.0}
    if ckpt is not None and cfg.resume:
        state, position = ckpt.restore(state)
        sampler.load_state_dict(sampler_state(position["sampler"], sampler))
    # every check passed: from here on the run writes
    placed = strategy.init(state)
    eval_step = make_eval_step(graphdef)
    writer = report.MetricsWriter(cfg.metrics_out if main_process else None)
    log = print if main_process and not cfg.quiet else (lambda *a, **k: None)
    step, epoch = int(state.step), sampler.epoch
    log(f"jaxpar: {cfg.strategy} on {strategy.describe()}; model {cfg.model} "
        f"({sum(a.size for a in jax.tree.leaves(state.params)):,} params); {len(train_set.y)} training samples"
        + (f"; resumed from step {step} (epoch {epoch}) in {cfg.checkpoint_dir}" if cfg.resume else ""))
    for note in ckpt.notes if ckpt is not None and main_process else ():
        print(f"jaxpar: note: resuming with a changed setting ({note}); the run will not match the original.")
    writer.write({"event": "start", "strategy": cfg.strategy, "model": cfg.model, "devices": devices_used(strategy),
                  "processes": nproc, "describe": strategy.describe(), "step": step,
                  "config": dataclasses.asdict(cfg)})

    def save() -> None:
        data = {"sampler": sampler.state_dict(), "loss_sum": loss_sum, "count": count}
        if not ckpt.save(step, strategy.unplace(placed), data):
            raise Diverged(f"step {step} left non-finite parameters; not saved. " + _kept(cfg, ckpt))

    total_steps = steps_per_epoch * cfg.epochs if cfg.steps is None else cfg.steps
    clock, stopped, start_step, epoch_done = report.Clock(), None, step, True
    last: dict[str, Any] = {}
    loss_sum, count = position["loss_sum"], position["count"]  # the epoch's running train loss
    try:
        with StopSignals(enabled=ckpt is not None) as signals:
            while step < total_steps and stopped is None:
                sampler.set_epoch(epoch)  # a resumed epoch keeps the checkpoint's offset
                loader = Loader(train_set, local_batch, sampler, drop_last=cfg.drop_last, put=strategy.put_batch)
                bar = tqdm(total=min(len(loader), total_steps - step), desc=f"epoch {epoch}", leave=False,
                           disable=cfg.quiet or not main_process)
                for batch in loader:
                    placed, metrics = strategy.step(placed, batch)
                    step += 1
                    loss, n = float(metrics["loss"]), float(metrics["count"])  # reads back: the step is done
                    clock.tick(n)
                    if not math.isfinite(loss):
                        writer.write({"event": "diverged", "step": step, "loss": loss, "checkpoint": _saved(ckpt)})
                        raise Diverged(f"the training loss became {loss} at step {step} (epoch {epoch}); stopped. "
                                       + _kept(cfg, ckpt) + " Lower --lr, or check the data for NaN values.")
                    loss_sum, count = loss_sum + loss * n, count + n
                    bar.update(1)
                    if step % cfg.log_every == 0:
                        bar.set_postfix(loss=f"{loss_sum / count:.4f}")
                        writer.write({"event": "step", "step": step, "epoch": epoch, "loss": loss,
                                      "train_loss": loss_sum / count, **clock.window()})
                    if on_step is not None:
                        on_step(step, metrics)
                    stopped = signals.agreed()
                    if ckpt is not None and (stopped or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                        save()
                        clock.skip()
                    if stopped or step >= total_steps:
                        break
                bar.close()
                last = {"epoch": epoch, "step": step, "train_loss": loss_sum / max(count, 1)}
                if stopped:
                    break
                epoch_done = len(loader) == 0  # else --steps ended the run mid-epoch
                if eval_set is not None:
                    params = strategy.unplace(placed).params
                    last.update(evaluate(eval_step, params, eval_set, cfg.eval_batch_size))
                clock.skip()
                writer.write({"event": "epoch", **last})
                log(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in last.items()))
                if epoch_done:
                    epoch, loss_sum, count = epoch + 1, 0.0, 0.0
            if ckpt is not None and not stopped and ckpt.saved_step != step:
                save()  # the end of the run is always saved
        final = strategy.unplace(placed)
        summary = {"strategy": cfg.strategy, "model": cfg.model, "devices": devices_used(strategy), "processes": nproc,
                   "precision": cfg.precision, "describe": strategy.describe(), "steps": step,
                   "epochs": epoch + (not epoch_done or bool(stopped)),
                   **{k: v for k, v in last.items() if k not in ("epoch", "step")}, **clock.total(),
                   "resumed_from": start_step if cfg.resume else None, "stopped": stopped}
        if stopped:
            writer.write({"event": "stopped", "step": step, "signal": stopped, "checkpoint": _saved(ckpt)})
            if main_process:
                print(f"jaxpar: {stopped} at step {step}: checkpoint saved in {cfg.checkpoint_dir}; "
                      "continue with the same command plus --resume.")
        if cfg.report:
            summary["report"] = strategy.report(placed)
            summary["memory"] = report.memory_rows(summary["report"])
            if main_process:
                print(report.table(summary, summary["report"], summary["memory"]))
        if cfg.export_torch and main_process and not stopped:
            export_torch(graphdef, final, cfg.export_torch)
        writer.write({"event": "summary", **{k: v for k, v in summary.items() if k not in ("report", "memory")},
                      "summary": summary_line(summary)})
    finally:
        writer.close()
        if ckpt is not None:
            ckpt.close()  # waits for an asynchronous save: the last good checkpoint is complete on disk
    if main_process:
        print(summary_line(summary))
    summary["state"] = final
    return summary


def sampler_state(saved: dict, sampler) -> dict:
    """The checkpoint's sampler position for this run's sampler; another process count gets the same GLOBAL
    position (samples consumed by all ranks together), as the global batch is the same."""
    if saved["num_replicas"] == sampler.num_replicas:
        return saved
    old = saved["num_replicas"]
    done = saved["offset"] >= -(-saved["num_samples"] // old) if not saved["drop_last"] else False
    consumed = saved["offset"] * old
    if not done and consumed % sampler.num_replicas:
        raise ValueError(f"the checkpoint stopped after {consumed} samples of epoch {saved['epoch']} with {old} "
                         f"processes, which {sampler.num_replicas} processes cannot split evenly; resume with "
                         f"{old} processes (or a count dividing {consumed}).")
    offset = len(sampler) if done else min(consumed // sampler.num_replicas, len(sampler))
    return {**saved, "num_replicas": sampler.num_replicas, "offset": offset}


def _saved(ckpt) -> int | None:
    return None if ckpt is None else ckpt.saved_step


def _kept(cfg: Config, ckpt) -> str:
    if ckpt is None:
        return "Nothing was saved (no --checkpoint-dir)."
    if ckpt.saved_step is None:
        return f"No checkpoint was saved yet in {cfg.checkpoint_dir}."
    return f"The last good checkpoint, step {ckpt.saved_step}, stays in {cfg.checkpoint_dir}."


def export_torch(graphdef, state: TrainState, path: str) -> None:
    """Write the trained weights as a PyTorch state dict (.npz of numpy arrays under torch's keys)."""
    from jaxpar import models

    np.savez(path, **models.to_torch_state_dict(nnx.merge(graphdef, state.params)))


def summary_line(s: dict) -> str:
    keys = ("strategy", "model", "devices", "processes", "steps", "epochs", "train_loss", "eval_loss",
            "eval_accuracy", "samples_per_s", "time_s")
    return "summary: " + " ".join(f"{k}={s[k]:.4g}" if isinstance(s[k], float) else f"{k}={s[k]}"
                                  for k in keys if k in s)

