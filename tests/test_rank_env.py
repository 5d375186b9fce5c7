"""How ``tltrun train`` reads a torch.distributed job from the environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when torchrun's agent did not set it (a
Kubernetes pod, a SLURM script, a leftover shell export): bad values are one line naming the
variable; a process that joins such a job says so; rank 0's setup failure of any kind stops
every rank with one line each (an OSError left rank 1 failing in the broadcast, reported as an
internal error).

Run: ``python -m pytest tests/test_rank_env.py -q`` (the job test starts two processes that
import torch: ~5 s on 2 cores).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from test_train import model_dir  # noqa: F401 (a fixture)

from tltrun.train import elastic
from tltsim.errors import UsageError


def job_env(monkeypatch, **values: str) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in {**base, **values}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"RANK": "abc"}, "RANK='abc': expected an integer >= 0"),
        ({"MASTER_PORT": "notaport"}, "MASTER_PORT='notaport': expected an integer in 1..65535"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected an integer >= 1"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
        ({"RANK": "3"}, "RANK=3 WORLD_SIZE=2: a rank must be below the world size"),
    ],
)
def test_bad_rank_variables_are_one_line(monkeypatch, values, message):
    job_env(monkeypatch, **values)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(".", r"\.")):
        elastic.rank_env()


def test_good_rank_variables_and_the_agent_marker(monkeypatch):
    job_env(monkeypatch, RANK="1", LOCAL_RANK="1")
    env = elastic.rank_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 29500)
    assert not elastic.is_torchrun_agent()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert elastic.is_torchrun_agent()
    monkeypatch.delenv("MASTER_PORT")
    assert elastic.rank_env() is None  # not a job: tltrun's own launcher starts the workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_zero_os_error_stops_both_ranks_with_one_line_each(model_dir, tmp_path):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "run"  # mkdir raises NotADirectoryError: an OSError, not a TLTError
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
        cmd = [sys.executable, "-m", "tltrun.cli.main", "train", "--model-dir", str(model_dir),
               "--out", str(out), "--num-steps", "1", "--num-threads", "1",
               "--max-new-tokens", "16"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=240)[1] for p in procs]
    for rank, (proc, err) in enumerate(zip(procs, errs, strict=True)):
        assert proc.returncode != 0, err
        assert "internal error" not in err and "Traceback" not in err, err
        # the leftover-variables line: which job it joins and that --num-workers is not used
        assert f"warning: RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1" in err, err
        assert "(--num-workers is not used: WORLD_SIZE is the number of workers)" in err, err
    assert "Not a directory" in errs[0], errs[0]
    assert "error: rank 1: rank 0 stopped the run" in errs[1], errs[1]


def test_a_rank_takes_the_first_ctrl_c_and_ignores_the_agents_repeat():
    """Ctrl-C reaches a rank from the terminal and again from torchrun's agent; the second
    KeyboardInterrupt hit the progress bar's cleanup and printed tqdm's "Exception ignored in"
    traceback. In a child process: the first SIGINT raises, the second is ignored."""
    code = (
        "import os, signal\n"
        "from tltrun.train.elastic import interrupt_once\n"
        "interrupt_once()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    signal.pause()\n"
        "except KeyboardInterrupt:\n"
        "    print('first', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('second ignored', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["first", "second", "ignored"]


def test_a_torchrun_rank_s_resume_hint_names_torchrun(tmp_path, monkeypatch):
    """Hunt: a rank of a torchrun job that failed said to go on with ``tltrun train --out X
    --resume``, which starts the workers on one machine only."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic.train_resume_hint(tmp_path).endswith(
        f"tltrun train --out {tmp_path} --resume starts it again from step 0"
    )
    assert "torchrun ..." not in elastic.train_resume_hint(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert elastic.train_resume_hint(tmp_path).endswith(
        f"torchrun ... -m tltrun train --out {tmp_path} --resume starts it again from step 0"
    )
