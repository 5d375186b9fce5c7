"""The torch rollout engine's model-free history drafter (issue #20): ``RolloutHistory`` owns the
engine's ``HistoryDrafter`` (``tltrun.model.history_drafter``, kept across rollouts) and the
bookkeeping of the rollout in progress, and turns the drafter's proposals into the
``DraftTree`` that ``tltrun.rollout.speculative.verify`` checks.

The engine calls ``start_rollout`` and ``finish_rollout`` around each rollout and ``draft`` for
every speculative iteration whose decision names ``drafter="history"``; ``tltrun train``'s
checkpoints keep ``state_dict`` (the index reaches across steps: a resume must not forget it).
Indexing is lazy: nothing is indexed until a policy first asks for a history draft; from then on
every rollout is kept. A sequence is keyed by (rollout number, request id) and grouped by its
``prompt_id`` (across rollouts) or, without one, by its prompt tokens within its own rollout:
such a rollout-local group never enters the cross-prompt index and is forgotten when its
rollout ends (``tltrun train``'s evaluation leaves the index as it was).

Run the tests: ``python -m pytest tests/test_history_engine.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter, tree_nodes
from tltrun.rollout.scheduler import Sequence
from tltrun.rollout.speculative import DraftTree
from tltsim.policy import SpecDecision


@dataclass
class _Indexed:
    """What the index holds of the rollout in progress. It catches up lazily (``sync``):
    admission is FIFO, so the admitted sequences are ``sequences[:n]``; the first ``cursor`` of
    them are indexed, ``open`` those still unfinished (by ``Sequence.index``)."""

    number: int  # rollouts started before this one: keys are unique across rollouts
    sequences: list[Sequence]  # the rollout's scheduler.sequences, in admission order
    cursor: int = 0
    open: dict[int, Sequence] = field(default_factory=dict)
    groups: set[tuple] = field(default_factory=set)


class RolloutHistory:
    """The history drafter of one engine, across its rollouts."""

    def __init__(self, config: HistoryConfig):
        self.drafter = HistoryDrafter(config)
        self.is_used = False  # a policy asked for a history draft: every rollout is kept
        self._num_rollouts = 0
        self._rollout: _Indexed | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the index holds (at most ``max_history_tokens`` once all are finished)."""
        return self.drafter.num_tokens

    def state_dict(self) -> dict:
        """What a checkpoint keeps between rollouts: the whole index (its automata, pickled
        as they are, since a rebuild from the strings could break ties differently and so
        draft, and sample, differently after a resume), whether it is in use, and the
        rollout count its keys are numbered by."""
        if self._rollout is not None:
            raise RuntimeError("history state_dict: a rollout is in progress")
        return {
            "drafter": self.drafter,
            "is_used": self.is_used,
            "num_rollouts": self._num_rollouts,
        }

    def load_state_dict(self, state: dict) -> bool:
        """Restore ``state_dict``'s state; False (and nothing restored: the index starts
        empty) when it was written with other history settings."""
        if self._rollout is not None:
            raise RuntimeError("history load_state_dict: a rollout is in progress")
        drafter = state["drafter"]
        if not isinstance(drafter, HistoryDrafter) or drafter.config != self.drafter.config:
            return False
        self.drafter = drafter
        self.is_used = bool(state["is_used"])
        self._num_rollouts = int(state["num_rollouts"])
        return True

    def start_rollout(self, sequences: list[Sequence]) -> None:
        """A rollout of ``sequences`` (its scheduler's, admitted in order) begins."""
        self._rollout = _Indexed(number=self._num_rollouts, sequences=sequences)
        self._num_rollouts += 1

    def finish_rollout(self) -> None:
        """The rollout ends (finished or replaced): once the history drafter has been used,
        keep its sequences (those with a prompt id) as history of later rollouts; drop its
        rollout-local groups. A no-op when none is in progress."""
        rollout, self._rollout = self._rollout, None
        if rollout is None or not self.is_used:
            return
        # rollout-local sequences not indexed yet are not added now only to be dropped: adding
        # them evicted older history (an eval rollout emptied a full index of training prompts)
        self._sync(rollout, is_final=True)
        for seq in rollout.open.values():  # unfinished: a replaced rollout
            self.drafter.finish(_key(rollout, seq))
        for group in rollout.groups:
            if group[0] == "rollout":
                self.drafter.drop_group(group)

    def draft(
        self,
        running: list[Sequence],
        roots: list[int],
        decision: SpecDecision,
        device: torch.device,
        *,
        is_trimmed: bool = False,
        max_drafted: int | None = None,
    ) -> DraftTree:
        """The history drafter's tree for ``running`` (whose pending last tokens are ``roots``)
        under ``decision``: a chain of verify_tokens tokens (topk 1; a chain's verify_tokens is
        its draft_steps), else up to topk continuations with distinct first tokens,
        verify_tokens nodes of them in (depth, branch) order. Point-mass drafts
        (``draft_probs`` None): ``verify`` accepts x with probability p(x). Where the history
        offers fewer tokens the draft is padded (a chain with its last token, a tree with
        copies of the root's first child, which are rejected once that child is): any
        deterministic draft is lossless, padding only costs verify work. ``is_trimmed`` (an
        eager forward, whose shape may change per iteration) pads only up to the batch's
        longest proposal (at least one node), so an iteration where the history matches
        little verifies little (SuffixDecoding's adaptive speculation length, arXiv
        2411.04975, per batch); a CUDA graph needs a fixed shape: ``max_drafted`` nodes, the
        shape of the strategy's verify graph (which EAGLE's tree sets: fewer than verify_tokens
        where its beam offers fewer, 10 for 3_2_12), by default verify_tokens."""
        rollout = self._current()
        self.is_used = True
        self._sync(rollout)
        num_drafted = decision.verify_tokens if max_drafted is None else max_drafted
        proposals = []  # per sequence: (tokens, parents) of its real nodes
        for seq in running:
            key = _key(rollout, seq)
            if decision.is_chain:  # a chain's verify_tokens <= draft_steps
                toks = self.drafter.propose(key, num_drafted)
                proposals.append((toks, list(range(len(toks)))))  # node i's parent is i - 1
            else:
                branches = self.drafter.propose_tree(key, decision.draft_steps, decision.topk)
                proposals.append(tree_nodes(branches, num_drafted))
        if is_trimmed:
            num_drafted = max(1, max(len(toks) for toks, _ in proposals))
        tokens, parents = [], []
        for (toks, pars), root in zip(proposals, roots, strict=True):
            num_pad = num_drafted - len(toks)
            if decision.is_chain:
                pad = toks[-1] if toks else root
                pars = list(range(num_drafted))
            else:
                pad = toks[0] if toks else root
                pars = pars + [0] * num_pad
            tokens.append([root] + toks + [pad] * num_pad)
            parents.append([0] + pars)
        # not checked (a read of device values): padding and ``tree_nodes`` put parents first
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            is_checked=False,
        )

    def _current(self) -> _Indexed:
        if self._rollout is None:
            raise RuntimeError("no rollout in progress: call start_rollout first")
        return self._rollout

    def _sync(self, rollout: _Indexed, *, is_final: bool = False) -> None:
        """Catch the index up on the committed tokens of the rollout's admitted sequences: new
        ones are added, unfinished ones extended by what they emitted since, finished ones
        marked evictable and not visited again. Cost: O(new tokens + unfinished sequences).
        ``is_final`` (the rollout ended): sequences without a prompt id are not added. A
        sequence without one stays out of the cross-prompt index (``HistoryDrafter.add``)."""
        history = self.drafter
        seqs = rollout.sequences
        while rollout.cursor < len(seqs) and seqs[rollout.cursor].slot is not None:
            seq = seqs[rollout.cursor]
            rollout.cursor += 1
            is_kept = seq.request.prompt_id is not None
            if is_final and not is_kept:
                continue
            group = _group(rollout, seq)
            history.add(_key(rollout, seq), group, seq.request.prompt_token_ids, is_shared=is_kept)
            rollout.groups.add(group)
            rollout.open[seq.index] = seq
        for seq in list(rollout.open.values()):
            key = _key(rollout, seq)
            num_indexed = len(history.tokens(key)) - seq.num_prompt_tokens
            if num_indexed < len(seq.output):
                history.extend(key, seq.output[num_indexed:])
            if seq.finish:
                history.finish(key)  # evictable from now on: never touched again
                del rollout.open[seq.index]


def _key(rollout: _Indexed, seq: Sequence) -> tuple:
    return (rollout.number, seq.request.id)


def _group(rollout: _Indexed, seq: Sequence) -> tuple:
    """A prompt id groups across rollouts; without one, the prompt tokens group this rollout's
    siblings only."""
    r = seq.request
    if r.prompt_id is not None:
        return ("prompt_id", r.prompt_id)
    return ("rollout", rollout.number, r.prompt_token_ids)
