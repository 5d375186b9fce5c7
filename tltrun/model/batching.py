"""Padded batches of token sequences: which sequences share one forward, and their right-padded
token ids. The rollout engine's prefill (``tltrun.rollout.engine``) and GRPO's micro-batches
(``tltrun.train.grpo``) both run the model over sequences of mixed lengths padded to the
longest one, under a cap on padded tokens per forward (memory, not results: the model masks
each sequence to its own length).

    groups = padded_groups([5, 7, 3, 9], max_padded_tokens=16)   # [[0, 1], [2], [3]]
    ids, lens = right_pad([(1, 2, 3), (4, 5)], pad_id=0)          # (2, 3), tensor([3, 2])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_groups(lengths: Sequence[int], max_padded_tokens: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (members x longest member) stays within
    ``max_padded_tokens``; greedy, in order. A sequence longer than the cap forms a group alone
    (there is no chunking)."""
    groups: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if groups and max(width, n) * (len(groups[-1]) + 1) <= max_padded_tokens:
            groups[-1].append(i)
            width = max(width, n)
        else:
            groups.append([i])
            width = n
    return groups


def right_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded with ``pad_id`` to the longest row, (B, T) long, and each row's
    length, (B,) long, both on ``device``."""
    lens = torch.tensor([len(r) for r in rows], device=device)  # (B,)
    ids = torch.full((len(rows), int(lens.max())), pad_id, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, device=device)
    return ids, lens
