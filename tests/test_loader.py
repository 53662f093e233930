"""jaxpar.data.loader.Loader: order, the prefetch thread (same results, errors, early exit) and resume."""
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

from jaxpar.data.datasets import Dataset
from jaxpar.data.loader import Loader
from jaxpar.data.sampler import DistributedSampler

N = 45


def dataset():
    x = np.arange(N * 6, dtype=np.float32).reshape(N, 2, 3, 1)  # row i holds 6i .. 6i+5
    return Dataset(x, (np.arange(N) % 7).astype(np.int32), 7, "toy")


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "jaxpar-loader"]


def test_batches_follow_the_sampler():
    ds, sampler = dataset(), DistributedSampler(N, 2, 1, seed=4)
    loader = Loader(ds, 4, sampler)
    plan = sampler.batch_plan(4)
    assert len(loader) == len(plan) == 6  # 23 samples on this rank: 5 full batches and 3 left
    batches = list(loader)
    assert [b.ids.tolist() for b in batches] == [p.tolist() for p in plan]  # Rows: ids are the sample indices
    for b in batches:
        assert b.ids.dtype == np.int32 and np.array_equal(b.data["x"], ds.x[b.ids])
        assert np.array_equal(b.data["y"], ds.y[b.ids])
    assert [b.mask.tolist() for b in batches] == [[1.0] * 4] * 5 + [[1.0, 1.0, 0.0]]  # 45 = 2 x 23 - 1: rank 1 pads
    assert sampler.offset == len(sampler)  # consumed; a new pass over the same epoch gives it whole, as torch's
    assert len(loader) == 6 and [b.ids.tolist() for b in loader] == [p.tolist() for p in plan]
    sampler.set_epoch(1)
    assert len(Loader(ds, 4, sampler, drop_last=True)) == 5
    assert [b.size for b in Loader(ds, 4, sampler, drop_last=True)] == [4] * 5


def test_prefetch_thread_gives_the_same_batches():
    ds = dataset()
    threads = []

    def put(batch):
        threads.append(threading.current_thread().name)
        return jax.device_put(batch)

    def run(**kw):
        return [jax.tree.map(np.asarray, b) for b in Loader(ds, 8, DistributedSampler(N, seed=2), **kw)]

    plain, synchronous, threaded = run(), run(put=put, prefetch=0), run(put=put, prefetch=3)
    assert threads[:6] == ["MainThread"] * 6 and set(threads[6:]) == {"jaxpar-loader"}  # really on a thread
    assert len(plain) == len(threaded) == 6
    for a, b, c in zip(plain, synchronous, threaded):
        la, lb, lc = (jax.tree.leaves(t) for t in (a, b, c))
        assert len(la) == len(lc) == 4 and all(np.array_equal(u, v) and np.array_equal(u, w)
                                               for u, v, w in zip(la, lb, lc))
    assert not loader_threads()


def test_offset_counts_consumed_not_produced_batches():
    sampler = DistributedSampler(N, seed=0)
    produced = []
    loader = Loader(dataset(), 5, sampler, put=lambda b: produced.append(1) or b, prefetch=2)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:  # the thread runs ahead: 1 taken, 2 queued
        time.sleep(0.01)
    assert len(produced) >= 3 and sampler.offset == 5
    next(it)
    assert sampler.offset == 10
    it.close()
    assert not loader_threads()


def test_errors_on_the_thread_reach_the_consumer():
    def put(batch):
        if batch.ids[0] == 15:
            raise RuntimeError("put failed on batch 3")
        return batch

    sampler = DistributedSampler(N, shuffle=False)
    got = []
    with pytest.raises(RuntimeError, match="put failed on batch 3"):
        for b in Loader(dataset(), 5, sampler, put=put):
            got.append(b)
    assert len(got) == 3 and sampler.offset == 15  # the batches before the failure arrived
    assert not loader_threads()


def test_early_break_stops_the_thread():
    sampler = DistributedSampler(N, seed=1)
    for i, _ in enumerate(Loader(dataset(), 2, sampler, put=lambda b: b, prefetch=1)):
        if i == 2:
            break
    assert not loader_threads()  # the generator closed on break: the thread was told to stop and joined
    assert sampler.offset == 6


