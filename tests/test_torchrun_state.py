"""torch.distributed checkpoints and FSDP2 sharding of ``tltrun train`` (issue #19), CPU / gloo,
tiny model: DCP actor and async drafter checkpoints round-trip; a checkpoint names the world size
that wrote it and a 2-rank run resumes on 3 ranks; FSDP2-sharded GRPO gives the replicated actor,
and ``--fsdp-size`` shards the actor of a real ``tltrun train`` run.

Run: ``python -m pytest tests/test_torchrun_state.py -q`` (the slow ones start torchrun jobs of 2-3
processes that import torch).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_torchrun import quiet_env, torchrun
from test_train import TASK, config, deterministic, model_dir, rows  # noqa: F401 (a fixture)

from tltrun.train.launch import run_train

# ---- DCP checkpoints ---------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A gloo process group of this test process alone (world size 1)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def _stepped(seed: int):
    """A tiny actor and its AdamW after one step on seeded random gradients."""
    import torch
    from tiny_models import tiny_model

    from tltrun.train.grpo import GRPOConfig, make_optimizer

    model = tiny_model(seed=seed).train()
    optimizer = make_optimizer(model, GRPOConfig(lr=1e-2))
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    return model, optimizer


def test_dcp_actor_and_async_drafter_round_trip(one_rank_group, tmp_path):
    import torch

    from tltrun.train import checkpoint as ckpt_io

    model, optimizer = _stepped(seed=0)
    ckpt_io.save_actor(model, optimizer, tmp_path / "dcp", one_rank_group)
    drafter, drafter_opt = _stepped(seed=1)
    meta = {"version": 7, "update_s": 0.25}
    future = ckpt_io.save_drafter_async(
        drafter, drafter_opt, meta, tmp_path / "drafter_dcp", one_rank_group
    )
    saved = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():  # training goes on while the write runs: the staged copy is kept
        for p in drafter.parameters():
            p.add_(1.0)
    future.result()

    fresh, fresh_opt = _stepped(seed=2)  # other weights and moments, all overwritten
    ckpt_io.load_actor(fresh, fresh_opt, tmp_path / "dcp", one_rank_group)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    # the same next step: identical weights after one more step on identical gradients
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        a.grad = torch.full_like(a, 0.5)
        b.grad = torch.full_like(b, 0.5)
    optimizer.step()
    fresh_opt.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)

    other, other_opt = _stepped(seed=3)
    loaded = ckpt_io.load_drafter(other, other_opt, tmp_path / "drafter_dcp", one_rank_group)
    assert loaded == meta
    for name, tensor in saved.items():
        assert torch.equal(other.state_dict()[name], tensor), name


def test_checkpoint_names_the_world_size_that_wrote_it(tmp_path):
    """A checkpoint of 3 ranks needs 3 rank files whatever the resuming world size."""
    from test_run_integrity import fake_checkpoint

    from tltrun.train import state as ts

    ckpt = fake_checkpoint(tmp_path, 2)  # rank files of 2 workers
    ts.write_state(ckpt, 2, num_workers=3)
    assert ts.verify_checkpoint(ckpt, 2) == [
        "rank2.pt: not in the manifest",
        "policy_rank2.json: not in the manifest",
    ]
    ts.write_state(ckpt, 2, num_workers=2)
    assert ts.verify_checkpoint(ckpt, 3) == []  # resumable on 3 ranks


@pytest.mark.slow
def test_resume_a_two_rank_checkpoint_on_three_ranks(model_dir, tmp_path):  # noqa: F811
    """torchrun, 2 ranks, 2 steps; then --resume on 3 ranks (--override-config: the world size
    changes the prompt split) for 2 more steps, twice from copies of the same directory: the
    log has every step once, the new steps have 3 ranks with one actor, and both resumes agree
    (rank 2, absent from the checkpoint, starts from the seeded streams of a fresh run)."""
    out = tmp_path / "run"
    done = subprocess.run(
        torchrun(2, model_dir, out), capture_output=True, text=True, timeout=300, env=quiet_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    results = []
    for run_dir in (out, copy):
        resumed = subprocess.run(
            [*torchrun(3, model_dir, run_dir, "--num-steps", "4", "--resume", "--override-config")],
            capture_output=True, text=True, timeout=300, env=quiet_env(),
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        log = rows(run_dir)
        assert [r["step"] for r in log] == [0, 1, 2, 3]
        assert [len(r["actor_sha1"]) for r in log] == [2, 2, 3, 3]
        assert all(len(set(r["actor_sha1"])) == 1 for r in log)
        history = [
            json.loads(x) for x in (run_dir / "config_history.jsonl").read_text().splitlines()
        ]
        assert history[0]["diff"]["train.num_workers"] == [2, 3]
        results.append([deterministic(r) for r in log])
    assert results[0] == results[1]


# ---- FSDP2 -------------------------------------------------------------------------------------

FSDP_SCRIPT = """
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from tiny_models import tiny_model
from tltrun.train.fsdp import full_state_dict, shard_actor
from tltrun.train.grpo import GRPOConfig, Sample, grpo_update, make_optimizer

