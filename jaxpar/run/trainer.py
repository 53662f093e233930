"""The training loop behind train.py: data, model, optimizer and a strategy, run for epochs or steps.

Roughly:
    data, model, tx = ...; strategy = build(model, tx, cfg); placed = strategy.init(state)
    for epoch: for batch in loader(put=strategy.put_batch): placed, metrics = strategy.step(placed, batch)
               evaluate(strategy.unplace(placed).params)
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import math
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar.config import DEFAULT_LR, Config
from jaxpar.optim import (DECAY_PARAMS, EPS_MIN, LR_SCHEDULES, OPTIMIZERS, clip_by_global_norm, eps_ok, make_optimizer,
                          warmup_cosine)
from jaxpar.run import distributed
from jaxpar.run import memory as jax_memory
from jaxpar.run import weights
from jaxpar.step import TrainState, init_state, make_eval_step
from jaxpar.strategies.base import STRATEGIES, cfg_objective, get_builder, whole_batch


def devices_used(strategy) -> int:
    """How many devices (over all processes) the strategy runs on: its mesh, its device list, or one."""
    if getattr(strategy, "mesh", None) is not None:
        return strategy.mesh.devices.size
    return len(getattr(strategy, "devices", [None]))


def local_devices_used(strategy) -> list | None:
    """This process's devices the strategy runs on (None: not known, so every device), for the memory rows."""
    import jax

    if getattr(strategy, "mesh", None) is not None:
        devices = list(strategy.mesh.devices.flat)
    elif getattr(strategy, "devices", None) is not None:
        devices = list(strategy.devices)
    elif getattr(strategy, "device", None) is not None:
        devices = [strategy.device]
    else:
        return None
    return [d for d in devices if d.process_index == jax.process_index()]


CONV_MODELS = ("convnet", "alexnet")  # the built-in models with Conv2d layers (--conv-impl)


