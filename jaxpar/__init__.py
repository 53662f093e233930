"""jaxpar: PyTorch's and DeepSpeed's parallel training strategies, rebuilt in JAX and Flax NNX.

The public API is what `__all__` lists; everything else is an implementation detail. Submodules with a vocabulary
of their own are imported as modules: `jaxpar.comm.collectives`, `jaxpar.comm.buckets`, `jaxpar.comm.cost`,
`jaxpar.pipeline.schedule`, `jaxpar.run.memory`, `jaxpar.run.checkpoint`, `jaxpar.run.distributed`, `jaxpar.launch`.
"""
from jaxpar.run.hostmem import tune_host_allocator

from jaxpar.comm import buckets  # noqa: E402
from jaxpar.comm import collectives  # noqa: E402
from jaxpar.comm import cost as comm_cost  # noqa: E402
from jaxpar.run import memory  # noqa: E402
from jaxpar.pipeline import schedule  # noqa: E402
from jaxpar.comm.buckets import BucketPlan, plan_buckets  # noqa: E402
from jaxpar.comm.collectives import all_reduce, ring_all_reduce  # noqa: E402
from jaxpar.config import Config  # noqa: E402
from jaxpar.data.datasets import DATASETS, DataError, Dataset, load  # noqa: E402
from jaxpar.strategies.data_parallel import DataParallel, chunk_sizes  # noqa: E402
from jaxpar.strategies.ddp import DistributedDataParallel, make_ddp_step  # noqa: E402
from jaxpar.data.loader import Loader  # noqa: E402
from jaxpar.mesh import DATA, PIPE, make_mesh  # noqa: E402
from jaxpar.optim import OPTIMIZERS, make_optimizer  # noqa: E402
from jaxpar.strategies.pipeline import Pipeline  # noqa: E402
from jaxpar.pipeline.module import LayerSpec, PipelineModule  # noqa: E402
from jaxpar.data.sampler import DistributedSampler  # noqa: E402
from jaxpar.step import (  # noqa: E402
    TrainState,
    apply_updates,
    init_state,
    loss_terms,
    make_eval_step,
    make_train_step,
    sample_keys,
)
from jaxpar.strategies.base import STRATEGIES, Strategy, get_builder  # noqa: E402

__all__ = [
    # the reference step every strategy matches
    "TrainState", "init_state", "loss_terms", "sample_keys", "apply_updates", "make_train_step", "make_eval_step",
    "OPTIMIZERS", "make_optimizer", "Config",
    # strategies
    "Strategy", "STRATEGIES", "get_builder",
    "DataParallel", "chunk_sizes",
    "DistributedDataParallel", "make_ddp_step",
    "PipelineModule", "LayerSpec", "Pipeline",
    # communication
    "DATA", "PIPE", "make_mesh", "all_reduce", "ring_all_reduce", "BucketPlan", "plan_buckets",
    "collectives", "buckets", "comm_cost", "schedule", "memory",
    # data
    "Dataset", "DataError", "DATASETS", "load", "DistributedSampler", "Loader",
    "tune_host_allocator",
]
