"""What ``tltsim compare`` reads from a measured trace: the policy, the placement, the batching cap
and the per-step drafter acceptance of a ``tltrun`` run, so the simulator can replay it.

    from tltsim.fidelity.measured_run import measured_run
    run = measured_run(load_trace("runs/x/trace_tlt.json"), "runs/x/trace_tlt.json")
    run.policy, run.settings, run.num_instances, run.instance_trace(0)

Contract: the per-step ``measured`` block fields this module reads (tltrun writes them)
------------------------------------------------------------------------------------------
Fields of ``tltsim.trace.measured.MeasuredStep``; their types are checked when the trace loads.
* ``rollout_s`` (required): seconds of the step's rollout (slowest instance); ``train_s``
  (optional): the actor update; both compared with the simulation. ``clock`` (optional,
  default ``"wall"``): ``"wall"`` or ``"cpu"`` seconds (``tltrun.profile.timing.CLOCKS``); it must be
  the clock the profile was measured with.
* ``policy.name`` (required): ``nospec`` | ``static`` | ``tlt`` (``tltsim.policy.make_policy``),
  the same in every step; ``policy.config`` (optional): the policy's settings, i.e.
  ``TLTConfig`` fields for ``tlt`` or ``{"strategy": "4_1_4"}`` for ``static`` (default: the
  ``TLTConfig`` defaults; a static policy's one strategy from ``policy.iterations_per_strategy``);
  ``policy.seed`` (optional, default 0): the seed the policy object was built with.
* ``max_running_requests`` (required unless given on the command line): the engine's
  continuous-batching cap per instance; ``null`` means each instance admitted its whole share.
* ``share_prompts`` (optional, default false: traces recorded before engines shared prompts):
  whether requests with identical prompts shared their prefill (tltrun's
  ``EngineConfig.share_prompts``, vLLM's prefix caching), the same in every step; the
  simulation replays it (``SimConfig.share_prompts``). ``prefix_block_tokens`` (optional,
  default 1): the granularity of that sharing (vLLM: its KV block size), replayed as
  ``SimConfig.prefix_block_tokens``.
* ``response_accept_hist_by_strategy`` (optional): ``{prompt id: [{strategy: hist} per
  response, in the prompt's order]}``, each response's own verifies. With it, each response
  that verified draws its accept lengths from the acceptance model at its own
  maximum-likelihood rate (``MeasuredAcceptance.request_accept_rates``), the others from the
  step's histograms: long responses often accept much less (or more) than their step's mean,
  and they make the tail.
* ``instance_prompts`` (optional): one list per engine instance (rollout worker) of the prompt
  ids it served, in admission order: all responses of a prompt ran on one instance, as in veRL's
  chunked split and ``tltrun train``. Absent: one instance served the whole step, which is an
  error when ``worker_rollout_s`` lists more than one worker.
* Acceptance: the per-response ``accept_hist`` and ``accept_hist_by_strategy`` of the fit
  contract (``tltsim.fidelity.fit``). They are replayed: in step s the simulation draws the accept
  lengths of each strategy from that strategy's measured histogram in step s (strategies the
  step did not use: the acceptance model at the step's maximum-likelihood rate,
  ``tltsim.fidelity.fit.estimate_accept_rate``). The comparison thus tests the cost model and the
  scheduling, not the drafter-dynamics model (``tltsim compare --drafter-dynamics`` does).

* The history drafter (issue #20; policy ``tltbase``, or a ``tlt`` config whose ``drafters``
  list it; arms ``"history:6_1_6"`` in the block's strategy keys, a version-2 trace): its
  verifies are replayed through ``HistoryModel`` fitted on the trace itself
  (``tltsim.fidelity.fit_history``: acceptance by group progress and history), each response
  that verified under a history arm at its own maximum-likelihood rate
  (``MeasuredAcceptance.request_history_rates``), as for EAGLE. A run without per-response
  histograms uses the ``HistoryModel`` defaults, or the model ``tltsim compare
  --drafter-dynamics`` names.

Bad input raises ``UsageError`` naming the file, the step and the field (a field of the wrong
type already failed ``load_trace`` with a ``TraceError`` of the same form).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tltsim.errors import UsageError
from tltsim.fidelity.fit import checked_hists, collect_steps, eagle_hists, hists_by_strategy
from tltsim.fidelity.fit_accept import argmax_unimodal, estimate_accept_rate, fit_sibling_rate
from tltsim.fidelity.fit_history import (
    HistoryObservation,
    fit_history,
    history_observations,
    prompt_ids_name_prompts,
)
from tltsim.policy import POLICY_NAMES, SpecDecision, TLTBase, TLTConfig
from tltsim.policy.tlt import TLTBASE_FIELDS
from tltsim.sim.acceptance import DEFAULT_ACCEPT_RATE, DEFAULT_SIBLING_RATE, DrafterState
from tltsim.sim.history_acceptance import HistoryModel, history_accept_len_pmf
from tltsim.trace.measured import UNRECORDED, MeasuredStep, PolicyRecord
from tltsim.trace.schema import Step, Trace


@dataclass(frozen=True)
class MeasuredAcceptance:
    """Drafter "dynamics" replaying a measured run. Step k of the simulation (its k-th RL step)
    draws accept lengths from the histogram the trace's k-th step measured for the decision's
    strategy (``accept_len_pmf``, which ``tltsim.sim.simulator`` asks first): acceptance differs a lot
    between strategies of one step, e.g. the chain a lone tail request drafts with. A strategy
    the step did not measure falls back to the acceptance model at the step's rate. Training
    and drift change nothing (the measurement already contains their effect). Implements the
    interface ``tltsim.sim.simulator.simulate`` needs from ``DrafterDynamics``."""

    rates: tuple[float, ...]
    sibling_rate: float = DEFAULT_SIBLING_RATE
    # per step: {strategy: verify counts by accepted drafts}, as tltsim.fidelity.fit collects them
    hists: tuple[dict[str, tuple[int, ...]], ...] = ()
    # per step: {prompt id: each response's own acceptance rate (nan: it verified nothing)}
    response_rates: tuple[dict[str, tuple[float, ...]], ...] = ()
    # the history drafter: the model fitted on the run (None: the simulator's default) and,
    # per step, each response's own history-arm rate, like ``response_rates``
    history: HistoryModel | None = None
    history_response_rates: tuple[dict[str, tuple[float, ...]], ...] = ()
    # whether a prompt id recurring in a later step is the same prompt (the simulator's
    # history flag; ``tltsim.fidelity.fit_history.prompt_ids_name_prompts``)
    prompt_ids_recur: bool = True

    def initial_state(self) -> DrafterState:
        return DrafterState(self.rates[0])

    def after_rl_step(self, state: DrafterState) -> DrafterState:
        k = min(state.num_rl_steps + 1, len(self.rates) - 1)
        return DrafterState(self.rates[k], state.trained_tokens, state.num_rl_steps + 1)

    def after_training(self, state: DrafterState, num_tokens: int) -> DrafterState:
        return dataclasses.replace(state, trained_tokens=state.trained_tokens + num_tokens)

    def request_accept_rates(self, state: DrafterState, step: Step) -> np.ndarray | None:
        """Per response of ``step`` (prompt-major, as ``tltsim.sim.simulator`` flattens a step): the
        acceptance rate its own verifies measured, nan where it verified nothing (those draw
        from the step's histograms). Long responses of a reasoning step often accept far less
        than the step's mean (repetitive or unusual text), and they are the long tail: replaying
        the step's pooled histogram for every response finishes the tail too early."""
        if state.num_rl_steps >= len(self.response_rates):
            return None
        table = self.response_rates[state.num_rl_steps]
        out = []
        for p in step.prompts:
            own = table.get(p.id, ())
            out += [own[i] if i < len(own) else math.nan for i in range(len(p.responses))]
        return np.asarray(out, dtype=np.float64)

    def request_history_rates(self, state: DrafterState, step: Step) -> np.ndarray | None:
        """Per response of ``step``: the history drafter's per-token match rate its own
        history-arm verifies measured, nan where it had none (those draw from ``history``)."""
        if state.num_rl_steps >= len(self.history_response_rates):
            return None
        table = self.history_response_rates[state.num_rl_steps]
        out = []
        for p in step.prompts:
            own = table.get(p.id, ())
            out += [own[i] if i < len(own) else math.nan for i in range(len(p.responses))]
        return np.asarray(out, dtype=np.float64)

    def accept_len_pmf(self, state: DrafterState, decision: SpecDecision) -> np.ndarray | None:
        """P(accept length = i + 1) as measured in this step for ``decision``, or None."""
        if state.num_rl_steps >= len(self.hists):
            return None
        hist = self.hists[state.num_rl_steps].get(decision.strategy)
        if not hist or not sum(hist):
            return None
        pmf = np.zeros(decision.draft_steps + 1)
        pmf[: len(hist)] = hist
        return pmf / pmf.sum()


@dataclass(frozen=True)
class MeasuredRun:
    """One measured trace, ready to simulate."""

    source: str
    trace: Trace
    policy: str
    settings: dict[str, Any]  # make_policy keyword arguments
    policy_seed: int
    placement: tuple[tuple[tuple[str, ...], ...], ...]  # per step, per instance: prompt ids
    max_running_requests: int | None  # None: each instance admits its whole share
    acceptance: MeasuredAcceptance
    clock: str  # "wall" | "cpu": what the measured seconds are
    share_prompts: bool = False  # the engine prefilled a group's prompt once (SimConfig's)
    prefix_block_tokens: int = 1  # in whole blocks of this many tokens (SimConfig's)

    @property
    def num_instances(self) -> int:
        return len(self.placement[0])

    def instance_trace(self, instance: int) -> Trace:
        """The steps' prompts that ran on ``instance`` (a one-instance trace), in the order the
        instance admitted them (``measured.instance_prompts``'s)."""
        steps = []
        for step, owners in zip(self.trace.steps, self.placement, strict=True):
            by_id = {p.id: p for p in step.prompts}
            steps.append(Step(step.step, tuple(by_id[pid] for pid in owners[instance])))
        return Trace(meta=self.trace.meta, steps=tuple(steps))

    def max_share(self, instance: int) -> int:
        """The most responses ``instance`` served in one step (the cap when none is recorded)."""
        trace = self.instance_trace(instance)
        return max(s.num_responses for s in trace.steps)


def _measured(step: Step, source: str) -> MeasuredStep:
    """The step's block, which must hold the rollout seconds (the types were checked on load)."""
    m = step.measured
    if m is None:
        raise UsageError(
            f"{source}: step {step.step}: no 'measured' block (expected a trace written by tltrun)"
        )
    if m.rollout_s is None or not m.rollout_s > 0:
        raise UsageError(
            f"{source}: step {step.step}: field 'measured.rollout_s': expected seconds > 0, got {m.rollout_s!r}"
        )
    return m


def _policy(trace: Trace, source: str) -> tuple[str, dict[str, Any], int]:
    """Name, recorded settings and seed of the one policy every step ran."""
    names, configs, seeds = set(), [], set()
    for step in trace.steps:
        policy = _measured(step, source).policy or PolicyRecord()
        if policy.name not in POLICY_NAMES:
            raise UsageError(
                f"{source}: step {step.step}: field 'measured.policy.name': expected one of {', '.join(POLICY_NAMES)}, got {policy.name!r}"
            )
        names.add(policy.name)
        configs.append(policy.config if policy.config is not None else {})
        seeds.add(policy.seed if policy.seed is not None else 0)
    if len(names) > 1 or len(seeds) > 1 or any(c != configs[0] for c in configs):
        raise UsageError(
            f"{source}: steps ran different policies or settings ({', '.join(sorted(names))}); compare one policy per trace"
        )
    return names.pop(), dict(configs[0]), seeds.pop()


def _settings(
    name: str, config: dict[str, Any], trace: Trace, source: str, tlt: dict[str, Any] | None
):
    """``make_policy`` keyword arguments; ``tlt`` (the command line's TLTConfig fields) replaces
    those fields of the recorded config, which keeps the others."""
    if name == "nospec":
        return {}
    if name == "static":
        strategy = config.get("strategy")
        if strategy is None:
            used = set()
            for step in trace.steps:
                used |= set(step.measured.policy.sd_strategies())
            if len(used) != 1:
                raise UsageError(
                    f"{source}: static policy without 'measured.policy.config.strategy' and {len(used)} strategies in 'policy.iterations_per_strategy' (expected exactly one)"
                )
            strategy = used.pop()
        try:
            SpecDecision.parse(strategy)
        except ValueError as err:
            raise UsageError(f"{source}: field 'measured.policy.config.strategy': {err}") from None
        return {"strategy": strategy}
    if tlt and name == "tltbase":  # its switch and bandit fields, its own strategies
        config = {**config, **{k: v for k, v in tlt.items() if k in TLTBASE_FIELDS}}
    elif tlt:
        config = {**config, **tlt}
    names = {f.name for f in dataclasses.fields(TLTConfig)}
    unknown = sorted(set(config) - names)
    if unknown:
        raise UsageError(
            f"{source}: field 'measured.policy.config.{unknown[0]}': not a TLTConfig field ({', '.join(sorted(names))})"
        )
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        built = TLTBase.config_of(values) if name == "tltbase" else TLTConfig(**values)
        return dataclasses.asdict(built)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{source}: field 'measured.policy.config': {err}") from None


def _placement(step: Step, source: str) -> tuple[tuple[str, ...], ...]:
    m = step.measured
    ids = [p.id for p in step.prompts]
    owners = m.instance_prompts
    where = f"{source}: step {step.step}: field 'measured.instance_prompts'"
    if owners is None:
        workers = m.worker_rollout_s
        if workers is not None and len(workers) > 1:
            raise UsageError(
                f"{where}: missing, but {len(workers)} workers ran the step (expected one list of prompt ids per worker)"
            )
        return (tuple(ids),)
    if not owners:
        raise UsageError(f"{where}: expected a non-empty list of lists of prompt ids")
    flat = [pid for o in owners for pid in o]
    if sorted(flat) != sorted(ids):
        raise UsageError(f"{where}: must name every prompt of the step exactly once")
    if any(not o for o in owners):
        raise UsageError(f"{where}: an instance without prompts cannot be simulated")
    return tuple(tuple(o) for o in owners)


def _instance_runs(trace: Trace, placement: tuple) -> str:
    """'steps 0-2 on 2 instances, steps 3-4 on 4': consecutive steps of one instance count."""
    runs: list[list] = []  # [first step, last step, instances]
    for step, owners in zip(trace.steps, placement, strict=True):
        if runs and runs[-1][2] == len(owners):
            runs[-1][1] = step.step
        else:
            runs.append([step.step, step.step, len(owners)])
    return ", ".join(
        f"step{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''} on {n} instance{'s' * (n > 1)}"
        for a, b, n in runs
    )


def _max_running(trace: Trace, source: str, given: int | None) -> int | None:
    if given is not None:
        return given
    values = set()
    for step in trace.steps:
        value = step.measured.max_running_requests
        if value is UNRECORDED:
            raise UsageError(
                f"{source}: step {step.step}: field 'measured.max_running_requests' is missing (record it, or pass --max-running-requests)"
            )
        values.add(value)
    if len(values) > 1:
        raise UsageError(f"{source}: 'measured.max_running_requests' differs between steps")
    return values.pop()


def _has_verifies(trace: Trace) -> bool:
    for step in trace.steps:
        by_strategy = step.measured.accept_hist_by_strategy if step.measured else None
        if by_strategy and any(sum(h) for h in by_strategy.values()):
            return True
        if any(r.accept_hist and sum(r.accept_hist) for p in step.prompts for r in p.responses):
            return True
    return False


def replayed_acceptance(trace: Trace, source: str, strategy: str = "") -> MeasuredAcceptance:
    """Per-step maximum-likelihood acceptance of the trace's verifies (steps without verifies
    get the run's pooled estimate; a run without any gets ``DEFAULT_ACCEPT_RATE``)."""
    history, history_rates = replayed_history(trace, source)
    steps = []
    if _has_verifies(trace):
        steps = collect_steps(
            trace, source, strategy, is_history_fitted=history is not None, is_eagle_required=False
        )
    if not any(s.hists for s in steps):
        rates = (DEFAULT_ACCEPT_RATE,) * len(trace.steps)
        return MeasuredAcceptance(
            rates,
            history=history,
            history_response_rates=history_rates,
            prompt_ids_recur=prompt_ids_name_prompts(trace),
        )
    is_tree = any(not d.is_chain for s in steps for d in s.hists)
    sibling = fit_sibling_rate(steps)[0] if is_tree else DEFAULT_SIBLING_RATE
    pooled: dict[SpecDecision, np.ndarray] = {}
    for s in steps:
        for d, hist in s.hists.items():
            have = pooled.get(d, np.zeros(0))
            n = max(have.size, hist.size)
            pooled[d] = np.pad(have, (0, n - have.size)) + np.pad(hist, (0, n - hist.size))
    overall = estimate_accept_rate(pooled, sibling)[0]
    rates = tuple(estimate_accept_rate(s.hists, sibling)[0] if s.hists else overall for s in steps)
    hists = tuple({d.strategy: tuple(int(c) for c in h) for d, h in s.hists.items()} for s in steps)
    per_response = tuple(_response_rates(step, source, sibling) for step in trace.steps)
    return MeasuredAcceptance(
        rates,
        sibling,
        hists,
        per_response,
        history,
        history_rates,
        prompt_ids_name_prompts(trace),
    )


def replayed_history(
    trace: Trace, source: str
) -> tuple[HistoryModel | None, tuple[dict[str, tuple[float, ...]], ...]]:
    """The history drafter's model fitted on the trace (None: no per-response history arms)
    and, per step, each response's own maximum-likelihood history rate (nan: none)."""
    observations = history_observations(trace, source)
    if not observations:
        return None, ()
    model = fit_history(observations).model
    own: dict[tuple[int, str, int], list[HistoryObservation]] = {}
    for o in observations:
        own.setdefault((o.step, o.prompt_id, o.response), []).append(o)
    out = []
    for step in trace.steps:
        table = {}
        for p in step.prompts:
            rates = [
                _history_rate(model, own.get((step.step, p.id, i), []))
                for i in range(len(p.responses))
            ]
            if any(math.isfinite(r) for r in rates):
                table[p.id] = tuple(rates)
        out.append(table)
    return model, tuple(out)


def _history_rate(model: HistoryModel, observations: list[HistoryObservation]) -> float:
    """Maximum-likelihood per-token rate of one response's history verifies (all its history
    arms); nan without any."""
    if not observations:
        return math.nan

    def loglik(a: float) -> float:
        total = 0.0
        for o in observations:
            pmf = history_accept_len_pmf(o.decision, a, model.sibling_rate)[: o.hist.size]
            total += float(o.hist @ np.log(np.maximum(pmf, 1e-300)))
        return total

    return float(argmax_unimodal(loglik, 1e-6, 1 - 1e-6))


def _response_rates(step: Step, source: str, sibling_rate: float) -> dict[str, tuple[float, ...]]:
    """Each response's maximum-likelihood acceptance rate from its own verifies by strategy
    (``measured.response_accept_hist_by_strategy``); nan for one that verified nothing."""
    table = step.measured.response_accept_hist_by_strategy if step.measured else None
    if table is None:
        return {}
    where = f"{source}: step {step.step}: field 'measured.response_accept_hist_by_strategy'"
    # (a loaded trace was checked so; a Trace built in code is checked here)
    step.measured.check_against(
        {p.id: len(p.responses) for p in step.prompts}, f"{source}: step {step.step}"
    )
    out = {}
    for pid, per_response in table.items():
        rates = []
        for i, by_strategy in enumerate(per_response):
            at = f"{where}[{pid!r}][{i}]"
            hists = checked_hists(eagle_hists(hists_by_strategy(by_strategy))[0], at)
            if not hists:
                rates.append(math.nan)
                continue
            rates.append(float(estimate_accept_rate(hists, sibling_rate)[0]))
        out[pid] = tuple(rates)
    return out


def measured_run(
    trace: Trace,
    source: str,
    max_running_requests: int | None = None,
    tlt: dict[str, Any] | None = None,
) -> MeasuredRun:
    """Read everything the simulation of ``trace`` needs (see the module docstring)."""
    name, config, seed = _policy(trace, source)
    placement = tuple(_placement(step, source) for step in trace.steps)
    if len({len(p) for p in placement}) > 1:
        raise UsageError(
            f"{source}: the number of instances changes between steps ({_instance_runs(trace, placement)}:"
            " a run resumed on another number of workers?); the simulation replays one cluster"
            " size: compare the steps of each size as a trace of their own"
        )
    strategy = config.get("strategy", "") if name == "static" else ""
    # absent: traces recorded before engines shared prompts / before the clock was recorded
    shares = {bool(step.measured.share_prompts) for step in trace.steps}
    if len(shares) > 1:
        raise UsageError(
            f"{source}: field 'measured.share_prompts': expected the same true or false in every step, got {sorted(map(str, shares))}"
        )
    blocks = {step.measured.prefix_block_tokens or 1 for step in trace.steps}
    if len(blocks) > 1:
        raise UsageError(
            f"{source}: field 'measured.prefix_block_tokens': expected the same integer >= 1 in every step, got {sorted(map(str, blocks))}"
        )
    clocks = {step.measured.clock or "wall" for step in trace.steps}
    if len(clocks) > 1:
        raise UsageError(
            f"{source}: field 'measured.clock': expected one of wall, cpu in every step, got {sorted(map(str, clocks))}"
        )
    return MeasuredRun(
        source=source,
        trace=trace,
        policy=name,
        settings=_settings(name, config, trace, source, tlt),
        policy_seed=seed,
        placement=placement,
        max_running_requests=_max_running(trace, source, max_running_requests),
        acceptance=replayed_acceptance(trace, source, strategy),
        clock=clocks.pop(),
        share_prompts=shares.pop(),
        prefix_block_tokens=blocks.pop(),
    )


__all__ = ["MeasuredAcceptance", "MeasuredRun", "measured_run", "replayed_acceptance"]
