"""One plain decode iteration as a single device program (issue #18: the host work between
graph replays). ``StaticDecode`` wraps the pool's decode forward of a batch bucket with
everything the engine did eagerly around it: reading each slot's pending token, padding the
free rows, sampling the next token, storing the hidden state, committing the KV cache and
writing the token. Captured as ONE CUDA graph (``GraphPool``), an iteration costs the host one
fill of the real-row count, one replay and one read of the sampled tokens, where the eager
epilogue launched some 25 kernels from Python between replays (the H200's 7B batch-1 step spent
0.8 ms of its 7.3 ms outside the graph: benchmarks/RESULTS.md, session 21). vLLM and SGLang keep
sampling outside their graphs but overlap it with the next step (SGLang's overlap scheduler);
gpt-fast compiles ``decode_one_token`` with its sampling inside, which this follows.

Sampling is the engine's: ``logits_to_probs`` then one uniform per row by inverse CDF from the
engine's generator (registered with the graph so each replay draws fresh numbers), or argmax at
temperature 0 (the inverse CDF of a one-hot: the same token, no draw). A bucket draws one
uniform per bucket row, padding included, so a sampled run equals the eager engine's token for
token only where every batch has its own bucket; the distribution is the same either way.

Run the tests: ``python -m pytest tests/test_static_decode.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.speculative import logits_to_probs, sample_from_weights

# Graph-safe custom generators (torch >= 2.5 on CUDA builds): without it no step that draws
# (sampled decode, verify or chain drafting) is captured; such a step then runs uncaptured
IS_GENERATOR_REGISTRABLE = hasattr(torch.cuda.CUDAGraph, "register_generator_state")


@dataclass(frozen=True, kw_only=True)
class DecodeSources:
    """The engine state a decode or verify iteration reads and writes
    (``tltrun.rollout.engine``'s per-slot invariant): every slot's tokens and target hidden
    states by position (None when the engine keeps none), the sampling settings, the engine's
    generator and the chain verification's implementation (``EngineConfig.verify_impl``)."""

    tokens: torch.Tensor  # (slots, max_tokens) long; tokens[s, lens[s]] is the pending token
    hidden: torch.Tensor | None  # (slots, max_tokens, C)
    sampling: SamplingParams
    generator: torch.Generator
    verify_impl: str = "ref"


def decode_sources(engine) -> DecodeSources:
    """What ``engine``'s decode steps read and write (a ``tltrun.rollout.prefill.SlotEngine``)."""
    return DecodeSources(
        tokens=engine.tokens,
        hidden=engine.hidden,
        sampling=engine.config.sampling,
        generator=engine.generator,
        verify_impl=engine.config.verify_impl,
    )


def capture_graph(
    run, pool, stream: torch.cuda.Stream, generator: torch.Generator | None, after_warm_up=None
) -> torch.cuda.CUDAGraph:
    """``run`` warmed up on a side stream (cuBLAS workspaces, compiled kernels), then captured
    into ``pool``, with ``generator`` registered when it draws (each replay then advances its
    Philox offset, as the default CUDA generator's); ``after_warm_up()`` runs in between (undo
    what the warm-up committed). Every graph of the pool is captured this way."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    if after_warm_up is not None:
        after_warm_up()
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        run()
    return graph


class StaticStep:
    """What the pool's whole-iteration steps share: the engine state they read and write, the
    real-row count the host fills before each call, one graph captured with no real row and
    replayed per call (on CPU, or where capture is off, ``run`` uncaptured)."""

    sources: DecodeSources
    num_real: torch.Tensor  # () long: the rows 0..num_real-1 are running slots
    graph: torch.cuda.CUDAGraph | None

    def run(self) -> None:
        raise NotImplementedError

    @property
    def is_sampled(self) -> bool:
        return not self.sources.sampling.is_greedy

    @property
    def is_capturable(self) -> bool:
        return not self.is_sampled or IS_GENERATOR_REGISTRABLE

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Capture with no real row: the warm-up changes nothing but free slots' lengths and
        scratch KV entries (between rollouts only, as every capture)."""
        self.num_real.zero_()
        generator = self.sources.generator if self.is_sampled else None
        self.graph = capture_graph(self.run, pool, stream, generator)

    def pad_rows(self, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside ``run``: which of the bucket's rows are real (B,) bool, with the free rows'
        cache ``lens`` (a view, written in place) set to 0 so they attend to themselves, and
        the rows' lengths now (B,), a copy: the position of each row's first new token."""
        is_real = self.rows < self.num_real
        lens.copy_(torch.where(is_real, lens, 0))
        return is_real, lens.clone()

    @staticmethod
    def write_real(buf: torch.Tensor, index: tuple, new: torch.Tensor, is_real: torch.Tensor):
        """``buf[index] = new`` on the real rows only (``is_real`` (B,), rows first in
        ``new``): a free row's entries keep their values."""
        mask = is_real.view(-1, *([1] * (new.dim() - 1)))
        buf[index] = torch.where(mask, new, buf[index])

    def launch(self, num_real: int) -> None:
        """Run the step for running slots ``0..num_real-1``: a replay where captured."""
        self.num_real.fill_(num_real)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()


class StaticDecode(StaticStep):
    """A plain decode iteration of slots ``0..batch-1`` around ``forward`` (the pool's
    ``StaticForward`` of ``batch`` x 1 token): ``run`` is what a graph captures. The real rows
    are the first ``num_real`` (a device scalar the host fills before each replay); the rest
    are free slots, set to length 0 and left otherwise untouched (their KV entry at position 0
    is scratch, as for every padded static forward)."""

    def __init__(self, forward, sources: DecodeSources):
        if forward.num_tokens != 1:
            raise ValueError(f"a decode step forwards 1 token per row, got {forward.num_tokens}")
        self.forward, self.sources, self.batch = forward, sources, forward.batch
        self.num_tokens = 1  # per row, as the forward's (the pool orders captures by size)
        device = sources.tokens.device
        self.num_real = torch.zeros((), dtype=torch.long, device=device)
        self.rows = torch.arange(self.batch, device=device)  # (B,)
        self.tokens_out = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()
    def run(self) -> None:
        """The captured iteration. Everything is indexed by device tensors: no host reads."""
        fwd, src, rows = self.forward, self.sources, self.rows
        lens = fwd.cache.lens[: self.batch]  # (B,) a view: written in place
        is_real, pos = self.pad_rows(lens)  # pos (B,): tokens[row, pos] is pending
        fwd.ids.copy_(src.tokens[rows, pos][:, None])  # (B,1)
        fwd.depth.zero_()  # the shared buffers may hold a verify's layout
        fwd.tree_mask.fill_(True)
        fwd.run()  # logits_out (B,1,V), hidden_out (B,1,C); KV written at pos
        logits = fwd.logits_out[:, 0]  # (B,V)
        if self.is_sampled:
            u = torch.rand(self.batch, generator=src.generator, device=rows.device)  # (B,)
            nxt = sample_from_weights(logits_to_probs(logits, src.sampling), u)
        else:  # the inverse CDF of the one-hot argmax is the argmax
            nxt = logits.float().argmax(dim=-1)
        if src.hidden is not None:
            self.write_real(src.hidden, (rows, pos), fwd.hidden_out[:, 0], is_real)  # (B,C)
        self.write_real(src.tokens, (rows, pos + 1), nxt, is_real)
        lens.copy_(pos + is_real.long())  # commit the real rows' new entry
        self.tokens_out.copy_(nxt)

    def __call__(self, num_real: int) -> torch.Tensor:
        """Run the iteration for running slots ``0..num_real-1``; their next tokens (n,), a view
        of the output buffer valid until this step's next call."""
        if not 1 <= num_real <= self.batch:
            raise ValueError(f"decode step of batch {self.batch}: got {num_real} slots")
        self.launch(num_real)
        return self.tokens_out[:num_real]
