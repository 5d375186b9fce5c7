"""``tltrun train`` on torch.distributed's launcher (issue #19), CPU / gloo, tiny model: a real
``torchrun --standalone`` job of 2 and of 3 ranks; ``tltrun train --num-workers``'s own launcher
(torchrun's agent in-process) reporting a rank's exception as one line naming the rank; spot
training with 7 workers (above the old 2^W cap of 6) completes; a rank killed with SIGKILL
mid-run ends the torchrun job (no hang) and ``--resume`` continues with no lost or repeated step.

Checkpoints and FSDP2: test_torchrun_state.py. Run: ``python -m pytest tests/test_torchrun.py -q``
(a few minutes on 2 cores: every job starts 2 to 7 processes that import torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import TASK, config, deterministic, model_dir, rows  # noqa: F401 (a fixture)

from tltrun.train.launch import run_train
from tltsim.errors import UsageError, WorkerError

SMALL = ["--num-steps", "2", "--prompts-per-step", "6", "--group-size", "2",
         "--max-new-tokens", "16", "--policy", "nospec", "--num-threads", "1", "--seed", "0",
         "--checkpoint-every", "1", "--spot-training"]  # fmt: skip


def torchrun(num_procs: int, model: Path, out: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={num_procs}", "-m", "tltrun.cli.main", "train",
        "--model-dir", str(model), "--out", str(out), *SMALL, *flags,
    ]  # fmt: skip


def quiet_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
@pytest.mark.parametrize("num_procs", [2, 3])
def test_torchrun_standalone_runs_two_grpo_steps(model_dir, tmp_path, num_procs):  # noqa: F811
    out = tmp_path / "run"
    done = subprocess.run(
        torchrun(num_procs, model_dir, out),
        capture_output=True,
        text=True,
        timeout=300,
        env=quiet_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("written to") == 1  # rank 0 speaks for the job
    log = rows(out)
    assert [r["step"] for r in log] == [0, 1]
    for row in log:  # one entry per rank, the same actor everywhere after each update
        assert len(row["actor_sha1"]) == num_procs and len(set(row["actor_sha1"])) == 1
        assert len(row["worker_rollout_s"]) == num_procs
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["train"]["num_workers"] == num_procs  # the world size decides
    assert (out / "ckpt" / "step_000002" / "manifest.json").is_file()
    assert (out / "final" / "actor" / "model.safetensors").is_file()


def test_ranks_started_with_other_settings_or_blind_to_out_stop_together(monkeypatch, tmp_path):
    """Hunt (two nodes on one machine): a node started with another --lr trained other weights
    with exit 0, another --checkpoint-every deadlocked, node-local --out failed at the first
    checkpoint blaming the disk. Every rank compares its settings with rank 0's, and checks it
    sees the run directory; the exchange itself is torch's (faked here with rank 1's values)."""
    import dataclasses

    import torch.distributed as dist

    from tltrun.train import elastic

    cfg = config(Path("m"), tmp_path / "run", num_steps=1)
    other = {"cfg": dataclasses.replace(cfg, lr=0.5, checkpoint_every=2), "sees": None}

    def gather(into, mine):  # rank 0 is this process, rank 1 differs
        into[0] = mine
        into[1] = (
            {**mine, **{f"train.{k}": v for k, v in dataclasses.asdict(other["cfg"]).items()}}
            if isinstance(mine, dict)
            else other["sees"]  # rank 1's digest of config.json (None: no such file)
        )

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    with pytest.raises(UsageError) as err:
        elastic.check_same_command(cfg, TASK, False, False)
    assert str(err.value) == (
        f"rank 1 was started with other settings than rank 0 (--lr {cfg.lr!r} vs 0.5; "
        "--checkpoint-every 1 vs 2): run the same tltrun train command on every node"
    )
    other["cfg"] = cfg
    elastic.check_same_command(cfg, TASK, False, False)  # the same command: nothing to say
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="rank 1 cannot see the run directory rank 0 prepared"):
        elastic.check_shared_out(tmp_path / "run")
    other["sees"] = "an earlier run's config.json on rank 1's own disk"  # (hunt: it passed)
    with pytest.raises(UsageError, match="rank 1 cannot see the run directory rank 0 prepared"):
        elastic.check_shared_out(tmp_path / "run")
    other["sees"] = hashlib.sha1(b"{}").hexdigest()  # the bytes rank 0 wrote
    elastic.check_shared_out(tmp_path / "run")


def test_a_rank_exception_is_one_line_naming_the_rank(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """tltrun's own launcher: rank 1 raises (a test hook parses a bad delay); the launcher
    raises one WorkerError naming rank 1 and its exception, the traceback in the log file."""
    import tempfile

    monkeypatch.setenv("TLTRUN_TEST_ROLLOUT_DELAY", "1:not-a-number")
    out = tmp_path / "run"
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("pytorch-errorfile-*"))
    with pytest.raises(WorkerError) as err:
        run_train(config(model_dir, out, num_steps=1), TASK)
    # torch's per-rank error files went with the launch's temp directory (two were left in /tmp)
    assert set(temp.glob("pytorch-errorfile-*")) <= before
    line = str(err.value)
    assert line.startswith("worker rank 1: ValueError: could not convert string to float"), line
    assert "\n" not in line and err.value.exit_code == 1
    log = (out / "worker_errors.log").read_text()
    assert "worker rank 1" in log and "_test_rollout_delay" in log  # the whole traceback


@pytest.mark.slow
def test_a_rank_exception_under_torchrun_names_the_rank(model_dir, tmp_path):  # noqa: F811
    """torchrun: rank 1 raises; its line names it, torchrun's summary carries its error file,
    the job ends (the other rank is stopped) and the traceback is in worker_errors.log."""
    out = tmp_path / "run"
    done = subprocess.run(
        torchrun(2, model_dir, out),
        capture_output=True,
        text=True,
        timeout=300,
        env=quiet_env(TLTRUN_TEST_ROLLOUT_DELAY="1:not-a-number"),
    )
    assert done.returncode != 0
    # (after rank 0's progress bar on the same terminal line, hence no line-start anchor)
    line = "error: worker rank 1: ValueError: could not convert string to float: 'not-a-number'"
    assert line in done.stderr, done.stderr[-3000:]
    # torchrun's summary: rank 1 with its error file's traceback
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", done.stderr)
    assert "error.json" in done.stderr and "_test_rollout_delay" in done.stderr
    assert "_test_rollout_delay" in (out / "worker_errors.log").read_text()


@pytest.mark.slow
def test_spot_training_with_seven_workers_completes(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Above the old cap (2^W - 1 groups up front, W <= 6): rank 6 is held back 4 s, so ranks
    0-5 finish first and spot-train together in groups created when needed."""
    monkeypatch.setenv("TLTRUN_TEST_ROLLOUT_DELAY", "6:4")
    out = tmp_path / "run"
    cfg = config(
        model_dir, out, num_workers=7, num_steps=1, prompts_per_step=7, group_size=2,
        max_new_tokens=16, prompt_split=(), max_running_requests=None,
    )  # fmt: skip
    run_train(cfg, TASK)
    (row,) = rows(out)
    assert row["drafter_updates"] >= 1 and len(set(row["drafter_sha1"])) == 1
    trainers = {t for decisions in row["spot_decisions"] for d in decisions for t in d["trainers"]}
    assert len(trainers) >= 2  # a subset group of several ranks trained together
    assert row["spot_decisions"][6] == []  # the last finisher never idles


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_sigkill_of_one_rank_ends_the_job_and_resume_loses_no_step(model_dir, tmp_path):  # noqa: F811
    flags = ["--num-steps", "4", "--no-spot-training"]
    reference = tmp_path / "reference"
    done = subprocess.run(
        torchrun(2, model_dir, reference, *flags), capture_output=True, text=True, timeout=300,
        env=quiet_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "killed"
    # rank 1 takes 2 s more per rollout: time to kill it between checkpoints
    env = quiet_env(TLTRUN_TEST_ROLLOUT_DELAY="1:2")
    job = subprocess.Popen(
        torchrun(2, model_dir, out, *flags),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        marker = out / "ckpt" / "step_000001" / "state.json"
        deadline = time.monotonic() + 180
        while not marker.is_file() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        ranks = children(job.pid)  # torchrun's agent starts one process per rank
        assert job.poll() is None and len(ranks) == 2, "the job ended before the kill"
        os.kill(max(ranks), signal.SIGKILL)
        t0 = time.monotonic()
        _, stderr = job.communicate(timeout=120)  # no hang: the agent ends the job
        assert job.returncode != 0 and time.monotonic() - t0 < 60
        assert "SIGKILL" in stderr and "rank" in stderr  # torchrun's summary names the rank
        assert not (out / "final").exists(), "the kill came too late"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    resumed = subprocess.run(
        torchrun(2, model_dir, out, *flags, "--resume"), capture_output=True, text=True,
        timeout=300, env=quiet_env(),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [deterministic(r) for r in rows(out)] == [deterministic(r) for r in rows(reference)]
    a = (out / "final" / "actor" / "model.safetensors").read_bytes()
    assert a == (reference / "final" / "actor" / "model.safetensors").read_bytes()


def test_launch_fields_unknown_to_this_torch_are_left_out(monkeypatch):
    # torch 2.11's LaunchConfig has no shutdown_timeout (the H200 image of session 23 raised
    # TypeError there); the local launcher passes only what this torch's LaunchConfig takes
    from dataclasses import dataclass

    import torch.distributed.launcher.api as launcher_api

    from tltrun.train.elastic import _launch_fields

    @dataclass
    class NewerLaunchConfig:  # the fields torch 2.13 has, in part
        min_nodes: int
        shutdown_timeout: int

    @dataclass
    class OlderLaunchConfig:  # the fields torch 2.11 has, in part
        min_nodes: int
        max_nodes: int

    # the real class is read at each call (not the installed torch's, whichever that is)
    monkeypatch.setattr(launcher_api, "LaunchConfig", NewerLaunchConfig)
    assert _launch_fields(min_nodes=1, shutdown_timeout=5) == {
        "min_nodes": 1,
        "shutdown_timeout": 5,
    }
    monkeypatch.setattr(launcher_api, "LaunchConfig", OlderLaunchConfig)
    assert _launch_fields(min_nodes=1, shutdown_timeout=5) == {"min_nodes": 1}


@pytest.mark.parametrize(
    ("device", "backend"), [("cuda", "cpu:gloo,cuda:nccl"), ("cuda:1", "cpu:gloo,cuda:nccl"),
                            ("cpu", "gloo")],
)  # fmt: skip
def test_a_cuda_run_keeps_gloo_for_its_cpu_collectives(monkeypatch, device, backend):
    """GRPO's token count, FSDP's microbatch count and the spot trainer's versions are CPU
    tensors, which a NCCL-only default group refuses: a CUDA run's default group is
    per-device (the CUDA recipe test, tests/test_train_data.py, runs a GRPO update through
    it). Here the group's creation is intercepted: this machine has no NCCL."""
    import torch
    import torch.distributed as dist

    from tltrun.train import elastic

    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "h",
                        "MASTER_PORT": 1}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: made.append(b))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    elastic.init_process_group(device)
    assert made == [backend]


@pytest.mark.parametrize("rank", [0, 1])
def test_settings_that_do_not_fit_the_torchrun_world_are_one_line_on_rank_0(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    rank,
):
    """Hunt: a --prompt-split made for another world size failed once per rank with no word of
    the world size, and a --num-workers other than the world size was dropped unsaid."""
    from tltrun.cli.main import main

    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "h",
                        "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "x"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    argv = ["train", "--model-dir", str(model_dir), "--out", str(tmp_path / "o"),
            "--num-workers", "3", "--prompt-split", "1,1,2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    if rank:
        assert err == ""
    else:
        assert "warning: --num-workers 3: not used under torchrun, whose world size (2)" in err
        assert "error: torchrun world size 2: " in err and "--prompt-split (1, 1, 2)" in err
        assert len(err.strip().splitlines()) == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_under_torchrun_is_one_line_on_rank_0_saying_how_to_resume(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    rank,
):
    """Hunt: Ctrl-C to torchrun's agent printed "interrupted" once per rank and never said
    --resume."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "h",
                        "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "x"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_train", interrupted)
    out = tmp_path / "o"
    assert main(["train", "--model-dir", str(model_dir), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    if rank:
        assert err == ""
    else:
        assert err.strip() == (  # (no step ran: none to continue from)
            f"interrupted; it wrote no checkpoint yet (--checkpoint-every): torchrun ... -m "
            f"tltrun train --out {out} --resume starts it again from step 0"
        )


def test_a_bad_flag_under_torchrun_is_not_blamed_on_the_world_size(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """Review: every flag error under torchrun was prefixed "torchrun world size N:"."""
    from tltrun.cli.main import main

    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "h",
                        "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "x"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    argv = ["train", "--model-dir", str(model_dir), "--out", str(tmp_path / "o"), "--lr", "-1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--lr and --drafter-lr in (0, 1.0]" in err and "world size" not in err


@pytest.mark.parametrize("is_deterministic", [False, True])
def test_a_worker_waiting_for_a_lost_nodes_rollout_raises_instead_of_hanging(is_deterministic):
    """Hunt: two torchrun nodes, one SIGKILLed while the other trained the drafter in its idle
    time: the survivor polled the store (alive on its own node) for the lost rank's rollout
    forever. It now raises after the wait timeout, naming the ranks that never finished."""
    import torch.distributed as dist
    from tiny_models import tiny_model

    from tltrun.model.drafter import EagleDrafter
    from tltrun.train.drafter_training import DrafterTrainConfig
    from tltrun.train.spot import SpotTrainer
    from tltrun.train.subset_groups import SubsetGroups
    from tltsim.policy import SpotTrainerPolicy

    store = dist.HashStore()
    drafter = EagleDrafter.for_target(tiny_model(seed=0), seed=1)
    groups = SubsetGroups(store, 0, 5.0)
    groups.groups[(0,)] = OneRank()  # rank 0 alone in its phase: no peer to talk to
    spot = SpotTrainer(0, 2, store, groups, drafter, SpotTrainerPolicy(), DrafterTrainConfig(),
                       seed=0, poll_s=0.01, wait_timeout_s=0.2)  # fmt: skip
    order = spot.announce_done(0)  # rank 1's rollout never ends
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 waited 0 s for the rollouts of rank\(s\) 1 "):
        if is_deterministic:
            spot.run_budget(0, [])
        else:
            spot.run_idle(0, order, [], started)
    assert time.monotonic() - started < 30


class OneRank:
    """A process group of one rank: its collectives change nothing."""

    def all_reduce(self, tensor, op=None):
        return tensor

    def all_gather(self, tensor):
        return [tensor]


def test_a_rank_environment_left_set_without_torchrun_is_not_called_torchrun(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """Hunt: RANK/WORLD_SIZE left exported (no torchrun agent) gave '--num-workers 2: not used
    under torchrun' and then '(--num-workers 1 is not used)': two warnings that contradicted
    each other; the launcher's own (joining that job as one rank) stays."""
    from tltrun.cli.main import main

    for name, value in {"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "h", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = ["train", "--model-dir", str(model_dir), "--out", str(tmp_path / "o"),
            "--num-workers", "3", "--prompt-split", "1,1,2"]  # fmt: skip
    assert main(argv) == 2
    assert "not used under torchrun" not in capsys.readouterr().err


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_refusal_every_rank_finds_is_said_once_per_node(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    local_rank,
):
    """Hunt: two nodes of two processes, one node started with another --lr: each node's log
    held the refusal twice (run_train's refusals skipped the one-rank-per-node rule)."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    for name, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": 2,
                        "MASTER_ADDR": "h", "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "x"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))

    def refused(*args, **kwargs):
        raise UsageError("rank 1 was started with other settings than rank 0 (--lr 1 vs 2)")

    monkeypatch.setattr(launch, "run_train", refused)
    argv = ["train", "--model-dir", str(model_dir), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert said == ("" if local_rank else "error: rank 1 was started with other settings than "
                    "rank 0 (--lr 1 vs 2)\n")  # fmt: skip
