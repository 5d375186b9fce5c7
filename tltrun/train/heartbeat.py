"""Heartbeats of a job's ranks through its c10d store: a rank lost with its whole node is found
by the ranks waiting for it within ``HEARTBEAT_TIMEOUT_S``, not the hour of the collective
timeout.

A node that dies whole takes its torchrun agent with it, so nothing on the other nodes reports
it, and their ranks wait in the spot trainer's poll of the store (which lives on, on the
rendezvous host) for the lost ranks' rollouts (tltrun.train.spot). Each rank's ``Heartbeat``
thread adds 1 to ``alive/<rank>`` every ``HEARTBEAT_S``; a waiting rank's ``PeerWatch`` reads
the counters of the ranks it waits for and calls lost a rank whose counter has not moved for
``HEARTBEAT_TIMEOUT_S`` of its own clock (counters, not timestamps: the nodes' clocks need not
agree). A rank that never beat at all (it died before its first beat) is lost the same way: its
counter stays 0.

Run: used by ``tltrun train``'s workers (tltrun.train.worker); tested in tests/test_heartbeat.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable

# One store request per rank every 10 s: nothing next to a rollout's traffic.
HEARTBEAT_S = 10.0
# Silent for two minutes: lost. A live rank's thread beats while its main thread decodes or
# trains (torch releases the GIL inside its kernels, Python switches threads every 5 ms); twelve
# missed beats leave room for a loaded, swapping machine and a slow checkpoint write.
HEARTBEAT_TIMEOUT_S = 120.0


def _key(rank: int) -> str:
    return f"alive/{rank}"


class Heartbeat:
    """This rank's beating thread. It needs a store client of its own (``store``): a client
    is not shared between threads. A failed beat is tried again at the next interval (a
    thread that ended at one store hiccup left a live rank silent, then called lost); a store
    gone for good is the rank's own collectives' to report, and the thread is a daemon."""

    def __init__(self, store, rank: int, interval_s: float = HEARTBEAT_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._store, self._rank, self._interval_s = store, rank, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"tlt-heartbeat-{rank}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s)

    def _beat(self) -> None:
        while True:
            # (any error of the store's client: tried again, see the docstring)
            with contextlib.suppress(Exception):
                self._store.add(_key(self._rank), 1)
            if self._stop.wait(self._interval_s):
                return


class PeerWatch:
    """Which of the ranks a rank waits for stopped beating. ``lost`` reads the store at most
    once per ``interval_s``; cheap to call every poll."""

    def __init__(
        self,
        store,
        timeout_s: float = HEARTBEAT_TIMEOUT_S,
        interval_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"timeout_s and interval_s must be > 0, got {timeout_s}, {interval_s}")
        self.timeout_s = timeout_s
        self._store, self._interval_s, self._clock = store, interval_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
        self._next_read_s = -math.inf

    def is_due(self) -> bool:
        """Whether ``lost`` would read the store now (callers skip their own reads otherwise)."""
        return self._clock() >= self._next_read_s

    def lost(self, ranks: Iterable[int]) -> dict[int, float]:
        """The ranks of ``ranks`` whose counter has not moved for more than ``timeout_s``, with
        the seconds it has been still (empty between reads)."""
        now = self._clock()
        if now < self._next_read_s:
            return {}
        self._next_read_s = now + self._interval_s
        still = {}
        for rank in ranks:
            count = self._store.add(_key(rank), 0)
            before = self._seen.get(rank)
            if before is None or before[0] != count:
                self._seen[rank] = (count, now)
            elif now - before[1] > self.timeout_s:
                still[rank] = now - before[1]
        return still
