"""Bytes per device: live-array accounting, and where DataParallel's master pays more than its replicas."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.run import memory
from jaxpar.strategies.data_parallel import DataParallel
from jaxpar.mesh import DATA, make_mesh
from jaxpar.step import init_state

CLASSES, BATCH, N = 10_000, 256, 4  # a wide output: the gathered logits dominate the master's extra


class WideLinear(nnx.Module):
    """The tutorial's LinearModel with many classes: Linear(5, 10000)."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(5, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


def test_live_bytes_counts_each_buffer_once_on_its_device():
    devices = jax.devices()
    before = memory.baseline()
    x = jax.device_put(jnp.ones((1000,), jnp.float32), devices[3])
    same = jax.device_put(x, devices[3])  # a new Array over the same buffer: not counted twice
    y = jax.device_put(jnp.ones((10, 10), jnp.int32), devices[5])
    grown = memory.diff(memory.live_bytes(), before)
    assert grown[devices[3]] == 4000 and grown[devices[5]] == 400
    assert all(grown[d] == 0 for d in devices if d not in (devices[3], devices[5]))
    assert memory.tree_bytes({"a": x, "b": same, "c": y, "n": 3})[devices[3]] == 4000


def test_peak_tracker_keeps_the_maximum_and_where():
    d = jax.devices()[2]
    tracker = memory.PeakTracker([d])
    base = memory.baseline([d])[d]
    big = jax.device_put(np.zeros(25_000, np.float32), d)
    tracker.mark("holding big")
    del big
    tracker.mark("released")
    assert tracker.peak[d] == base + 100_000 and tracker.where[d] == "holding big"


def test_report_rows_and_table():
    devices = jax.devices()[:2]
    rows = memory.memory_report(devices, live={devices[0]: 3 * 2**20, devices[1]: 2**20}, base={devices[0]: 2**20})
    assert [r["delta_bytes"] for r in rows] == [2 * 2**20, 2**20]
    assert all(r["peak_bytes"] is None for r in rows)  # CPU devices keep no allocator statistics
    table = memory.format_table(rows)
    assert "cpu:0" in table and "3.000" in table and "2.000" in table


def _measure(loss_on_device: bool) -> tuple[dict, dict]:
    """DataParallel's report after one step, and the bytes per device before anything of it existed."""
    before = memory.baseline(jax.devices()[:N])
    model = WideLinear(nnx.Rngs(0))
    state = init_state(model, optax.sgd(0.1))
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(BATCH, 5)).astype(np.float32),
             "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}
    dp = DataParallel(model, optax.sgd(0.1), device_ids=list(range(N)), loss_on_device=loss_on_device)
    placed = dp.init(state)
    placed, _ = dp.step(placed, dp.put_batch(batch))
    return dp.report(placed), before


def _extra(measured: tuple[dict, dict]) -> int:
    """The master's peak bytes over the fullest replica's, counting only what DataParallel's run put there
    (arrays other tests left alive are in `before`)."""
    report, before = measured
    held = [r["live_bytes"] - b for r, b in zip(report["memory"], before.values())]
    return held[0] - max(held[1:])


def test_dp_master_holds_more_and_loss_on_device_shrinks_the_gap():
    gathered, on_device = _measure(False), _measure(True)
    logits_bytes = BATCH * CLASSES * 4
    for measured in (gathered, on_device):
        assert len(measured[0]["memory"]) == N and _extra(measured) > 0  # params, grads, optimizer state
        assert measured[0]["master_extra_bytes"] > 0
    # the master holds the gathered logits and their gradient: at least one [B, C] float32 more than a replica
    assert _extra(gathered) > logits_bytes
    # loss_on_device gathers scalars only: the master's extra drops by more than the gathered logits
    assert _extra(gathered) - _extra(on_device) > logits_bytes
    assert _extra(on_device) < logits_bytes / N
    assert "MiB more than the fullest other device" in gathered[0]["master_extra"]


def test_dp_report_measures_a_full_batch_not_the_short_last_one():
    """An epoch's short last batch (3 rows on N devices) reaches 3 devices and gathers 3 rows of logits: the report
    measured it, a smaller master excess over fewer devices (a QA finding). It measures the largest batch."""
    def report(row_counts):
        model = WideLinear(nnx.Rngs(0))
        rng = np.random.default_rng(0)
        dp = DataParallel(model, optax.sgd(0.1), device_ids=list(range(N)))
        placed = dp.init(init_state(model, optax.sgd(0.1)))
        for rows in row_counts:
            batch = {"x": rng.normal(size=(rows, 5)).astype(np.float32),
                     "y": rng.integers(0, CLASSES, rows).astype(np.int32)}
            placed, _ = dp.step(placed, dp.put_batch(batch))
        return dp.report(placed)

    full, short, both = report([BATCH]), report([3]), report([BATCH, 3])
    assert full["master_extra_bytes"] > short["master_extra_bytes"] + 3 * CLASSES * 4  # the check can fail
    assert both["master_extra_bytes"] == full["master_extra_bytes"]


def test_replicated_spmd_step_holds_the_same_on_every_device():
    """The DDP contrast: one SPMD step with replicated params and a sharded batch leaves equal bytes per device."""
    mesh = make_mesh(N)
    devices = list(mesh.devices.flat)
    w = jax.device_put(jnp.ones((5, CLASSES // 10)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((BATCH, 5)), NamedSharding(mesh, P(DATA)))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P())
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return w - 0.1 * jax.lax.pmean(g, DATA)

    base = memory.baseline(devices)
    new_w = step(w, x)
    held = memory.diff(memory.live_bytes(devices), base)
    assert len(set(held.values())) == 1 and held[devices[0]] == new_w.nbytes


def test_pipeline_memory_sizes_typed_prng_keys():
    """The pipeline's memory table counts a typed PRNG key's bytes (a selective recompute's residuals hold dropout
    keys; `--report` failed on them after training, a QA finding), beside plain arrays and shapes."""
    from jaxpar.pipeline.memory import _bytes

    keys = jax.random.split(jax.random.key(0), 3)
    tree = {"keys": keys, "a": np.zeros(4, np.float32), "s": jax.ShapeDtypeStruct((2,), keys.dtype)}
    assert _bytes(tree) == 3 * keys.dtype.itemsize + 16 + 2 * keys.dtype.itemsize
