"""Child processes that end with their parent (standard library only).

A process started by ours (a torch rank, a reward process, a sweep's pool worker) must not
outlive it, however the parent ends: SIGTERM's default action and SIGKILL run no ``finally``,
so nothing in the parent can stop its children then. The child asks for it itself.

    from tltsim.lifetime import die_with_parent
    die_with_parent(parent_pid)          # first thing in the child

A temporary directory of ours is removed by whoever made it, in a ``finally``; a process
killed by SIGKILL (or SIGTERM's default action) runs none, so its directory stays. Such
directories carry their maker's pid, and the next one made with the same prefix removes those
whose maker is gone:

    work = owned_tempdir("tlt-elastic-")  # /tmp/tlt-elastic-<pid>-<random>
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def owned_tempdir(prefix: str) -> str:
    """``tempfile.mkdtemp`` named ``<prefix><pid>-<random>``, after removing the directories of
    this prefix whose maker no longer runs (a SIGKILLed launcher's tlt-elastic-*, a SIGTERMed
    rank's vLLM directories piled up in /tmp). A maker's pid reused by another process keeps
    its directory until that one ends: it is never removed while any process has the pid."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or _is_running(int(pid)):
            continue
        try:
            if path.stat().st_uid != os.getuid():  # another user's: not ours to judge
                continue
        except OSError:  # removed meanwhile
            continue
        shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


__all__ = ["die_with_parent", "owned_tempdir", "pool_worker_init"]