def validate(cfg: Config) -> None:
    """Reject a bad configuration before any work starts (names, ranges); strategies check their own rules."""
    from jaxpar import models
    from jaxpar.data.datasets import DATASETS
    from jaxpar.losses import LOSSES
    from jaxpar.precision import PRECISIONS

    from jaxpar.run.distributed import CPU_COLLECTIVES

    choices = {"strategy": STRATEGIES, "dataset": DATASETS, "optimizer": OPTIMIZERS, "precision": PRECISIONS,
               "lr_schedule": LR_SCHEDULES, "weight_decay_params": DECAY_PARAMS, "cpu_collectives": CPU_COLLECTIVES}
    for field, valid in choices.items():
        value = getattr(cfg, field)
        if value not in valid:
            raise ValueError(f"--{field.replace('_', '-')} {value!r} is not known; use one of: {', '.join(valid)}.")
    if cfg.model not in models.NAMES and ":" not in cfg.model:
        raise ValueError(f"--model {cfg.model!r} is not known; use one of: {', '.join(models.NAMES)}, or "
                         "MODULE:NAME / FILE.py:NAME naming a function or class that builds an nnx.Module.")
    if cfg.loss is not None and cfg.loss not in LOSSES and ":" not in cfg.loss:
        raise ValueError(f"--loss {cfg.loss!r} is not known; use one of: {', '.join(LOSSES)}, or MODULE:NAME / "
                         "FILE.py:NAME naming fn(outputs, batch) -> (loss_sum, weight_sum[, metrics]).")
    if cfg.conv_impl is not None:
        if cfg.conv_impl not in models.CONV_IMPLS:
            raise ValueError(f"--conv-impl {cfg.conv_impl!r} is not known; use one of: {', '.join(models.CONV_IMPLS)}.")
        if cfg.model not in CONV_MODELS:
            raise ValueError(f"--conv-impl is for the built-in convnet and alexnet; --model {cfg.model!r} has no "
                             "Conv2d to set: drop --conv-impl.")
    if cfg.model_kwargs is not None:
        if ":" not in cfg.model:
            raise ValueError(f"--model-kwargs is for --model MODULE:NAME; the built-in {cfg.model!r} takes its "
                             "sizes from the data; drop --model-kwargs.")
        model_kwargs_of(cfg)
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"--dropout {cfg.dropout} must be in [0, 1) (the probability of zeroing a unit, torch's "
                         "nn.Dropout p); pass e.g. --dropout 0.1, or 0.0 (nanoGPT pretrains without).")
    for field in ("checkpoint_dir", "metrics_out", "export_torch", "init_torch"):
        if getattr(cfg, field) is not None and not getattr(cfg, field).strip():  # an unset shell variable, say
            raise ValueError(f"--{field.replace('_', '-')} {getattr(cfg, field)!r} names no path; pass one, or leave "
                             f"--{field.replace('_', '-')} out.")
    for field, fix in (("n_head", "e.g. --n-head 4, or leave it out for the config's own"),
                       ("num_devices", "e.g. --num-devices 2, or leave it out for every device"),
                       ("image_size", "e.g. --image-size 32, or leave it out for the model's own size")):
        if getattr(cfg, field) is not None and getattr(cfg, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} {getattr(cfg, field)} must be >= 1; pass {fix}.")
    if cfg.output_device is not None and cfg.output_device < 0:
        raise ValueError(f"--output-device {cfg.output_device} must be the index of one of the devices DataParallel "
                         "runs on (0 .. --num-devices - 1, torch's output_device); pass e.g. --output-device 0.")
    if cfg.model in models.GPT_NAMES:  # heads vs width: before any data is read
        models.GPTConfig.named(cfg.model, n_head=cfg.n_head, dropout=cfg.dropout,
                               activation_function=cfg.activation_function)
    if not 0.0 <= cfg.label_smoothing <= 1.0:
        raise ValueError(f"--label-smoothing {cfg.label_smoothing} must be in [0, 1] (torch's rule; 0 is plain "
                         "cross-entropy); pass e.g. --label-smoothing 0.1.")
    if cfg.label_smoothing and cfg.loss not in (None, "cross_entropy"):
        raise ValueError(f"--label-smoothing {cfg.label_smoothing} smooths the cross-entropy's targets, but --loss is "
                         f"{cfg.loss}; drop --label-smoothing, or use the cross_entropy loss.")
    if cfg.sequence_parallel and (cfg.strategy not in ("tp", "pipeline") or cfg.tensor_parallel < 2):
        raise ValueError(f"--sequence-parallel splits the tokens over the tensor ranks of --strategy tp or pipeline "
                         f"with --tensor-parallel >= 2 (got --strategy {cfg.strategy}, --tensor-parallel "
                         f"{cfg.tensor_parallel}); use both, or drop --sequence-parallel.")
    if cfg.sequence_parallel and cfg.dataset == "text" and cfg.seq_len % cfg.tensor_parallel:  # npz: gpt_model
        raise ValueError(f"--seq-len {cfg.seq_len} does not split over --tensor-parallel {cfg.tensor_parallel} ranks "
                         "(--sequence-parallel gives each its share of every sequence's tokens); use a --seq-len "
                         f"that is a multiple of {cfg.tensor_parallel}, or drop --sequence-parallel.")
    if cfg.strategy == "pipeline" and cfg.tensor_parallel != 1:  # 3-D: D x S x T devices, heads split over T
        tp, stages = cfg.tensor_parallel, cfg.num_stages
        if tp < 1:
            raise ValueError(f"--tensor-parallel {tp} must be >= 1; pass 1 (no tensor parallelism) or more.")
        if cfg.num_devices and cfg.num_devices % (stages * tp):
            fit = stages * tp * max(1, cfg.num_devices // (stages * tp))
            raise ValueError(f"--num-devices {cfg.num_devices} must be a multiple of --num-stages x --tensor-parallel "
                             f"= {stages} x {tp} (D x S x T); use --num-devices {fit}.")
    splits = cfg.strategy == "tp" or (cfg.strategy == "pipeline" and cfg.tensor_parallel > 1)
    tp = cfg.tensor_parallel
    if cfg.strategy == "tp" and tp >= 2:  # the groups before the heads: the heads' fix would fail on them next
        devices = cfg.num_devices
        if not devices and cfg.cpu_devices:  # simulated: known before JAX starts (x the launcher's processes)
            from jaxpar.run import distributed

            group = distributed.detect()
            devices = cfg.cpu_devices * (group.num_processes if group is not None and group.num_processes else 1)
        if devices and devices % tp:
            raise ValueError(f"--tensor-parallel {tp} must divide the {devices} devices (--strategy tp's tensor "
                             f"groups); use a divisor of {devices}, or more devices.")
    if splits and tp >= 2 and cfg.model in models.GPT_NAMES and not (cfg.init_torch and cfg.n_head is None):
        heads = models.GPTConfig.named(cfg.model, n_head=cfg.n_head).n_head  # (else the file's: the strategy checks)
        if heads % tp:
            raise ValueError(f"--model {cfg.model} has {heads} heads, which --tensor-parallel {tp} does not split "
                             f"evenly; use a --tensor-parallel dividing {heads} (or --n-head a multiple of {tp}).")
    if splits and cfg.model in models.NAMES and cfg.model not in models.GPT_NAMES:  # before the data loads
        raise ValueError(f"--model {cfg.model} has no module that tensor parallelism can split (none defines "
                         f"tensor_layout()); use a GPT ({', '.join(models.GPT_NAMES[:3])}, ...) or a model of your own "
                         f"built for it, or {'--strategy ddp' if cfg.strategy == 'tp' else '--tensor-parallel 1'}.")
    if cfg.strategy == "tp" and tp < 2:  # (jaxpar.TensorParallel's default is 2)
        given = "" if tp != Config().tensor_parallel else " (the default)"
        raise ValueError(f"--strategy tp with --tensor-parallel {tp}{given} " + (
            "splits no layer (it would be data parallelism alone)" if tp == 1 else "is not a group size")
            + "; pass --tensor-parallel T >= 2 (Megatron's --tensor-model-parallel-size), or use --strategy ddp.")
    if cfg.torch_layout not in models.gpt.LAYOUTS:
        raise ValueError(f"--torch-layout {cfg.torch_layout!r} is not known; use hf (transformers' GPT2LMHeadModel) "
                         "or nanogpt.")
    if cfg.seq_len < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} must be >= 1; pass the window length in tokens, e.g. 256.")
    if cfg.peak_tflops is not None and not 0 < cfg.peak_tflops < math.inf:
        raise ValueError(f"--peak-tflops {cfg.peak_tflops} must be a finite number > 0; pass the device's peak "
                         "TFLOP/s, or leave it out.")
    if cfg.per_sample not in (None, "on", "off"):
        raise ValueError(f"--per-sample {cfg.per_sample!r} is not known; use on, off, or leave it out (on unless "
                         "the model has BatchNorm).")
    for field in ("batch_size", "epochs", "eval_batch_size", "log_every"):
        if getattr(cfg, field) is not None and getattr(cfg, field) < 1:  # epochs: None is 1
            raise ValueError(f"--{field.replace('_', '-')} {getattr(cfg, field)} must be >= 1; pass a positive count.")
    if cfg.activation_checkpoint_interval < 0:
        raise ValueError(f"--activation-checkpoint-interval {cfg.activation_checkpoint_interval} must be >= 0; pass 0 "
                         "(keep every activation) or N (recompute each N-layer segment in the backward).")
    if cfg.zero_reduce is not None and cfg.strategy not in ("zero", "pipeline", "tp"):
        raise ValueError(f"--zero-reduce {cfg.zero_reduce} sets how ZeRO-1 reduces gradients under --strategy zero, "
                         f"tp or pipeline, not {cfg.strategy}; use one of those, or drop --zero-reduce.")
    if cfg.zero_reduce is not None and cfg.strategy in ("pipeline", "tp") and not cfg.zero_stage:
        raise ValueError(f"--zero-reduce {cfg.zero_reduce} sets how ZeRO-1 reduces gradients, but --strategy "
                         f"{cfg.strategy} runs without ZeRO here; add --zero-stage 1, or drop --zero-reduce.")
    if cfg.zero_fetch is not None and (cfg.strategy, cfg.zero_stage) != ("zero", 3):
        stage = f"--zero-stage {cfg.zero_stage}" if cfg.zero_stage is not None else "its default stage"
        raise ValueError(f"--zero-fetch {cfg.zero_fetch} sets how ZeRO stage 3 gathers the weights, not --strategy "
                         f"{cfg.strategy} with {stage}; add --strategy zero --zero-stage 3, or drop --zero-fetch.")
    if cfg.zero_stage is not None and cfg.strategy not in ("zero", "pipeline", "tp"):
        raise ValueError(f"--zero-stage {cfg.zero_stage} partitions state over data replicas under --strategy zero "
                         f"(1-3), pipeline or tp (1), not {cfg.strategy}; use one of those, or drop --zero-stage.")
    if cfg.zero_stage not in (None, 0, 1) and cfg.strategy in ("pipeline", "tp"):
        raise ValueError(f"--zero-stage {cfg.zero_stage} under --strategy {cfg.strategy}: it takes stage 0 or 1 (" + (
            "Megatron's distributed optimizer" if cfg.strategy == "tp" else "DeepSpeed refuses stages 2-3 with "
            "pipeline parallelism") + "); pass --zero-stage 1, or --strategy zero for stages 2-3.")
    if cfg.activation_checkpoint_interval and cfg.strategy == "zero" and cfg.zero_stage == 3:
        raise ValueError(f"--activation-checkpoint-interval {cfg.activation_checkpoint_interval} with --zero-stage 3: "
                         "stage 3 runs each layer under its own fetching recomputation; use --zero-stage 1 or 2 "
                         "with it, or drop it.")
    if cfg.sample:
        if cfg.sample < 0 or cfg.model not in models.GPT_NAMES or cfg.dataset != "text":
            raise ValueError(f"--sample {cfg.sample} prints bytes a GPT generates after training on text: it needs a "
                             f"count >= 0, one of jaxpar's GPTs and --dataset text (got --model {cfg.model}, --dataset "
                             f"{cfg.dataset}); use those, or drop --sample.")
        if not 0 <= cfg.sample_temperature < math.inf:
            raise ValueError(f"--sample-temperature {cfg.sample_temperature} must be a finite number >= 0 (0: greedy); "
                             "pass e.g. 0.8 (nanoGPT's).")
        if not cfg.sample_top_k >= 1:  # a k above the 256 bytes keeps every byte: nanoGPT's min(top_k, vocab)
            raise ValueError(f"--sample-top-k {cfg.sample_top_k} must be >= 1 (256 or more: every byte, as nanoGPT "
                             "takes min(top_k, vocabulary)); pass e.g. 200 (nanoGPT's).")
        if not cfg.sample_prompt:
            raise ValueError("--sample-prompt is empty; pass the text to continue, e.g. a newline (nanoGPT's).")
    if cfg.recompute_granularity is not None:
        if cfg.recompute_granularity != "selective":
            raise ValueError(f"--recompute-granularity {cfg.recompute_granularity!r} is not known; use selective (the "
                             "GPT's core attention); full recompute is --activation-checkpoint-interval N (Megatron's "
                             "--recompute-num-layers N).")
        if cfg.model not in models.GPT_NAMES:
            raise ValueError(f"--recompute-granularity selective recomputes a GPT's core attention, but --model "
                             f"{cfg.model} is not one of jaxpar's GPTs ({', '.join(models.GPT_NAMES)}); use "
                             "--activation-checkpoint-interval N for any model with `layers`.")
        if cfg.activation_checkpoint_interval:
            raise ValueError(f"--recompute-granularity selective with --activation-checkpoint-interval "
                             f"{cfg.activation_checkpoint_interval}: full recompute already reruns the attention of "
                             "each segment; use one of the two (Megatron's --recompute-granularity takes one).")
    if cfg.steps is not None and cfg.steps < 1:
        raise ValueError(f"--steps {cfg.steps} must be >= 1 (or leave it out to run whole epochs).")
    defaults = Config()
    changed = lambda fields: [f"--{f.replace('_', '-')}" for f in fields  # noqa: E731  (the flags given)
                              if getattr(cfg, f) != getattr(defaults, f)]
    if cfg.precision == "fp16" and cfg.loss_scale:  # a static scale: the dynamic scaler's flags are read by nothing
        given = changed(LOSS_SCALE_FIELDS[1:])
        if given:
            raise ValueError(f"{', '.join(given)} set(s) the dynamic loss scaler, but --loss-scale {cfg.loss_scale} "
                             "is a fixed scale; drop them, or pass --loss-scale 0 for dynamic scaling.")
    scaler = loss_scale_config(cfg)  # fp16's loss scaler: its settings checked here, before any work
    if scaler is None:
        given = changed(LOSS_SCALE_FIELDS)
        if given:
            raise ValueError(f"{', '.join(given)} set(s) the loss scaler of --precision fp16, but --precision is "
                             f"{cfg.precision}; add --precision fp16, or drop them (bf16 and fp32 need no scaling).")
    if cfg.lr is not None and not 0 < cfg.lr < math.inf:
        raise ValueError(f"--lr {cfg.lr} must be a finite number > 0; pass a positive learning rate, or leave it "
                         f"out for the optimizer's default ({DEFAULT_LR[cfg.optimizer]}).")
    if not cfg.grad_clip >= 0:
        raise ValueError(f"--grad-clip {cfg.grad_clip} must be >= 0; pass the largest global gradient norm (nanoGPT: "
                         "1.0), or 0 for no clipping.")
    if cfg.lr_schedule != "cosine":
        given = [f"--{f.replace('_', '-')} {getattr(cfg, f)}" for f, off in
                 (("warmup_steps", 0), ("lr_decay_steps", None), ("min_lr", None)) if getattr(cfg, f) != off]
        if given:
            raise ValueError(f"{', '.join(given)} shape the cosine schedule, but --lr-schedule is {cfg.lr_schedule}; "
                             "add --lr-schedule cosine, or drop them.")
    else:
        lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
        if cfg.warmup_steps < 0:
            raise ValueError(f"--warmup-steps {cfg.warmup_steps} must be >= 0; pass 0 for no warmup.")
        if cfg.lr_decay_steps is not None and cfg.lr_decay_steps <= cfg.warmup_steps:
            raise ValueError(f"--warmup-steps {cfg.warmup_steps} must be below --lr-decay-steps "
                             f"{cfg.lr_decay_steps}; pass a larger --lr-decay-steps or fewer --warmup-steps.")
        if cfg.min_lr is not None and not 0 <= cfg.min_lr <= lr:
            raise ValueError(f"--min-lr {cfg.min_lr} must be in [0, --lr {lr}]; pass e.g. --min-lr {lr / 10:g} "
                             "(nanoGPT's lr / 10), or leave it out.")
    if cfg.weight_decay_params != "all" and not (cfg.weight_decay or cfg.optimizer == "adamw" and
                                                  cfg.weight_decay is None):
        raise ValueError(f"--weight-decay-params {cfg.weight_decay_params} chooses which parameters decay, but "
                         f"--optimizer {cfg.optimizer} runs with no weight decay; pass --weight-decay (nanoGPT: 0.1), "
                         "or drop --weight-decay-params.")
    if not 0 <= cfg.momentum < math.inf:
        raise ValueError(f"--momentum {cfg.momentum} must be a finite number >= 0; pass 0 (torch's default) or a "
                         "positive value such as 0.9.")
    if cfg.nesterov and cfg.optimizer == "sgd" and not cfg.momentum > 0:
        raise ValueError("--nesterov needs a momentum (torch.optim.SGD's rule), but --momentum is 0; pass e.g. "
                         "--momentum 0.9, or drop --nesterov.")
    if cfg.eps is not None and not eps_ok(cfg.eps):
        raise ValueError(f"--eps {cfg.eps} must be a finite number of at least {EPS_MIN:.3g} (it keeps the update's "
                         "denominator off zero in float32); pass e.g. 1e-8 (torch's Adam default), or leave it out for "
                         "the optimizer's default.")
    for flag, beta, torch_default, nanogpt in (("--adam-beta1", cfg.adam_beta1, 0.9, 0.9),
                                               ("--adam-beta2", cfg.adam_beta2, 0.999, 0.95)):
        if not 0 <= beta < 1:
            raise ValueError(f"{flag} {beta} must be in [0, 1) (torch.optim.Adam's rule); pass e.g. torch's "
                             f"{torch_default} or nanoGPT's {nanogpt}.")
    if cfg.weight_decay is not None and not 0 <= cfg.weight_decay < math.inf:
        raise ValueError(f"--weight-decay {cfg.weight_decay} must be a finite number >= 0 (torch.optim's rule); "
                         "pass e.g. 0.1, or leave it out for the optimizer's default.")
    if not 0 < cfg.gamma < math.inf:
        raise ValueError(f"--gamma {cfg.gamma} must be > 0 (StepLR multiplies the learning rate by it each epoch: "
                         "0 stops training, a negative one ascends); pass e.g. 0.7, or 1.0 for a constant rate.")
    if not 0 <= cfg.seed < 2 ** 63:  # JAX's key takes an int64 (2**63 and up failed inside nnx.Rngs: a QA finding)
        raise ValueError(f"--seed {cfg.seed} must be in [0, 2**63) (numpy's and JAX's seeds); pass e.g. --seed 0.")
    for field in ("num_stages", "micro_batches", "virtual_stages"):
        if getattr(cfg, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} {getattr(cfg, field)} must be >= 1; pass a positive count "
                             "(the pipeline's defaults: 2 stages, 4 micro-batches, 1 chunk per stage).")
    check_flags_are_read(cfg)
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
    if cfg.strategy == "pipeline" and cfg.schedule == "interleaved" and cfg.virtual_stages == 1:
        raise ValueError("--schedule interleaved needs --virtual-stages >= 2 model chunks per stage (with 1 its "
                         "ticks are 1F1B's); pass --virtual-stages 2, or --schedule 1f1b.")
    from jaxpar.run import distributed

    group = distributed.detect()  # the process count the launcher set, before joining (run() checks it again)
    if group is not None and group.num_processes:
        check_process_batch(cfg, group.num_processes)
        if cfg.cpu_devices:  # each process's device count is known before joining only when simulated
            check_process_layout(cfg, group.num_processes, cfg.cpu_devices)


