"""``tltrun train`` on torch.distributed's own launcher (torchrun / torch.distributed.elastic).

Every worker process is one rank of a torch.distributed job whose rank, world size and
rendezvous come from the environment torchrun (or its API) sets: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (``init_method="env://"``); gloo on CPU, NCCL
on CUDA (one device per local rank). Two ways in, the same worker code:

* ``torchrun --nnodes N --nproc-per-node G -m tltrun.cli.main train ...``: torchrun starts
  every rank with the CLI (tltrun.train.launch.run_ranked: rank 0 locks and prepares the run
  directory and tells the others what to resume from);
* ``tltrun train --num-workers W`` on one machine: ``launch_local`` runs torchrun's agent in the
  launcher process (``torch.distributed.launcher.api``, the code behind ``torchrun --standalone``)
  with ``tltrun.train.worker.worker_entry`` as the function every rank runs.

Failures (``root_failure``): a rank's exception is written by ``errors.record`` into the
error file torchrun's agent gives each rank; the agent sees the rank end, stops the others
(SIGTERM, then SIGKILL after ``SHUTDOWN_TIMEOUT_S``) and raises ``ChildFailedError`` naming
every failed rank, so a dead rank ends the job instead of leaving the others in a collective.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import signal
import tempfile
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tltrun.train.run_logs import resume_hint
from tltsim.errors import UsageError, WorkerError, is_input_error_name
from tltsim.lifetime import die_with_parent

# Seconds torchrun's agent waits after SIGTERM before it SIGKILLs the surviving ranks of a failed
# job (its own default is 30 s: our workers have no shutdown work that needs that long).
SHUTDOWN_TIMEOUT_S = 5
# How often the agent polls its ranks for an exit (torchrun's default 0.1 s polls ten times as
# often for no gain here: a failure is seen within this, and the job ends that much later).
MONITOR_INTERVAL_S = 0.5
# Collectives and store waits: a rank blocked longer than this raises instead of hanging (a
# dead peer normally ends the job much sooner, through the agent). Rollouts of long responses
# on a slow CPU keep the other ranks in a barrier for minutes: an hour leaves them room.
COLLECTIVE_TIMEOUT_S = 3600
# The exception a rank raises when another rank was lost whole (tltrun.train.spot's wait)
LOST_RANK = "TimeoutError"
# Exceptions a rank raises because ANOTHER rank died (its sockets closed): never a root cause.
COLLATERAL = ("DistBackendError", "DistNetworkError", "Connection closed", "Connection reset")


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """This process's place in the job, as torchrun's environment gives it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def rank_env() -> RankEnv | None:
    """The torchrun environment of this process (None: not started by torchrun or its API).
    A value that cannot be one (``RANK=abc``, ``RANK`` >= ``WORLD_SIZE``, a port out of range)
    is one ``UsageError`` naming the variable."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    values = {}
    for name, lowest, highest in (
        ("WORLD_SIZE", 1, None),
        ("RANK", 0, None),
        ("LOCAL_RANK", 0, None),
        ("MASTER_PORT", 1, 65535),
    ):
        text = os.environ.get(name, "0")
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lowest or (highest is not None and value > highest):
            bounds = f">= {lowest}" if highest is None else f"in {lowest}..{highest}"
            raise UsageError(f"environment variable {name}={text!r}: expected an integer {bounds}")
        values[name] = value
    if values["RANK"] >= values["WORLD_SIZE"]:
        raise UsageError(
            f"environment variables RANK={values['RANK']} WORLD_SIZE={values['WORLD_SIZE']}: "
            "a rank must be below the world size"
        )
    return RankEnv(
        rank=values["RANK"],
        world_size=values["WORLD_SIZE"],
        local_rank=values["LOCAL_RANK"],
        master_addr=os.environ["MASTER_ADDR"],
        master_port=values["MASTER_PORT"],
    )


class ContentionWarning(UserWarning):
    """This machine's workers run more threads than it has cores (``warn_contention``)."""


