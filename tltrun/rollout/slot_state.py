"""The torch engine's per-slot state outside the model: what a finished request leaves for
drafter training (``HarvestRecord``), moving running sequences to new slots when the scheduler
compacts, and loading new weights into a live engine in place.

Each is a plain function of the tensors it touches, so the engine's step loop
(``tltrun.rollout.engine``) reads as the loop and these stay testable on their own.

In-place loading matters on a GPU (issue #18): captured CUDA graphs read the parameters'
storage, so a weight sync must copy into that storage rather than swap tensors; the same code
runs on CPU, where the engine tests compare generation after an update with a fresh engine.

Run the tests: ``python -m pytest tests/test_engine.py tests/test_engine_paths.py -q``.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from tltrun.model.kvcache import KVCache
from tltrun.rollout.scheduler import Sequence


@dataclass(frozen=True, kw_only=True)
class HarvestRecord:
    """One finished request, for drafter training: hidden[p] is the target's post-norm hidden
    state after reading token_ids[p] (so it predicts token_ids[p + 1])."""

    request_id: str
    token_ids: torch.Tensor  # (T,) long, prompt then response
    num_prompt_tokens: int
    hidden: torch.Tensor  # (T-1, C)


def harvest_record(seq: Sequence, hidden: torch.Tensor) -> HarvestRecord:
    """The record of a finished sequence, read from the engine's hidden states by position
    (``hidden``: (slots, max_tokens, C)) before its slot is released."""
    n = seq.num_tokens
    ids = torch.tensor(list(seq.request.prompt_token_ids) + seq.output, dtype=torch.long)
    return HarvestRecord(
        request_id=seq.request.id,
        token_ids=ids,
        num_prompt_tokens=seq.num_prompt_tokens,
        hidden=hidden[seq.slot, : n - 1].detach().cpu().clone(),  # (T-1, C)
    )


def move_slots(
    moves: list[tuple[int, int]],
    caches: tuple[KVCache | None, ...],
    tokens: torch.Tensor,
    hidden: torch.Tensor | None,
) -> None:
    """Copy running sequences' per-slot state (KV caches and lengths, tokens, hidden states)
    from ``src`` to ``dst`` slots (``Scheduler.compact``; sources and destinations are
    disjoint). The first cache is the target's: its lengths bound what is copied."""
    device = tokens.device
    src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=device)
    dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=device)
    width = int(caches[0].lens[src].max()) + 1  # + the pending token / its hidden state
    for cache in caches:
        if cache is not None:
            cache.copy_positions(src, dst, width)
            cache.lens[dst] = cache.lens[src]
            cache.lens[src] = 0
    tokens[dst] = tokens[src]
    if hidden is not None:
        w = min(width, hidden.shape[1])
        hidden[dst, :w] = hidden[src, :w]


def load_in_place(
    module: torch.nn.Module, state_dict: dict[str, torch.Tensor], what: str, drop: AbstractSet[str]
) -> None:
    """Copy ``state_dict`` into ``module``'s existing parameter storage (names and shapes must
    match exactly, except the names in ``drop``); ValueError names the first mismatches, and
    then nothing was copied."""
    own = module.state_dict()
    shapes = {k: tuple(v.shape) for k, v in own.items()}
    for name, tensor in check_state_dict(shapes, state_dict, what, drop).items():
        own[name].copy_(tensor)


def check_state_dict(
    shapes: Mapping[str, tuple[int, ...]],
    state_dict: Mapping[str, torch.Tensor],
    what: str,
    drop: AbstractSet[str],
) -> dict[str, torch.Tensor]:
    """``state_dict`` less the names in ``drop``, if its names and shapes are exactly those of
    ``shapes`` (less ``drop``); else ValueError naming the first mismatches. Checked whole
    before any copy: a weight sync is applied completely or not at all."""
    given = {k: v for k, v in state_dict.items() if k not in drop}
    unexpected = sorted(set(given) - set(shapes))
    missing = sorted(set(shapes) - set(given) - drop)
    if unexpected or missing:
        raise ValueError(f"{what} weights: unexpected {unexpected[:3]}, missing {missing[:3]}")
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(
                f"{what} weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}"
            )
    return given
