"""FSDP2 sharding of the actor over the training ranks (``torch.distributed.fsdp.fully_shard``):
each decoder layer is one FSDP unit and the root holds the embeddings, final norm and LM head,
so a rank keeps 1/W of the parameters, gradients and AdamW state and gathers one layer at a time
in forward and backward. tltrun.train.grpo.grpo_update trains a sharded actor as it trains a
replicated one (every rank runs the same number of micro-batches, FSDP's
reduce-scatter reduces the gradients); ``full_state_dict`` gathers the full weights a rollout
engine loads after each step (the resharding veRL and TLT do between training and rollout).

``tltrun train --fsdp-size W`` (W = the number of workers; 1 keeps the actor replicated) shards
the workers' actor; tests/test_torchrun_state.py checks that a sharded GRPO update, and a sharded
``tltrun train`` run, give the actor of the replicated data-parallel one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def shard_actor(actor: torch.nn.Module, device: str = "cpu"):
    """Shard ``actor`` in place over a 1-D mesh of every rank. FSDP2 AVERAGES the gradients
    over the mesh (gloo has no PREMUL_SUM for a divide factor of 1), while GRPO's loss is
    already normalised by the global token count and wants their SUM: grpo_update scales a
    sharded actor's loss by ``gradient_scale``. (A mesh of fewer ranks than the world, HSDP,
    is not implemented.)"""
    size = dist.get_world_size()
    # FSDP2 shards row-contiguous parameters only: undo gemm_layout's column-major weights
    # (a decoding speed-up; the rollout engine's own copy keeps it)
    for param in actor.parameters():
        param.data = param.data.contiguous()
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (size,))
    for layer in actor.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(actor, mesh=mesh)
    return actor


def gradient_scale(actor: torch.nn.Module) -> float:
    """The loss factor that turns FSDP2's gradient average into the sum (the mesh size)."""
    return float(dist.get_world_size()) if isinstance(actor, FSDPModule) else 1.0


def full_state_dict(actor: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights (a collective: every rank of the mesh calls it)."""
    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in actor.state_dict().items()
    }


def max_over_ranks(value: int) -> int:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0])