torch.set_num_threads(1)
dist.init_process_group("gloo")
r = dist.get_rank()
gen = torch.Generator().manual_seed(100 + r)
samples = []
for g in range(1 + 2 * r):  # rank 1 has 3x the groups: more micro-batches than rank 0
    prompt = tuple(torch.randint(4, 90, (5,), generator=gen).tolist())
    for _ in range(4):
        n = int(torch.randint(2, 30, (1,), generator=gen))
        resp = tuple(torch.randint(4, 90, (n,), generator=gen).tolist())
        samples.append(Sample(f"r{r}g{g}", prompt, resp, float(torch.rand(1, generator=gen))))
cfg = GRPOConfig(lr=1e-2, kl_coef=0.0, num_epochs=2, max_batch_tokens=64)


def all_reduce_sum(t):
    dist.all_reduce(t)
    return t


start = tiny_model(seed=0).state_dict()
replicated = tiny_model(seed=0).train()
replicated_opt = make_optimizer(replicated, cfg)
sharded = shard_actor(tiny_model(seed=0).train())
sharded_opt = make_optimizer(sharded, cfg)
for _ in range(2):
    a = grpo_update(replicated, None, replicated_opt, samples, cfg, 1.0, 0, all_reduce_sum)
    b = grpo_update(sharded, None, sharded_opt, samples, cfg, 1.0, 0, all_reduce_sum)
full = full_state_dict(sharded)
ref = replicated.state_dict()
close = all(torch.allclose(full[k], v, rtol=1e-4, atol=1e-5) for k, v in ref.items())
moved = max((v - start[k]).abs().max().item() for k, v in ref.items())
local = sum(p.to_local().numel() for p in sharded.parameters())
total = sum(p.numel() for p in replicated.parameters())
with open(f"{sys.argv[2]}/rank{r}.txt", "w") as fh:  # (one file per rank: no interleaving)
    fh.write(f"{r} {close} {moved} {local} {total} {a['loss']} {b['loss']}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_sharded_grpo_gives_the_replicated_actor(tmp_path):
    """2 ranks, gloo: two GRPO steps (2 epochs each) of an FSDP2-sharded actor and of the
    replicated data-parallel one on the same per-rank samples (rank 1 with 3x the micro-batches)
    end in the same weights; each rank holds about half of them."""
    script = tmp_path / "fsdp_grpo.py"
    script.write_text(FSDP_SCRIPT)
    tests_dir = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), tests_dir, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=quiet_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    for _, close, moved, local, total, loss_a, loss_b in lines:
        assert close == "True" and float(moved) > 1e-3  # the same actor, and it did train
        assert int(local) < 0.6 * int(total)  # sharded: about half the parameters per rank
        assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_fsdp_size_shards_the_actor_of_tltrun_train(model_dir, tmp_path):  # noqa: F811
    """--fsdp-size 2: the workers train an FSDP2-sharded actor, gather it into their engines
    after each step and save it whole — the same rollouts and (allclose) the same final actor
    as the replicated run. Greedy NoSpec rollouts: equal weights <=> equal rollouts."""
    import torch

    from tltrun.model.hf_checkpoint import read_safetensors

    logs, weights = {}, {}
    for fsdp in (1, 2):
        out = tmp_path / f"fsdp{fsdp}"
        cfg = config(model_dir, out, num_steps=2, temperature=0.0, fsdp_size=fsdp,
                     is_spot_training=False, checkpoint_every=1)  # fmt: skip
        run_train(cfg, TASK)
        logs[fsdp] = rows(out)
        weights[fsdp] = read_safetensors(out / "final" / "actor")
    # step 0's rollout precedes any update; step 1's follows the first, sharded, update
    assert [r["rollout_sha1"][0] for r in logs[2]][:1] == [r["rollout_sha1"][0] for r in logs[1]][
        :1
    ]
    assert [r["loss"] for r in logs[2]] == pytest.approx(
        [r["loss"] for r in logs[1]], rel=1e-4, abs=1e-7
    )
    moved = max(
        float((weights[1][k] - read_safetensors(model_dir)[k]).abs().max()) for k in weights[1]
    )
    assert moved > 1e-3  # the actor really trained
    for name, full in weights[1].items():
        torch.testing.assert_close(weights[2][name], full, rtol=1e-4, atol=1e-5)
    assert len(set(logs[2][-1]["actor_sha1"])) == 1  # every engine got the same gathered weights
