"""DeepSpeed's pipeline engine: the model's layers cut into stages that each own their weights, micro-batches run
on a schedule that is plain data (GPipe, 1F1B, interleaved, zero-bubble ZB-H1 and ZB-V; forward-only for
evaluation).

    pipe = Pipeline(model, optax.sgd(0.1), loss_fn=jaxpar.OutputLoss(mse), num_stages=2, micro_batches=4)
    placed = pipe.init(jaxpar.init_state(model, pipe.tx))         # the canonical state, cut into stages
    placed, metrics = pipe.step(placed, pipe.put_batch(batch))
    state = pipe.unplace(placed)                                  # the canonical TrainState again

Each stage is a column of the (DATA, PIPE) mesh (`pipeline_mesh`): D data-parallel replicas in one process.
MPMD: every stage runs its own small jitted functions over its own weights (jaxpar.pipeline.stage), one Python
interpreter walks the schedule (jaxpar.pipeline.engine), and activations move by device_put in a process or a
two-sided ppermute between processes. Every process reads the WHOLE global batch (a stage holds all its
replicas; the first stage needs every input, the last every target, every stage the sample ids): train.py's
sampler gives each process all of it (``WHOLE_BATCH``). A batch is padded with masked rows until D x M divide it.
Per-sample objectives (the default) give the single-device numbers for any split: dropout masks follow the sample
id. Batch-mode objectives (BatchNorm, per_sample=False) see one micro-batch at a time, as torch.distributed.
pipelining does: statistics per micro-batch, running averages updated micro-batch after micro-batch.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar import loss_scale
from jaxpar.batch import Rows, as_rows, check_unpadded, num_rows, pad_rows, padded_size, round_up
from jaxpar.config import Config
from jaxpar.mesh import DATA, PIPE, TENSOR, make_mesh
from jaxpar.objective import Objective, OutputLoss, Sums, metrics_of
from jaxpar.pipeline import analysis, generators
from jaxpar.pipeline import optimizer as opt_lib
from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.pipeline.engine import Engine
from jaxpar.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from jaxpar.pipeline.stage import Layout, act_spec
from jaxpar.pipeline.transfer import Transport
from jaxpar.step import TrainState
from jaxpar.strategies.tensor import TensorParallel, check_split_computes, foreign_split, rank_shapes
from jaxpar.strategies.zero1 import check_reduce_is_read, is_stage
from jaxpar.strategies.base import (LayersCheck, check_batch_size, check_not_consumed, check_objective_options,
                                    check_placed, check_state, check_tx, from_process_0, processes,
                                    refuse_sync_batch_norm)

__all__ = ["Batch", "LayerSpec", "Pipeline", "PipelineModule", "PipelineState", "TiedLayerSpec", "build",
           "pipeline_mesh"]
WHOLE_BATCH = True  # train.py: every process of a pipeline run reads the whole global batch


def pipeline_mesh(devices: int | Sequence | None = None, num_stages: int = 1, tensor_parallel: int = 1):
    """A (DATA, PIPE) mesh with PIPE the outer axis, as DeepSpeed's PipeDataParallelTopology: stage s holds the
    consecutive devices ``s*D .. s*D + D-1``, so stages spread over processes and replicas stay within them.

    With tensor_parallel T > 1: a (DATA, PIPE, TENSOR) mesh in Megatron-LM's rank order -- tensor ranks adjacent,
    then data, then pipeline: device ``s*D*T + d*T + t`` is stage s, replica d, tensor rank t -- so a tensor group
    (the most communication) is T consecutive devices and stage s holds the consecutive ``s*D*T .. (s+1)*D*T - 1``.
    """
    all_devices = jax.devices()
    if isinstance(devices, (bool, float)) or (isinstance(devices, (int, np.integer)) and
                                              not 1 <= devices <= len(all_devices)):
        # a count past the devices was cut to those present in silence (16 gave 8), 0 an empty mesh, -4 all but 4
        raise ValueError(f"pipeline_mesh(devices={devices!r}): a device count is an int between 1 and the "
                         f"{len(all_devices)} devices present (or a list of devices, or None for all); pass at most "
                         f"{len(all_devices)}, or more --cpu-devices.")
    devices = all_devices[:devices] if isinstance(devices, (int, np.integer)) else list(devices or all_devices)
    n = len(devices)
    if tensor_parallel != 1:
        T, S = tensor_parallel, num_stages
        for name, v in (("tensor_parallel", T), ("num_stages", S)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1; pass --{name.replace('_', '-')} 1 or more.")
        if n % (S * T):
            raise ValueError(f"num_devices={n} must be a multiple of num_stages x tensor_parallel = {S} x {T} "
                             f"(D x S x T devices: data x pipeline x tensor); use "
                             + (f"devices={n - n % (S * T)} (--num-devices, of the {n}) or " if n > S * T else "")
                             + f"num_stages / tensor_parallel (--num-stages / --tensor-parallel) whose product "
                             f"divides {n}.")
        grid = np.array(devices, dtype=object).reshape(S, n // (S * T), T).transpose(1, 0, 2)  # [DATA, PIPE, TENSOR]
        return jax.sharding.Mesh(grid, (DATA, PIPE, TENSOR))
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1 (stages of the pipeline); pass 2 or more "
                         "to pipeline, 1 to run the model as one stage.")
    if num_stages > n or n % num_stages:
        fewer = f"devices={n - n % num_stages} (--num-devices, of the {n}) or " if n > num_stages else ""
        raise ValueError(f"num_devices={n} must be a multiple of num_stages={num_stages} (one data-parallel group "
                         f"of {num_stages} stages per {num_stages} devices); use {fewer}num_stages (--num-stages) "
                         f"dividing {n} ({', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}).")
    grid = np.array(devices, dtype=object).reshape(num_stages, n // num_stages).T  # [DATA, PIPE]
    return make_mesh(devices=list(grid.ravel()), pipe=num_stages) if num_stages > 1 else \
        jax.sharding.Mesh(grid, (DATA, PIPE))


def _module_loss(fn):
    """A PipelineModule's loss_fn(outputs, batch), whose failure on the last stage's outputs says how jaxpar calls it:
    a loss written for DeepSpeed, loss_fn(outputs, labels), failed deep inside JAX ("entry not a 2- or 3- tuple")."""
    @functools.wraps(fn)
    def loss(outputs, batch):
        try:
            return fn(outputs, batch)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"PipelineModule's loss_fn={getattr(fn, '__name__', fn)!r} failed on the last stage's "
                             f"outputs ({type(e).__name__}: {first}); it is called as loss_fn(outputs, batch) with "
                             "the whole batch (DeepSpeed's gets (outputs, labels): here the labels are batch['y']) "
                             "and returns (loss_sum, weight_sum); jaxpar.cross_entropy is one.") from e
    loss.jaxpar_wrapped = fn  # the loss it runs: Objective's checks read jaxpar.cross_entropy's targets through it
    return loss


class PipelineState(NamedTuple):
    """The placed state: per local stage its parameter leaves, optimizer state and model-state leaves."""
    params: dict
    opt_state: dict
    model_state: dict
    extra_state: list  # canonical model-state leaves no layer uses, carried along
    step: int


class Batch(NamedTuple):
    """A placed batch: per local stage, per micro-batch, (the leaves it reads, row mask, sample ids)."""
    layout: Layout
    stages: dict


def _used(fn, *specs) -> set[int]:
    """Positions of the flat leaves of `specs` that `fn(*specs)` really reads (its jaxpr, dead code removed)."""
    from jax._src.interpreters import partial_eval as pe

    flat, treedef = jax.tree.flatten(specs)
    jaxpr = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(treedef, leaves)))(*flat).jaxpr
    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return {i for i, u in enumerate(used) if u}


DEFAULT_CUT = {"num_stages": 2, "virtual_stages": 1, "partition_method": "parameters",
               "activation_checkpoint_interval": 0, "seed": 0}


def check_module_args(module: PipelineModule, cut: dict, example_input, options: dict) -> None:
    """ValueError where the strategy is given partition arguments or a `wrt` other than the PipelineModule's own:
    the module was cut (and its stages' parameters chosen) when it was built, so they would be ignored."""
    have = {"num_stages": module.num_stages, "virtual_stages": module.virtual_stages,
            "partition_method": module.partition_method, "activation_checkpoint_interval": module.interval,
            "seed": module.seed}
    for name, value in cut.items():
        if value is not None and value != have[name]:
            raise ValueError(f"Pipeline({name}={value!r}), but the PipelineModule was built with {name}="
                             f"{have[name]!r}, and it fixes that when it is built; pass {name}={value!r} to "
                             f"PipelineModule(...), or leave it out of Pipeline(...).")
    if example_input is not None and example_input is not module.example_input:
        raise ValueError("Pipeline(example_input=...), but a PipelineModule was cut when it was built; pass "
                         "example_input (with partition_method='profile') to PipelineModule(...).")
    wrt = options.get("wrt", module.wrt)
    if wrt is not module.wrt and wrt != module.wrt:  # the stages' parameters are the module's selection
        name = lambda f: getattr(f, "__name__", repr(f))  # noqa: E731
        raise ValueError(f"Pipeline(wrt={name(wrt)}), but the PipelineModule trains wrt={name(module.wrt)} (its "
                         f"stages own what that selects); pass wrt={name(wrt)} to PipelineModule(...) and leave it "
                         "out of Pipeline(...).")


class Pipeline:
    """The pipeline strategy: `model` (an NNX module with flat ``layers``, or a PipelineModule) cut into `num_stages`
    stages on `mesh` (default: the first num_stages devices, one per stage), trained on `schedule` (a name, or a
    jaxpar.schedule.Schedule written as data: validated, and its stage, chunk and micro-batch counts must be the
    Pipeline's; unset num_stages / virtual_stages are read from it) with `micro_batches` micro-batches.
    ``tensor_parallel`` T > 1: 3-D parallelism, every stage's blocks split over T devices as Megatron's
    (jaxpar.strategies.tensor's plan; the model must define tensor_layout(), as jaxpar.models.gpt's blocks do), on a
    (DATA, PIPE, TENSOR) mesh in Megatron's device order (`pipeline_mesh`; default: S x T devices; `sequence_parallel`
    and `parallel_output` as TensorParallel's, the activations between stages then split by tokens over TENSOR too;
    `check_split` as TensorParallel's, on one tensor group of the whole model before the first step). ``loss_fn`` must
    be an OutputLoss (the last stage runs it on the outputs). `batch_size` (global) fixes every batch's padded shape
    (one compile).
    ``compiler_options`` go to every jit (e.g. {"xla_backend_optimization_level": 0}: a third of the compile time,
    slower code)."""

    name = "pipeline"

    def __init__(self, model: nnx.Module | PipelineModule, tx: optax.GradientTransformation, *, loss_fn=None,
                 num_stages: int | None = None, micro_batches: int = 4, schedule: str | schedule_lib.Schedule = "1f1b",
                 virtual_stages: int | None = None, partition_method: str | None = None,
                 activation_checkpoint_interval: int | None = None, mesh=None, batch_size: int | None = None,
                 example_input=None, seed: int | None = None, compiler_options: dict | None = None,
                 tensor_parallel: int = 1, sequence_parallel: bool = False, parallel_output: bool | None = None,
                 zero_stage: int = 0, zero_reduce: str = "reduce_scatter", check_split: bool | None = None,
                 defer_wgrad: bool = False, **objective_options):
        # the partition's arguments (None: 2 stages, 1 chunk, by parameters, no recompute, seed 0) cut `model`; a
        # PipelineModule was cut already, and one that disagrees with it is refused (it would be ignored)
        cut = {"num_stages": num_stages, "virtual_stages": virtual_stages, "partition_method": partition_method,
               "activation_checkpoint_interval": activation_checkpoint_interval, "seed": seed}
        check_objective_options("Pipeline", objective_options)
        if isinstance(model, PipelineModule):
            check_module_args(model, cut, example_input, objective_options)
            objective_options.setdefault("wrt", model.wrt)
        check_tx(tx)  # before loss_scale.wraps calls tx.init
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1; pass --micro-batches 1 or more.")
        micro_batches = int(micro_batches)
        T = tensor_parallel
        if not isinstance(T, (int, np.integer)) or isinstance(T, bool) or T < 1:
            raise ValueError(f"tensor_parallel={T!r} must be an int >= 1; pass --tensor-parallel 1 or more.")
        if not is_stage(zero_stage, (0, 1)):
            raise ValueError(f"zero_stage={zero_stage!r}: the pipeline takes ZeRO stage 0 or 1 (each stage's optimizer "
                             "state partitioned over its data replicas); DeepSpeed refuses stages 2 and 3 with "
                             "pipeline parallelism (their gradient and weight partitions would be reduced and gathered "
                             "every micro-batch): pass 0 or 1, or use --strategy zero for stages 2-3.")
        if not isinstance(defer_wgrad, (bool, np.bool_)):
            raise ValueError(f"defer_wgrad={defer_wgrad!r} must be True or False (--defer-wgrad: every weight "
                             "gradient at the pipeline's flush).")
        if isinstance(schedule, str) and schedule.endswith("+dw"):  # the deferred schedule's own name
            schedule, defer_wgrad = schedule.removesuffix("+dw"), True
        if defer_wgrad and micro_batches == 1:
            raise ValueError("defer_wgrad=True with micro_batches=1 defers nothing: the one micro-batch's weight "
                             "gradient follows its input gradient at once, and there is no other to join it with; "
                             "pass micro_batches >= 2 (--micro-batches), or drop defer_wgrad (--defer-wgrad).")
        if zero_reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"zero_reduce={zero_reduce!r} is not known; use reduce_scatter (DeepSpeed's default: each "
                             "replica gets its block of the summed gradient) or all_reduce (the whole gradient).")
        check_reduce_is_read(zero_reduce, zero_stage)
        for name, value in (("parallel_output", parallel_output), ("check_split", check_split)):
            if value is not None and T == 1:  # as sequence_parallel below: nothing is split
                raise ValueError(f"{name}={value!r} applies to the tensor-parallel split, but tensor_parallel=1; pass "
                                 f"tensor_parallel >= 2 with it, or drop {name}.")
        if mesh is not None and mesh.shape.get(TENSOR, 1) != T:
            raise ValueError(f"mesh {dict(mesh.shape)} must have a {TENSOR!r} axis of tensor_parallel={T}; build it "
                             "with jaxpar.strategies.pipeline.pipeline_mesh(devices, num_stages, tensor_parallel).")
        custom = schedule if isinstance(schedule, schedule_lib.Schedule) else None  # one written as data
        if custom is None and not isinstance(schedule, str):
            raise ValueError(f"schedule={schedule!r} must be a name ({', '.join(generators.SCHEDULES)}) "
                             "or a jaxpar.schedule.Schedule (e.g. from_programs(...)).")
        placement = custom.placement if custom else "v" if schedule == "zbv" else "loop"  # schedule.virtual's
        if isinstance(model, PipelineModule):
            module = model
        else:
            if custom is not None:  # a schedule written as data says how many stages and chunks it runs
                own = {"num_stages": custom.num_stages, "virtual_stages": custom.virtual_stages}
                cut = {k: own.get(k) if v is None else v for k, v in cut.items()}
            defaults = {k: DEFAULT_CUT[k] if v is None else v for k, v in cut.items()}
            if T > 1:  # its own copy, pointed at the tensor axis below: the user's model stays whole
                model = nnx.clone(model)
            module = PipelineModule.from_model(
                model, defaults.pop("num_stages"), placement=placement, example_input=example_input,
                wrt=objective_options.get("wrt", nnx.Param), **defaults)
        if loss_fn is None and module.loss_fn is not None:
            loss_fn = module.loss_fn if isinstance(module.loss_fn, OutputLoss) else \
                OutputLoss(_module_loss(module.loss_fn))
        self.module, self.tx, self.batch_size = module, tx, check_batch_size(batch_size)
        self.objective = Objective.of(module.model, loss_fn, **objective_options).check_trains()
        if isinstance(model, PipelineModule) and self.objective.compute_dtype is not None:
            module.cut()  # the layers as they are now: an Embed's dtype set after the module was built
        self.objective.output_loss()  # a one-line ValueError for a loss(model, batch)
        S, V, M = module.num_stages, module.virtual_stages, micro_batches
        if mesh is None and S * T > jax.device_count():
            raise ValueError(f"num_stages x tensor_parallel = {S} x {T} needs {S * T} devices, but "
                             f"{jax.device_count()} are present; use fewer stages or a smaller tensor_parallel (their "
                             "product at most the devices), or more --cpu-devices.")
        self.mesh = pipeline_mesh(S * T, S, T) if mesh is None else mesh
        self.tp = T
        # after the objective: the whole model's graph stays unsplit; the last stage's head hands the loss its
        # vocabulary-split logits when the loss takes them (Megatron's parallel_output, jaxpar.strategies.tensor)
        from jaxpar.strategies.tensor import resolve_parallel_output

        self.parallel_output = T > 1 and resolve_parallel_output(parallel_output, self.objective.loss_fn)
        if sequence_parallel and T < 2:
            raise ValueError(f"sequence_parallel splits the tokens over the tensor ranks, but tensor_parallel={T}; "
                             "pass tensor_parallel >= 2 (--tensor-parallel 2), or drop --sequence-parallel.")
        self._split_checker, self._split_check = None, None  # TensorParallel's check of a user's split modules
        if T > 1 and (any(foreign_split(module.model)) if check_split is None else check_split):
            group = jax.sharding.Mesh(np.array(jax.local_devices()[:T]).reshape(1, T), (DATA, TENSOR))
            self._split_checker = TensorParallel(module.model, optax.sgd(1.0), tensor_parallel=T, mesh=group,
                                                 sequence_parallel=sequence_parallel, loss_fn=loss_fn,
                                                 check_split=True, **objective_options)
        module.set_tensor_parallel(T, TENSOR, self.parallel_output, sequence_parallel)
        whole = [lay.whole for lay in module.tensor_layouts or () if lay.whole]
        if sequence_parallel and whole:  # a whole head's logits and their gradient would be counted T times
            raise ValueError(f"--sequence-parallel needs the embedding split by vocabulary rows, but {whole[0]}; "
                             "pad the vocabulary to a multiple of --tensor-parallel (GPT-2's 50257 to 50304).")
        self.parallel_output = self.parallel_output and not whole
        if self.mesh.shape.get(PIPE) != S:
            raise ValueError(f"mesh {dict(self.mesh.shape)} must have a {PIPE!r} axis of num_stages={S}; build it "
                             "with jaxpar.strategies.pipeline.pipeline_mesh(devices, num_stages).")
        if custom is not None:
            schedule_lib.validate(custom)  # its own steps, if it has them, as written: that is what would run
            have = (custom.num_stages, custom.num_microbatches, custom.virtual_stages)
            for label, got, want, fix in zip(("num_stages", "micro_batches", "virtual_stages"), have, (S, M, V),
                                             ("num_stages", "micro_batches", "virtual_stages")):
                if got != want:
                    raise ValueError(f"schedule {custom.name!r} is for {label}={got}, but this Pipeline runs "
                                     f"{label}={want}; build the schedule for {want} or pass {fix}={got}.")
            if not custom.training:
                raise ValueError(f"schedule {custom.name!r} is forward-only (backward='') and cannot train; give it "
                                 "B's (or I's and W's) (the strategy evaluates with the forward schedule by itself).")
            schedule = custom.name
        elif schedule == "forward":
            raise ValueError("schedule='forward' has no backward and cannot train; use gpipe, 1f1b, interleaved, "
                             "zbh1 or zbv (the strategy evaluates with the forward schedule by itself).")
        if custom is None and schedule == "zbv" and V != 2:
            fix = ("build the PipelineModule with virtual_stages=2, placement='v'" if model is module else
                   "pass virtual_stages=2 (--virtual-stages 2)")
            raise ValueError(f"schedule='zbv' runs two model chunks per stage in a V; got virtual_stages={V}; {fix}.")
        if custom is None and schedule == "interleaved" and V == 1:  # the generator's V=1 is 1F1B: not asked for
            raise ValueError("schedule='interleaved' needs virtual_stages >= 2 model chunks per stage (got 1, whose "
                             "ticks are 1F1B's); pass virtual_stages=2 (--virtual-stages 2), or schedule='1f1b'.")
        if custom is None and V > 1 and schedule not in ("interleaved", "zbv"):
            raise ValueError(f"virtual_stages={V} needs schedule='interleaved' or 'zbv' (model chunks); got "
                             f"{schedule!r}.")
        if module.placement != placement:
            raise ValueError(f"the PipelineModule places its chunks {module.placement!r} but schedule={schedule!r} "
                             f"runs them {placement!r}; build it with PipelineModule(..., placement={placement!r}).")
        grid = custom if custom is not None else generators.make(schedule, S, M, V)
        if defer_wgrad:
            grid = generators.defer_wgrad(grid)
        self.schedule = schedule_lib.validate(schedule_lib.with_communication(grid))
        self.eval_schedule = schedule_lib.validate(schedule_lib.add_communication(
            generators.forward_only(S, M, V, placement=placement)))
        self.micro_batches, self.D = M, self.mesh.shape[DATA]
        self.transport = Transport(self.mesh, act_spec(module))
        for j, stages in module.tied.items():  # a tied gradient is summed between two processes at most
            procs = sorted({self.transport.process[s] for s in stages})
            if len(procs) > 2:
                raise ValueError(f"parameter {'/'.join(map(str, module.param_paths[j]))} is tied across stages "
                                 f"{stages} on processes {procs}; a tied weight may span two processes at most: "
                                 "use fewer processes, or place its uses on stages of two processes.")
        # a loss scaler skips on the global norm: every stage must be given the same one
        scaled = loss_scale.wraps(tx, jax.tree.unflatten(module.param_treedef, module.param_specs))
        self.needs_norm = opt_lib.probe(tx, module) or scaled
        self.engine = Engine(module, self.objective, tx, self.transport, needs_norm=self.needs_norm,
                             compiler_options=compiler_options)
        self.engine.scaled = scaled
        self.zero_stage = zero_stage
        from jaxpar.strategies import zero_optim

        tree, lays = jax.tree.unflatten(module.param_treedef, module.param_specs), module.tensor_layouts
        slices = None if lays is None else rank_shapes(module.param_specs, lays, module.tensor_parallel)
        if zero_stage:  # the flat slices' update must equal the stage's: elementwise transforms only
            from jaxpar.pipeline.memory import device_params
            from jaxpar.strategies import zero1

            zero_optim.check(tx, tree, slices=slices)
            for s in range(S):  # ZeRO's flat plan needs something to split
                if not module.stage_params[s]:
                    held = " ".join(module.names[i] for v in range(module.num_parts) if module.stage_of(v) == s
                                    for i in range(module.bounds[v], module.bounds[v + 1]))
                    raise ValueError(f"zero_stage=1 splits each stage's trained parameters over its data replicas, "
                                     f"but stage {s} holds none (its layers: {held}); cut the model so that every "
                                     f"stage holds some (partition_method={module.partition_method!r} gave it only "
                                     "layers without parameters: try 'uniform', 'type:REGEX' or fewer stages), or "
                                     "pass zero_stage=0.")
            self.engine.zero = {s: zero1.of(self.transport.meshes[s], device_params(self, s),
                                            [None if lays is None else lays[j].axis for j in module.stage_params[s]])
                                for s in range(S)}
            self.engine.scatter = zero_reduce == "reduce_scatter"
        elif slices is not None:  # 3-D: each tensor rank updates its slices
            zero_optim.shape_choices(tx, tree, slices, flat=False)
        self.zero_reduce = zero_reduce
        self.engine.state_specs = None  # set by init, from the canonical model state
        self._layouts: dict = {}
        self._last: Any = None
        # a model of the user's own: its __call__ must be its layers in turn (checked on the first batch, on the
        # objective's unsplit model: under 3-D too)
        self._own_model, self._layers_check = not isinstance(model, PipelineModule), LayersCheck()

    # -- placement -----------------------------------------------------------------------------------------

    def init(self, state: TrainState) -> PipelineState:
        """The canonical state cut into this process's stages (fresh buffers: the step donates them)."""
        mod, tr = self.module, self.transport
        check_state(state, self.tx, self.objective)  # the model's tree and shapes (module.model's for a PipelineModule)
        state = from_process_0(state)  # torch DDP's broadcast of rank 0's parameters at construction
        refuse_sync_batch_norm(self.objective.merge(state.params, state.model_state), "the pipeline's stages")
        if self._split_checker is not None:
            self._split_check = (jax.tree.map(np.asarray, state.params), state.model_state)
        self._layers_check.arm_rows(self.objective, state, self.tx)
        if self._own_model:
            self._layers_check.arm(self.objective, state, "the pipeline runs the model's",
                                   "pass a PipelineModule built from a layer list", self.module.unpack)
        params, rest = jax.tree.leaves(state.params), jax.tree.leaves(state.model_state)
        self.engine.state_specs = [jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in rest]
        self._key_impls = {k: jax.random.key_impl(a) for k, a in enumerate(rest)
                           if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)}
        fresh = lambda x: jax.tree.map(lambda a: jnp.array(a, copy=True), x)  # noqa: E731  (the step donates them)
        put = lambda x, s: jax.device_put(fresh(x), tr.kinds[s]["rep"])  # noqa: E731
        out = PipelineState({}, {}, {}, [rest[j] for j in mod.extra_state], int(state.step))
        if mod.tensor_layouts is not None:
            return self._init_slices(state, rest, out)
        for s in tr.local_stages:
            out.params[s] = put([params[j] for j in mod.stage_params[s]], s)
            stage_opt = opt_lib.to_stage(self.tx, mod, s, state.opt_state)
            if self.zero_stage:
                out.opt_state[s] = self.engine.zero[s].place(self.tx, self._stage_params(s, params), stage_opt)
            else:
                out.opt_state[s] = put(stage_opt, s)
            out.model_state[s] = put([rest[j] for j in mod.stage_state[s]], s)
        return out

    def _stage_params(self, s: int, params: list | None = None):
        """The stage's parameter tree (the optimizer's view) of canonical leaves `params` (default: their specs)."""
        mod = self.module
        leaves = mod.param_specs if params is None else params
        return jax.tree.unflatten(opt_lib.stage_treedef(mod, s), [leaves[j] for j in mod.stage_params[s]])

    def _init_slices(self, state: TrainState, rest: list, out: PipelineState) -> PipelineState:
        """3-D: split leaves in tensor order (qkv columns per rank, as TensorParallel.init), each stage's weights,
        optimizer moments and frozen weights (model state) sharded over its TENSOR axis by the plan, the rest
        replicated."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxpar.strategies.tensor import in_tensor_order, leaf_specs, map_params, split_leaves

        mod, tr, lays = self.module, self.transport, self.module.tensor_layouts
        params = jax.tree.leaves(map_params(in_tensor_order, state.params, state.params, lays))
        opt_state = map_params(in_tensor_order, state.opt_state, state.params, lays)
        is_spec = lambda x: isinstance(x, P)  # noqa: E731

        def place(tree, specs, s):
            leaves, treedef = jax.tree.flatten(tree)
            shards = [NamedSharding(tr.meshes[s], sp) for sp in jax.tree.leaves(specs, is_leaf=is_spec)]
            return jax.tree.unflatten(treedef, [jax.device_put(jnp.array(a, copy=True), sh)
                                                for a, sh in zip(leaves, shards)])

        for s in tr.local_stages:
            idx, mine = mod.stage_params[s], [lays[j] for j in mod.stage_params[s]]
            sp = [lay.spec(np.ndim(params[j])) for j, lay in zip(idx, mine)]
            out.params[s] = place([params[j] for j in idx], sp, s)
            stage_opt = opt_lib.to_stage(self.tx, mod, s, opt_state)
            stage_params = jax.tree.unflatten(opt_lib.stage_treedef(mod, s), [params[j] for j in idx])
            if self.zero_stage:
                out.opt_state[s] = self.engine.zero[s].place(self.tx, stage_params, stage_opt)
            else:
                out.opt_state[s] = place(stage_opt, leaf_specs(stage_opt, stage_params, mine), s)
            held = mod.stage_state[s]  # frozen split weights: split as trained ones
            stage_rest = split_leaves(in_tensor_order, [rest[j] for j in held], [mod.state_layouts[j] for j in held])
            out.model_state[s] = place(stage_rest, mod.state_specs(held), s)
        return out

    def layout(self, rows: Rows) -> Layout:
        """The micro-batch layout of host `rows` (one micro-batch of every replica), and what each end reads."""
        specs = tuple(jax.ShapeDtypeStruct((self.D * rows.size // (self.D * self.micro_batches),) + np.shape(a)[1:],
                                           jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
                      for a in jax.tree.leaves(rows.data))
        treedef = jax.tree.structure(rows.data)
        key = (treedef, specs)
        if key not in self._layouts:
            n = specs[0].shape[0]
            mask, ids = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32)
            loss, obj = self.objective.output_loss(), self.objective
            data = jax.tree.unflatten(treedef, specs)
            inputs = _used(lambda d: loss.inputs(d), data)
            params = jax.tree.unflatten(self.module.param_treedef, self.module.param_specs)
            state = jax.tree.unflatten(self.module.state_treedef, self.engine.state_specs)
            outs = jax.eval_shape(lambda p, s, d, m, i: obj.outputs(p, s, Rows(d, m, i))[0], params, state, data,
                                  mask, ids)
            used = _used(lambda o, d, m, i: obj.output_sums(o, Rows(d, m, i)), outs, data, mask, ids)
            k = len(jax.tree.leaves(outs))
            targets = {i - k for i in used if k <= i < k + len(specs)}
            self._layouts[key] = Layout(treedef, specs, tuple(sorted(inputs)), tuple(sorted(targets)))
        return self._layouts[key]

    def put_batch(self, batch) -> Batch:
        """The whole global batch (a pytree or Rows; every process passes all of it) padded with masked rows to a
        multiple of D x M (to batch_size's, given one: a larger batch is refused), cut into micro-batches, each
        stage's leaves placed on its devices."""
        return self._put(batch, fixed=True)

    def _put(self, batch, fixed: bool) -> Batch:
        """put_batch; `fixed` False: without the batch_size rule (evaluate's batches, --eval-batch-size, may be
        larger than the training batch)."""
        if self.engine.state_specs is None:
            raise ValueError("Pipeline.put_batch() before init(); call placed = pipe.init(state) first.")
        if fixed:  # before any work; every process passes the whole batch: the rule is the global one
            padded_size(batch.size if isinstance(batch, Rows) else num_rows(batch), "Pipeline", self.batch_size,
                        self.D * self.micro_batches)
        rows = as_rows(batch)
        self._layers_check(rows)  # once: the model's __call__ is its layers in turn (armed by init)
        if self._split_check is not None:  # once: the split model computes the unsplit one (armed by init)
            check_split_computes(self._split_checker, *self._split_check, rows)
            self._split_check = None
        group = self.D * self.micro_batches
        target = round_up(max(rows.size, self.batch_size or 0), group)
        rows = pad_rows(rows, target)
        if not self.objective.per_sample:
            check_unpadded(rows, "per_sample=False")
        layout = self.layout(rows)
        D, M, n = self.D, self.micro_batches, target // group
        order = lambda a: np.asarray(a).reshape(D, M, n, *np.shape(a)[1:]).swapaxes(0, 1)  # noqa: E731
        leaves = [order(a) for a in jax.tree.leaves(rows.data)]
        mask, ids = order(rows.mask), order(rows.ids)
        stages = {}
        for s in self.transport.local_stages:
            need = self.engine.needs(layout, s)
            host = [({i: leaves[i][m].reshape(D * n, *leaves[i].shape[3:]) for i in need},
                     mask[m].reshape(-1), ids[m].reshape(-1)) for m in range(M)]
            stages[s] = self.transport.put(host, s, "rows")
        return Batch(layout, stages)

    # -- the step ------------------------------------------------------------------------------------------

    def _check_cut(self, placed: PipelineState, who: str) -> None:
        """ValueError unless `placed` holds this pipeline's stages, each with its parameters' shapes: another
        Pipeline's placed state (another cut of the same model) failed with an IndexError deep in the engine, and
        unplace() paired its leaves with this cut's paths without a word."""
        mod = self.module
        if not isinstance(placed, PipelineState):
            raise TypeError(f"Pipeline.{who}() got a {type(placed).__name__}, not the PipelineState this strategy's "
                            "init() returns; place a TrainState first: placed = pipe.init(state).")
        mine = list(self.transport.local_stages)
        for s in mine:
            have = placed.params.get(s)
            key = ("cut", s)  # every step checks: the shapes are listed once
            if key not in self._layouts:
                self._layouts[key] = [tuple(mod.param_specs[j].shape) for j in mod.stage_params[s]]
            want = self._layouts[key]
            if have is None or [tuple(np.shape(a)) for a in have] != want:
                got = "nothing" if have is None else f"{len(have)} parameter leaves" + (
                    " of other shapes" if len(have) == len(want) else "")
                raise ValueError(f"Pipeline.{who}() got a placed state that is not this pipeline's cut (its stage {s} "
                                 f"holds {got} where this pipeline's stage {s} holds {len(want)}): another Pipeline "
                                 "placed it (other num_stages, virtual_stages or partition); move it with state = "
                                 "other.unplace(placed), then placed = pipe.init(state).")
        if sorted(placed.params) != sorted(mine):
            raise ValueError(f"Pipeline.{who}() got a placed state of stages {sorted(placed.params)} where this "
                             f"pipeline holds {mine}: it was placed by another Pipeline; move it with state = "
                             "other.unplace(placed), then pipe.init(state).")

    def step(self, placed: PipelineState, batch: Batch) -> tuple[PipelineState, dict]:
        check_placed(batch, Batch, "Pipeline", placed)
        self._check_cut(placed, "step")
        plan = self.engine.plan(batch.layout, self.schedule)
        scale = self._scale(placed.opt_state)  # fp16's loss scale S this step runs at (None without a scaler)
        last = self.module.stage_of(self.module.num_parts - 1)
        on_last = scale is not None and self.transport.mine(last)  # the seed's S: the last stage's own copy
        total, state, acc = self.engine.run(plan, placed.params, placed.model_state, batch.stages,
                                            scale=loss_scale.current(placed.opt_state[last]) if on_last else None)
        params, opt_state, state, vec = self.engine.reduce_and_update(
            dict(placed.params), dict(placed.opt_state), state, acc, total, plan.sums_treedef)
        self._last = (batch.layout, plan)
        extra = [_advance(a, k) for a, k in zip(placed.extra_state, self._extra_kinds())]
        metrics = self._metrics(plan.sums_treedef)(vec)
        return PipelineState(params, opt_state, state, extra, placed.step + 1), {**metrics,
                                                                                 **loss_scale.metrics(scale)}

    def _scale(self, opt_state: dict):
        """The loss scaler's S in the state of this process's first stage (every stage holds the same), or None;
        a copy, as the update consumes the state's buffers."""
        return jnp.copy(loss_scale.current(opt_state[self.transport.local_stages[0]])) if self.engine.scaled else None

    def _metrics(self, treedef):
        """vector -> the step's metrics, jitted (eager slicing would wait for the step: the clock runs on)."""
        key = ("metrics", treedef)
        if key not in self._layouts:
            self._layouts[key] = self.engine.jit(  # [Sums..., squared norm of the summed gradient, its seed]
                lambda v: metrics_of(jax.tree.unflatten(treedef, [v[i] for i in range(treedef.num_leaves)]),
                                     jnp.sqrt(v[-2]) / v[1] / v[-1]))
        return self._layouts[key]

    def evaluate(self, placed: PipelineState, batch) -> Sums:
        """Sums of the loss and metrics over the real rows of `batch` in eval mode, on the forward-only schedule."""
        self._check_cut(placed, "evaluate")
        if not self.objective.per_sample and not isinstance(batch, Batch):
            rows = as_rows(batch)
            self.objective.check_inputs(rows.data)  # a batch the model cannot take, in one line (put_batch's check)
            if rows.size % (self.D * self.micro_batches):  # padding rows would reach the batch-mode loss (its sums
                # see every row): the canonical state on one device, as the other strategies evaluate
                from jaxpar.step import make_eval_step

                if getattr(self, "_eval_step", None) is None:
                    self._eval_step = make_eval_step(self.objective)
                state = self.unplace(placed)
                return self._eval_step(state.params, state.model_state, rows)
        pb = batch if isinstance(batch, Batch) else self._put(batch, fixed=False)
        plan = self.engine.plan(pb.layout, self.eval_schedule)
        total, _, _ = self.engine.run(plan, placed.params, placed.model_state, pb.stages, train=False)
        n = plan.sums_treedef.num_leaves
        vec = jnp.zeros((n,), jnp.float32) if total is None else total
        return jax.tree.unflatten(plan.sums_treedef, list(self.transport.all_processes_sum(vec)))

    def _extra_kinds(self) -> list[bool]:
        return [self.module.state_kinds[j].__name__ == "RngCount" for j in self.module.extra_state]

    # -- back to the canonical state -----------------------------------------------------------------------

    def unplace(self, placed: PipelineState) -> TrainState:
        """The canonical TrainState (the tree of jaxpar.init_state(model, tx)), on this process's first device;
        across processes every stage's leaves are summed in from the process that owns them."""
        self._check_cut(placed, "unplace")
        check_not_consumed(placed, "Pipeline.unplace()")
        mod, tr = self.module, self.transport
        home = tr.first_device

        def first(a):  # a split leaf (3-D) gathered whole; a replicated one from its first copy
            if isinstance(a, jax.Array) and not a.sharding.is_fully_replicated:
                return jax.device_put(np.asarray(a), home)
            return jnp.array(jax.device_put(a.addressable_data(0), home), copy=True)
        params = [None] * len(mod.param_paths)
        rest = [None] * len(mod.state_paths)
        for s in tr.local_stages:
            for j, a in zip(mod.stage_params[s], placed.params[s]):
                if mod.owner[j] == s:
                    params[j] = first(a)
            for j, a in zip(mod.stage_state[s], placed.model_state[s]):
                if mod.state_owner[j] == s:
                    rest[j] = first(a)
        if self.zero_stage:  # the flat moments gathered and cut back into the stage's (whole) leaves
            stage_opt = {s: jax.tree.map(lambda a: jax.device_put(a, home), self.engine.zero[s].unplace(
                self.tx, self._stage_params(s), placed.opt_state[s])) for s in tr.local_stages}
        else:
            stage_opt = {s: jax.tree.map(first, placed.opt_state[s]) for s in tr.local_stages}
        if len(tr.proc_devices) > 1:
            params, rest, stage_opt = self._gather(params, rest, stage_opt)
        for j, a in zip(mod.extra_state, placed.extra_state):
            rest[j] = jax.device_put(a, home)
        opt_state = opt_lib.to_canonical(self.tx, mod, stage_opt)
        params = jax.tree.unflatten(mod.param_treedef, params)
        if mod.tensor_layouts is not None:  # qkv columns back in q | k | v order
            from jaxpar.strategies.tensor import in_canonical_order, map_params

            def back(a, lay):
                return jax.device_put(in_canonical_order(a, lay), home) if lay.order else a

            opt_state = map_params(back, opt_state, params, mod.tensor_layouts)
            params = map_params(back, params, params, mod.tensor_layouts)
            rest = [back(a, lay) for a, lay in zip(rest, mod.state_layouts)]  # frozen split weights
        return TrainState(params, opt_state, jax.tree.unflatten(mod.state_treedef, rest),
                          jnp.asarray(placed.step, jnp.int32))

    def _gather(self, params: list, rest: list, stage_opt: dict):
        """Every process's leaves, by one sum over processes (zeros where a process does not own a leaf)."""
        mod, tr, keys = self.module, self.transport, self._key_impls
        zeros = lambda spec: jnp.zeros(spec.shape, spec.dtype)  # noqa: E731
        pspecs, sspecs = mod.param_specs, self.engine.state_specs
        opt_specs = {s: jax.eval_shape(self.tx.init, jax.tree.unflatten(
            opt_lib.stage_treedef(mod, s), [pspecs[j] for j in mod.stage_params[s]])) for s in range(mod.num_stages)}
        raw = lambda k, a: jax.random.key_data(a) if k in keys else a  # noqa: E731  (keys travel as their data)
        rest = [raw(k, r) if r is not None else
                (jnp.zeros(jax.eval_shape(jax.random.key_data, sspecs[k]).shape, jnp.uint32) if k in keys
                 else zeros(sspecs[k])) for k, r in enumerate(rest)]
        tree = ([p if p is not None else zeros(pspecs[j]) for j, p in enumerate(params)], rest,
                {s: stage_opt.get(s, jax.tree.map(zeros, opt_specs[s])) for s in range(mod.num_stages)})
        params, rest, opt = tr.all_processes_sum(tree)
        return params, [jax.random.wrap_key_data(a, impl=keys[k]) if k in keys else a for k, a in enumerate(rest)], opt

    # -- reports -------------------------------------------------------------------------------------------

    def describe(self) -> str:
        from jaxpar.strategies.tensor import whole_note

        sch, mod = self.schedule, self.module
        return (f"{self.mesh.devices.size} devices ({processes()}), mesh {dict(self.mesh.shape)}: "
                f"D x S x T = {self.D} x {mod.num_stages} x {self.tp} (data x pipeline x tensor): "
                f"{mod.num_stages} stages x {self.D} data replicas"
                + (f", Megatron tensor parallelism over {self.tp} devices per stage" if self.tp > 1 else "")
                + (f", ZeRO-1 (each stage's optimizer state split over its {self.D} replicas, gradients by "
                   f"{self.zero_reduce.replace('_', '-')})" if self.zero_stage and self.D > 1 else "")
                + (", ZeRO-1 over one data replica (nothing to split)" if self.zero_stage and self.D == 1 else "")
                + (", sequence parallel" if mod.sequence_parallel else "")
                + (", logits split by vocabulary into the loss (parallel_output)" if self.parallel_output else "")
                + (whole_note(mod.tensor_layouts) if mod.tensor_layouts else "")
                + f", schedule {sch.name} ({sch.num_microbatches} "
                f"micro-batches" + (f", {sch.virtual_stages} chunks per stage" if sch.virtual_stages > 1 else "")
                + (f", activation checkpoint interval {mod.interval}" if mod.interval else "")
                + (", every weight gradient at the flush" if sch.name.endswith("+dw") else "") + ")")

    def report(self, placed: PipelineState | None = None) -> dict:
        """Partition, bubble (grid and zero-bubble costs), in-flight micro-batches, memory per stage."""
        from jaxpar.pipeline import memory

        sch = self.schedule
        out = {"devices": self.mesh.devices.size, "processes": jax.process_count(), "mesh": dict(self.mesh.shape),
               "data_parallel": self.D, "num_stages": self.module.num_stages, "tensor_parallel": self.tp,
               "zero_stage": self.zero_stage, "zero_reduce": self.zero_reduce if self.zero_stage else None,
               "partition": self.module.describe(), "schedule": sch.name, "ticks": sch.num_ticks,
               "bubble_fraction": analysis.bubble_fraction(sch),
               "bubble_fraction_zb_costs": analysis.bubble_fraction(sch, analysis.COSTS),
               "peak_inflight": analysis.peak_inflight(sch), "tied": len(self.module.tied),
               "global_norm_across_stages": self.needs_norm}
        if self._last is not None:
            out["stage_memory_mib"] = memory.text(memory.table(self, self._last[0]))
            plan, mod = self._last[1], self.module
            if plan.runs or sch.name.endswith("+dw"):
                # per part: whether its W's went as one call over the micro-batches' joined rows (False: one by one,
                # as batch-mode objectives run them; None: a part on another process)
                out["wgrad_joined"] = [None if not self.transport.mine(mod.stage_of(v)) else
                                       bool(f.joined) and all(f.joined.values()) for v, f in enumerate(plan.fns)]
        return out


def _advance(a, is_count: bool):
    return a + 1 if is_count else a


def build(model: nnx.Module, tx: optax.GradientTransformation, cfg: Config, loss_fn=None,
          example_input=None) -> Pipeline:
    """The strategy train.py builds: --num-stages, --micro-batches, --schedule, --virtual-stages, --defer-wgrad,
    --partition-method, --activation-checkpoint-interval, --tensor-parallel (3-D: D x S x T = --num-devices, in
    Megatron's device order: tensor ranks adjacent, then data, then pipeline); stages outermost. `example_input`:
    one sample of the model's input as the data hold it (train.py's, for --partition-method profile)."""
    from jaxpar.precision import compute_dtype

    per_sample = {None: None, "on": True, "off": False}[cfg.per_sample]
    example = None
    if cfg.partition_method == "profile":
        from jaxpar import models

        if isinstance(model, models.GPT):  # token ids, one window of the run's length (not the image default)
            example = jax.ShapeDtypeStruct((1, model.config.block_size), jnp.int32)
        elif example_input is not None:  # the data's own sample: any model, a user's included
            example = example_input
        else:
            first = list(model.layers)[0]
            shape = (first.in_features,) if hasattr(first, "in_features") else \
                models.input_shape(cfg.model, image_size=cfg.image_size)
            example = jax.ShapeDtypeStruct((1,) + tuple(shape), jnp.float32)
    return Pipeline(model, tx, loss_fn=loss_fn, num_stages=cfg.num_stages, micro_batches=cfg.micro_batches,
                    schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, partition_method=cfg.partition_method,
                    defer_wgrad=cfg.defer_wgrad,
                    activation_checkpoint_interval=cfg.activation_checkpoint_interval,
                    mesh=pipeline_mesh(cfg.num_devices, cfg.num_stages, cfg.tensor_parallel),
                    tensor_parallel=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel,
                    zero_stage=0 if cfg.zero_stage is None else cfg.zero_stage,
                    zero_reduce=cfg.zero_reduce or "reduce_scatter",
                    parallel_output=None if cfg.parallel_output else False,
                    batch_size=cfg.batch_size,
                    example_input=example, seed=cfg.seed, per_sample=per_sample,
                    compute_dtype=compute_dtype(cfg.precision))

