"""The distributed part of a ``tltrun train`` checkpoint: torch.distributed.checkpoint (DCP).

* ``dcp/``: the actor's weights and AdamW state, keyed by parameter name
  (``torch.distributed.checkpoint.state_dict.get_state_dict``: the same keys whether the actor
  is replicated or sharded), saved by every rank together (``dcp.save``: replicated tensors
  are written once). DCP loads them into any world size: a run resumed on 3 ranks from a
  2-rank checkpoint reads the same tensors (the prompt split, hence later steps, follow the new
  world size).
* ``drafter_dcp/``: the spot trainer's drafter, its AdamW state, version and seconds per
  update, saved with ``dcp.async_save``: the copy is staged (cloned) at once and written by a
  background thread while the next rollout runs (TLT, arXiv 2511.16665, checkpoints its drafter
  asynchronously so that preemption costs little). The checkpoint directory is committed only
  after that write finished on every rank (tltrun.train.worker.Worker._finish_checkpoint), so
  a kill meanwhile leaves the previous checkpoint as the newest complete one.

Both go through their own gloo process group (``checkpoint_group``): DCP's background thread
then never interleaves its collectives with the training loop's on the default group. The
drafter's vLLM-layout copy in the run directory is swapped in by renames
(``export_drafter_atomic``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map_only

from tltrun.train.state import effective_config
from tltsim.errors import TLTError

ACTOR_DCP = "dcp"
DRAFTER_DCP = "drafter_dcp"


class CheckpointWriteError(TLTError):
    """A checkpoint could not be written (one line: which, where, why, and the free space)."""


# What gloo's errors say when the peer of a collective died (DCP's save gathers over every
# rank): a dead peer, not a full disk (hunt: a SIGKILLed node was reported as "full?").
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


@contextlib.contextmanager
def explain_write_failure(ckpt_dir: Path) -> Iterator[None]:
    """Turn a failed write under ``ckpt_dir`` into a CheckpointWriteError. A full disk reached
    users as torch's zip writer's "[enforce fail at inline_container.cc:672] . unexpected pos
    704 vs 598" inside DCP's CheckpointException (a BaseException, listing each rank's
    failure): the message now says where the write failed and how much space is left there."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as err:
        cause = err
        if isinstance(err, CheckpointException) and err.failures:
            cause = next(iter(err.failures.values()))[0]  # (exception, stack summary) per rank
        text = (str(cause).strip().splitlines() or [""])[0][:200]
        if any(mark in str(cause) for mark in LOST_PEER):  # a rank died mid-write: not the disk
            raise CheckpointWriteError(
                f"checkpoint {ckpt_dir}: writing failed because another rank was lost during "
                f"it ({type(cause).__name__}: {text})"
            ) from err
        where = ckpt_dir
        while not where.exists() and where != where.parent:
            where = where.parent
        free_mib = shutil.disk_usage(where).free / 2**20
        raise CheckpointWriteError(
            f"checkpoint {ckpt_dir}: writing failed ({type(cause).__name__}: {text}); the file "
            f"system holding it has {free_mib:,.1f} MiB free (full? free space, or keep fewer "
            f"checkpoints with --keep-checkpoints N, then --resume)"
        ) from err


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every rank for DCP (a collective: every rank calls it, at start-up)."""
    return dist.new_group(backend="gloo")


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # (an optimizer that has not stepped yet gets its zero state first: DCP needs the keys)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_actor(model, optimizer, path: Path, group: dist.ProcessGroup) -> None:
    """Actor weights + AdamW state into ``path`` (every rank calls it)."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(path), process_group=group)


def load_actor(model, optimizer, path: Path, group: dist.ProcessGroup) -> None:
    """``save_actor``'s state into ``model`` and ``optimizer`` (every rank, any world size)."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group's learning rate (a loaded optimizer state brings the saved one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def save_drafter_async(
    drafter, optimizer, meta: dict[str, float], path: Path, group: dist.ProcessGroup
) -> Future:
    """Start writing the drafter, its AdamW state and ``meta`` (version, update_s) into
    ``path``; returns DCP's future (``result()`` waits for the write). The tensors are cloned
    first: spot training goes on changing the live ones while the write runs."""
    state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), _state(drafter, optimizer))
    state["meta"] = dict(meta)
    return dcp.async_save(state, checkpoint_id=str(path), process_group=group)


def load_drafter(drafter, optimizer, path: Path, group: dist.ProcessGroup) -> dict[str, float]:
    """``save_drafter_async``'s state into ``drafter`` and ``optimizer``; returns its meta."""
    state = _state(drafter, optimizer)
    state["meta"] = {"version": 0, "update_s": 0.0}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(
        drafter, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state["meta"]


# ---- the SD policy's state ----------------------------------------------------------------


def save_policy_state(ckpt_dir: Path, rank: int, policy) -> None:
    """``policy.state_dict()`` as ``ckpt_dir/policy_rank{rank}.json`` (``write_state`` fsyncs it)."""
    (ckpt_dir / f"policy_rank{rank}.json").write_text(json.dumps(policy.state_dict()) + "\n")


def load_policy_state(ckpt_dir: Path, rank: int, policy) -> None:
    """Restore ``save_policy_state``'s file into ``policy`` (built from the run's config)."""
    path = ckpt_dir / f"policy_rank{rank}.json"
    if not path.is_file():
        from tltrun.model.config import CheckpointError

        raise CheckpointError(
            f"{path}: missing (a checkpoint written before policies were saved as state_dict(); start the run afresh)"
        )
    policy.load_state_dict(json.loads(path.read_text()))


def is_reward_mode_kept(out: Path, step: int, is_deterministic: bool) -> bool:
    """Whether the SD policy state of checkpoint ``step`` was learned in the reward mode the run
    has now: --deterministic's modelled costs or the clock's seconds (a resume that switched
    starts the policy afresh: its bandit windows held both units)."""
    learned = effective_config(out, before_step=step)
    if learned is None:
        return True
    return bool(learned["train"].get("is_deterministic", False)) == is_deterministic


def export_drafter_atomic(drafter, dest: Path) -> None:
    """export_vllm into a temporary directory, then swap it in by renames."""
    from tltrun.model.drafter import export_vllm

    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)  # a kill mid-swap left it: the rename needs it gone
    export_vllm(drafter, tmp)
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
