"""The courier that runs a process's cross-process exchanges (Transport.post / drain): it returns at once, runs
the exchanges one at a time in the order posted, each finished before the next starts, and an exchange's error
reaches the caller (`exchange` replaced by a recorder, so one process suffices); and the two-sided program every
exchange runs, on one process's devices: which side sends, and which device receives which piece. (Whole
exchanges run across two real processes in test_pipeline's test_two_processes_equal_single.)"""
from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import DATA
from jaxpar.pipeline.transfer import Transport, _pair_program
from jaxpar.strategies.pipeline import pipeline_mesh


def recording_transport(release: threading.Event):
    tr = Transport(pipeline_mesh(2, num_stages=2))
    log, lock = [], threading.Lock()

    def exchange(a, b, messages):
        (_, value, _), = messages
        with lock:
            log.append(("start", value))
        if value == "first":  # holds the courier until the test has posted everything
            assert release.wait(timeout=60), "post() blocked: the test never got to release the first exchange"
        if value == "bad":
            raise ValueError("the exchange failed")
        with lock:
            log.append(("end", value))
        return f"got {value}"

    tr.exchange = exchange
    return tr, log


def test_post_returns_at_once_and_runs_in_order_one_at_a_time():
    release = threading.Event()
    tr, log = recording_transport(release)
    futures = [tr.post(0, 1, [(0, v, None)]) for v in ("first", "second", "third")]  # a blocking post would wait here
    assert not futures[0].done() and ("start", "second") not in log  # the first is held; nothing overtook it
    release.set()
    tr.drain()
    assert [f.result() for f in futures] == ["got first", "got second", "got third"]
    assert log == [(e, v) for v in ("first", "second", "third") for e in ("start", "end")]  # never two at once
    assert tr._posted == []


def test_an_exchange_error_reaches_drain_and_the_courier_goes_on():
    release = threading.Event()
    release.set()
    tr, log = recording_transport(release)
    tr.post(0, 1, [(0, "bad", None)])
    after = tr.post(0, 1, [(0, "after", None)])
    with pytest.raises(ValueError, match="the exchange failed"):
        tr.drain()
    assert after.result() == "got after" and ("end", "after") in log


def test_the_pair_program_moves_each_buffer_its_way_piece_by_piece_and_sums_both_sides():
    """_pair_program over side 0 = devices 0, 1 and side 1 = devices 2, 3, buffers split by rows over DATA: a
    buffer with moves[k] True lands on side 1 (each device gets the piece of the device at its position on side 0),
    one with False on side 0; moves None sums the sides. Each side starts with its own values (the receiver's
    zeros), which the program's "replicated over the pair" layout lets differ."""
    devs = tuple(jax.devices()[:4])
    side = {0: devs[:2], 1: devs[2:]}
    vals = {(k, s): np.arange(4, dtype=np.float32) + 10 * (2 * k + s + 1) for k in (0, 1) for s in (0, 1)}

    def buffer(mesh, k, senders):  # side s's devices hold vals[k, s] (rows split over the side's 2 devices)
        pieces = [jax.device_put(vals[k, s][2 * i:2 * i + 2] if s in senders else np.zeros(2, np.float32), d)
                  for s in (0, 1) for i, d in enumerate(side[s])]
        return jax.make_array_from_single_device_arrays((4,), NamedSharding(mesh, P(DATA)), pieces)

    def on(out, s):  # side s's whole buffer, its devices' pieces in position order
        got = {sh.device: np.asarray(sh.data) for sh in out.addressable_shards}
        return np.concatenate([got[d] for d in side[s]])

    mesh, fn = _pair_program(devs, (True, False), P(DATA))
    down, up = fn([buffer(mesh, 0, senders=(0,)), buffer(mesh, 1, senders=(1,))])
    np.testing.assert_array_equal(on(down, 1), vals[0, 0])  # side 0 -> side 1, piece by piece
    np.testing.assert_array_equal(on(up, 0), vals[1, 1])  # side 1 -> side 0
    assert not on(down, 0).any() and not on(up, 1).any()  # a sender keeps nothing of what it sent
    mesh, fn = _pair_program(devs, None, P(DATA))
    both, = fn([buffer(mesh, 0, senders=(0, 1))])
    for s in (0, 1):
        np.testing.assert_array_equal(on(both, s), vals[0, 0] + vals[0, 1])
