"""Shared piece of the kill tests: run a command in a subprocess and SIGKILL it once a
condition holds (``sigkill_when``), so that a test can check what a killed run left on disk.

A SIGKILL cannot be caught: nothing the run does at exit (flushes, final writes, handlers)
happens, as when a machine is lost or the OOM killer strikes. Commands that should be killed
mid-work slow their steps down (``time.sleep`` in a patched step) so the condition is met
before they end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def sigkill_when(
    cmd: list[str], is_ready: Callable[[], bool], what: str, timeout_s: float = 120.0,
    settle_s: float = 0.0,
) -> None:  # fmt: skip
    """Start ``cmd``; once ``is_ready()`` (polled every 20 ms), wait ``settle_s`` and SIGKILL
    it. Fails naming ``what`` if the run ends first (with its stderr's tail) or ``timeout_s``
    pass; the process never outlives the call."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout_s
        while not is_ready():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"{what}: not in {timeout_s:.0f} s"
            time.sleep(0.02)
        time.sleep(settle_s)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
