"""Step-time models: roofline from model + hardware specs, or measured profile tables.

Every cost the simulator charges goes through a ``CostModel``; a measured profile CSV
(``tltrun profile``) slots in behind the same interface (issue #7).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class CostModel(Protocol):
    """Seconds for the work of ONE engine instance (a TP group of ``tp`` GPUs)."""

    def decode_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        """One target forward over ``batch`` sequences, each feeding ``tokens_per_seq`` new
        tokens, attending to ``context_tokens`` KV tokens in total over the batch."""
        ...

    def decode_span_s(self, batch: int, context_tokens: float, num_iters: int) -> float:
        """Sum of ``decode_iter_s(batch, context_tokens + i * batch, 1)`` for i in 0..num_iters-1:
        plain decoding of a fixed batch whose context grows by one token per sequence per
        iteration. Lets the simulator advance analytically between batch-composition changes."""
        ...

    def prefill_s(self, num_tokens: int, context_tokens: float = 0.0) -> float:
        """Prefill ``num_tokens`` new tokens (summed over requests) on top of ``context_tokens``."""
        ...

    def drafter_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        """One drafter forward (one draft step) over the batch."""
        ...

    def train_s(self, num_tokens: int) -> float:
        """Actor update (forward + backward + optimizer, with recompute) over ``num_tokens``
        (prompt + response) tokens on this instance's ``tp`` GPUs. The simulator's training
        phase is data parallel: ``train_s(total_tokens / num_instances)``."""
        ...

    def drafter_train_s(self, num_tokens: int) -> float:
        """Drafter training over ``num_tokens`` harvested tokens on one instance."""
        ...
