"""Heartbeats of a job's ranks (tltrun.train.heartbeat): the watch calls lost only a rank whose
counter stood still past the timeout, reads the store at most once per interval; the beating
thread beats until stopped, through a store's failures; a spot trainer waiting for a
silent rank's rollout raises within the heartbeat timeout, not the collective's hour, and
keeps waiting for one that beats.

Run: ``python -m pytest tests/test_heartbeat.py -q`` (seconds).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from test_torchrun import OneRank

from tltrun.train.heartbeat import Heartbeat, PeerWatch


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_watch_calls_lost_only_a_rank_still_past_the_timeout():
    store, clock = dist.HashStore(), Clock()
    watch = PeerWatch(store, timeout_s=30.0, interval_s=10.0, clock=clock)
    assert watch.lost([1, 2]) == {}  # first sight of both (rank 2 never beats)
    for now_s in (10.0, 20.0, 30.0):
        clock.now_s = now_s
        store.add("alive/1", 1)
        assert watch.lost([1, 2]) == {}  # rank 2 still for 30 s: not more than the timeout
    clock.now_s = 35.0
    assert not watch.is_due() and watch.lost([1, 2]) == {}  # no read between intervals
    clock.now_s = 40.0
    store.add("alive/1", 1)
    assert watch.is_due() and watch.lost([1, 2]) == {2: 40.0}
    clock.now_s = 80.0  # rank 1 stopped after its beat at 40 s
    assert watch.lost([1, 2]) == {1: 40.0, 2: 80.0}
    assert watch.lost([1]) == {}  # (read again only after the interval)


def test_the_thread_beats_until_stopped_and_through_a_store_s_failures():
    store = dist.HashStore()
    beat = Heartbeat(store, 3, interval_s=0.01).start()
    deadline = time.monotonic() + 30
    while store.add("alive/3", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.stop()
    count = store.add("alive/3", 0)
    assert count >= 3 and not beat._thread.is_alive()
    time.sleep(0.05)
    assert store.add("alive/3", 0) == count  # stopped: no more beats

    class Hiccup:  # fails twice, then works (a store that fails for good fails every time)
        def __init__(self):
            self.calls = 0

        def add(self, key, value):
            self.calls += 1
            if self.calls <= 2:
                raise RuntimeError("Connection reset by peer")
            return store.add(key, value)

    flaky = Heartbeat(Hiccup(), 4, interval_s=0.01).start()
    deadline = time.monotonic() + 30
    while store.add("alive/4", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    flaky.stop()
    # beats after the failures (it ended at the first one: a live rank went silent)
    assert store.add("alive/4", 0) >= 2 and not flaky._thread.is_alive()
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        Heartbeat(store, 0, interval_s=0)


def spot_trainer(store, watch: PeerWatch):
    from tiny_models import tiny_model

    from tltrun.model.drafter import EagleDrafter
    from tltrun.train.drafter_training import DrafterTrainConfig
    from tltrun.train.spot import SpotTrainer
    from tltrun.train.subset_groups import SubsetGroups
    from tltsim.policy import SpotTrainerPolicy

    groups = SubsetGroups(store, 0, 5.0)
    groups.groups[(0,)] = OneRank()  # rank 0 alone in its phase: no peer to talk to
    drafter = EagleDrafter.for_target(tiny_model(seed=0), seed=1)
    return SpotTrainer(0, 2, store, groups, drafter, SpotTrainerPolicy(), DrafterTrainConfig(),
                       seed=0, poll_s=0.01, wait_timeout_s=3600.0, watch=watch)  # fmt: skip


@pytest.mark.parametrize("is_deterministic", [False, True])
def test_a_wait_for_a_silent_rank_ends_within_the_heartbeat_timeout(is_deterministic):
    """Multi-node hunt: a node lost whole kept the other nodes' ranks waiting for its
    rollouts for the collective timeout (an hour); its heartbeats stop at once."""
    store = dist.HashStore()
    spot = spot_trainer(store, PeerWatch(store, timeout_s=0.3, interval_s=0.05))
    order = spot.announce_done(0)  # rank 1's rollout never ends, and it never beats
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 in step 0, which sent no heartbeat"):
        spot.run_budget(0, []) if is_deterministic else spot.run_idle(0, order, [], started)
    assert time.monotonic() - started < 30


def test_a_rank_that_beats_is_waited_for():
    store = dist.HashStore()
    spot = spot_trainer(store, PeerWatch(store, timeout_s=0.2, interval_s=0.02))
    spot.announce_done(0)
    beat = Heartbeat(store, 1, interval_s=0.01).start()  # rank 1 alive, rolling out for 1 s

    def finish_later():
        time.sleep(1.0)
        store.add("s0/num_done", 1)
        store.set("s0/order/2", "1")

    finisher = threading.Thread(target=finish_later)
    finisher.start()
    try:
        spot.run_budget(0, [])  # returns when rank 1 finished, five timeouts later
    finally:
        beat.stop()
        finisher.join()
    assert spot._missing(0) == []
