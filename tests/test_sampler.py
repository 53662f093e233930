"""jaxpar.data.sampler.DistributedSampler: torch's index plan, shuffling per epoch, and mid-epoch resume."""
import math

import numpy as np
import pytest

from jaxpar.data.sampler import DistributedSampler


def torch_indices(n, num_replicas, rank, drop_last):
    """torch.utils.data.DistributedSampler.__iter__ with shuffle=False, written out as the reference."""
    if drop_last and n % num_replicas != 0:
        num_samples = math.ceil((n - num_replicas) / num_replicas)
    else:
        num_samples = math.ceil(n / num_replicas)
    total_size = num_samples * num_replicas
    indices = list(range(n))
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:num_replicas]
    assert len(indices) == num_samples
    return indices


@pytest.mark.parametrize("n, replicas", [(10, 3), (12, 4), (3, 8), (1, 4), (7, 7), (2, 5), (11, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_equals_torch_without_shuffle(n, replicas, drop_last):
    for rank in range(replicas):
        s = DistributedSampler(n, replicas, rank, shuffle=False, drop_last=drop_last)
        want = torch_indices(n, replicas, rank, drop_last)
        assert s.indices().tolist() == want and list(s) == want and len(s) == len(want)
    if n == 3 and replicas == 8 and not drop_last:  # padding (5) exceeds n: the list repeats whole
        assert [DistributedSampler(3, 8, r, shuffle=False).indices()[0] for r in range(8)] == [0, 1, 2] * 2 + [0, 1]


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_cover_the_data_disjointly(drop_last):
    n, replicas = 103, 4
    per_rank = [DistributedSampler(n, replicas, r, seed=3, drop_last=drop_last).indices() for r in range(replicas)]
    assert len({len(p) for p in per_rank}) == 1  # all ranks equal length
    every = np.concatenate(per_rank)
    if drop_last:  # 100 distinct samples, the 3 left over dropped
        assert len(every) == 100 and len(set(every.tolist())) == 100
    else:  # all 103 samples, 1 repeated to pad to 104
        assert len(every) == 104 and set(every.tolist()) == set(range(n))
        assert np.bincount(every).max() == 2 and (np.bincount(every) == 2).sum() == 1


def test_shuffle_per_epoch_and_seed():
    s = DistributedSampler(50, 2, 1, seed=5)
    first = s.indices()
    assert not np.array_equal(first, np.arange(1, 50, 2))  # shuffled
    assert np.array_equal(first, DistributedSampler(50, 2, 1, seed=5).indices())  # deterministic
    s.set_epoch(1)
    assert not np.array_equal(s.indices(), first)  # set_epoch changes the order
    s.set_epoch(0)
    assert np.array_equal(s.indices(), first)
    assert not np.array_equal(DistributedSampler(50, 2, 1, seed=6).indices(), first)
    other = DistributedSampler(50, 2, 0, seed=5)
    assert sorted(np.concatenate([first, other.indices()]).tolist()) == list(range(50))  # one shared permutation


def test_batches_and_resume_mid_epoch():
    s = DistributedSampler(37, 2, 0, seed=1)
    s.set_epoch(3)
    epoch = s.indices()
    plan = s.batch_plan(4)
    assert [len(b) for b in plan] == [4, 4, 4, 4, 3] and np.array_equal(np.concatenate(plan), epoch)
    assert [len(b) for b in s.batch_plan(4, drop_last=True)] == [4] * 4
    it = s.batches(4)
    seen = [next(it), next(it)]
    assert s.offset == 8  # advanced by what was handed out, nothing more
    state = s.state_dict()
    assert state["epoch"] == 3 and state["offset"] == 8 and state["seed"] == 1

    resumed = DistributedSampler(37, 2, 0, seed=0)  # the seed (and so the order) comes from the state
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the same epoch keeps the position
    assert resumed.batch_plan(4)[0].tolist() == epoch[8:12].tolist()
    rest = list(resumed.batches(4))
    assert [len(b) for b in rest] == [4, 4, 3]
    assert np.concatenate(seen + rest).tolist() == epoch.tolist()  # nothing repeated, nothing skipped
    assert resumed.offset == len(resumed)  # the epoch is consumed, and a checkpoint now says so
    finished = DistributedSampler(37, 2, 0)
    finished.load_state_dict(resumed.state_dict())
    assert list(finished) == [] and finished.batch_plan(4) == []  # a finished epoch loaded: the run goes on
    assert list(resumed) == epoch.tolist()  # iterated again after running out: the whole epoch, as torch's
    resumed.set_epoch(4)  # a new epoch starts over
    assert resumed.offset == 0 and len(list(resumed)) == 19


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=10, num_replicas=0), "num_replicas=0"),
    (dict(num_samples=10, num_replicas=4, rank=4), "rank=4 must be in \\[0, num_replicas=4\\)"),
    (dict(num_samples=10, rank=-1), "rank=-1"),
    (dict(num_samples=10, seed=2**64), "seed=18446744073709551616 must be an integer in \\[-2\\*\\*63, 2\\*\\*64\\)"),
    (dict(num_samples=10, seed=-2**63 - 1), "seed=-9223372036854775809 must be an integer in"),
    (dict(num_samples=-1), "num_samples=-1 must be an integer >= 0"),
    (dict(num_samples=2.5), "num_samples=2.5"),
    (dict(num_samples=10.0), "num_samples=10.0 must be an integer >= 0; pass the dataset's length \\(an int"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)


def test_an_empty_dataset_and_a_negative_seed_are_taken_as_torch_takes_them():
    """torch's DistributedSampler takes len 0 (no indices) and any int64 seed (QA 51: jaxpar refused both)."""
    empty = DistributedSampler(0, 2, 1)
    assert len(empty) == 0 and list(empty) == [] and empty.batch_plan(4) == [] and empty.real().size == 0
    negative, zero = DistributedSampler(10, 2, 0, seed=-1), DistributedSampler(10, 2, 0, seed=0)
    assert sorted(negative.indices().tolist() + DistributedSampler(10, 2, 1, seed=-1).indices().tolist()) == \
        list(range(10))
    assert negative.indices().tolist() != zero.indices().tolist()  # its own permutation
    assert negative.indices().tolist() == DistributedSampler(10, 2, 0, seed=-1).indices().tolist()  # seeded
    restored = DistributedSampler(10, 2, 0)
    restored.load_state_dict(negative.state_dict())
    assert restored.indices().tolist() == negative.indices().tolist()


def test_load_state_dict_checks_the_settings():
    state = DistributedSampler(20, 2, 0).state_dict()
    with pytest.raises(ValueError, match="num_replicas=2 differs .* num_replicas=4"):
        DistributedSampler(20, 4, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="offset=11 must be in \\[0, 10\\]"):
        DistributedSampler(20, 2, 0).load_state_dict({**state, "offset": 11})


@pytest.mark.parametrize("key, other", [("num_samples", 21), ("shuffle", False), ("drop_last", True),
                                        ("num_replicas", 4)])
def test_a_state_from_other_settings_is_refused_for_each_setting(key, other):
    """Each setting the offset is relative to (the dataset's length, the process count, shuffle, drop_last) changes
    which samples an offset means: a state that differs in any one of them is refused, naming it."""
    state = DistributedSampler(20, 2, 0).state_dict()
    settings = {"num_samples": 20, "num_replicas": 2, "shuffle": True, "drop_last": False, key: other}
    mine = DistributedSampler(settings["num_samples"], settings["num_replicas"], 0, shuffle=settings["shuffle"],
                              drop_last=settings["drop_last"])
    with pytest.raises(ValueError, match=rf"state {key}={state[key]!r} differs from this sampler's {key}={other!r}"):
        mine.load_state_dict(state)


def torch_batches(indices, batch_size, drop_last):
    """torch.utils.data.BatchSampler.__iter__ (2.13), written out as the reference: fill a batch, yield it when
    full; the partial batch left at the end is yielded unless drop_last."""
    out, batch = [], []
    for i in indices:
        batch.append(i)
        if len(batch) == batch_size:
            out.append(batch)
            batch = []
    if batch and not drop_last:
        out.append(batch)
    return out


@pytest.mark.parametrize("n, batch_size", [(16, 4), (17, 4), (18, 3), (3, 4)])
def test_batch_plan_drop_last_is_torchs_batch_sampler(n, batch_size):
    """batch_plan(b, drop_last) cuts this rank's indices as torch's BatchSampler(sampler, b, drop_last) does: every
    full batch kept (also when the rest divides evenly), only a short last batch dropped."""
    s = DistributedSampler(2 * n, 2, 1, seed=7)
    for drop_last in (False, True):
        want = torch_batches(s.indices().tolist(), batch_size, drop_last)
        assert [b.tolist() for b in s.batch_plan(batch_size, drop_last)] == want, drop_last


def test_loading_a_state_after_a_finished_pass_resumes_at_its_offset():
    """A sampler whose pass ran to the end (the next pass would start over) that then loads a mid-epoch state
    resumes at the state's offset, not at 0."""
    s = DistributedSampler(10, 2, 0, shuffle=False)
    assert len(list(s.batches(2))) == 3 and s.start == 0  # ran out: the next pass would start over
    s.load_state_dict({**s.state_dict(), "offset": 2})
    assert s.start == 2 and list(s) == torch_indices(10, 2, 0, False)[2:]


def test_a_0d_array_is_refused_in_one_line():
    """A 0-d array has no rows to count (len() of it is a TypeError): it is refused as a num_samples that is not
    an int, not taken as a dataset."""
    with pytest.raises(ValueError, match=r"num_samples=array\(7\) must be an integer >= 0"):
        DistributedSampler(np.array(7), 2, 0)


@pytest.mark.parametrize("n, replicas, padding_ranks", [
    (41, 2, [1]), (41, 3, [2]), (41, 4, [1, 2, 3]), (3, 8, [3, 4, 5, 6, 7]), (12, 4, []), (7, 7, [])])
@pytest.mark.parametrize("shuffle", [False, True])
def test_real_marks_the_wrap_around_padding(n, replicas, padding_ranks, shuffle):
    """real() is False exactly at the padded positions (>= n), and the real positions of all ranks hold every
    sample once; torch's plan itself (indices()) is unchanged and repeats samples."""
    for epoch in (0, 1):
        every, real_every = [], []
        for rank in range(replicas):
            s = DistributedSampler(n, replicas, rank, shuffle=shuffle, seed=2)
            s.set_epoch(epoch)
            idx, real = s.indices(), s.real()
            assert real.dtype == bool and real.shape == idx.shape == (len(s),)
            if not shuffle:
                assert idx.tolist() == torch_indices(n, replicas, rank, False)  # still torch's plan
            positions = rank + replicas * np.arange(len(s))
            assert real.tolist() == (positions < n).tolist()
            assert (not real.all()) == (rank in padding_ranks) and (~real).sum() <= 1  # at most the last one
            assert real[:-1].all()
            every.append(idx)
            real_every.append(idx[real])
        every, real_every = np.concatenate(every), np.concatenate(real_every)
        assert (len(every) > n) == bool(padding_ranks)  # where there is padding, torch's plan repeats samples
        if padding_ranks:
            assert np.bincount(every, minlength=n).max() >= 2
        assert sorted(real_every.tolist()) == list(range(n))  # the real positions: every sample exactly once


@pytest.mark.parametrize("n, replicas", [(41, 2), (41, 3), (41, 4), (3, 2)])
def test_real_with_drop_last_is_all_true(n, replicas):
    for rank in range(replicas):
        s = DistributedSampler(n, replicas, rank, seed=1, drop_last=True)
        assert s.real().shape == s.indices().shape and s.real().all()
    got = np.concatenate([DistributedSampler(n, replicas, r, seed=1, drop_last=True).indices()
                          for r in range(replicas)])
    assert len(set(got.tolist())) == len(got) < n  # drop_last trims instead of padding: no repeats


def test_real_ignores_the_offset():
    s = DistributedSampler(41, 2, 1, seed=0)
    whole = s.real()
    next(s.batches(8))
    assert s.offset == 8 and np.array_equal(s.real(), whole) and not whole[-1]


def test_a_pass_to_the_end_leaves_the_next_pass_the_whole_epoch_as_torch():
    """torch's sampler (and a DataLoader over it) gives the whole epoch on every pass, with or without
    set_epoch(same epoch). Here the consumed offset used to persist, so a loop ported from torch without set_epoch
    trained on the first epoch only (a review: batches per epoch [3, 0, 0] against torch's [3, 3, 3])."""
    from jaxpar.data.datasets import Dataset
    from jaxpar.data.loader import Loader

    x, y = np.arange(10, dtype=np.float32)[:, None], np.arange(10, dtype=np.int32)
    dataset = Dataset(x, y, 10, "toy")
    want = torch_indices(10, 2, 0, False)
    for same_epoch in (False, True):
        s = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)  # torch's (dataset, ...) works
        passes = []
        for _ in range(3):
            if same_epoch:
                s.set_epoch(0)
            passes.append(np.concatenate([np.asarray(b.ids) for b in Loader(dataset, 2, s)]).tolist())
        assert passes == [want] * 3 and list(s) == want and [b.tolist() for b in s.batches(5)] == [want]
    s = DistributedSampler(10, 2, 0, shuffle=False)
    it = iter(Loader(dataset, 2, s))
    next(it)
    it.close()  # a pass left before the end: the next one resumes after what was consumed
    assert np.concatenate([np.asarray(b.ids) for b in Loader(dataset, 2, s)]).tolist() == want[2:]