def check_process_batch(cfg: Config, nproc: int) -> None:
    """The strategy runs across processes, and every process reads an equal share of --batch-size (the pipeline:
    every process all of it)."""
    if nproc > 1 and cfg.strategy in ("single", "dp"):
        raise ValueError(f"--strategy {cfg.strategy} runs in one process, but the launcher started {nproc}; use "
                         "--strategy ddp (or zero, tp, pipeline) across processes, or launch one process.")
    if cfg.batch_size % nproc and not whole_batch(cfg.strategy):
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the {nproc} processes; "
                         f"use a multiple of {nproc}.")


def check_process_layout(cfg: Config, nproc: int, per_process: int) -> None:
    """Before joining: refuse the tensor group or pipeline stage that would lie on devices of two processes, as
    TensorParallel and the pipeline's Transport would after joining (jax.devices() lists the processes' devices
    process by process; a tensor group is T consecutive devices, a stage --num-devices / --num-stages)."""
    from jaxpar.mesh import stage_fix, straddler, tensor_group_error

    n, T, S = cfg.num_devices or nproc * per_process, max(1, cfg.tensor_parallel), cfg.num_stages
    if n > nproc * per_process:
        return  # more devices than the processes hold: make_mesh's refusal says so
    if cfg.strategy == "tp" and T >= 2 and n % T == 0 and (procs := straddler(n, T, per_process)):
        raise tensor_group_error(T, procs, per_process)
    if cfg.strategy == "pipeline" and n % (S * T) == 0 and (procs := straddler(n, n // S, per_process)):
        shape = f"{n // (S * T)} x {T} (D x T)" if T > 1 else f"{n // S}"
        raise ValueError(f"--num-stages {S} over {nproc} processes of {per_process} device(s) puts a stage's "
                         f"{shape} devices on processes {procs}; a stage must live in one process: "
                         f"{stage_fix(n, per_process, T)}; or --strategy ddp across processes.")


# Flags that only some strategies read: given to another, they would be accepted and silently ignored
STRATEGY_FLAGS = {"allreduce": ("ddp",), "overlap": ("ddp",), "bucket_cap_mb": ("ddp", "zero"),
                  "grad_accum": ("ddp", "zero"), "grad_comm_dtype": ("ddp",), "spmd": ("ddp",),
                  "loss_on_device": ("dp",), "print_shapes": ("dp",), "output_device": ("dp",),
                  "tensor_parallel": ("tp", "pipeline"), "parallel_output": ("tp", "pipeline"),
                  "num_stages": ("pipeline",), "micro_batches": ("pipeline",), "schedule": ("pipeline",),
                  "virtual_stages": ("pipeline",), "partition_method": ("pipeline",), "defer_wgrad": ("pipeline",)}
HINTS = {("grad_accum", "pipeline"): " (the pipeline accumulates over --micro-batches, DeepSpeed's "
                                     "gradient_accumulation_steps)"}


def check_flags_are_read(cfg: Config) -> None:
    """ValueError for a flag changed from its default that nothing in this run reads: another strategy's, a GPT's
    on another model, a dataset's on another dataset, another schedule's or optimizer's."""
    from jaxpar import models
    from jaxpar.cli import NEGATED

    defaults = Config()
    given = lambda f: getattr(cfg, f) != getattr(defaults, f)  # noqa: E731
    flag = lambda f: NEGATED.get(f, f"--{f.replace('_', '-')}")  # noqa: E731  (as typed: --no-overlap)
    value = lambda f: (v if not isinstance(v := getattr(cfg, f), str) or v.isprintable() else repr(v))  # noqa: E731
    shown = lambda f: flag(f) if isinstance(getattr(cfg, f), bool) else f"{flag(f)} {value(f)}"  # noqa: E731
    for field, owners in STRATEGY_FLAGS.items():
        if given(field) and cfg.strategy not in owners:
            raise ValueError(f"{shown(field)} is read by --strategy {' and '.join(owners)}, not {cfg.strategy}"
                             f"{HINTS.get((field, cfg.strategy), '')}; use that strategy, or drop {flag(field)}.")
    readers = [(("n_head", "dropout", "activation_function", "torch_layout"), cfg.model in models.GPT_NAMES,
                f"--model {cfg.model} is not one of jaxpar's GPTs ({', '.join(models.GPT_NAMES)})"),
               (("seq_len",), cfg.dataset == "text", f"--dataset {cfg.dataset} is not text"),
               (("data_dir",), cfg.dataset in ("mnist", "cifar10"), f"--dataset {cfg.dataset} reads no IDX or tfds "
                                                                     "folder (mnist and cifar10 do)"),
               (("data_path",), cfg.dataset in ("npz", "text"), f"--dataset {cfg.dataset} reads no file (npz and "
                                                                 "text do)"),
               (("gamma",), cfg.lr_schedule == "step", f"--lr-schedule {cfg.lr_schedule} is not StepLR's"),
               (("momentum", "nesterov"), cfg.optimizer == "sgd",
                f"--optimizer {cfg.optimizer} has no momentum flag (SGD's)"),
               (("eps",), cfg.optimizer != "sgd", "--optimizer sgd has no eps (Adam's, AdamW's and Adadelta's)"),
               (("adam_beta1", "adam_beta2"), cfg.optimizer in ("adam", "adamw"),
                f"--optimizer {cfg.optimizer} has no betas (Adam's and AdamW's)"),
               (("checkpoint_keep",), bool(cfg.checkpoint_dir), "no --checkpoint-dir is given (nothing is saved)"),
               (("torch_layout",), bool(cfg.export_torch), "nothing is exported without --export-torch (--init-torch "
                                                             "reads either layout)"),
               (("parallel_output",), cfg.strategy == "tp" or cfg.tensor_parallel > 1,
                "no vocabulary is split without --tensor-parallel >= 2"),
               (("eval_batch_size",), cfg.eval_split != "", "--eval-split '' skips evaluation"),
               (("log_every",), not cfg.quiet or bool(cfg.metrics_out),
                "--quiet prints no progress and no --metrics-out file is written"),
               (("sample_temperature", "sample_top_k", "sample_prompt"), bool(cfg.sample),
                "nothing is sampled without --sample N"),
               (("peak_tflops",), cfg.model not in models.NAMES or cfg.model in models.GPT_NAMES,
                f"--model {cfg.model} is not one of jaxpar's GPTs, the only models MFU is reported for"),
               (("image_size",), cfg.dataset != "text" and not (cfg.dataset == "synthetic" and cfg.model == "linear")
                and not (cfg.dataset == "npz" and _npz_vectors(cfg.data_path)),
                f"--dataset {cfg.dataset} holds {'text' if cfg.dataset == 'text' else 'vectors'} here, not images"),
               (("num_devices",), cfg.strategy != "single" or cfg.num_devices == 1,
                "--strategy single runs on one device (a data-parallel strategy uses more)"),
               (("cpu_collectives",), distributed.detect() is not None,
                "this is one process (no launcher's variables: nothing crosses processes)"),
               (("bucket_cap_mb",), not (cfg.strategy == "zero" and cfg.zero_stage == 3),
                "--zero-stage 3 gathers and reduces each leaf on its own (no buckets)")]
    for fields, read, why in readers:
        for field in fields:
            if given(field) and not read:
                raise ValueError(f"{shown(field)} would be ignored: {why}; drop {flag(field)}.")


def _npz_vectors(path: str | None) -> bool:
    """Whether the .npz at `path` holds vectors x [N, F], read from x's header alone (an unreadable file is left to
    the loader's error)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z, z.open("x.npy") as f:
            version = np.lib.format.read_magic(f)
            shape = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                     np.lib.format.read_array_header_2_0)(f)[0]
            return len(shape) == 2
    except Exception:  # noqa: BLE001  (missing, corrupt, no x: the loader names it)
        return False


def load_object(ref: str, flag: str) -> Any:
    """The object `ref` names: ``package.module:NAME`` (importable, or from the working directory) or
    ``path/to/file.py:NAME``."""
    import importlib
    import importlib.util
    import os
    import sys

    where, _, name = ref.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag} {ref!r} must be MODULE:NAME or FILE.py:NAME, e.g. examples/regression.py:make_model.")
    try:
        if where.endswith(".py") or os.sep in where:
            if not os.path.isfile(where):
                raise ValueError(f"{flag} {ref!r}: no file {where!r}; pass an existing .py file.")
            spec = importlib.util.spec_from_file_location(f"jaxpar_user_{abs(hash(os.path.abspath(where)))}", where)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"{flag} {ref!r}: module {where!r} could not be imported ({e}); check the name, or pass "
                         "FILE.py:NAME.") from None
    if not hasattr(module, name):
        own = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
               and getattr(v, "__module__", None) == module.__name__]
        raise ValueError(f"{flag} {ref!r}: {where!r} has no {name!r}; pass one of the functions or classes it "
                         f"defines: {', '.join(own[:12]) or 'none'}.")
    return getattr(module, name)


def model_kwargs_of(cfg: Config) -> dict:
    """--model-kwargs as a dict (JSON object)."""
    import json

    if cfg.model_kwargs is None:
        return {}
    try:
        kwargs = json.loads(cfg.model_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-kwargs {cfg.model_kwargs!r} is not JSON ({e.msg}); pass an object such as "
                         "'{\"hidden\": 64}'.") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--model-kwargs {cfg.model_kwargs!r} must be a JSON object of keyword arguments, "
                         "e.g. '{\"hidden\": 64}'.")
    return kwargs


def builtin_kwargs(cfg: Config, x_shape: tuple, num_classes: int) -> dict:
    """A built-in model's constructor arguments for this data: input size and class count."""
    features = int(np.prod(x_shape[1:]))
    if cfg.model == "linear":
        return {"input_size": features, "output_size": num_classes}
    if cfg.model == "mlp":
        return {"in_features": features, "hidden_dim": 128, "out_features": num_classes}
    out = {"num_classes": num_classes} if cfg.model == "alexnet" else {}
    return out | ({"conv_impl": cfg.conv_impl} if cfg.conv_impl and cfg.model in CONV_MODELS else {})


def make_model(cfg: Config, train_set, eval_set=None) -> nnx.Module:
    """The model named by cfg, freshly initialised from the seed or loaded from --init-torch.

    A user's ``--model MODULE:NAME`` is called with --model-kwargs, plus ``rngs=nnx.Rngs(params=seed,
    dropout=seed)`` when it takes `rngs` and the kwargs do not give it."""
    import inspect

    from jaxpar import models

    if cfg.model in models.GPT_NAMES:
        return gpt_model(cfg, train_set, eval_set)
    if cfg.model in models.NAMES:
        if train_set.num_classes is None:
            raise ValueError(f"--model {cfg.model} classifies, but the data's targets are not class labels; use a "
                             "--model MODULE:NAME of your own with a --loss for them.")
        kwargs = builtin_kwargs(cfg, np.shape(train_set.x), train_set.num_classes)
        if cfg.init_torch:
            state_dict = weights.read(cfg.init_torch, "--init-torch")[0]
            known = models.kwargs_from_state_dict(cfg.model, state_dict)  # sizes come from the state dict
            outputs = next((known[k] for k in ("output_size", "out_features", "num_classes") if k in known), None)
            classes = max(n for n in (train_set.num_classes, getattr(eval_set, "num_classes", None)) if n)
            if outputs is not None and outputs < classes:  # a label without an output: NaN at the first step
                raise ValueError(f"--init-torch {cfg.init_torch!r} holds a {cfg.model} with {outputs} outputs, but the "
                                 f"data has {classes} classes (labels up to {classes - 1}), which its cross-entropy "
                                 f"cannot score; pass the state dict of a model with {classes} outputs or more, or "
                                 f"data of at most {outputs} classes.")
            return models.from_torch_state_dict(cfg.model, state_dict,
                                                **{k: v for k, v in kwargs.items() if k not in known})
        return models.get(cfg.model, seed=cfg.seed, **kwargs)
    build = load_object(cfg.model, "--model")
    kwargs = model_kwargs_of(cfg)
    if not callable(build):
        raise ValueError(f"--model {cfg.model!r} is a {type(build).__name__}; name a function or class that "
                         "returns an nnx.Module.")
    try:  # a class: its __init__'s parameters (nnx's metaclass hides them from signature(cls))
        takes_rngs = "rngs" in inspect.signature(build.__init__ if isinstance(build, type) else build).parameters
    except (TypeError, ValueError):
        takes_rngs = False
    if takes_rngs and "rngs" not in kwargs:
        kwargs["rngs"] = nnx.Rngs(params=cfg.seed, dropout=cfg.seed)
    try:
        model = build(**kwargs)
    except TypeError as e:
        raise ValueError(f"--model {cfg.model!r} could not be built with --model-kwargs {cfg.model_kwargs!r} ({e}); "
                         "pass the arguments it needs as a JSON object.") from None
    if not isinstance(model, nnx.Module):
        raise ValueError(f"--model {cfg.model!r} returned a {type(model).__name__}, not an nnx.Module.")
    if cfg.init_torch:
        if not callable(getattr(model, "load_torch_state_dict", None)):
            raise ValueError(f"--init-torch: {type(model).__name__} has no load_torch_state_dict(state_dict) "
                             "method to read a PyTorch state dict with; define one, or drop --init-torch.")
        model.load_torch_state_dict(weights.read(cfg.init_torch, "--init-torch")[0])
    if any(isinstance(m, nnx.Embed) for _, m in nnx.iter_graph(model)):  # integer inputs index its table
        check_token_ids(cfg, train_set, eval_set, targets=False)
    return model


def check_token_ids(cfg: Config, train_set, eval_set, targets: bool) -> None:
    """ValueError where token ids index an embedding (integer `x` of the data sets: npz tokens) and one is negative,
    which nnx.Embed would silently read as a row from the table's end; with `targets` (the GPTs' cross-entropy)
    also a target below 0 other than torch's ignore_index -100 (else the loss is NaN at the first step)."""
    from jaxpar.losses import IGNORE_INDEX

    for flag, data in (("--train-split", train_set), ("--eval-split", eval_set)):  # eval rows index it too
        x = getattr(data, "x", None) if data is not None and len(data) else None
        if x is None or not np.issubdtype(np.asarray(x).dtype, np.integer):
            continue
        split = getattr(data, "split", "")
        x_min = int(np.min(x))
        y = np.asarray(data.y) if targets else np.zeros(1, np.int64)
        y_bad = (y < 0) & (y != IGNORE_INDEX)
        if x_min < 0 or y_bad.any():
            what = f"x holds token {x_min}" if x_min < 0 else f"y holds target {int(y[y_bad][0])}"
            if targets:
                rule = (f"token ids must be >= 0 and targets >= 0 or {IGNORE_INDEX} (torch's ignore_index; nanoGPT's "
                        f"-1 is not); fix the file: set ignored targets to {IGNORE_INDEX}, tokens to ids in [0, vocab).")
            else:
                rule = ("token ids must be >= 0 (the model's nnx.Embed would read a negative one as a row from the "
                        "table's end); fix the file: tokens to ids in [0, vocab).")
            raise ValueError(f"--dataset {cfg.dataset} {flag} {split!r}: {what}; {rule}")


def gpt_model(cfg: Config, train_set, eval_set=None) -> nnx.Module:
    """A GPT config sized by the data -- vocabulary: the text's 256 bytes, or the largest token + 1 of the training
    and evaluation sets; block size: the sequence length -- or read off --init-torch's state dict, whose vocabulary
    and block size must cover the data."""
    from jaxpar import models

    x = train_set.batch(np.arange(1))["x"]
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"--model {cfg.model} reads token sequences (integer x [N, T]), but --dataset {cfg.dataset} "
                         f"gives x {x.shape[1:]} {x.dtype}; use --dataset text, or npz with integer x and y [N, T].")
    seq_len = x.shape[1]
    if cfg.sequence_parallel and cfg.dataset == "npz" and seq_len % cfg.tensor_parallel:  # text: validate()
        raise ValueError(f"--data-path {cfg.data_path!r} holds sequences of {seq_len} tokens, which do not split over "
                         f"--tensor-parallel {cfg.tensor_parallel} ranks (--sequence-parallel gives each its share of "
                         f"every sequence's tokens); write x and y as [N, T] with T a multiple of "
                         f"{cfg.tensor_parallel}, or drop --sequence-parallel.")
    vocab = getattr(train_set, "vocab_size", None)
    if vocab is None:  # npz tokens: the vocabulary is the largest id + 1, of the inputs and the targets
        check_token_ids(cfg, train_set, eval_set, targets=True)
        vocab = max(1 + int(max(np.max(d.x), np.max(d.y))) for d in (train_set, eval_set) if d is not None and len(d))
    options = dict(n_head=cfg.n_head, dropout=cfg.dropout, recompute_granularity=cfg.recompute_granularity,
                   activation_function=cfg.activation_function)
    if not cfg.init_torch:
        check_attention_fits(models.GPTConfig.named(cfg.model, n_head=cfg.n_head), seq_len, cfg)
        return models.get(cfg.model, seed=cfg.seed, vocab_size=vocab, block_size=seq_len, **options)
    state_dict, meta = weights.read(cfg.init_torch, "--init-torch")
    if "n_head" in meta:  # the checkpoint's own head count (config.json, nanoGPT's model_args)
        if cfg.n_head not in (None, meta["n_head"]):
            raise ValueError(f"--n-head {cfg.n_head} differs from the n_head={meta['n_head']} --init-torch "
                             f"{cfg.init_torch!r} was trained with; drop --n-head.")
        options["n_head"] = meta["n_head"]
    models.gpt.check_hf_config(meta, f"--init-torch {cfg.init_torch!r}")
    act = models.gpt.activation_of(meta)  # the GELU its weights were trained with (config.json, the file's record)
    if act is not None:
        if cfg.activation_function not in (None, act):
            raise ValueError(f"--activation-function {cfg.activation_function} differs from the "
                             f"activation_function={meta['activation_function']} --init-torch {cfg.init_torch!r} "
                             "was trained with; drop --activation-function.")
        options["activation_function"] = act
    elif cfg.activation_function is None and (implied := models.gpt.implied_activation(meta)):  # nanoGPT's ckpt.pt
        options["activation_function"] = implied
        if jax.process_index() == 0:
            print(f"jaxpar: note: --init-torch {cfg.init_torch!r} is a checkpoint of nanoGPT's train.py, whose model "
                  "runs the erf GELU: it loads with --activation-function gelu (pass gelu_new for GPT-2's tanh form).",
                  file=sys.stderr)
    model = models.from_torch_state_dict(cfg.model, state_dict, seed=cfg.seed, **options)
    if seq_len > model.config.block_size:
        block = model.config.block_size
        if cfg.dataset == "npz":  # the sequences' length is the file's (--seq-len is the text dataset's)
            raise ValueError(f"--data-path {cfg.data_path!r} holds sequences of {seq_len} tokens, beyond the block "
                             f"size {block} of --init-torch's model (its position table); write the file's x and y "
                             f"as [N, T] with T <= {block}.")
        raise ValueError(f"--seq-len {seq_len} is beyond the block size {block} of --init-torch's model (its "
                         f"position table); use --seq-len <= {block}.")
    if vocab > model.config.vocab_size:
        raise ValueError(f"the data holds token {vocab - 1}, beyond the vocabulary of --init-torch's model "
                         f"({model.config.vocab_size}); use data tokenized for that model.")
    check_attention_fits(model.config, seq_len, cfg)
    return model


def check_attention_fits(gpt, seq_len: int, cfg: Config, memory: int | None = None) -> None:
    """Refuse a sequence length whose attention scores cannot fit in memory, before anything is built. On CPUs XLA
    forms each head's causal scores (causal_attention's query blocks), and the devices of one host share its
    memory: every device that runs the step in lockstep (all but single and the pipeline's stages) holds its heads'
    scores of at least one sequence in one layer at once. That floor -- the step keeps a batch of them, layer by
    layer, for the backward -- beyond the host's memory would have the kernel kill the run minutes later.
    `memory`: the host's bytes (default: its physical memory)."""
    from jaxpar.models import gpt_ops

    memory = jax_memory.host_bytes() if memory is None else memory
    if jax.default_backend() != "cpu" or not memory:  # GPUs: fused attention, and XLA's own out-of-memory error
        return
    tp = max(1, cfg.tensor_parallel) if cfg.strategy in ("tp", "pipeline") else 1
    nproc = jax.process_count()
    local = (cfg.num_devices or jax.device_count()) // nproc
    devices = 1 if cfg.strategy in ("single", "pipeline") else max(1, min(local, cfg.batch_size // nproc * tp))
    heads, scores = -(-gpt.n_head // tp), gpt_ops.cpu_score_count(seq_len)
    need = devices * heads * scores * 4
    if need > memory:
        raise ValueError(f"--seq-len {seq_len}: the attention scores of one sequence in one layer alone take "
                         f"{need / 2**30:,.1f} GiB ({devices} device(s) x {heads} heads x {scores:,} float32 scores; "
                         f"XLA:CPU forms them whole), beyond this machine's {memory / 2**30:,.1f} GiB; lower --seq-len "
                         "(the scores grow with its square).")


def abstract_model(model: nnx.Module) -> nnx.Module:
    """`model` with its arrays replaced by their shapes and dtypes: the same type and config, no memory. Once the
    strategy holds the state, the model train.py built would otherwise keep a whole unsharded copy of the initial
    weights on device 0 for the run (as much as a ZeRO-3 shard of every other device, and more: a QA finding)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                                            if isinstance(a, jax.Array) else a, state))


def lm_summary(cfg: Config, model: nnx.Module, train_set, summary: dict, devices: int) -> dict:
    """Language-model numbers for the summary, on token data (integer x [N, T]): tokens/s; for a GPT the model
    TFLOP/s and MFU (jaxpar.run.flops); on text the held-out bits per byte beside the corpus's unigram entropy."""
    from jaxpar import models
    from jaxpar.run import flops

    x = train_set.batch(np.arange(1))["x"]
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
        return {}
    rate = summary.get("samples_per_s", math.nan) * x.shape[1]
    out = {"tokens_per_s": rate}
    if isinstance(model, models.GPT):
        out = flops.utilisation(rate, models.gpt.flops_per_token(model.config, x.shape[1]), devices,
                                cfg.peak_tflops)
    if "eval_loss" in summary and getattr(train_set, "unigram_bits", None) is not None:
        nll = summary.get("eval_nll", summary["eval_loss"])  # the targets' -log p: not the label-smoothed loss
        out.update(eval_bits_per_byte=nll / math.log(2), unigram_bits_per_byte=train_set.unigram_bits)
    return out


def make_loss(cfg: Config):
    """The loss train.py trains with: a ready-made one by name, or the user's fn(outputs, batch)."""
    from jaxpar.losses import LOSSES
    from jaxpar.objective import OutputLoss

    if cfg.loss in (None, "cross_entropy"):
        if cfg.label_smoothing:
            return OutputLoss(functools.partial(LOSSES["cross_entropy"], label_smoothing=cfg.label_smoothing))
        return OutputLoss(LOSSES["cross_entropy"])
    if cfg.loss in LOSSES:
        return OutputLoss(LOSSES[cfg.loss])
    fn = load_object(cfg.loss, "--loss")
    if isinstance(fn, OutputLoss):
        return fn
    if not callable(fn):
        raise ValueError(f"--loss {cfg.loss!r} is a {type(fn).__name__}; name fn(outputs, batch) -> "
                         "(loss_sum, weight_sum[, metrics]).")
    return OutputLoss(fn)


def check_fits(objective, state: TrainState, train_set, cfg: Config) -> None:
    """Trace the loss on two training rows (no compute): a model that does not fit the data fails here, in
    one line, before anything runs or is written."""
    from jaxpar.batch import as_rows

    idx = np.arange(min(2, len(train_set)))
    rows = as_rows(train_set.batch(idx), idx)
    try:
        jax.eval_shape(lambda p, m, r: objective.sums(p, m, r)[0], state.params, state.model_state, rows)
    except (TypeError, ValueError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(" It is the strategies' loss when none is given")[0].rstrip(".")  # a library hint
        shapes = jax.tree.map(lambda a: tuple(np.shape(a)), rows.data)
        from jaxpar import models

        fix = ("data whose shapes fit it" + (" (npz: x and y token arrays of the same [N, T], y being x shifted "
                                             "by one)" if cfg.model in models.GPT_NAMES else "")
               if cfg.model in models.NAMES else "--model-kwargs (or data) whose shapes agree")
        if cfg.init_torch and cfg.model in models.NAMES and cfg.model not in models.GPT_NAMES:
            # the state dict fixed the input size, not the data (a 784-wide MLP on 5 features)
            x = rows.data["x"] if isinstance(rows.data, dict) and "x" in rows.data else jax.tree.leaves(rows.data)[0]
            row = tuple(np.shape(x)[1:])
            fix = (f"an --init-torch state dict of a {cfg.model} built for rows shaped {row} (the data's), or data "
                   "whose shapes fit the state dict's")
        raise ValueError(f"--model {cfg.model} with --loss {cfg.loss or 'cross_entropy'} does not fit the data "
                         f"(two rows: {shapes}): {type(e).__name__}: {first}; pass {fix}.") from None


def _norm_of(metrics: dict) -> dict:
    """The step's gradient norm (before clipping) for its record, where the strategy reports one, and the loss
    scale its backward ran at (--precision fp16)."""
    return {k: float(metrics[k]) for k in ("grad_norm", "loss_scale") if k in metrics}


def decay_steps(cfg: Config, total_steps: int) -> int:
    """The step the cosine schedule reaches --min-lr: --lr-decay-steps, by default the run's last step."""
    return total_steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps


def learning_rate(cfg: Config, steps_per_epoch: int, total_steps: int | None = None) -> float | optax.Schedule:
    """The learning rate by update count: StepLR(step_size=1 epoch, gamma), or nanoGPT's warmup + cosine decaying
    to --min-lr at --lr-decay-steps (default: the run's last step, `total_steps`)."""
    lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
    if total_steps is None:
        total_steps = steps_per_epoch * (cfg.epochs or 1) if cfg.steps is None else cfg.steps
    if cfg.lr_schedule == "cosine":
        decay = decay_steps(cfg, total_steps)
        if decay <= cfg.warmup_steps:
            raise ValueError(f"--warmup-steps {cfg.warmup_steps} leaves no decay: the run has {total_steps} steps; "
                             "pass fewer --warmup-steps, or a larger --lr-decay-steps or --steps.")
        return warmup_cosine(lr, cfg.warmup_steps, decay, lr / 10 if cfg.min_lr is None else cfg.min_lr)
    if cfg.gamma != 1.0:
        return optax.exponential_decay(lr, transition_steps=max(steps_per_epoch, 1), decay_rate=cfg.gamma,
                                       staircase=True)
    return lr


LOSS_SCALE_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                     "min_loss_scale")


def loss_scale_config(cfg: Config):
    """--precision fp16's LossScaleConfig from the flags (ValueError naming the flag), None for fp32 and bf16."""
    from jaxpar.loss_scale import LossScaleConfig

    if cfg.precision != "fp16":
        return None
    try:
        return LossScaleConfig(**{f: getattr(cfg, f) for f in LOSS_SCALE_FIELDS})
    except ValueError as e:
        raise ValueError(f"--precision fp16: --{str(e).replace('_', '-')}") from None


def make_tx(cfg: Config, steps_per_epoch: int, total_steps: int | None = None) -> optax.GradientTransformation:
    """The optimizer at `learning_rate`, after global-norm clipping when --grad-clip is set (every strategy gives
    jaxpar's clip the norm over all of the gradients: DeepSpeed's and torch's clip_grad_norm_ semantics), behind
    DeepSpeed's loss scaler with --precision fp16."""
    from jaxpar.loss_scale import loss_scaling

    lr = learning_rate(cfg, steps_per_epoch, total_steps)
    tx = make_optimizer(cfg.optimizer, lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        weight_decay=cfg.weight_decay, decay_params=cfg.weight_decay_params, eps=cfg.eps,
                        betas=(cfg.adam_beta1, cfg.adam_beta2))
    tx = optax.chain(clip_by_global_norm(cfg.grad_clip), tx) if cfg.grad_clip else tx
    scaler = loss_scale_config(cfg)
    return tx if scaler is None else loss_scaling(tx, scaler)


def eval_batch_size(cfg: Config) -> int:
    """--eval-batch-size, else 1000 (torch's MNIST example's test batch) or, for a language model, the training
    batch (nanoGPT's estimate_loss): 1000 sequences of GPT-2's 1024 tokens would need ~100 GB for the logits alone."""
    from jaxpar import models

    if cfg.eval_batch_size is not None:
        return cfg.eval_batch_size
    return cfg.batch_size if cfg.model in models.GPT_NAMES or cfg.dataset == "text" else 1000


def evaluate(eval_step, state: TrainState, dataset, batch_size: int, pad: bool = True) -> dict[str, float]:
    """Mean loss and every metric (divided by the summed weight) of `state` over `dataset`, in batches of
    `batch_size`; the last batch padded with masked rows when `pad` (per-sample objectives), else smaller.
    `state` None: `eval_step(rows)` evaluates by itself (a strategy's own evaluate)."""
    from jaxpar.batch import as_rows, pad_rows

    n, totals = len(dataset), None
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        rows = as_rows(dataset.batch(idx), idx)
        if pad and n > batch_size:
            rows = pad_rows(rows, batch_size)
        sums = jax.device_get(eval_step(rows) if state is None else eval_step(state.params, state.model_state, rows))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    w = float(totals.weight)  # 0 (every target masked out): the mean is 0/0, NaN as jaxpar.evaluate's and torch's
    mean = (lambda v: float(v) / w) if w else (lambda v: float("nan"))  # noqa: E731
    return {"eval_loss": mean(totals.loss), **{f"eval_{k}": mean(v) for k, v in totals.metrics.items()}}


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: the run stops, and the last good checkpoint stays the latest."""


def prepare_outputs(cfg: Config, state: TrainState, model: nnx.Module | None = None,
                    total_steps: int | None = None):
    """Check every path the run will write -- checkpoint dir (writable, same model and head count, something to
    resume), the metrics and export files (a folder only for `model` a GPT in Hugging Face's layout, with biases) --
    before anything is written; returns the Checkpointer (or None)."""
    from jaxpar import models
    from jaxpar.run import checkpoint

    ckpt = None
    if cfg.checkpoint_dir:
        gpt = model.config if isinstance(model, models.GPT) else None
        decay = decay_steps(cfg, total_steps) if cfg.lr_schedule == "cosine" else None
        info = checkpoint.run_info(cfg, state, gpt and gpt.n_head, decay, gpt and gpt.activation_function)
        ckpt = checkpoint.Checkpointer(cfg.checkpoint_dir, info,
                                       resume=cfg.resume, keep=cfg.checkpoint_keep)
    try:
        if cfg.metrics_out:
            checkpoint.writable_file(cfg.metrics_out, "--metrics-out")
        if cfg.export_torch:  # a folder (save_pretrained's) for GPT-2 in Hugging Face's layout only
            gpt = isinstance(model, models.GPT) and cfg.torch_layout == "hf"
            weights.check_writable(cfg.export_torch, "--export-torch", folder_ok=gpt)
            if gpt and weights.is_folder(cfg.export_torch):
                models.gpt.hf_config(model.config)  # refuses a GPT that transformers' GPT2 cannot hold
            if model is not None and not any(callable(getattr(model, f, None)) for f in ("torch_state_dict",
                                                                                          "torch_modules")):
                raise ValueError(f"--export-torch: {type(model).__name__} has neither torch_state_dict() nor "
                                 "torch_modules(), so its weights have no PyTorch names; define one (the README's "
                                 "'Bring your own model'), or drop --export-torch.")
    except BaseException:
        if ckpt is not None:
            ckpt.close()  # releases the directory's lock
        raise
    return ckpt


def run(cfg: Config, on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Train as `cfg` says and return the summary (also printed as one line by process 0).

    `on_step(step, metrics)` runs after every step (tests use it to send signals at a chosen step).
    """
    from tqdm import tqdm

    from jaxpar import models
    from jaxpar.data import datasets as data_lib
    from jaxpar.run import report
    from jaxpar.run.checkpoint import StopSignals
    from jaxpar.data.loader import Loader
    from jaxpar.data.sampler import DistributedSampler

    validate(cfg)
    from jaxpar.run.distributed import check_same_config

    check_same_config(cfg)  # every process runs the same command
    nproc, rank = jax.process_count(), jax.process_index()
    main_process = rank == 0
    check_process_batch(cfg, nproc)
    model_name = cfg.model if cfg.model in data_lib.MODELS else None  # built-ins decide shapes; user models not
    load = lambda split: data_lib.load(cfg.dataset, split, data_dir=cfg.data_dir, data_path=cfg.data_path,  # noqa
                                       model=model_name, image_size=cfg.image_size, seed=cfg.seed,
                                       seq_len=cfg.seq_len)
    try:
        train_set = load(cfg.train_split)
    except data_lib.DataError as e:
        if "split" not in str(e):
            raise
        raise data_lib.DataError(f"--train-split {cfg.train_split!r}: {str(e).rstrip('.')}.") from None
    eval_split = cfg.eval_split
    if eval_split is None:  # the default: the test split where the dataset has one
        eval_split = "test" if "test" in data_lib.splits(cfg.dataset, data_path=cfg.data_path) else ""
        if not eval_split and cfg.eval_batch_size != Config().eval_batch_size:
            raise ValueError(f"--eval-batch-size {cfg.eval_batch_size} would be ignored: --dataset {cfg.dataset} has "
                             "no test split here, so nothing is evaluated; drop --eval-batch-size, or pass "
                             "--eval-split SPLIT.")
    try:
        eval_set = load(eval_split) if eval_split else None
    except ValueError as e:
        raise ValueError(f"--eval-split {eval_split!r}: {str(e).rstrip('.')}; or pass --eval-split '' (that skips "
                         "evaluation).") from None
    from jaxpar.run.distributed import check_same_data

    check_same_data(train=len(train_set), eval=len(eval_set) if eval_set is not None else -1)
    shared = split_overlap(cfg.train_split, eval_split, cfg.dataset, {s: len(d) for s, d in (
        (cfg.train_split.strip(), train_set), (eval_split.strip(), eval_set)) if d is not None}, load) \
        if eval_set is not None else 0
    if shared and main_process:
        print(overlap_warning(cfg.train_split, eval_split, shared, cfg.dataset, len(train_set)), file=sys.stderr)
    replicas, shard = (1, 0) if whole_batch(cfg.strategy) else (nproc, rank)  # pipeline: all of it everywhere
    sampler = DistributedSampler(len(train_set), num_replicas=replicas, rank=shard, shuffle=cfg.shuffle,
                                 seed=cfg.seed, drop_last=cfg.drop_last)
    local_batch = cfg.batch_size // replicas
    steps_per_epoch = (len(sampler) // local_batch if cfg.drop_last else math.ceil(len(sampler) / local_batch))
    if steps_per_epoch == 0:
        if len(sampler) == 0:  # the sampler's own drop_last: fewer samples than processes
            raise ValueError(f"--drop-last with {len(train_set)} samples over {replicas} processes leaves each "
                             "process none (DistributedSampler drops the samples that do not split evenly); use "
                             "more samples or fewer processes, or drop --drop-last.")
        raise ValueError(f"--batch-size {cfg.batch_size} with --drop-last leaves no batch from "
                         f"{len(train_set)} samples; lower the batch size or drop --drop-last.")

    model = make_model(cfg, train_set, eval_set)
    if cfg.peak_tflops is not None and not isinstance(model, models.GPT):
        raise ValueError(f"--peak-tflops {cfg.peak_tflops} would be ignored: MFU is reported for jaxpar's GPT "
                         f"(its FLOPs per token are known), and --model {cfg.model} builds a "
                         f"{type(model).__name__}; drop --peak-tflops.")
    loss_fn = make_loss(cfg)
    total_steps = steps_per_epoch * (cfg.epochs or 1) if cfg.steps is None else cfg.steps
    lr_at = learning_rate(cfg, steps_per_epoch, total_steps)
    tx = make_tx(cfg, steps_per_epoch, total_steps)
    objective = cfg_objective(model, loss_fn, cfg)  # the whole model's: evaluation, checks, export
    state = init_state(model, tx, objective.wrt)
    check_fits(objective, state, train_set, cfg)
    if not objective.per_sample and not cfg.drop_last and len(sampler) % local_batch:
        raise ValueError(f"the loss sees whole shards (--per-sample off, or BatchNorm), so every batch must be full, "
                         f"but {len(sampler)} samples per process leave a last batch of {len(sampler) % local_batch}; "
                         "pass --drop-last.")
    if not objective.per_sample and sampler.total_size > sampler.num_samples:
        raise ValueError(f"the loss sees whole shards (--per-sample off, or BatchNorm), but {len(train_set)} samples "
                         f"do not divide by the {replicas} processes: the sampler pads with "
                         f"{sampler.total_size - sampler.num_samples} wrap-around copies, which would reach the batch "
                         "statistics; pass --drop-last.")
    options = {}
    if cfg.strategy == "pipeline" and cfg.partition_method == "profile":  # the cost model's sample: the data's own
        one = loss_fn.inputs(train_set.batch(np.arange(1)))
        options["example_input"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            np.shape(a), jax.dtypes.canonicalize_dtype(np.asarray(a).dtype)), one)
    # the strategy pads every batch to its share of the batch size (one shape: one compiled step); a batch size
    # beyond the samples an epoch gives each process pads every step up to it, so it gets the largest batch the
    # loader yields (--batch-size 2**40 on 5 samples: batches of 5, as single's and torch's DataLoader)
    largest = min(local_batch, len(sampler)) * replicas
    built = cfg if largest >= cfg.batch_size else dataclasses.replace(cfg, batch_size=largest)
    strategy = get_builder(cfg.strategy)(model, tx, built, loss_fn, **options)  # validates the strategy's own rules
    if not objective.per_sample:
        check_batch_divides(cfg, strategy, local_batch, replicas)
    ckpt = prepare_outputs(cfg, state, model, total_steps)
    completed, writer = False, None
    try:  # from here on the Checkpointer is closed (its lock released) whatever happens
        position = {"loss_sum": 0.0, "count": 0.0}
        scaler = loss_scale_config(cfg)  # fp16: steps skipped on overflowing gradients advance no schedule
        if ckpt is not None and cfg.resume:
            state, position = ckpt.restore(state)
            sampler.load_state_dict(sampler_state(position["sampler"], sampler))
            if scaler is not None and not scaler.dynamic:  # the static --loss-scale given now, not the checkpoint's S
                from jaxpar import loss_scale as scaling  # (a new one was silently ignored: a QA finding)

                state = state._replace(opt_state=scaling.with_scale(state.opt_state, scaler.loss_scale))
        # every check passed: from here on the run writes
        placed = strategy.init(state)
        eval_step = make_eval_step(objective)
        # a resumed run's file keeps one record per step and epoch: later steps' records (trained again) go
        writer = report.MetricsWriter(cfg.metrics_out if main_process else None, append=cfg.resume,
                                      resumed_at=int(state.step) if cfg.resume else None)
        log = print if main_process and not cfg.quiet else (lambda *a, **k: None)
        step, epoch = int(state.step), sampler.epoch
        log(f"jaxpar: {cfg.strategy} on {strategy.describe()}; model {cfg.model} "
            f"({sum(a.size for a in jax.tree.leaves(state.params)):,} params); {len(train_set)} training samples"
            + (f"; resumed from step {step} (epoch {epoch}) in {cfg.checkpoint_dir}" if cfg.resume else ""))
        del state  # the strategy holds the weights now; this copy's optimizer state would sit on device 0 all run
        model = abstract_model(model)  # and the model's own weights (the end reads its type and config only)
        if cfg.epochs is not None and cfg.steps is not None and main_process:
            print(f"jaxpar: note: --steps {cfg.steps} sets the run's length, not --epochs {cfg.epochs} (as Hugging "
                  "Face's max_steps overrides num_train_epochs).", file=sys.stderr)
        for note in ckpt.notes if ckpt is not None and main_process else ():
            print(f"jaxpar: note: resuming with a changed setting ({note}); the run will not match the original.",
                  file=sys.stderr)
        for note in ckpt.ignored if ckpt is not None and main_process else ():
            print(f"jaxpar: note: {note}.", file=sys.stderr)
        if cfg.resume and step >= total_steps and main_process:
            print(f"jaxpar: note: the checkpoint is at step {step}, and this run ends at step {total_steps}: nothing "
                  "is left to train; raise --steps or --epochs to train on.", file=sys.stderr)
        writer.write({"event": "start", "strategy": cfg.strategy, "model": cfg.model,
                      "devices": devices_used(strategy), "processes": nproc, "describe": strategy.describe(),
                      "step": step, "config": dataclasses.asdict(cfg)})

        def save(pending: bool) -> None:
            """`pending`: the save comes at the end of an epoch whose record (its evaluation) is not written yet: a
            resumed run writes it first (a stop at an epoch's last step lost that epoch's record: a QA finding)."""
            data = {"sampler": sampler.state_dict(), "loss_sum": loss_sum, "count": count, "skipped": skipped,
                    "epoch_pending": pending}
            if not ckpt.save(step, strategy.unplace(placed), data):
                raise Diverged(f"step {step} left non-finite parameters; not saved. " + _kept(cfg, ckpt))

        def end_epoch(partial: bool = False) -> dict[str, Any]:
            """The epoch's record: its train loss, the evaluation, written and logged. `partial`: --steps ended the
            run mid-epoch; the record says so, and the record of the whole epoch replaces it (a resumed run)."""
            record = {"epoch": epoch, "step": step,  # NaN: every step of the epoch was skipped (fp16)
                      "train_loss": loss_sum / count if count else float("nan")}
            if eval_set is not None:  # a strategy with evaluate() runs it where its weights are (pipeline)
                on = getattr(strategy, "evaluate", None)
                record.update(evaluate(eval_step, strategy.unplace(placed), eval_set, eval_batch_size(cfg),
                                       pad=objective.per_sample) if on is None else
                              evaluate(lambda rows: on(placed, rows), None, eval_set, eval_batch_size(cfg),
                                       pad=objective.per_sample))
            writer.write({"event": "epoch", "epoch": epoch, "step": step, "partial": partial, **record})
            log(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
            return record

        def finished_epoch() -> bool:  # whether this rank's epoch has no batch left (else --steps ended it mid-epoch)
            rest = len(sampler) - sampler.offset  # this rank's samples not yet trained on this epoch
            return (rest // local_batch if cfg.drop_last else rest) == 0

        # a resumed run that has nothing left to train counts its epochs as the run that saved it did
        clock, stopped, start_step, epoch_done = report.Clock(), None, step, finished_epoch() if cfg.resume else True
        skipped = skipped_before = int(position.get("skipped", 0))
        last: dict[str, Any] = {}
        loss_sum, count = position["loss_sum"], position["count"]  # the epoch's running train loss
        if cfg.resume and epoch_done and position.get("epoch_pending"):  # saved at its epoch's end, before the record
            last = end_epoch()
            clock.skip()  # the evaluation is not training time
        if cfg.resume and epoch_done and step < total_steps:  # the checkpoint ended its epoch exactly: the next begins
            epoch, loss_sum, count = epoch + 1, 0.0, 0.0  # (it reported that epoch again, train_loss nan: a QA finding)
        with StopSignals(enabled=ckpt is not None) as signals:
            while step < total_steps and stopped is None:
                sampler.set_epoch(epoch)  # a resumed epoch keeps the checkpoint's offset
                loader = Loader(train_set, local_batch, sampler, drop_last=cfg.drop_last, put=strategy.put_batch)
                bar = tqdm(total=min(len(loader), total_steps - step), desc=f"epoch {epoch}", leave=False,
                           disable=cfg.quiet or not main_process or not sys.stderr.isatty())  # no bar in logs
                after_record = False  # a save due at the epoch's last step, made once its record is written
                for batch in loader:
                    placed, metrics = strategy.step(placed, batch)
                    writer.begin()  # the step traced and ran: from here on --metrics-out is this run's
                    step += 1
                    loss, n = float(metrics["loss"]), float(metrics["samples"])  # reads back: the step is done
                    weight = float(metrics["weight"])
                    clock.tick(n)
                    # fp16: the gradients overflowed and the update was skipped (DeepSpeed's skip, either scaler)
                    overflow = scaler is not None and not math.isfinite(float(metrics["grad_norm"]))
                    if overflow:
                        scale, skipped = float(metrics["loss_scale"]), skipped + 1
                        writer.write({"event": "overflow", "step": step, "loss_scale": scale})
                        if scaler.dynamic and scale <= scaler.min_loss_scale:
                            raise Diverged(f"the gradients overflowed at step {step} at the minimum loss scale "
                                           f"{scale:g} (--min-loss-scale); stopped. " + _kept(cfg, ckpt) +
                                           " Lower --lr, or train in --precision bf16.")
                    elif not math.isfinite(loss):
                        writer.write({"event": "diverged", "step": step, "loss": loss, "checkpoint": _saved(ckpt)})
                        if weight == 0:  # every row or token masked: the mean is 0/0 (as torch's), the update NaN
                            raise Diverged(f"the batch of step {step} (epoch {epoch}) has a total loss weight of 0 "
                                           "(every row or token masked out), so its mean loss and the update are "
                                           "NaN; stopped. " + _kept(cfg, ckpt) + " Drop such rows from the data.")
                        raise Diverged(f"the training loss became {loss} at step {step} (epoch {epoch}); stopped. "
                                       + _kept(cfg, ckpt) + " Lower --lr, or check the data for NaN values and for "
                                       "class targets outside the model's outputs (cross-entropy gives NaN for a "
                                       "label >= its number of classes).")
                    else:  # a skipped step's loss is not counted
                        loss_sum, count = loss_sum + loss * weight, count + weight
                    bar.update(1)
                    if step % cfg.log_every == 0 and not overflow:
                        bar.set_postfix(loss=f"{loss_sum / count:.4f}")
                        writer.write({"event": "step", "step": step, "epoch": epoch, "loss": loss,
                                      "train_loss": loss_sum / count, **_norm_of(metrics),
                                      "lr": float(lr_at(step - 1 - skipped)) if callable(lr_at) else lr_at,
                                      **clock.window()})
                    if on_step is not None:
                        on_step(step, metrics)
                    stopped = signals.agreed()
                    due = ckpt is not None and bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0
                    # a save due at an epoch's last step waits for the epoch's record (a resume would write it
                    # again); a stop saves at once, the record pending
                    after_record = due and not stopped and finished_epoch()
                    if ckpt is not None and (stopped or (due and not after_record)):
                        save(bool(stopped) and finished_epoch())
                        clock.skip()
                    if stopped or step >= total_steps:
                        break
                bar.close()
                if stopped:
                    last = {"epoch": epoch, "step": step, "train_loss": loss_sum / count if count else float("nan")}
                    break
                epoch_done = finished_epoch()
                last = end_epoch(partial=not epoch_done)
                if after_record:
                    save(False)
                clock.skip()
                if epoch_done:
                    epoch, loss_sum, count = epoch + 1, 0.0, 0.0
            if ckpt is not None and not stopped and ckpt.saved_step != step:
                save(False)  # the end of the run is always saved (its epoch's record written)
        if cfg.report:  # measured before train.py's own copy of the weights (unplace) is made
            strategy_report = strategy.report(placed)
            memory_rows = report.memory_rows(strategy_report, local_devices_used(strategy))
        final = strategy.unplace(placed)
        from jaxpar.run import checkpoint as checkpoint_lib
        if not stopped and not checkpoint_lib.finite([np.asarray(a) for a in jax.tree.leaves(final.params)]):
            # the last step's update is checked nowhere else without --checkpoint-dir (its loss was computed
            # before the update): never report success or export non-finite weights
            raise Diverged(f"step {step} left non-finite parameters; nothing exported. " + _kept(cfg, ckpt) +
                           " Lower --lr, or check the data for NaN values.")
        summary = {"strategy": cfg.strategy, "model": cfg.model, "devices": devices_used(strategy), "processes": nproc,
                   "precision": cfg.precision, "describe": strategy.describe(), "steps": step,
                   "epochs": epoch + (not epoch_done or bool(stopped)),
                   **{k: v for k, v in last.items() if k not in ("epoch", "step")}, **clock.total(),
                   "resumed_from": start_step if cfg.resume else None, "stopped": stopped,
                   **({"skipped_steps": skipped} if scaler is not None else {})}
        if shared:  # evaluation partly measured training samples: the summary line and --metrics-out say so
            summary["eval_overlaps_train"] = shared
        if scaler is not None and not scaler.dynamic and skipped and main_process:  # it never lowers itself
            print(f"jaxpar: note: {skipped - skipped_before} of {step - start_step} steps"
                  + (f" (of this session; {skipped} of {step} in the run)" if skipped_before else "")
                  + f" overflowed at the static --loss-scale "
                  f"{cfg.loss_scale:g} and were skipped (no update); lower --loss-scale, or pass --loss-scale 0 for "
                  "the dynamic scaler.", file=sys.stderr)
        summary.update(lm_summary(cfg, model, train_set, summary, devices_used(strategy)))
        if cfg.sample and not stopped:
            summary["sample"] = sample_text(cfg, model, final)
            if main_process:
                print(f"--- sample ({cfg.sample} bytes from {cfg.sample_prompt!r}, temperature "
                      f"{cfg.sample_temperature}, top-k {cfg.sample_top_k}) ---\n{summary['sample']}\n---")
        if stopped:
            writer.write({"event": "stopped", "step": step, "signal": stopped, "checkpoint": _saved(ckpt)})
            if main_process:
                print(f"jaxpar: {stopped} at step {step}: checkpoint saved in {cfg.checkpoint_dir}; "
                      "continue with the same command plus --resume.")
        if cfg.report:
            summary["report"], summary["memory"] = strategy_report, memory_rows
            summary.update(report.memory_fields(summary["report"]))  # held bytes (ZeRO) in the summary record
            if main_process:
                print(report.table(summary, summary["report"], summary["memory"]))
        if cfg.export_torch and main_process and not stopped:
            export_torch(objective, final, cfg.export_torch, cfg.torch_layout)
        writer.write({"event": "summary", **{k: v for k, v in summary.items() if k not in ("report", "memory")},
                      "summary": summary_line(summary)})
        completed = True
    finally:
        if writer is not None:  # a run that failed before its first step leaves the file alone
            writer.close(keep_pending=completed)
        if ckpt is not None:
            ckpt.close()  # waits for an asynchronous save: the last good checkpoint is complete on disk
    if main_process:
        print(summary_line(summary))
    summary["state"] = final
    return summary


def check_batch_divides(cfg: Config, strategy, local_batch: int, replicas: int) -> None:
    """A loss that sees whole shards (BatchNorm, --per-sample off) takes no padding rows: refuse a --batch-size
    whose share per process the strategy's devices (x micro-steps) do not divide, which --drop-last cannot fix."""
    if getattr(strategy, "D", None) and getattr(strategy, "micro_batches", None):  # the pipeline: replicas x micro
        multiple = strategy.D * strategy.micro_batches
        what = f"{strategy.D} data replicas x --micro-batches {strategy.micro_batches} = {multiple}"
    elif getattr(strategy, "multiple", None):
        multiple, accum = strategy.multiple, getattr(strategy, "grad_accum", 1)
        what = f"the {multiple} devices" if accum == 1 else f"{multiple // accum} devices x --grad-accum {accum} = " \
            f"{multiple}"
    else:
        return
    if local_batch % multiple == 0:
        return
    step = multiple * replicas
    lower, upper = cfg.batch_size // step * step, (cfg.batch_size // step + 1) * step
    near = f"{lower} or {upper}" if lower else f"{upper}"
    per = f" ({local_batch} per process)" if replicas > 1 else ""
    raise ValueError(f"--batch-size {cfg.batch_size}{per} does not divide over {what}: the padding "
                     "rows would reach a loss that sees whole shards (BatchNorm, or --per-sample off), which "
                     f"--drop-last cannot help; pass --batch-size {near}.")


def split_ranges(spec: str, dataset: str, count: Callable[[str], int], names: set[str]) -> dict[str, list]:
    """{split name: the sample index ranges [lo, hi) `spec` takes from it, merged and sorted}, for the named splits
    in `names` only (ranges, not index sets: a text corpus has as many windows as bytes / --seq-len)."""
    from tensorflow_datasets.core import splits as tfds_splits
    from types import SimpleNamespace

    from jaxpar.data import text

    out: dict[str, list] = {}
    for part in spec.split("+"):
        name = part.split("[")[0].strip()
        if name not in names:
            continue
        if dataset == "text":
            _, lo, hi = text.parse_split(part, {name: count(name)})  # the split it names alone: a held-out part
            # too short for a window was refused here when both splits read train ('train[90%:]')
        else:
            info = {name: SimpleNamespace(num_examples=count(name), shard_lengths=[count(name)])}
            (a,) = tfds_splits.ReadInstruction.from_spec(part.strip()).to_absolute(info)
            lo, hi = a.from_ or 0, count(name) if a.to is None else a.to
        out.setdefault(name, []).append((lo, hi))
    for name, ranges in out.items():  # merged: parts of one spec may overlap ('test[:8]+test[4:]')
        merged: list = []
        for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        out[name] = merged
    return out


def split_overlap(train: str, evals: str, dataset: str, known: dict[str, int], load: Callable) -> int:
    """How many samples the eval split `evals` shares with the train split `train` of the same dataset (the same
    split name with overlapping ranges, e.g. 'test[:8000]' and 'test'). `known`: sizes of splits already loaded,
    by name; any other named split is loaded to count it."""
    names = lambda spec: {p.split("[")[0].strip() for p in spec.split("+")}  # noqa: E731
    shared = names(train) & names(evals)
    if not shared:
        return 0
    count = functools.cache(lambda s: known[s] if s in known else len(load(s)))
    a, b = split_ranges(train, dataset, count, shared), split_ranges(evals, dataset, count, shared)
    return sum(max(0, min(hi, bhi) - max(lo, blo)) for s in shared for lo, hi in a.get(s, ())
               for blo, bhi in b.get(s, ()))


def overlap_warning(train: str, evals: str, shared: int, dataset: str, n_train: int) -> str:
    """The one line that says evaluation runs partly on training samples, and how to split them apart."""
    fix = "a slice disjoint from the training samples"
    plain = train.strip().split("[")[0]
    if "+" not in train and plain == evals.strip():  # e.g. train 'test[:8000]', eval 'test'
        lo_hi = train.strip()[len(plain):].strip("[]").split(":")
        if len(lo_hi) == 2 and lo_hi[0] in ("", "0") and lo_hi[1]:
            fix = f"--eval-split '{plain}[{lo_hi[1]}:]'"
        elif len(lo_hi) == 2 and lo_hi[0] and not lo_hi[1]:
            fix = f"--eval-split '{plain}[:{lo_hi[0]}]'"
    return (f"jaxpar: warning: --eval-split {evals!r} shares {shared:,} samples with --train-split {train!r} "
            f"(--dataset {dataset}, {n_train:,} training samples): evaluation partly measures training data; "
            f"pass {fix}, or --eval-split '' to skip evaluation.")


def sampler_state(saved: dict, sampler) -> dict:
    """The checkpoint's sampler position for this run's sampler; another process count gets the same GLOBAL
    position (samples consumed by all ranks together), as the global batch is the same."""
    flags = {"num_samples": "--dataset / --data-path / --train-split", "shuffle": "--no-shuffle",
             "drop_last": "--drop-last"}  # what define an epoch's indices, so the saved offset's meaning
    for key, flag in flags.items():
        if key in saved and saved[key] != getattr(sampler, key):
            raise ValueError(f"--resume: the checkpoint's data position was taken with {key}={saved[key]!r}, this "
                             f"run has {key}={getattr(sampler, key)!r} (from {flag}), so its offset would name other "
                             "samples; resume with the data flags the checkpoint was written with, or drop --resume "
                             "to start a new run.")
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


def export_torch(objective, state: TrainState, path: str, layout: str = "hf") -> None:
    """Write the trained weights as a PyTorch state dict (jaxpar.run.weights: .npz, .safetensors, torch's .pt /
    .bin, or, for GPT-2 in Hugging Face's layout, a save_pretrained folder with config.json): the built-in models'
    conversion, or the model's own ``torch_state_dict()``."""
    from jaxpar import models

    model = objective.merge(state.params, state.model_state)
    own = getattr(model, "torch_state_dict", None)
    config = meta = None
    if isinstance(model, models.GPT):  # GPT-2: Hugging Face's or nanoGPT's layout (--torch-layout)
        own = functools.partial(model.torch_state_dict, layout)
        config = models.gpt.hf_config(model.config) if weights.is_folder(path) else None
        meta = models.gpt.file_meta(model.config)  # a file's record of the head count and GELU no weight shows
    weights.write(own() if callable(own) else models.to_torch_state_dict(model), path, "--export-torch", config,
                  meta=meta, nanogpt=meta is not None and layout == "nanogpt")


def sample_text(cfg: Config, model: nnx.Module, state: TrainState) -> str:
    """--sample: the trained GPT's continuation of --sample-prompt (its UTF-8 bytes), decoded with replacement
    characters where the bytes are not UTF-8 (jaxpar.models.gpt_generate; the run's seed draws). A model with a
    larger vocabulary (GPT-2's weights by --init-torch) draws only the bytes, the ids the text trained it on (its
    ids above 255 printed as id % 256 before, a QA finding)."""
    from jaxpar import models

    trained = models.gpt.GPT(model.config, rngs=nnx.Rngs(cfg.seed))  # unsplit, whatever the strategy did
    nnx.update(trained, state.params)
    prompt = np.frombuffer(cfg.sample_prompt.encode(), np.uint8).astype(np.int32)[None]
    out = trained.generate(prompt, cfg.sample, temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                           seed=cfg.seed, vocab_limit=256)
    return bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def summary_line(s: dict) -> str:
    evals = tuple(k for k in s if k.startswith("eval_"))
    keys = ("strategy", "model", "devices", "processes", "steps", "skipped_steps", "epochs", "train_loss", *evals,
            "unigram_bits_per_byte", "samples_per_s", "tokens_per_s", "mfu", "time_s")
    shown = lambda v: ("null" if not math.isfinite(v) else f"{v:.4g}") if isinstance(v, float) else v  # noqa: E731
    return "summary: " + " ".join(f"{k}={shown(s[k])}" for k in keys if k in s)  # null as in --metrics-out

