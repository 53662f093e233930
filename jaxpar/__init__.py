"""jaxpar: PyTorch's, DeepSpeed's and Megatron's parallel training strategies, rebuilt in JAX and Flax NNX.

Bring your own NNX model, loss and batch, or take a bundled one (`jaxpar.get_model("gpt2")`, `jaxpar.ConvNet`;
the names in `jaxpar.MODELS`):

    import jaxpar, optax
    ddp = jaxpar.DistributedDataParallel(model, optax.adam(1e-3), loss_fn=loss_fn, mesh=jaxpar.make_mesh(4))
    placed = ddp.init(jaxpar.init_state(model, ddp.tx))
    placed, metrics = ddp.step(placed, ddp.put_batch(batch))     # batch: any pytree with a leading batch axis

The public API is what `__all__` lists; importing jaxpar has no side effects (no device set-up, no allocator
tuning: call `tune_host_allocator()` first thing for the CPU fast path). Submodules with a vocabulary of their
own are imported as modules: `jaxpar.comm.collectives`, `jaxpar.comm.buckets`, `jaxpar.comm.cost`,
`jaxpar.pipeline.schedule`, `jaxpar.run.memory`, `jaxpar.run.checkpoint`, `jaxpar.run.distributed`,
`jaxpar.run.weights` (state-dict files: `sd, meta = read("gpt2/")`, `write(sd, "out.safetensors")`),
`jaxpar.launch`, `jaxpar.models`, `jaxpar.losses`. docs/architecture.md maps the folders.
"""
from jaxpar import losses, models
from jaxpar.batch import Rows, as_rows, pad_rows
from jaxpar.comm import buckets, collectives
from jaxpar.comm import cost as comm_cost
from jaxpar.comm.buckets import BucketPlan, plan_buckets
from jaxpar.comm.collectives import all_reduce, ring_all_reduce
from jaxpar.config import Config
from jaxpar.data.datasets import DATASETS, DataError, Dataset, load
from jaxpar.data.loader import Loader
from jaxpar.data.sampler import DistributedSampler
from jaxpar.losses import cross_entropy, mse
from jaxpar.mesh import DATA, PIPE, TENSOR, make_mesh
from jaxpar.models import (GPT, MLP, AlexNet, ConvNet, GPTConfig, LinearModel, from_torch_state_dict,
                           to_torch_state_dict)
from jaxpar.models import NAMES as MODELS
from jaxpar.models import get as get_model
from jaxpar.objective import LossOutput, Objective, OutputLoss
from jaxpar import loss_scale, optim
from jaxpar.loss_scale import LossScaleConfig, loss_scaling
from jaxpar.optim import OPTIMIZERS, make_optimizer
from jaxpar.pipeline import schedule
from jaxpar.run import memory
from jaxpar.run.checkpoint import restore_checkpoint, save_checkpoint
from jaxpar.run.hostmem import tune_host_allocator
from jaxpar.step import TrainState, apply_updates, init_state, make_eval_step, make_train_step, train_step
from jaxpar.strategies.base import STRATEGIES, Strategy, evaluate, get_builder
from jaxpar.strategies.data_parallel import DataParallel, chunk_sizes
from jaxpar.strategies.ddp import DistributedDataParallel, make_ddp_step
from jaxpar.strategies.pipeline import LayerSpec, Pipeline, PipelineModule, TiedLayerSpec
from jaxpar.strategies.ddp import sync_batch_norm
from jaxpar.strategies.single import SingleDevice
from jaxpar.strategies.tensor import TensorParallel
from jaxpar.strategies.zero import ZeroRedundancy

__all__ = [
    # the model-and-loss contract, and the reference step every strategy matches
    "Objective", "OutputLoss", "LossOutput", "losses", "cross_entropy", "mse",
    # the bundled models: the tutorials' PyTorch twins and GPT-2, by name or by class, and their PyTorch /
    # Hugging Face state dicts (the rest -- layers, configs, GPT layouts -- in jaxpar.models)
    "models", "MODELS", "get_model", "LinearModel", "MLP", "ConvNet", "AlexNet", "GPT", "GPTConfig",
    "from_torch_state_dict", "to_torch_state_dict",
    "Rows", "as_rows", "pad_rows",
    "TrainState", "init_state", "train_step", "apply_updates", "make_train_step", "make_eval_step",
    "OPTIMIZERS", "make_optimizer", "optim", "Config",
    # fp16's loss scaler (DeepSpeed's), wrapped around any optimizer
    "loss_scaling", "LossScaleConfig", "loss_scale",
    # strategies
    "Strategy", "STRATEGIES", "get_builder", "evaluate", "SingleDevice",
    # orbax checkpoints of the canonical state (strategy.unplace(placed)), atomic; train.py's --checkpoint-dir
    "save_checkpoint", "restore_checkpoint",
    "DataParallel", "chunk_sizes",
    "DistributedDataParallel", "make_ddp_step", "sync_batch_norm", "TensorParallel",
    "ZeroRedundancy",
    "Pipeline", "PipelineModule", "LayerSpec", "TiedLayerSpec",
    # communication
    "DATA", "PIPE", "TENSOR", "make_mesh", "all_reduce", "ring_all_reduce", "BucketPlan", "plan_buckets",
    "collectives", "buckets", "comm_cost", "schedule", "memory",
    # data
    "Dataset", "DataError", "DATASETS", "load", "DistributedSampler", "Loader",
    "tune_host_allocator",
]