def test_after_a_whole_pass_the_plan_is_the_whole_epoch_and_a_pass_left_early_resumes():
    """After a pass ran to the end, batch_plan (from `start`) is the whole epoch again, not the empty rest at the
    offset; the next pass, left after one batch, ends the 'ran out' state, so the one after it resumes there."""
    s = DistributedSampler(10, 2, 0, shuffle=False)
    want = torch_indices(10, 2, 0, False)
    whole = [want[:2], want[2:4], want[4:]]
    assert [b.tolist() for b in s.batches(2)] == whole and s.offset == 5
    assert [b.tolist() for b in s.batch_plan(2)] == whole and list(s) == want
    it = s.batches(2)
    assert next(it).tolist() == want[:2]
    it.close()  # left before the end
    assert s.offset == 2 and s.start == 2 and list(s) == want[2:]
    assert [b.tolist() for b in s.batches(2)] == whole[1:]


def test_an_array_dataset_counts_its_rows_as_torchs_sampler_does():
    """DistributedSampler(np.arange(7)) was refused as an empty dataset; torch's takes len(dataset), as for a list.
    torch's indices here (no shuffle, 2 replicas, rank 1): 0..6 padded from the start to 8, every second from 1."""
    for dataset in (np.arange(7), np.zeros((7, 3)), list(range(7))):
        ours = DistributedSampler(dataset, 2, 1, shuffle=False)
        assert ours.num_samples == 7 and list(ours.indices()) == [1, 3, 5, 0]


