"""Continuous-batching bookkeeping of the rollout engine: which requests wait, which run in which
KV slot, when a request stops. Pure Python, no torch (as nano-vllm's scheduler): the engine's
``ModelRunner`` side (tltrun.rollout.engine) owns the tensors, this side owns the sequences.

Lifecycle of a ``Sequence``: WAITING -> (admitted into the lowest free slot) RUNNING -> FINISHED
when it emits EOS (unless ``ignore_eos``: trace replay) or reaches ``max_new_tokens``. After
sequences finish, ``compact`` moves the running ones with the highest slots into the freed
lower ones (the engine moves their cache rows), so the running batch always occupies slots
0..n-1 in slot order and the engine's attention reads the KV cache through a view instead of
gathering scattered slots every layer of every iteration. Tokens past the
stop point of an iteration (e.g. accepted drafts after an EOS) are dropped, which is what plain
decoding would have done, so speculative decoding never changes a sequence.

Run the tests: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

from collections import deque
from enum import Enum

from tltrun.rollout.interface import Request, RequestOutput


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, index: int):
        self.request = request
        self.index = index  # position in the caller's request list (output order)
        self.output: list[int] = []
        self.status = Status.WAITING
        self.slot: int | None = None
        self.finish = ""
        self.accept_hist: list[int] = []
        self.accept_by_strategy: dict[str, list[int]] = {}
        self.first_token_s = 0.0
        self.finish_s = 0.0
        # The drafter has consumed this sequence's pairs up to the previous SD iteration; False
        # after admission and after every plain (SD off) iteration: the next SD iteration then
        # re-prefills the drafter first (TLT's switching cost).
        self.is_drafter_fresh = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output)

    def append(self, tokens: list[int], eos_ids: frozenset[int], now_s: float) -> int:
        """Append tokens until a stop; returns how many were kept."""
        if not self.output and tokens:
            self.first_token_s = now_s
        kept = 0
        for tok in tokens:
            self.output.append(tok)
            kept += 1
            if tok in eos_ids and not self.request.ignore_eos:
                self.finish = "stop"
            elif len(self.output) >= self.request.max_new_tokens:
                self.finish = "length"
            if self.finish:
                self.status = Status.FINISHED
                self.finish_s = now_s
                break
        return kept

    def record_accept(self, num_accepted: int, strategy: str) -> None:
        add_to_hist(self.accept_hist, num_accepted)
        add_to_hist(self.accept_by_strategy.setdefault(strategy, []), num_accepted)

    def to_output(self) -> RequestOutput:
        r = self.request
        return RequestOutput(
            id=r.id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=list(self.output),
            finish=self.finish,
            accept_hist=list(self.accept_hist),
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            accept_hist_by_strategy={k: list(v) for k, v in self.accept_by_strategy.items()},
        )


def add_to_hist(hist: list[int], value: int) -> None:
    """hist[value] += 1, growing ``hist`` as needed."""
    if len(hist) <= value:
        hist.extend([0] * (value + 1 - len(hist)))
    hist[value] += 1


class Scheduler:
    """FIFO admission into at most ``max_running`` slots."""

    def __init__(self, requests: list[Request], max_running: int):
        self.sequences = [Sequence(r, i) for i, r in enumerate(requests)]
        self.waiting: deque[Sequence] = deque(self.sequences)
        self.running: list[Sequence] = []
        self.max_running = max_running
        self.free_slots: deque[int] = deque(range(max_running))
        self.finished: list[Sequence] = []  # in the order they finished (a caller streams them)

    @property
    def is_done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.status is Status.FINISHED]
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]
            for seq in done:
                self.free_slots.append(seq.slot)
            self.finished += done
        return done

    def compact(self) -> list[tuple[int, int]]:
        """Move running sequences from slots >= n (n running) into the free slots below n;
        returns the (from slot, to slot) moves, in increasing ``from`` order, for the engine to
        copy. Afterwards ``running`` holds slots 0..n-1 in slot order and the free slots are
        n..max_running-1 (admission then fills them in order)."""
        n = len(self.running)
        holes = sorted(s for s in self.free_slots if s < n)
        movers = sorted((s for s in self.running if s.slot >= n), key=lambda s: s.slot)
        moves = []
        for seq, dst in zip(movers, holes, strict=True):
            moves.append((seq.slot, dst))
            seq.slot = dst
        self.running.sort(key=lambda s: s.slot)
        self.free_slots = deque(range(n, self.max_running))
        return moves

    def outputs(self) -> list[RequestOutput]:
        return [s.to_output() for s in self.sequences]
