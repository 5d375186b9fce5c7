"""``tltrun profile --backend vllm``: the rollout ops of ``tltrun.vllm_backend.VLLMBackend``,
timed as whole vLLM engine steps (``LLMEngine.step``: schedule, forward, sample, propose), the
unit in which the backend runs a rollout and records ``IterationRecord``s.

vLLM exposes no per-phase timing of a step, so per-op costs are derived from whole steps of a
controlled batch (``batch`` requests of ``context`` prompt tokens, ``ignore_eos``), each timed
``num_repeats`` times after ``num_warmup`` steps:

* ``decode``: steps with k = 0 draft tokens. On an engine with a drafter vLLM still runs the
  drafter once per step to keep its KV cache in sync (tltrun.vllm_backend), so this is the cost
  of an "off" step of THAT engine: profile, and run NoSpec, on the engine the policy uses.
* ``verify`` / ``drafter``: steps with k = draft_steps of each (chain) strategy, set through the
  backend's dynamic-SD lookup (vLLM's EAGLE drafts chains; a tree strategy runs as its chain).
  Step time is linear in k to a good approximation (k drafter forwards, k more verified tokens):
  the ``drafter`` row is the least-squares slope over k = 0 and the strategies (the marginal
  cost of one draft step, its verify token included), and the ``verify`` row of a strategy is
  its step time minus k x slope (at least 10% of it). The simulator's draft_steps x drafter +
  verify then reproduces every measured step time, as for the torch engine.
* ``sd_switch``: what ``control="switch"`` does when SD turns on: abort the running requests
  and resubmit them with their generated prefix; timed until each has a new token (the re-prefill
  is served mostly from vLLM's prefix cache).
* ``prefill``: fresh random prompts (no prefix-cache hits), timed until each has its first token.

Contexts drift while steps are timed (each step adds 1..k+1 tokens per request); each row
records the mean context of its timed steps, so rows sit near, not on, the grid's values.
Prompts are submitted before timing starts, as ``VLLMBackend.generate`` submits before its clock.
Not run directly: ``tltrun profile --backend vllm`` calls ``profile_vllm``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from tltsim.profile import ProfileRow


class VLLMProbe:
    """One vLLM engine and the request bookkeeping the timed steps need."""

    def __init__(self, backend, vocab_size: int, seed: int):
        self.backend = backend
        self.engine = backend._engine
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # generated so far, per request
        self.num_submitted = 0

    def submit(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from vllm import SamplingParams

        s = self.backend.sampling
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k or 0,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=self.rng.getrandbits(31),
            detokenize=False,
        )
        ids = []
        for prompt in prompts:
            self.num_submitted += 1
            rid = f"profile-{self.num_submitted}"
            self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
            self.prompts[rid], self.tokens[rid] = list(prompt), []
            ids.append(rid)
        return ids

    def random_prompts(self, batch: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab_size) for _ in range(length)] for _ in range(batch)]

    def step(self) -> None:
        for out in self.engine.step():
            if out.request_id in self.tokens:
                self.tokens[out.request_id] = list(out.outputs[0].token_ids)

    def step_until_new_token(self, ids: list[str]) -> None:
        """Step until every request in ``ids`` emitted at least one more token."""
        before = {rid: len(self.tokens[rid]) for rid in ids}
        while any(len(self.tokens[rid]) == before[rid] for rid in ids):
            self.step()

    def context(self, ids: list[str]) -> int:
        return sum(len(self.prompts[rid]) + len(self.tokens[rid]) for rid in ids)

    def abort(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        for rid in ids:
            self.prompts.pop(rid, None)
            self.tokens.pop(rid, None)

    def set_k(self, k: int) -> None:
        if self.backend.has_drafter:
            self.backend._set_lookup([[1, self.backend.config.max_num_seqs, k]])


def _steps(probe: VLLMProbe, ids: list[str], measure) -> tuple[np.ndarray, int]:
    """Timed steps of the running ``ids`` and their mean batch context (tokens)."""
    contexts = []

    def one() -> None:
        contexts.append(probe.context(ids))
        probe.step()

    samples = measure.samples(one)
    return samples, int(round(np.mean(contexts[-len(samples) :])))


def measure_point(probe: VLLMProbe, batch: int, context: int, ks: list[int], measure, margin: int):
    """decode / verify / drafter / sd_switch rows at one (batch, context per sequence)."""
    prompts = probe.random_prompts(batch, context)
    by_k: dict[int, tuple[np.ndarray, int]] = {}
    for k in [0, *ks]:
        probe.set_k(k)
        ids = probe.submit(prompts, margin)  # same prompts: a prefix-cache hit after the first
        probe.step_until_new_token(ids)
        by_k[k] = _steps(probe, ids, measure)
        probe.abort(ids)
    rows = [measure.row("decode", batch, by_k[0][1], 1, by_k[0][0])]
    if ks:
        k_arr = np.array([0, *ks], dtype=float)
        times = np.stack([by_k[k][0] for k in [0, *ks]])  # (len(ks)+1, repeats)
        # per repeat, least-squares slope of step time over k
        slope = ((k_arr - k_arr.mean())[:, None] * (times - times.mean(0))).sum(0)
        slope = np.maximum(slope / ((k_arr - k_arr.mean()) ** 2).sum(), 0.01 * times[0])
        rows.append(measure.row("drafter", batch, by_k[ks[-1]][1], 1, slope))
        step_s = float(np.median(slope))
        for k in ks:
            it, ctx = by_k[k]
            rows.append(
                measure.row("verify", batch, ctx, k + 1, np.maximum(it - k * step_s, 0.1 * it))
            )
        rows.append(measure_switch(probe, prompts, ks[-1], measure, margin))
    return rows


def measure_switch(probe: VLLMProbe, prompts, k: int, measure, margin: int) -> ProfileRow:
    """Abort and resubmit running requests with their generated prefix (control="switch")."""
    probe.set_k(0)
    ids = probe.submit(prompts, margin)
    probe.step_until_new_token(ids)
    probe.step()
    probe.set_k(k)
    state = {"ids": ids}
    contexts = []

    def resubmit() -> None:
        new_prompts = [probe.prompts[r] + probe.tokens[r] for r in state["ids"]]
        contexts.append(sum(len(p) for p in new_prompts))
        probe.abort(state["ids"])
        state["ids"] = probe.submit(new_prompts, margin)
        probe.step_until_new_token(state["ids"])

    samples = measure.samples(resubmit)
    probe.abort(state["ids"])
    batch, total = len(prompts), int(round(np.mean(contexts[-len(samples) :])))
    return measure.row("sd_switch", batch, total, max(1, round(total / batch)), samples)


def measure_prefill(probe: VLLMProbe, batch: int, tokens: int, measure) -> ProfileRow:
    state = {}

    def submit() -> None:
        state["ids"] = probe.submit(probe.random_prompts(batch, tokens), 1)

    def prefill() -> None:
        probe.step_until_new_token(state["ids"])

    def finish() -> None:
        probe.abort(state["ids"])
        submit()

    submit()
    samples = measure.samples(prefill, finish)
    probe.abort(state["ids"])
    return measure.row("prefill", batch, 0, tokens, samples)


def profile_vllm(cfg, measure, progress: Callable[[str], None]) -> list[ProfileRow]:
    """Rollout rows of ``cfg``'s grid (a ``tltrun.profile.ProfileRunConfig``) on one in-process
    vLLM engine configured as the run's ``VLLMBackend`` would be."""
    from tltrun.interface import SamplingParams
    from tltrun.model import read_config
    from tltrun.vllm_backend import VLLMBackend, VLLMBackendConfig

    ks = sorted({d.draft_steps for d in cfg.decisions}) if cfg.drafter else []
    steps_per_point = measure.num_warmup + measure.num_repeats + 2
    margin = steps_per_point * (max(ks, default=0) + 1) + 2
    longest = max(max(cfg.context_per_seq), max(cfg.prefill_tokens_per_seq))
    config = VLLMBackendConfig(
        control="iteration",
        max_draft_steps=max(ks, default=1),
        max_num_seqs=max(max(cfg.batches), max(cfg.prefill_batches)),
        max_model_len=2 * (longest + margin),  # sd_switch resubmits prompt + generated
        kv_cache_bytes=cfg.vllm_kv_cache_bytes,
        dtype=cfg.dtype,
        seed=cfg.seed,
    )
    backend = VLLMBackend(cfg.model, cfg.drafter or None, config, SamplingParams(cfg.temperature))
    probe = VLLMProbe(backend, read_config(cfg.model).vocab_size, cfg.seed)
    rows: list[ProfileRow] = []
    try:
        for batch in cfg.batches:
            for context in cfg.context_per_seq:
                progress(f"vllm steps batch {batch} context {context}")
                rows += measure_point(probe, batch, context, ks, measure, margin)
        probe.set_k(0)
        for batch in cfg.prefill_batches:
            for tokens in cfg.prefill_tokens_per_seq:
                progress(f"vllm prefill batch {batch} x {tokens} tokens")
                rows.append(measure_prefill(probe, batch, tokens, measure))
    finally:
        backend.close()
    return rows


__all__ = ["VLLMProbe", "profile_vllm"]
