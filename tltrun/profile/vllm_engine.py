"""``tltrun profile --backend vllm``: the rollout ops of ``tltrun.rollout.vllm_backend.VLLMBackend``,
timed as whole vLLM engine steps (``LLMEngine.step``: schedule, forward, sample, propose), the
unit in which the backend runs a rollout and records ``IterationRecord``s.

vLLM exposes no per-phase timing of a step, so per-op costs are derived from whole steps of a
controlled batch (``batch`` requests of ``context`` prompt tokens, ``ignore_eos``). Every point
is timed in interleaved rounds (``tltrun.profile.timing.Measure.interleaved``, as the torch backend):
each round visits every point, sets it up (untimed: submit its prompts, which are prefix-cache
hits after the first round, and step until each has its first token), runs ``num_warmup``
untimed steps and times one. A slow or fast spell of a shared machine so reaches all points
alike, and a caller can run its measured rollouts between rounds on the same engine
(``profile_vllm(..., backend=, between_rounds=)``; benchmarks/bench_fidelity.py does).

* ``decode``: steps with k = 0 draft tokens. On an engine with a drafter vLLM still runs the
  drafter once per step to keep its KV cache in sync (tltrun.rollout.vllm_backend), so this is the cost
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

A timed step runs at the point's context plus the tokens of the warm-up steps before it; each
row records the mean context of its timed steps, so rows sit near, not on, the grid's values.
Prompts are submitted before timing starts, as ``VLLMBackend.generate`` submits before its clock.
Not run directly: ``tltrun profile --backend vllm`` calls ``profile_vllm``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from tltrun.profile.timing import Series, warn_if_floored
from tltsim.cost.profile import ProfileRow


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

    def abort_all(self) -> None:
        """Abort every request this probe submitted that is still known (setup of a point)."""
        if self.prompts:
            self.abort(list(self.prompts))

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


def _timed(values: list, measure) -> list:
    """The values recorded by the timed call of each round: a series' ``fn`` runs
    ``num_warmup`` untimed times and then once timed, every round (``Measure.interleaved``)."""
    return values[measure.num_warmup :: measure.num_warmup + 1]


def _series(key: tuple, fn, setup, reset=lambda: None) -> Series:
    """A series warmed up every round, which ``_timed`` relies on."""
    return Series(key, fn, reset=reset, setup=setup, is_warmed_each_round=True)


def step_series(probe: VLLMProbe, prompts, k: int, margin: int, contexts: list) -> Series:
    """Engine steps with k draft tokens of the running ``prompts``. Setup (untimed): submit
    them (a prefix-cache hit after the first round) and step until each has its first token."""
    state: dict = {}

    def setup() -> None:
        probe.abort_all()
        probe.set_k(k)
        state["ids"] = probe.submit(prompts, margin)
        probe.step_until_new_token(state["ids"])

    def step() -> None:
        contexts.append(probe.context(state["ids"]))
        probe.step()

    return _series(("step", len(prompts), len(prompts[0]), k), step, setup)


def switch_series(probe: VLLMProbe, prompts, k: int, margin: int, contexts: list) -> Series:
    """What ``control="switch"`` does when SD turns on: abort the running requests and
    resubmit them with their generated prefix; timed until each has a new token (the
    re-prefill is served mostly from vLLM's prefix cache)."""
    state: dict = {}

    def setup() -> None:
        probe.abort_all()
        probe.set_k(0)
        state["ids"] = probe.submit(prompts, margin)
        probe.step_until_new_token(state["ids"])
        probe.step()
        probe.set_k(k)

    def resubmit() -> None:
        new_prompts = [probe.prompts[r] + probe.tokens[r] for r in state["ids"]]
        contexts.append(sum(len(p) for p in new_prompts))
        probe.abort(state["ids"])
        state["ids"] = probe.submit(new_prompts, margin)
        probe.step_until_new_token(state["ids"])

    return _series(("switch", len(prompts), len(prompts[0])), resubmit, setup)


def prefill_series(probe: VLLMProbe, batch: int, tokens: int) -> Series:
    """Fresh random prompts (no prefix-cache hits), timed until each has its first token."""
    state: dict = {}

    def submit() -> None:
        probe.abort_all()
        state["ids"] = probe.submit(probe.random_prompts(batch, tokens), 1)

    return _series(
        ("prefill", batch, tokens), lambda: probe.step_until_new_token(state["ids"]), submit, submit
    )


def point_rows(
    b: int, c: int, ks: list[int], timed: dict, contexts: dict, measure, is_warned: bool = False
) -> list:
    """decode, drafter, verify and sd_switch rows of one (batch, context per sequence);
    ``is_warned``: a floored verify row is said (the final rows)."""

    def ctx(key) -> int:  # the timed calls' contexts (an interrupted round's left out)
        return int(round(np.mean(_timed(contexts[key], measure)[: len(timed[key])])))

    by_k = {k: timed[("step", b, c, k)] for k in [0, *ks]}
    rows = [measure.row("decode", b, ctx(("step", b, c, 0)), 1, by_k[0])]
    if not ks:
        return rows
    k_arr = np.array([0, *ks], dtype=float)
    times = np.stack([by_k[k] for k in [0, *ks]])  # (len(ks) + 1, repeats)
    # per round, the least-squares slope of step time over k
    slope = ((k_arr - k_arr.mean())[:, None] * (times - times.mean(0))).sum(0)
    slope = np.maximum(slope / ((k_arr - k_arr.mean()) ** 2).sum(), 0.01 * times[0])
    rows.append(measure.row("drafter", b, ctx(("step", b, c, ks[-1])), 1, slope))
    step_s = rows[-1].seconds  # the row's statistic (tltrun.profile.torch_engine.point_rows)
    for k in ks:
        it = by_k[k]
        verify = np.maximum(it - k * step_s, 0.1 * it)
        rows.append(measure.row("verify", b, ctx(("step", b, c, k)), k + 1, verify))
        if is_warned:
            it_s = measure.row("verify", b, 0, k + 1, it).seconds  # the iteration's statistic
            what = f"chain of {k} at batch {b}, context {c}"
            warn_if_floored(what, k, step_s, rows[-1].seconds, it_s)
    total = ctx(("switch", b, c))
    per_seq = max(1, round(total / b))
    rows.append(measure.row("sd_switch", b, total, per_seq, timed[("switch", b, c)]))
    return rows


def start_backend(cfg, margin: int, ks: list[int]):
    """An in-process engine configured as the run's ``VLLMBackend`` would be."""
    from tltrun.rollout.interface import SamplingParams
    from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig
    from tltrun.rollout.vllm_config import vllm_seed

    config = VLLMBackendConfig(
        control="iteration",
        max_draft_steps=max(ks, default=1),
        max_num_seqs=max(max(cfg.batches), max(cfg.prefill_batches)),
        max_model_len=profile_model_len(cfg, margin),
        kv_cache_bytes=cfg.vllm_kv_cache_bytes,
        dtype=cfg.dtype_name,
        seed=vllm_seed(cfg.seed),
    )
    return VLLMBackend(cfg.model, cfg.drafter or None, config, SamplingParams(cfg.temperature))


def draft_steps(cfg) -> list[int]:
    """The grid's distinct draft steps k, ascending ([] without a drafter)."""
    return sorted({d.draft_steps for d in cfg.decisions}) if cfg.drafter else []


def profile_margin(cfg, num_warmup: int) -> int:
    """max_tokens of a profile request: the steps of one round at the deepest k, and spare."""
    return (num_warmup + 3) * (max(draft_steps(cfg), default=0) + 1) + 2


def profile_model_len(cfg, margin: int) -> int:
    """The max_model_len a profiling engine needs (sd_switch resubmits prompt + generated)."""
    return 2 * (max(max(cfg.context_per_seq), max(cfg.prefill_tokens_per_seq)) + margin)


def check_backend(cfg, backend, margin: int) -> None:
    """A caller's engine must hold the grid: its batches, lengths and draft steps."""
    need = {
        "max_num_seqs": max(max(cfg.batches), max(cfg.prefill_batches)),
        "max_model_len": profile_model_len(cfg, margin),
        "max_draft_steps": max(draft_steps(cfg), default=0),
    }
    for name, value in need.items():
        have = getattr(backend.config, name)
        if have is None or have < value:
            raise ValueError(f"profile_vllm: the engine's {name} is {have}, the grid needs {value}")
    if bool(cfg.drafter) != backend.has_drafter or backend.config.control == "table":
        raise ValueError(
            "profile_vllm: the engine needs a drafter exactly when the profile has one, and "
            "control 'iteration' or 'switch' (in-process)"
        )


def profile_vllm(
    cfg,
    measure,
    progress: Callable[[str], None],
    between_rounds: Callable[[int], None] = lambda r: None,
    backend=None,
    on_rows: Callable[[list[ProfileRow]], None] = lambda rows: None,
) -> list[ProfileRow]:
    """Rollout rows of ``cfg``'s grid (a ``tltrun.profile.measure.ProfileRunConfig``) on one in-process
    vLLM engine: ``backend`` (a ``VLLMBackend`` the caller also runs, left open; its
    ``control`` must not be ``"table"``) or one started here as the run's would be.
    ``between_rounds(r)`` runs after round r (on ``backend``: a measured rollout); ``on_rows(rows)``
    gets the rows of the rounds completed so far after each round."""
    from tltrun.model.config import read_config

    ks = draft_steps(cfg)
    margin = profile_margin(cfg, measure.num_warmup)
    is_own = backend is None
    if is_own:
        backend = start_backend(cfg, margin, ks)
    else:
        check_backend(cfg, backend, margin)
    probe = VLLMProbe(backend, read_config(cfg.model).vocab_size, cfg.seed)
    contexts: dict[tuple, list[int]] = {}
    series: list[Series] = []
    for b in cfg.batches:
        for c in cfg.context_per_seq:
            prompts = probe.random_prompts(b, c)
            for k in [0, *ks]:
                key = ("step", b, c, k)
                series.append(step_series(probe, prompts, k, margin, contexts.setdefault(key, [])))
            if ks:
                key = ("switch", b, c)
                lst = contexts.setdefault(key, [])
                series.append(switch_series(probe, prompts, ks[-1], margin, lst))
    for b in cfg.prefill_batches:
        for t in cfg.prefill_tokens_per_seq:
            series.append(prefill_series(probe, b, t))

    def after_round(r: int) -> None:
        probe.abort_all()
        probe.set_k(0)
        between_rounds(r)

    def rows_of(timed: dict, is_warned: bool = False) -> list[ProfileRow]:
        rows: list[ProfileRow] = []
        for b in cfg.batches:
            for c in cfg.context_per_seq:
                rows += point_rows(b, c, ks, timed, contexts, measure, is_warned)
        for b in cfg.prefill_batches:
            for t in cfg.prefill_tokens_per_seq:
                rows.append(measure.row("prefill", b, 0, t, timed[("prefill", b, t)]))
        return rows

    try:
        timed = measure.interleaved(
            series,
            progress=progress,
            between_rounds=after_round,
            on_round=lambda timed: on_rows(rows_of(timed)),
        )
    finally:
        if is_own:
            backend.close()
    return rows_of(timed, is_warned=True)


__all__ = ["VLLMProbe", "profile_vllm"]