def warn_contention(num_local_workers: int, num_threads: int) -> None:
    """This machine's workers x their threads over its cores: they contend, and the measured
    step times say so (hunt: a step's 1.5 s rollout took 119 s, unsaid). Said by the launcher,
    or torchrun's local rank 0, after the worker count was checked."""
    cores = os.cpu_count() or 1
    if num_local_workers * num_threads > cores:
        warnings.warn(
            f"{num_local_workers} workers x --num-threads {num_threads} = "
            f"{num_local_workers * num_threads} threads on this machine's {cores} cores: they "
            "contend, and the step times measure it",
            ContentionWarning,
            stacklevel=3,
        )


def is_torchrun_agent() -> bool:
    """Started by torchrun's agent (or its API), which sets TORCHELASTIC_RUN_ID; the rank
    variables alone may be left over in a shell, a Kubernetes pod or a SLURM script."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def init_process_group(device: str) -> RankEnv:
    """Join the job (``env://``): NCCL on CUDA with this rank's local device, gloo on CPU.

    On CUDA the default group is ``cpu:gloo,cuda:nccl`` (torch's per-device backends): the run's
    bookkeeping collectives hold CPU tensors (GRPO's token count, FSDP's microbatch count, the
    spot trainer's versions), which a NCCL-only group refuses; object collectives and barriers
    then go through gloo (torch's ``_get_object_coll_device`` picks cpu), CUDA tensors through
    NCCL."""
    env = rank_env()
    if env is None:
        raise RuntimeError("not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT unset")
    is_cuda = device.startswith("cuda")
    if is_cuda and device == "cuda":  # "cuda:N" pins every rank to N on purpose
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if is_cuda else "gloo",
        init_method="env://",
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return env


def side_store(env: RankEnv) -> dist.Store:
    """A client of the job's c10d store (the one ``env://`` rendezvoused on, served by rank 0's
    process group or torchrun's agent) under a prefix of ours: the spot trainer's finish order."""
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return dist.PrefixStore(f"tlt/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", store)


def die_with_launcher(launcher_pid: int) -> None:
    """Make this worker end when its launcher does, however the launcher ends (kill -9 too):
    ``tltsim.lifetime.die_with_parent``. (Torch's spawn wrapper sets SIGINT, which a worker
    blocked in a collective or catching KeyboardInterrupt can outlive; a worker spends its first
    seconds importing torch, and one whose launcher died meanwhile exits before it touches the
    run directory or joins the other workers.)"""
    die_with_parent(launcher_pid)


def interrupt_once() -> None:
    """Ctrl-C reaches a rank twice: from the terminal (SIGINT goes to the whole process group)
    and from torchrun's agent, which passes the signal that stopped it on to the ranks. The
    second KeyboardInterrupt landed in the cleanup the first one started (the progress bar's
    close) and printed tqdm's "Exception ignored in" traceback before the launcher's one line
    in 3 of 4 runs. The first SIGINT interrupts; later ones are ignored (the agent SIGKILLs a
    rank still alive after its shutdown timeout)."""

    def on_sigint(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def launch_local(num_procs: int, entry: Callable, args: tuple, log_dir: Path) -> None:
    """Run ``entry(*args)`` in ``num_procs`` ranks on this machine through torchrun's agent
    (what ``torchrun --standalone --nproc-per-node num_procs`` does); raises torchrun's
    ``ChildFailedError`` when a rank fails (``root_failure`` picks its cause)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every rank's start and stop, and the signal that stopped it; the launcher
    # reports a failure or a stop in one line. torch's get_logger sets each module's logger's
    # own level (WARNING), so the package logger's level alone left "Received 15 death signal".
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR + 10)
    config = LaunchConfig(**_launch_fields(

        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_procs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",  # --standalone: a c10d store on a free port of this machine
        rdzv_endpoint="localhost:0",
        max_restarts=0,  # a failed rank ends the job; --resume continues it
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    ))  # fmt: skip
    # torch's spawn leaves an error file per rank in the temp directory (delete=False): two
    # pytorch-errorfile-*.pickle in /tmp per failed run piled up; in log_dir they go with it
    saved, tempfile.tempdir = tempfile.tempdir, str(log_dir)
    try:
        elastic_launch(config, entry)(*args)
    finally:
        tempfile.tempdir = saved


def _launch_fields(**fields) -> dict:
    """``fields`` less those this torch's ``LaunchConfig`` does not have: ``shutdown_timeout``
    is newer than torch 2.11 (the GPU image of session 23 raised TypeError on it), whose agent
    then waits its own default after SIGTERM."""
    from torch.distributed.launcher.api import LaunchConfig

    known = inspect.signature(LaunchConfig).parameters
    return {name: value for name, value in fields.items() if name in known}


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """The failure that ended a job: its rank, and either the signal that killed it, the exit
    code it ended with, or the traceback its error file holds."""

    rank: int
    pid: int
    exit_code: int
    signal_name: str = ""
    traceback: str = ""


def root_failure(failures: dict[int, Any]) -> RankFailure:
    """The cause among torchrun's ``ChildFailedError.failures`` ({global rank: ProcessFailure}):
    a rank killed by a signal other than the agent's own SIGTERM, else an exception that is not
    a consequence of another rank's death (COLLATERAL), else the earliest."""

    def order(item) -> tuple:
        rank, failure = item
        text = _traceback(failure)
        killed = failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM
        collateral = not text or any(mark in text for mark in COLLATERAL)
        return (not killed, collateral, failure.timestamp, rank)

    rank, failure = min(failures.items(), key=order)
    return RankFailure(
        rank=rank,
        pid=failure.pid,
        exit_code=failure.exitcode,
        signal_name=failure.signal_name() if failure.exitcode < 0 else "",
        traceback=_traceback(failure),
    )


def _traceback(failure) -> str:
    """The rank's traceback from its error file ("": no error file, e.g. killed by a signal)."""
    if not os.path.isfile(failure.error_file):
        return ""  # (torch then holds a placeholder message, "<NONE>")
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("py_callstack", "") or message.get("message", "")
    return message if isinstance(message, str) else ""


def train_resume_hint(out: Path) -> str:
    """How the stopped ``tltrun train`` run in ``out`` goes on (``run_logs.resume_hint``): a
    rank of a torchrun job names torchrun (it named the one-machine command, which would start
    the workers on this machine only)."""
    command = "torchrun ... -m tltrun train" if is_torchrun_agent() else "tltrun train"
    return resume_hint(out, f"{command} --out {out}")


def failure_error(out: Path, failure) -> WorkerError:
    """One line for the rank that ended a job (tltrun.train.elastic.root_failure)."""
    if failure.traceback and any(mark in failure.traceback for mark in COLLATERAL):
        # torch reports the first failure it sees: when a worker is killed outright, often a
        # survivor's broken collective instead (the killed rank is not in the report)
        logged = worker_error(out, failure.rank, failure.traceback)
        return WorkerError(
            f"worker rank {failure.rank} lost its connection to another worker, which died "
            f"(killed, or out of memory?); the other workers were stopped; {train_resume_hint(out)} "
            f"({str(logged).rpartition('(')[2]}",
            is_output_cut=True,
        )
    if failure.traceback and _exception_line(failure.traceback).startswith(LOST_RANK):
        # a rank lost whole (the spot trainer's wait, tltrun.train.heartbeat): how to go on
        logged = str(worker_error(out, failure.rank, failure.traceback))
        return WorkerError(f"{logged}; {train_resume_hint(out)}", is_output_cut=True)
    if failure.traceback:
        return worker_error(out, failure.rank, failure.traceback)
    how = (
        f"was killed by {failure.signal_name}"
        if failure.signal_name
        else f"exited with code {failure.exit_code}"
    )
    return WorkerError(
        f"worker rank {failure.rank} {how} (pid {failure.pid}); the other workers were "
        f"stopped; {train_resume_hint(out)}",
        is_output_cut=True,
    )


def worker_error(out: Path, rank: int, report: str) -> WorkerError:
    """One line for a worker's exception: its rank and the exception's last line (type and
    message); the whole traceback is appended to ``OUT/worker_errors.log``."""
    log = out / "worker_errors.log"
    try:
        with log.open("a") as fh:
            fh.write(f"--- worker rank {rank}, {datetime.now(UTC).isoformat()} ---\n{report}\n")
    except OSError:  # a rank that cannot reach --out: the error is said, not the log's failure
        log = Path(tempfile.gettempdir()) / f"tltrun-worker-{rank}-{os.getpid()}.log"
        log.write_text(report)
    cause = _exception_line(report)
    kind, _, message = cause.partition(": ")
    is_input = is_input_error_name(kind)
    shown = message if is_input and message else cause
    return WorkerError(
        f"worker rank {rank}: {shown} (full traceback in {log})", exit_code=2 if is_input else 1
    )


# The first line of a traceback's final exception: "Type: message" at column 0 (a dotted type
# of a module, e.g. pydantic_core._pydantic_core.ValidationError)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(: |$)")


def _exception_line(report: str) -> str:
    """The final exception's first line: not the traceback's last line, which for a message of
    several lines (pydantic's, vLLM's config errors) was boilerplate ("For further information
    visit https://errors.pydantic.dev/...")."""
    lines = report.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[i]):
            # a message continued on indented lines (pydantic: "1 validation error for X",
            # then the error itself): its first continuation says what went wrong
            more = [line.strip() for line in lines[i + 1 : i + 2] if line.startswith(" ")]
            return ": ".join([lines[i].strip(), *more])
    return next((line.strip() for line in reversed(lines) if line.strip()), "no message")


def check_same_command(cfg: Any, task: Any, is_resume: bool, is_override_config: bool) -> None:
    """Every rank of a torchrun job parsed its own command line, and only rank 0's is checked
    and recorded: a node started with another --lr trained other weights with exit 0, another
    --checkpoint-every deadlocked in the checkpoint barrier, another --out failed at the first
    checkpoint (hunt). The ranks compare their settings and stop together, naming the flags."""
    from dataclasses import asdict

    from tltrun.train.config_checks import flag_of

    mine = {
        **{f"train.{k}": v for k, v in asdict(cfg).items()},
        **{f"task.{k}": v for k, v in asdict(task).items()},
        "train.resume": is_resume,
        "train.override_config": is_override_config,
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        differ = [k for k in mine if every[0].get(k) != theirs.get(k)]
        if differ:
            shown = "; ".join(
                f"{flag_of(k)} {every[0].get(k)!r} vs {theirs.get(k)!r}" for k in differ[:4]
            )
            dist.destroy_process_group()
            raise UsageError(
                f"rank {rank} was started with other settings than rank 0 ({shown}): run the "
                "same tltrun train command on every node"
            )


def check_shared_out(out: Path) -> None:
    """Rank 0 prepared ``out``; a rank that cannot see it (node-local disks under one path)
    would fail at the first checkpoint, blaming the disk (hunt): every rank stops now. Each
    rank reads config.json's bytes: a node-local directory holding an earlier run's copy passed
    a check of its presence (hunt), and close-to-open consistency (NFS) shows every rank the
    bytes rank 0 wrote."""
    try:
        seen = hashlib.sha1((out / "config.json").read_bytes()).hexdigest()
    except OSError:
        seen = None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    blind = [r for r, digest in enumerate(every) if digest is None or digest != every[0]]
    if blind:
        dist.destroy_process_group()
        raise UsageError(
            f"--out {out}: rank {blind[0]} cannot see the run directory rank 0 prepared: --out "
            "must be on a file system every node shares"
        )
