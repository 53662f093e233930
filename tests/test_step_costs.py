"""What a warmed-up step costs besides its program, through the library as research code calls it: no implicit
transfer between host and devices (a Python number given to a compiled function, an eager index into a result,
each one a copy and a dispatch at every step), and no new program when the state is taken back to its canonical
form again (`unplace`: at every evaluation, checkpoint and export). tests/test_train.py counts the programs of
whole train.py runs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.strategies.pipeline import pipeline_mesh


def mse(outputs, batch):
    return jnp.sum((outputs - batch["y"]) ** 2), outputs.size


def build(name: str, model, tx):
    loss, mesh = jaxpar.OutputLoss(mse), jaxpar.make_mesh(2)
    return {
        "single": lambda: jaxpar.SingleDevice(model, tx, loss_fn=loss),
        "dp": lambda: jaxpar.DataParallel(model, tx, loss_fn=loss, device_ids=[0, 1]),
        "ddp": lambda: jaxpar.DistributedDataParallel(model, tx, loss_fn=loss, mesh=mesh, allreduce="ring"),
        "ddp-pmap": lambda: jaxpar.DistributedDataParallel(model, tx, loss_fn=loss, mesh=mesh, spmd="pmap"),
        "zero3": lambda: jaxpar.ZeroRedundancy(model, tx, loss_fn=loss, stage=3, mesh=mesh),
        "pipeline": lambda: jaxpar.Pipeline(model, tx, loss_fn=loss, num_stages=2, micro_batches=2, schedule="1f1b",
                                            mesh=pipeline_mesh(2, 2)),
        "pipeline-fp16": lambda: jaxpar.Pipeline(model, tx, loss_fn=loss, num_stages=2, micro_batches=2,
                                                 schedule="zbh1", mesh=pipeline_mesh(4, 2)),
    }[name]()


class Traces:
    """JAX's traces and lowerings while active (each one a new program, or a new trace of an old one)."""
    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        self.count += event in self.EVENTS

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


@pytest.mark.parametrize("name", ["single", "dp", "ddp", "ddp-pmap", "zero3", "pipeline", "pipeline-fp16"])
def test_a_warm_step_transfers_nothing_implicitly_and_unplace_traces_once(name):
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 2, rngs=nnx.Rngs(1)))
    tx = optax.adam(optax.cosine_decay_schedule(1e-2, 10))
    if name.endswith("fp16"):  # DeepSpeed's dynamic loss scaler: the pipeline's last stage seeds the backward with S
        tx = jaxpar.loss_scaling(tx)
    strategy = build(name, model, tx)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    placed = strategy.init(jaxpar.init_state(model, tx))
    for _ in range(2):
        placed, metrics = strategy.step(placed, strategy.put_batch(batch))
    rows = strategy.put_batch(batch)  # host to devices, as put_batch is for
    before = jax.tree.leaves(strategy.unplace(placed).params)
    with jax.transfer_guard("disallow"):
        placed, metrics = strategy.step(placed, rows)
    jax.block_until_ready((placed, metrics))
    assert np.isfinite(float(metrics["loss"]))
    with Traces() as traces:
        state = strategy.unplace(placed)
        strategy.unplace(placed)
    assert traces.count == 0, f"unplace made {traces.count} traces/lowerings after its first call"
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state.params), before)) > 0
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="[Dd]isallowed"):  # the guard bites
        jax.jit(lambda x: x + 1)(np.ones(3, np.float32))
