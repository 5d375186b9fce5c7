"""Child processes that end with their parent (standard library only).

A process started by ours (a torch rank, a reward process, a sweep's pool worker) must not
outlive it, however the parent ends: SIGTERM's default action and SIGKILL run no ``finally``,
so nothing in the parent can stop its children then. The child asks for it itself.

    from tltsim.lifetime import die_with_parent
    die_with_parent(parent_pid)          # first thing in the child
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (its parent now) ends, kill -9 included.

    Linux's PR_SET_PDEATHSIG has the kernel SIGKILL this process when its parent dies;
    elsewhere a daemon thread polls the parent pid. Either only covers deaths from now on: if
    the parent died before this call, this process has been re-parented and exits now."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def pool_worker_init(parent_pid: int) -> None:
    """``multiprocessing.Pool(initializer=...)``: the worker ends with its parent, and leaves
    Ctrl-C to it (a terminal's SIGINT reaches the whole process group: each worker printed its
    KeyboardInterrupt traceback before the parent's one 'interrupted' line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


__all__ = ["die_with_parent", "pool_worker_init"]
