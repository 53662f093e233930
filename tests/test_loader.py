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
        assert b.ids.dtype == np.int32 and np.array_equal(b.data["x"], ds.x[b.ids]) and b.mask.all()
        assert np.array_equal(b.data["y"], ds.y[b.ids])
    assert sampler.offset == len(sampler) and len(loader) == 0 and list(loader) == []
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
    assert first + rest == want and len(Loader(ds, 4, resumed)) == 0


def test_invalid_arguments():
    ds = dataset()
    with pytest.raises(ValueError, match="batch_size=0"):
        Loader(ds, 0, DistributedSampler(N))
    with pytest.raises(ValueError, match="prefetch=-1"):
        Loader(ds, 2, DistributedSampler(N), prefetch=-1)
    with pytest.raises(ValueError, match="sampler covers 44 samples but the dataset has 45"):
        Loader(ds, 2, DistributedSampler(N - 1))