def test_interpreter_exits_with_a_loader_left_open():
    """A consumer that stops mid-epoch and keeps the iterator (thread blocked on a full queue, a put in
    flight) must not keep the process from exiting."""
    code = textwrap.dedent("""
        import time
        import numpy as np
        from jaxpar.data.datasets import Dataset
        from jaxpar.data.loader import Loader
        from jaxpar.data.sampler import DistributedSampler
        ds = Dataset(np.zeros((100, 3), np.float32), np.zeros(100, np.int32), 2, "toy")
        it = iter(Loader(ds, 2, DistributedSampler(100), put=lambda b: time.sleep(0.3) or b, prefetch=2))
        next(it)
        time.sleep(0.5)
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr


def test_resume_mid_epoch_gives_the_remaining_batches():
    ds = dataset()
    sampler = DistributedSampler(N, 3, 2, seed=9)
    sampler.set_epoch(2)
    reference = DistributedSampler(N, 3, 2, seed=9)
    reference.set_epoch(2)
    want = [b.tolist() for b in reference.batch_plan(4)]
    first = []
    for b in Loader(ds, 4, sampler, put=lambda b: b):
        first.append(b.ids.tolist())
        if len(first) == 2:
            break
    state = sampler.state_dict()
    assert state["offset"] == 8  # two batches consumed, however many the thread had produced

    resumed = DistributedSampler(N, 3, 2)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    rest = [b.ids.tolist() for b in Loader(ds, 4, resumed, put=lambda b: b)]
    assert first + rest == want and len(Loader(ds, 4, resumed)) == len(want)  # ran out: the next pass is whole


def test_invalid_arguments():
    ds = dataset()
    with pytest.raises(ValueError, match="batch_size=0"):
        Loader(ds, 0, DistributedSampler(N))
    with pytest.raises(ValueError, match="prefetch=-1"):
        Loader(ds, 2, DistributedSampler(N), prefetch=-1)
    with pytest.raises(ValueError, match="sampler covers 44 samples but the dataset has 45"):
        Loader(ds, 2, DistributedSampler(N - 1))


def toy(n):
    x = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3, 1)
    return Dataset(x, (np.arange(n) % 7).astype(np.int32), 7, "toy")


PUTS = {"plain": {}, "synchronous": dict(put=lambda b: b, prefetch=0), "threaded": dict(put=lambda b: b, prefetch=2)}


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("mode", PUTS)
def test_wrap_around_padding_gets_mask_0(replicas, mode):
    """41 samples on 2, 3, 4 ranks: torch's plan repeats 1, 1, 3 of them; those rows (and only those) get mask 0,
    keeping their sample's id and data."""
    n, ds, ids, masks = 41, toy(41), [], []
    for rank in range(replicas):
        sampler = DistributedSampler(n, replicas, rank, seed=3)
        sampler.set_epoch(1)
        batches = list(Loader(ds, 4, sampler, **PUTS[mode]))
        mask, idx = np.concatenate([b.mask for b in batches]), np.concatenate([b.ids for b in batches])
        assert mask.dtype == np.float32 and mask.tolist() == sampler.real().astype(np.float32).tolist()
        assert idx.tolist() == sampler.indices().tolist()  # padding rows keep their sample index
        assert all(np.array_equal(b.data["x"], ds.x[b.ids]) for b in batches)
        ids.append(idx)
        masks.append(mask)
    ids, masks = np.concatenate(ids), np.concatenate(masks)
    assert len(ids) > n and (masks == 0).sum() == len(ids) - n  # there is padding, and only it is masked
    assert sorted(ids[masks == 1].tolist()) == list(range(n))  # the real rows: every sample exactly once


@pytest.mark.parametrize("mode", PUTS)
@pytest.mark.parametrize("batch_size", [4, 5])
def test_padding_mask_after_resuming_mid_epoch(mode, batch_size):
    """Resumed at offset 8, the mask stays aligned with the positions: 0 only on rank 2's last (the padding)."""
    ds, sampler = toy(41), DistributedSampler(41, 3, 2, seed=9)
    whole = sampler.real()
    assert not whole[-1] and whole[:-1].all()
    for i, _ in enumerate(Loader(ds, 4, sampler, **PUTS[mode])):
        if i == 1:
            break
    resumed = DistributedSampler(41, 3, 2)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.offset == 8
    rest = list(Loader(ds, batch_size, resumed, **PUTS[mode]))
    assert np.concatenate([b.mask for b in rest]).tolist() == whole[8:].astype(np.float32).tolist()
    assert np.concatenate([b.ids for b in rest]).tolist() == resumed.indices()[8:].tolist()
    assert rest[-1].mask[-1] == 0 and rest[-1].mask[:-1].all()


def test_ranks_together_train_what_one_process_trains():
    """Simulated processes: one sampler and Loader per rank, their batch k interleaved into the global batch as the
    strategies lay it out (rank r's row j at position j * R + r). The single-device step on those global batches
    equals the step on one process's batches; with the wrap-around copy trained (mask 1, torch's behaviour) it
    does not. A loss that sees whole shards (per_sample=False) refuses the padding row, as it refuses pad_rows'."""
    from flax import nnx
    from test_ddp import problem

    from jaxpar import SingleDevice, make_train_step, pad_rows

    objective, tx, state, _ = problem()  # a tiny MLP 12 -> 10 with dropout keyed by the sample ids, SGD + momentum
    n, replicas, local, rng = 41, 2, 6, np.random.default_rng(0)
    ds = Dataset(rng.normal(size=(n, 12)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32), 10, "toy")

    def loader(num_replicas, rank, batch_size):
        sampler = DistributedSampler(n, num_replicas, rank, seed=5)
        sampler.set_epoch(1)
        return list(Loader(ds, batch_size, sampler))

    single = loader(1, 0, replicas * local)  # 12, 12, 12, 5 rows
    ranks = [loader(replicas, r, local) for r in range(replicas)]  # 6, 6, 6, 3 rows per rank
    glob = [jax.tree.map(lambda *a: np.stack(a, 1).reshape(-1, *a[0].shape[1:]), *parts) for parts in zip(*ranks)]
    assert [b.size for b in single] == [12, 12, 12, 5] and [b.size for b in glob] == [12, 12, 12, 6]
    for g, s in zip(glob, single):
        assert g.ids[g.mask > 0].tolist() == s.ids.tolist()  # the same samples, in the same order
    assert glob[-1].mask.tolist() == [1] * 5 + [0]  # the wrap-around copy, last

    step = make_train_step(objective, tx)

    def train(batches):
        s = state
        for b in batches:  # a short last batch padded with masked rows, as the strategies pad it (one compile)
            s, metrics = step(s, pad_rows(b, replicas * local))
        return [np.asarray(a) for a in jax.tree.leaves(s.params)], float(metrics["samples"])

    want, _ = train(single)
    torch_like, seen = train(glob[:-1] + [glob[-1]._replace(mask=np.ones(6, np.float32))])
    assert seen == 6 and max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(torch_like, want)) > 1e-3
    got, seen = train(glob)
    assert seen == 5  # the "samples" metric (and so throughput) counts real rows only
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    shards = SingleDevice(nnx.Linear(12, 10, rngs=nnx.Rngs(0)), tx, per_sample=False)
    shards.put_batch(glob[0])  # full batches pass
    with pytest.raises(ValueError, match="1 padding rows would reach a loss that sees whole shards"):
        shards.put_batch(glob[-1])


def test_a_dataset_or_sampler_of_another_kind_is_named():
    """QA: arrays as the dataset failed at the first batch ('ndarray' object has no attribute 'batch'), a list of
    indices as the sampler with "'list' object has no attribute 'num_samples'"."""
    ds = dataset()
    with pytest.raises(TypeError, match="dataset is a ndarray, which has no batch\\(idx\\) method and len\\(\\); pass "
                                        "a jaxpar.Dataset"):
        Loader(ds.x, 4, DistributedSampler(N))
    with pytest.raises(TypeError, match="sampler is a list, not a jaxpar.DistributedSampler; pass "
                                        "jaxpar.DistributedSampler\\(len\\(dataset\\)"):
        Loader(ds, 4, list(range(N)))