def test_replicas_and_rank_default_to_the_processes_as_torchs_do_to_the_process_group(monkeypatch):
    """torch's DistributedSampler(dataset) takes the process group's world size and rank; jaxpar's takes
    jax.process_count() and jax.process_index() (it used to take 1 and 0: every process read the whole dataset)."""
    import jax

    assert (DistributedSampler(10).num_replicas, DistributedSampler(10).rank) == (1, 0)  # one process here
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    s = DistributedSampler(10, seed=4)
    assert (s.num_replicas, s.rank) == (3, 2) and len(s) == 4
    np.testing.assert_array_equal(list(s), list(DistributedSampler(10, 3, 2, seed=4)))
    assert DistributedSampler(10, num_replicas=4).rank == 2 and DistributedSampler(10, rank=0).num_replicas == 3
    # launched as one of 2 processes (torchrun's variables) before joining: asking JAX would start it alone
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"has not joined yet; call jaxpar.run.distributed.initialize\(\).*or pass "
                                         "num_replicas and rank"):
        DistributedSampler(10)
    assert DistributedSampler(10, 2, 1).rank == 1


def test_a_state_without_its_position_is_refused_before_anything_changes():
    """QA: load_state_dict({"epoch": 3}) set the epoch, then raised KeyError('offset'): half a state loaded."""
    sampler = DistributedSampler(10, 1, 0, seed=5)
    with pytest.raises(ValueError, match="the sampler state lacks \\['offset'\\] \\(it has \\['epoch', 'seed'\\]\\); "
                                         "pass a state from DistributedSampler.state_dict\\(\\)"):
        sampler.load_state_dict({"epoch": 3, "seed": 9})
    assert (sampler.epoch, sampler.offset, sampler.seed) == (0, 0, 5)
