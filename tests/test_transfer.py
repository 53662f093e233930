"""The courier that runs a process's cross-process exchanges (Transport.post / drain): it returns at once, runs
the exchanges one at a time in the order posted, each finished before the next starts, and an exchange's error
reaches the caller. (The exchanges themselves run across two real processes in test_pipeline's
test_two_processes_equal_single; here `exchange` is replaced by a recorder, so one process suffices.)"""
from __future__ import annotations

import threading

import pytest

from jaxpar.pipeline.transfer import Transport
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
