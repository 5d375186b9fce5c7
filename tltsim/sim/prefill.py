"""What the simulator's prefills cost: admitting requests (one prefill of the leaders' prompts, a
forward over the followers' uncached prompt tails) and the SD switch's re-prefill of the running
requests, each priced by the cost model as equal sequences that attend over the same pairs.

Used by ``tltsim.sim.instance.InstanceRollout``; plain functions of arrays and a cost model.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def attention_seqs(lengths: np.ndarray) -> float:
    """The sequences a prefill of prompts of ``lengths`` is priced as. Cost models price a
    batch's attention as N tokens split evenly over S sequences (N(N/S + 1)/2 pairs), exact for
    equal lengths; uneven ones attend over sum(n_i(n_i + 1)/2) pairs, up to S times more, so a
    long prompt got cheaper when a short one joined it (and its rollout fell below the ideal
    bound). N^2 / sum(n_i^2) sequences (in [1, S], S for equal lengths) give the exact pairs."""
    n = lengths.astype(np.float64)
    return float(n.sum() ** 2 / float((n * n).sum()))


def shared_tokens(prompts: np.ndarray, block: int) -> np.ndarray:
    """Prompt tokens a follower reuses from its group's cached prompt: whole ``block``-token
    blocks, short of the last token."""
    return (prompts - 1) // block * block


def admission_s(
    cost: Any, prompts: np.ndarray, cached: np.ndarray, lead: np.ndarray, is_padded: bool
) -> float:
    """Seconds to admit requests of ``prompts`` tokens: one prefill of the ``lead`` ones, and
    for the others (followers reusing ``cached`` tokens) a decode-shaped forward when one token
    is left (tltrun's torch engine), else a prefill on top of the cached blocks (vLLM's prefix
    cache). A padded engine computes every sequence at the longest one's length."""
    dt = 0.0
    if lead.any():
        p = prompts[lead]
        num = p.size * int(p.max()) if is_padded else int(p.sum())
        dt += cost.prefill_s(num, 0.0, int(p.size) if is_padded else attention_seqs(p))
    if not lead.all():
        have, new = cached[~lead], prompts[~lead] - cached[~lead]
        ctx = have.size * int(have.max()) if is_padded else int(have.sum())
        if int(new.max()) == 1:
            dt += cost.decode_iter_s(int(have.size), float(ctx), 1)
        else:
            num = new.size * int(new.max()) if is_padded else int(new.sum())
            seqs = int(new.size) if is_padded else attention_seqs(new)
            dt += cost.prefill_s(num, float(ctx), seqs)
    return dt


def reprefill_work(
    contexts: np.ndarray,
    groups: np.ndarray | None,
    prompts: np.ndarray,
    block: int,
    is_padded: bool,
) -> tuple[float, float]:
    """(sequences, tokens) of the SD switch's drafter re-prefill over running requests of
    ``contexts`` tokens: each one's context, less the shared prompt blocks for all but one
    running response of a group (``groups``: each request's prompt index, None without prompt
    sharing; tltrun's re-prefill feeds a group's prompt once), priced as ``attention_seqs``
    equal sequences (the even split gave a long context's pairs to the short ones). A padded
    engine re-prefills the batch at its longest context."""
    b = contexts.size
    if is_padded:
        contexts = np.full(b, contexts.max())
    saved = np.zeros(b)
    if groups is not None:
        order = np.argsort(groups, kind="stable")
        is_follower = np.zeros(b, dtype=bool)
        is_follower[order[1:]] = groups[order[1:]] == groups[order[:-1]]
        saved[is_follower] = shared_tokens(prompts[is_follower], block)
    if is_padded:
        return float(b), max(float(b), float(contexts.sum() - saved.sum()))
    lengths = contexts - saved
    return attention_seqs(lengths), float(lengths.sum())


__all__ = ["admission_s", "attention_seqs", "reprefill_work", "shared_tokens"]
