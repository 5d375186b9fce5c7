"""Processes of ``tltrun train`` (tltrun.train.state, tltrun.train.launch): the run directory's
lock refuses a second process on the same ``--out``; no orphans: a launcher killed at any moment
of start-up or mid-run leaves no worker behind; a worker's failure reaches the user as one line
naming its rank. The checkpoints, logs and settings of a run directory:
tests/test_run_integrity.py, whose fake runs and tiny model these tests share.

The fast tests hold the lock from a subprocess and format worker errors; the slow ones start real
runs of a tiny model in their own session and kill the launcher or a worker. Run:
``python -m pytest tests/test_run_processes.py -q`` (``-m "not slow"``: seconds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import test_run_integrity
from test_run_integrity import cli, make_fake_run

from tltrun.train import state as ts
from tltrun.train.run_logs import resume_hint
from tltsim.errors import UsageError
from tltsim.lifetime import owned_tempdir

model_dir = test_run_integrity.model_dir  # its fixture: a tiny model, saved once per module


# ---- the lock --------------------------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from pathlib import Path
from tltrun.train.state import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_second_process_on_the_same_out_is_refused(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    make_fake_run(model_dir, out)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        code, err = cli(["train", "--out", str(out), "--resume"], capsys)
        assert code == 2 and "\n" not in err
        assert err.startswith(f"error: {out}: another tltrun train is running in this directory")
        assert f"pid {holder.pid}" in err
        # also within one process: flock is per open file
        with pytest.raises(UsageError), ts.RunLock(out):
            pass
        assert (out / "log.jsonl").read_text() == "".join(
            json.dumps({"step": s}) + "\n" for s in range(3)
        )  # the refused run touched nothing
    finally:
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait()
    with ts.RunLock(out):
        assert (out / ts.LOCK).read_text() == f"tltrun train pid {os.getpid()}\n"


@pytest.mark.slow
def test_second_launcher_refused_while_a_real_run_holds_the_lock(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", "--model-dir", str(model_dir),
           "--out", str(out), "--num-workers", "2", "--num-steps", "50", "--prompts-per-step", "2",
           "--group-size", "2", "--max-new-tokens", "16", "--policy", "nospec"]  # fmt: skip
    first = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "log.jsonl").is_file() and time.monotonic() < deadline:
            assert first.poll() is None, f"the first run ended (exit {first.returncode})"
            time.sleep(0.1)
        code, err = cli(["train", "--out", str(out), "--resume"], capsys)
        assert code == 2 and "another tltrun train is running in this directory" in err
        code, err = cli(cmd[3:], capsys)  # a fresh run on the same --out: refused too
        assert code == 2 and "another tltrun train is running in this directory" in err
        assert first.poll() is None  # the first run goes on
    finally:
        stop_session(first)


def stop_session(launcher: subprocess.Popen) -> None:
    """Stop a run as a user would (SIGTERM), then kill what is left of its session. SIGKILL to
    the whole group killed multiprocessing's resource tracker too, leaving the run's semaphores
    (9 per run) in /dev/shm."""
    launcher.terminate()
    deadline = time.monotonic() + 60
    while session_pids(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in session_pids(launcher.pid):
        os.kill(pid, 9)
    launcher.wait()


# ---- no orphans ------------------------------------------------------------------------------


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid`` (the launcher's, started in its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after "pid (comm)": state, ppid, pgrp, session
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


def wait_for(condition, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition(), "timed out"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
@pytest.mark.parametrize(
    "moment, delay_s",
    [
        ("launch", 0.0),  # before any worker exists
        ("launch", 1.0),
        ("workers spawned", 0.0),  # workers importing torch, before any of our code runs
        ("workers spawned", 1.0),
        ("first step logged", 0.0),  # mid-run
    ],
)
def test_killing_the_launcher_ends_every_worker(model_dir, tmp_path, moment, delay_s):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", "--model-dir", str(model_dir),
           "--out", str(out), "--num-workers", "2", "--num-steps", "100000", "--prompts-per-step",
           "2", "--group-size", "2", "--max-new-tokens", "16", "--policy", "nospec"]  # fmt: skip
    launcher = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        if moment == "workers spawned":  # the launcher, the resource tracker, 2 workers
            wait_for(lambda: len(session_pids(launcher.pid)) >= 4)
        elif moment == "first step logged":
            wait_for(lambda: (out / "log.jsonl").is_file())
            assert len(session_pids(launcher.pid)) >= 3  # the launcher and both workers
        time.sleep(delay_s)
        assert launcher.poll() is None, "the run ended before the kill"
        launcher.kill()  # SIGKILL to the launcher alone: it cleans nothing up
        launcher.wait()
        # A worker still starting (importing torch) notices the loss of its launcher when it
        # gets to its first statement; give it the time to get there.
        wait_for(lambda: session_pids(launcher.pid) == [], timeout_s=60)
        # its launch directory stays (SIGKILL runs no finally); the next launch removes it
        left = list(Path(tempfile.gettempdir()).glob(f"tlt-elastic-{launcher.pid}-*"))
        assert left or moment != "first step logged"
        Path(owned_tempdir("tlt-elastic-")).rmdir()
        assert not any(path.exists() for path in left)
    finally:
        for pid in session_pids(launcher.pid):
            os.kill(pid, 9)


def test_a_dead_makers_temp_dirs_are_removed_by_the_next_of_their_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"tlt-x-{ended.stdout.strip()}-abc"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "model.safetensors").write_bytes(b"weights")
    kept = [
        tmp_path / f"tlt-x-{os.getpid()}-abc",  # its maker runs
        tmp_path / f"tlt-y-{ended.stdout.strip()}-abc",  # another prefix
        tmp_path / "tlt-x-notapid-abc",
    ]
    for path in kept:
        path.mkdir()
    made = Path(owned_tempdir("tlt-x-"))
    assert not dead.exists() and all(path.is_dir() for path in kept)
    assert made.parent == tmp_path and made.name.startswith(f"tlt-x-{os.getpid()}-")


# ---- a worker's failure reaches the user as one line ------------------------------------------


def test_worker_errors_are_one_line_naming_the_rank(tmp_path):
    from tltrun.train.elastic import worker_error

    report = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call "
        'last):\n  File "x.py", line 3, in f\n    raise CheckpointError(...)\n'
        "tltrun.model.config.CheckpointError: m/model.safetensors: truncated\n"
    )
    err = worker_error(tmp_path, 1, report)
    assert str(err) == (
        f"worker rank 1: m/model.safetensors: truncated (full traceback in "
        f"{tmp_path / 'worker_errors.log'})"
    )
    assert err.exit_code == 2  # the worker's own error was input a user can fix
    bug = worker_error(tmp_path, 0, "Traceback ...\nZeroDivisionError: division by zero\n")
    assert "worker rank 0: ZeroDivisionError: division by zero" in str(bug)
    assert bug.exit_code == 1
    log = (tmp_path / "worker_errors.log").read_text()
    assert "raise CheckpointError" in log and "ZeroDivisionError" in log  # both, appended
    # a message of several lines (vLLM's config check through pydantic): its first lines, not
    # the traceback's last ("For further information visit https://errors.pydantic.dev/...")
    pydantic = worker_error(
        tmp_path,
        0,
        'Traceback ...\n  File "v.py", line 9, in c\n    check()\n'
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, max_model_len (1048) is greater than the derived max_model_len\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n",
    )
    assert "1 validation error for ModelConfig: Value error, max_model_len (1048)" in str(pydantic)
    assert "pydantic.dev" not in str(pydantic)


def test_a_survivors_broken_collective_says_a_worker_died_and_how_to_resume(tmp_path):
    """A worker killed while the other waits in a collective: torch reported the survivor's
    gloo error ('Connection reset by peer ... GLHF!'), without the killed rank or --resume."""
    from tltrun.train.elastic import RankFailure, failure_error

    gloo = ("Traceback ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:41211: Connection reset by peer\n")  # fmt: skip
    err = failure_error(tmp_path, RankFailure(rank=0, pid=1, exit_code=1, traceback=gloo))
    message = str(err)
    assert message.startswith("worker rank 0 lost its connection to another worker, which died")
    assert "--resume starts it again from step 0" in message and "worker_errors.log" in message
    assert "\n" not in message and err.is_output_cut
    assert "Connection reset by peer" in (tmp_path / "worker_errors.log").read_text()


def test_a_rank_lost_whole_says_how_to_resume(tmp_path):
    """The spot trainer's wait for a rank lost with its node (tltrun.train.heartbeat) ended
    the job with its TimeoutError alone: nothing said the run resumes once the node is back."""
    from tltrun.train.elastic import RankFailure, failure_error

    lost = ("Traceback ...\nTimeoutError: rank 0 waited for the rollouts of rank(s) 1 in step 0, "
            "which sent no heartbeat for 120 s: lost (a node that died whole is seen by no "
            "launcher here)?\n")  # fmt: skip
    message = str(failure_error(tmp_path, RankFailure(rank=0, pid=1, exit_code=1, traceback=lost)))
    assert message.startswith("worker rank 0: TimeoutError: rank 0 waited for the rollouts of")
    assert message.endswith(f"tltrun train --out {tmp_path} --resume starts it again from step 0")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_a_killed_worker_ends_the_run_with_one_line(model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", "--model-dir", str(model_dir),
           "--out", str(out), "--num-workers", "2", "--num-steps", "100000", "--prompts-per-step",
           "2", "--group-size", "2", "--max-new-tokens", "16", "--policy", "nospec"]  # fmt: skip
    launcher = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "log.jsonl").is_file())
        # the launcher's own spawned children (each worker spawns reward processes too)
        workers = [
            pid
            for pid in session_pids(launcher.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            and parent_pid(pid) == launcher.pid
        ]
        assert len(workers) == 2
        os.kill(workers[-1], 9)
        _, stderr = launcher.communicate(timeout=120)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert launcher.returncode == 1 and "Traceback" not in stderr, stderr
        assert len(errors) == 1 and errors[0].startswith("error: worker rank "), stderr
        assert "was killed by SIGKILL" in errors[0] and "--resume" in errors[0]
        assert "\nerror: worker rank " in stderr, stderr
        wait_for(lambda: session_pids(launcher.pid) == [], timeout_s=60)
    finally:
        for pid in session_pids(launcher.pid):
            os.kill(pid, 9)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_sigterm_to_the_launcher_is_a_stop_not_a_bug(model_dir, tmp_path):
    """``timeout`` or a scheduler sends the launcher SIGTERM mid-run: the workers are stopped
    and the run ends with one line saying so and how to resume (exit 143), not an internal
    error with a traceback file."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", "--model-dir", str(model_dir),
           "--out", str(out), "--num-workers", "2", "--num-steps", "100000", "--prompts-per-step",
           "2", "--group-size", "2", "--max-new-tokens", "16", "--policy", "nospec"]  # fmt: skip
    before = set(Path(tempfile.gettempdir()).glob("tltrun-traceback-*.txt"))
    launcher = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "log.jsonl").is_file() and (out / "log.jsonl").stat().st_size > 0)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {out}: stopped by SIGTERM; its workers were stopped; "
        + resume_hint(out, f"tltrun train --out {out}")  # (tested in test_run_dir_lifecycle)
    ], err
    assert "internal error" not in err and "Traceback" not in err
    # the error line is a line of its own, not glued to rank 0's progress bar; torch's agent
    # no longer logs the signal beside it, nor multiprocessing's resource tracker the
    # semaphores of the killed workers' progress bars (tqdm's default lock)
    assert "\nerror: " in err and "death signal" not in err and "leaked" not in err, err
    assert set(Path(tempfile.gettempdir()).glob("tltrun-traceback-*.txt")) == before
    wait_for(lambda: session_pids(launcher.pid) == [], timeout_s=30)  # no worker left behind
