"""Process groups of rank subsets for spot drafter training (tltrun.train.spot): a set's gloo
communicator created by its members only, under a store prefix named by the set
(``SubsetGroup``), kept per set (``SubsetGroups``), and an optimiser whose step first averages
the gradients over one (``AveragedOptimizer``). The spot trainer's no-deadlock argument (its
module docstring) covers their creation like any other collective of a set.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from tltrun.model.transformer import reduce_grads


class SubsetGroup:
    """A gloo communicator of one rank set, created by its members only: a
    ``dist.ProcessGroupGloo`` that rendezvouses under a store prefix named by its ranks.

    Not ``dist.new_group``: that is a collective of EVERY rank (which would wait for the ranks
    still rolling out), and with ``use_local_synchronization=True`` it names the group by a
    hash of its ranks AND the number of groups the calling rank created before, so two members
    that met different subsets earlier derive different names and wait for each other forever
    (seen on torch 2.13: rank 0 alone creating {0}, then {0, 1} with rank 1, hangs). The name
    here depends on the rank set only. Gloo also reduces CUDA tensors (the drafter's gradients
    on GPUs), through host copies: the drafter is small."""

    def __init__(self, store: dist.Store, rank: int, ranks: tuple[int, ...], timeout_s: float):
        self.rank, self.ranks = rank, ranks
        prefix = dist.PrefixStore("spot-group/" + "_".join(map(str, ranks)), store)
        self.pg = dist.ProcessGroupGloo(
            prefix, ranks.index(rank), len(ranks), timedelta(seconds=timeout_s)
        )

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([tensor], opts).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor``, in the order of ``ranks``."""
        rows = [torch.zeros_like(tensor) for _ in self.ranks]
        self.pg.allgather([rows], [tensor]).wait()
        return rows

    def broadcast_object(self, obj, src: int):
        """``obj`` of global rank ``src`` on every member (pickled, as broadcast_object_list)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        data = (
            torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            if self.rank == src
            else None
        )
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.long)
        self.pg.broadcast([size], opts).wait()
        if data is None:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.pg.broadcast([data], opts).wait()
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())


class SubsetGroups:
    """The ``SubsetGroup`` of a rank set, created the first time its members need it and kept.

    Creating one is a collective of its members only, so a phase's group is created by exactly
    the ranks that then use it, at the same point of the protocol: phase entry for the phase's
    members, after the decision for its trainers; the protocol's no-deadlock argument covers it
    like any other collective of the group (every member of a set has created it, or none has,
    so the cache agrees across its members). A run creates only the sets it meets (at most W
    phase sets and W trainer sets per step), not all 2^W - 1 up front: W is not capped."""

    def __init__(self, store: dist.Store, rank: int, timeout_s: float):
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.groups: dict[tuple[int, ...], SubsetGroup] = {}

    def __getitem__(self, ranks) -> SubsetGroup:
        key = tuple(sorted(ranks))
        if key not in self.groups:
            self.groups[key] = SubsetGroup(self.store, self.rank, key, self.timeout_s)
        return self.groups[key]


class AveragedOptimizer:
    """Wraps an optimiser: ``step`` first averages the gradients over ``group``."""

    def __init__(self, inner: torch.optim.Optimizer, group, size: int):
        self.inner, self.group, self.size = inner, group, size

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        params = [p for g in self.inner.param_groups for p in g["params"]]
        if self.size > 1:
            reduce_grads(params, self._average)
        self.inner.step()

    def _average(self, flat: torch.Tensor) -> None:
        self.group.all_reduce(flat)
        flat /= self.size
