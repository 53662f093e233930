"""One typed record of a training run: every flag of train.py, with its default and meaning."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    # what to train
    strategy: str = "single"  # single | ddp | dp | pipeline | zero | tp (jaxpar.strategies.base.STRATEGIES)
    model: str = "convnet"  # linear | mlp | convnet | alexnet | a GPT config (gpt2, gpt2-medium, ..., gpt-cpu: jaxpar.models.gpt.CONFIGS), or MODULE:NAME / FILE.py:NAME building an nnx.Module
    model_kwargs: str | None = None  # JSON object of keyword arguments for --model MODULE:NAME, e.g. '{"hidden": 64}'
    loss: str | None = None  # cross_entropy | mse | MODULE:NAME: fn(outputs, batch) -> (loss_sum, weight_sum[, metrics])
    label_smoothing: float = 0.0  # cross_entropy: torch's label_smoothing, in [0, 1]
    dataset: str = "synthetic"  # synthetic | mnist | cifar10 | npz | text (jaxpar.data.datasets.DATASETS)
    data_dir: str | None = None  # IDX folder for mnist, or the tfds data dir
    data_path: str | None = None  # the .npz file for --dataset npz; the text file or folder for text (default: Python's stdlib)
    train_split: str = "train"  # tfds split syntax, e.g. 'test[:8000]'
    eval_split: str | None = None  # tfds split syntax, e.g. 'test[8000:]'; '' skips; default 'test' where there is one
    image_size: int | None = None  # resize images to this side (alexnet: 64 by default, 224 in DeepSpeed's tutorial)
    conv_impl: str | None = None  # chunked | im2col | xla: convnet's and alexnet's conv (default chunked on CPUs, else xla)
    seq_len: int = 256  # --dataset text: window length in bytes (tokens); a new GPT's block size (--init-torch: <= its)
    # GPT models (gpt2, gpt2-medium, ..., gpt-mini, gpt-micro, gpt-nano, gpt-cpu: jaxpar.models.gpt)
    n_head: int | None = None  # attention heads (default: the config name's); must divide the width
    dropout: float = 0.0  # GPT dropout rate (nanoGPT pretrains with 0.0)
    activation_function: str | None = None  # GPT MLP's GELU, transformers' names: gelu_new (tanh, GPT-2's; default) or gelu (erf, nanoGPT's)
    torch_layout: str = "hf"  # hf | nanogpt: the GPT state-dict layout --export-torch writes (--init-torch reads either)
    peak_tflops: float | None = None  # the device's peak TFLOP/s for MFU (default: a table of GPUs; none for CPUs)
    sample: int = 0  # after training, print this many bytes sampled from the GPT (nanoGPT's sample.py; --dataset text)
    sample_prompt: str = "\n"  # the bytes the sample starts from
    sample_temperature: float = 0.8  # logits / T before sampling; 0: greedy (nanoGPT's sample.py: 0.8)
    sample_top_k: int = 200  # sample among the k most likely bytes (nanoGPT's sample.py: 200)
    # how to train
    batch_size: int = 64  # the GLOBAL batch, the same meaning for every strategy
    eval_batch_size: int | None = None  # evaluation batch (None: 1000, torch's MNIST example's; for a GPT or --dataset text the --batch-size, as nanoGPT's estimate_loss)
    epochs: int | None = None  # passes over the training split (None: 1); --steps overrides it, with a note
    steps: int | None = None  # stop after this many steps in all (None: run the epochs), whatever --epochs says
    optimizer: str = "adadelta"  # sgd | adam | adamw | adadelta (PyTorch defaults)
    lr: float | None = None  # None: the optimizer's default, torch's (sgd, adam, adamw 1e-3; adadelta 1.0)
    momentum: float = 0.0  # sgd only (torch.optim.SGD's default 0)
    nesterov: bool = False  # sgd only: Nesterov momentum, as torch.optim.SGD(nesterov=True); needs --momentum > 0
    eps: float | None = None  # adam/adamw/adadelta: torch's eps in the update's denominator (None: 1e-8, adadelta 1e-6)
    adam_beta1: float = 0.9  # adam/adamw: torch's betas[0], the gradient average's decay (Megatron's --adam-beta1)
    adam_beta2: float = 0.999  # adam/adamw: torch's betas[1], the squared gradient's decay (nanoGPT: 0.95)
    weight_decay: float | None = None  # None: torch's default (0, adamw 0.01)
    weight_decay_params: str = "all"  # all: every parameter (torch.optim) | matrices: 2+ dims only (nanoGPT's, Megatron's)
    gamma: float = 0.7  # StepLR(step_size=1 epoch, gamma) as in PyTorch's MNIST example; 1.0 = constant
    lr_schedule: str = "step"  # step: StepLR by --gamma | cosine: nanoGPT's linear warmup, then cosine to --min-lr
    warmup_steps: int = 0  # cosine: steps of linear warmup (nanoGPT's warmup_iters)
    lr_decay_steps: int | None = None  # cosine: the step the decay reaches --min-lr (default: the run's last)
    min_lr: float | None = None  # cosine: the floor (default: --lr / 10, as nanoGPT)
    grad_clip: float = 0.0  # max global gradient norm (torch's clip_grad_norm_, DeepSpeed's gradient_clipping); 0: off
    seed: int = 0  # parameters, dropout, shuffling, the synthetic dataset's samples and the text windows derive from it
    shuffle: bool = True  # DistributedSampler(shuffle=...)
    drop_last: bool = False  # drop the last, smaller batch (otherwise it is padded and masked)
    precision: str = "fp32"  # fp32 | bf16 | fp16: the compute dtype (master weights and optimizer state stay fp32); fp16 scales the loss (DeepSpeed's fp16)
    loss_scale: float = 0.0  # fp16: 0 for dynamic loss scaling (DeepSpeed's default), or a fixed scale
    initial_scale_power: int = 16  # fp16, dynamic: the scale starts at 2**N (DeepSpeed's initial_scale_power)
    loss_scale_window: int = 1000  # fp16, dynamic: steps without an overflow before the scale doubles
    hysteresis: int = 2  # fp16, dynamic: overflows tolerated before the scale halves (DeepSpeed's hysteresis)
    consecutive_hysteresis: bool = False  # fp16, dynamic: refill the hysteresis after every step without an overflow
    min_loss_scale: float = 1.0  # fp16, dynamic: the scale never halves below this (DeepSpeed's min_loss_scale)
    per_sample: str | None = None  # on | off: the loss per sample (split-independent) or per shard; default on unless BatchNorm
    # devices and processes
    cpu_devices: int | None = None  # simulate this many CPU devices (set before JAX starts)
    num_devices: int | None = None  # use only the first N devices (default: all)
    cpu_collectives: str = "gloo"  # gloo | mpi: CPU collectives across processes
    # DistributedDataParallel
    allreduce: str = "psum"  # psum | ring | reduce_broadcast | all_to_all
    bucket_cap_mb: float | None = None  # gradient bucket size in MiB (torch's bucket_cap_mb): default 25 with a 1 MiB first bucket; a value given caps the first bucket too (torch's rule); 0 = one leaf per bucket
    overlap: bool = True  # issue each bucket's reduction from inside the backward pass
    grad_accum: int = 1  # micro-steps per optimizer step, reduced once (torch's no_sync)
    grad_comm_dtype: str | None = None  # bf16: compress gradients for communication
    spmd: str = "shard_map"  # shard_map | pmap front end
    # ZeRO (DeepSpeed; also takes --bucket-cap-mb and --grad-accum)
    zero_stage: int | None = None  # zero: 1 (default) | 2 | 3: partition the optimizer state, + gradients (FSDP SHARD_GRAD_OP), + parameters (FULL_SHARD); pipeline and tp: 0 (default) | 1
    zero_reduce: str | None = None  # reduce_scatter (default) | all_reduce: ZeRO-1's gradient reduction (zero, tp, pipeline)
    zero_fetch: str | None = None  # layer (default) | model: ZeRO-3 gathers each of `layers` as it runs them, or every weight at once through the model's __call__
    # DataParallel
    loss_on_device: bool = False  # each device computes its own loss; only scalars are gathered
    print_shapes: bool = False  # print the tutorial's "In Model" / "Outside" lines
    output_device: int = 0  # the master device
    # Megatron tensor parallelism
    tensor_parallel: int = 1  # devices each layer is split over (--strategy tp; with --strategy pipeline: 3-D)
    sequence_parallel: bool = False  # tp, 3-D pipeline: LayerNorms and dropout on 1/T of the tokens (Megatron's)
    parallel_output: bool = True  # a vocabulary-split head's logits go to the loss split (Megatron's); off: gathered
    # pipeline
    num_stages: int = 2  # pipeline stages (DeepSpeed's num_stages); more devices than stages: data x pipeline
    micro_batches: int = 4  # micro-batches a step splits the batch into (DeepSpeed's gradient_accumulation_steps)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zbh1 (zero-bubble H1) | zbv (ZB-V, 2 chunks)
    virtual_stages: int = 1  # model chunks per stage (interleaved; zbv: 2)
    partition_method: str = "parameters"  # parameters | uniform | type:REGEX | profile
    defer_wgrad: bool = False  # every weight gradient at the flush, one call over the micro-batches: less work, M micro-batches held (Megatron's defer_embedding_wgrad_compute, for every layer)
    # every strategy but ZeRO-3 (the pipeline per stage; the others on the model's `layers`)
    activation_checkpoint_interval: int = 0  # N: keep each N-layer segment's input, recompute it in the backward
    recompute_granularity: str | None = None  # selective: GPT's core attention recomputed in the backward (Megatron's)
    # runs, files and reports
    init_torch: str | None = None  # start from a PyTorch / Hugging Face state dict: .npz, .safetensors, torch's .pt/.pth/.bin (nanoGPT's ckpt.pt too), or a save_pretrained folder
    export_torch: str | None = None  # write the trained weights as a PyTorch state dict: .npz, .safetensors, .pt/.pth/.bin, or a folder (an existing one, or a path ending in /; a GPT in the hf layout) that GPT2LMHeadModel.from_pretrained loads
    metrics_out: str | None = None  # JSON lines of per-step and per-epoch metrics
    checkpoint_dir: str | None = None  # folder of orbax checkpoints (atomic; the newest --checkpoint-keep kept)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)
    resume: bool = False  # continue from the latest complete checkpoint in --checkpoint-dir
    report: bool = False  # print the run report (memory, communication, schedule) at the end
    log_every: int = 50  # steps between the progress bar's loss and --metrics-out's step records
    quiet: bool = False  # no progress bar or per-epoch lines (the summary line still prints)
    checkpoint_keep: int = 2  # complete checkpoints kept in --checkpoint-dir (older ones are deleted)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


DEFAULT_LR = {"sgd": 1e-3, "adam": 1e-3, "adamw": 1e-3, "adadelta": 1.0}  # torch.optim's (SGD: since torch 2.2)
