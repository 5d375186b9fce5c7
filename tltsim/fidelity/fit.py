"""``tltsim fit``: drafter-dynamics parameters from a measured run (issue #7, part 3).

    tltsim fit runs/measured.json --out fitted_drafter.json
    tltsim replay trace.json --drafter-dynamics fitted_drafter.json   # (see tltsim.cli.fidelity)

    from tltsim.fidelity.fit import FitConfig, fit_trace, load_dynamics
    result = fit_trace(load_trace("runs/measured.json"), FitConfig())
    result.dynamics            # a tltsim.sim.acceptance.DrafterDynamics

Two stages, both on the simulator's own model (``tltsim.sim.acceptance``):

1. Per RL step, the per-token acceptance ``a`` of the drafter's top-1 guess, by maximum
   likelihood of the step's verify outcomes. For chain drafting with k draft tokens a verify
   that accepted i tokens contributes a^i (1-a) (i < k) or a^k (i = k): a truncated geometric,
   so a = S / (S + F) (S accepted tokens, F rejections) with standard error sqrt(a(1-a)/(S+F)).
   For trees the likelihood is ``accept_len_pmf`` and ``a`` is found numerically; the tree
   model's ``sibling_rate`` is fitted once for the whole run by profile likelihood
   (``tltsim.fidelity.fit_accept``, which says how tree standard errors are taken).
2. ``DrafterDynamics`` (initial, max and stale acceptance, drift per RL step, learn tokens) by
   weighted least squares (``tltsim.fidelity.fit_dynamics``: scipy, the ``fit`` extra) of the
   per-step ``a`` on the dynamics recursion the simulator runs:
   the acceptance of step s's rollout, then training on that step's trained tokens, then one
   drift per RL update up to the next recorded step. Standard errors come from the Jacobian,
   scaled by the reduced chi^2 when it exceeds 1 (steps vary more than binomial noise).
   Parameters the trace cannot determine are held at their base values and reported as such.

Contract: what a measured trace must record (``tltrun`` writes it)
-----------------------------------------------------------------
* per response ``accept_hist``: ``accept_hist[i]`` = verify iterations in which the response had
  i draft tokens accepted (``tltrun.rollout.interface.RequestOutput``);
* per step ``measured``, to say which strategy produced those verifies, the first found of:
  ``accept_hist_by_strategy`` ({strategy: histogram summed over the step's responses}; needed
  when one step mixed strategies, e.g. TLTAdaptive's bandit), ``policy.iterations_per_strategy``
  with exactly one strategy other than "off" (``tltrun.rollout.measured_trace``), ``strategy``; else
  ``FitConfig.strategy`` (``--strategy``). Strategies are ``SpecDecision`` names ("4_1_4").
* the dynamics fit models the learned (EAGLE) drafter; verifies recorded under the history
  drafter's arms (``"history:6_1_6"``, a version-2 trace; ``tltsim.trace.measured``) fit its
  own ``HistoryModel`` (``tltsim.fidelity.fit_history``, from each response's
  ``measured.response_accept_hist_by_strategy``), written beside the dynamics in the same file
  (``"history"``; ``load_history`` reads it). A trace with history arms only fits the history
  model and keeps the dynamics at their base values. Callers that replay EAGLE acceptance
  only (``collect_steps(..., is_history_fitted=False)``) leave history arms out with one
  ``SkippedArmWarning``.
* per step ``measured.drafter_trained_tokens``: tokens the drafter was trained on during that
  step (the simulator's step record has the same field); absent = 0 (a frozen drafter).

Bad input (mixed strategies without a per-strategy histogram, a histogram longer than the
strategy allows, no SD verifies at all) is one ``UsageError`` line naming the file and step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tltsim.errors import UsageError
from tltsim.fidelity.fit_accept import estimate_accept_rate, fit_sibling_rate
from tltsim.fidelity.fit_dynamics import DYNAMICS_FIELDS, DynamicsFit, StepAcceptance, fit_dynamics
from tltsim.fidelity.fit_history import LOGITS, HistoryFit, fit_history, history_observations
from tltsim.jsonio import finite_json, read_json
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.trace.measured import MeasuredStep, arm_drafter
from tltsim.trace.schema import Step, Trace

FORMAT = "tlt-drafter-dynamics"
VERSION = 1


def _help(text: str) -> dict[str, str]:
    return {"help": text}


class SkippedArmWarning(UserWarning):
    """Verifies of a drafter other than EAGLE (a history arm) left out of the EAGLE fit."""


@dataclass(frozen=True)
class FitConfig:
    """Settings of ``tltsim fit`` (one flag per field)."""

    strategy: str = field(
        default="",
        metadata=_help("SD strategy of steps whose measured block does not name one, e.g. 4_1_4"),
    )
    fixed: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "DrafterDynamics and HistoryModel fields held at their base values: "
            + ", ".join(DYNAMICS_FIELDS + ("sibling_rate",) + LOGITS)
            + " (sibling_rate: the EAGLE drafter's and the history drafter's)"
        ),
    )

    def __post_init__(self) -> None:
        if self.strategy:
            decision = SpecDecision.parse(self.strategy)  # ValueError names the expected form
            if not decision.enabled:
                raise ValueError("strategy must enable SD ('off' produces no verifies)")
        known = DYNAMICS_FIELDS + ("sibling_rate",) + LOGITS
        unknown = sorted(set(self.fixed) - set(known))
        if unknown:
            raise ValueError(
                f"fixed: unknown field(s) {', '.join(unknown)}; expected some of {', '.join(known)}"
            )


# --- stage 0: per-step histograms from the trace ---------------------------------------------


def _step_strategy(measured: MeasuredStep | None, default: str) -> str | None:
    """The one SD strategy of a step's verifies (contract order), or None if none is named."""
    if measured is None:
        return default or None
    used = measured.policy.sd_strategies() if measured.policy is not None else []
    if len(used) > 1:
        raise ValueError(
            f"mixed strategies {', '.join(used)} in one step: measured.accept_hist_by_strategy is needed to tell their verifies apart"
        )
    if used:
        return used[0]
    return measured.strategy or default or None


def _summed_hist(step: Step) -> list[int]:
    total: list[int] = []
    for p in step.prompts:
        for r in p.responses:
            if r.accept_hist:
                total += [0] * (len(r.accept_hist) - len(total))
                total = [
                    t + (r.accept_hist[i] if i < len(r.accept_hist) else 0)
                    for i, t in enumerate(total)
                ]
    return total


def _step_hists(step: Step, where: str, default_strategy: str) -> dict[str, list[int]]:
    """Strategy name -> verify histogram of one step (empty without SD verifies)."""
    measured = step.measured
    if measured is not None and measured.accept_hist_by_strategy is not None:
        return hists_by_strategy(measured.accept_hist_by_strategy)
    total = _summed_hist(step)
    if not sum(total):
        return {}
    try:
        strategy = _step_strategy(measured, default_strategy)
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None
    if strategy is None:
        raise UsageError(
            f"{where}: responses have accept_hist but no strategy is recorded (expected measured.strategy, measured.policy.iterations_per_strategy or --strategy)"
        )
    return {strategy: total}


def hists_by_strategy(by_strategy: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """A recorded ``{strategy: verify counts}`` without its empty entries (the block's types
    were checked when the trace loaded)."""
    return {k: list(v) for k, v in by_strategy.items() if sum(v)}


def checked_hists(hists: dict[str, list[int]], where: str) -> dict[SpecDecision, np.ndarray]:
    """Strategy names parsed, 'off' refused, each histogram no longer than its strategy allows
    (trailing zeros dropped)."""
    checked = {}
    for name, hist in hists.items():
        try:
            decision = SpecDecision.parse(name)
        except ValueError as err:
            raise UsageError(f"{where}: {err}") from None
        if decision.drafter != "eagle":  # callers drop these first (collect_steps)
            raise UsageError(
                f"{where}: arm {name}: the acceptance model fits the EAGLE drafter only, not the {decision.drafter} drafter"
            )
        if not decision.enabled:
            raise UsageError(f"{where}: verifies recorded under strategy 'off'")
        # a verify accepts at most draft_steps tokens, and no more than it verifies
        most = min(decision.draft_steps, decision.verify_tokens)
        while len(hist) > most + 1 and hist[-1] == 0:
            hist = hist[:-1]
        if len(hist) > most + 1:
            raise UsageError(
                f"{where}: accept_hist has {len(hist)} entries but strategy {name} accepts at most {most} draft tokens per verify (expected <= {most + 1})"
            )
        checked[decision] = np.asarray(hist, dtype=np.float64)
    return checked


def eagle_hists(hists: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(the EAGLE drafter's histograms, {other drafter's arm: verifies}) of one step's."""
    eagle = {k: h for k, h in hists.items() if arm_drafter(k) == "eagle"}
    return eagle, {k: sum(h) for k, h in hists.items() if k not in eagle}


def collect_steps(
    trace: Trace,
    source: str,
    default_strategy: str = "",
    is_history_fitted: bool = False,
    is_eagle_required: bool = True,
) -> list[StepAcceptance]:
    """Per step: EAGLE verify histograms by strategy and drafter tokens trained (see the
    contract); other drafters' arms are left out, with one ``SkippedArmWarning`` unless their
    own model is fitted (``is_history_fitted``). Without ``is_eagle_required`` a trace with no
    EAGLE verifies gives steps without histograms instead of an error."""
    steps = []
    skipped: dict[str, int] = {}
    for s in trace.steps:
        where = f"{source}: step {s.step}"
        trained = s.measured.drafter_trained_tokens if s.measured is not None else None
        hists, other = eagle_hists(_step_hists(s, where, default_strategy))
        for arm, n in other.items():
            skipped[arm] = skipped.get(arm, 0) + n
        steps.append(StepAcceptance(s.step, checked_hists(hists, where), trained or 0))
    if not any(st.hists for st in steps) and not is_eagle_required:
        return steps
    if not any(st.hists for st in steps) and skipped:
        raise UsageError(
            f"{source}: no EAGLE-drafter verifies recorded, only {', '.join(sorted(skipped))} (the history model needs each response's histograms: measured.response_accept_hist_by_strategy)"
        )
    if not any(st.hists for st in steps):
        raise UsageError(
            f"{source}: no SD verifies recorded (expected per-response accept_hist or measured.accept_hist_by_strategy)"
        )
    if skipped and not is_history_fitted:
        warnings.warn(
            f"{source}: left out {sum(skipped.values())} verifies of {', '.join(sorted(skipped))}: "
            "the EAGLE fit leaves history arms out, and the history model needs each response's "
            "histograms (measured.response_accept_hist_by_strategy)",
            SkippedArmWarning,
            stacklevel=2,
        )
    return steps


# --- the whole fit -----------------------------------------------------------------------------


@dataclass
class FitResult:
    dynamics: DrafterDynamics
    fit: DynamicsFit | None  # None: no EAGLE verifies (dynamics = the base values)
    sibling_rate_se: float | None  # None: not fitted (no tree verifies, or fixed)
    steps: list[StepAcceptance]
    history: HistoryFit | None = None  # None: no history-drafter verifies

    def to_json(self, source: str) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "dynamics": dataclasses.asdict(self.dynamics),
            "fit": self._dynamics_json(source) if self.fit is not None else None,
        }
        if self.history is not None:
            out["history"] = self.history.to_json()
        return out

    def _dynamics_json(self, source: str) -> dict[str, Any]:
        stderr = dict(self.fit.stderr)
        if self.sibling_rate_se is not None:
            stderr["sibling_rate"] = self.sibling_rate_se
        return {
            "source": source,
            "fitted": list(self.fit.fitted)
            + (["sibling_rate"] if self.sibling_rate_se is not None else []),
            "held": self.fit.held,
            "caveats": self.fit.caveats,
            "stderr": {k: (v if math.isfinite(v) else None) for k, v in stderr.items()},
            "chi2_per_dof": self.fit.chi2_per_dof,
            "steps": [
                {
                    "step": s.step,
                    "num_verifies": s.num_verifies,
                    "accept_rate": s.accept_rate,
                    "stderr": s.stderr,
                    "predicted": p,
                    "drafter_trained_tokens": s.trained_tokens,
                }
                for s, p in zip(self.steps, self.fit.predicted, strict=True)
            ],
        }


def fit_trace(
    trace: Trace,
    config: FitConfig,
    source: str = "<trace>",
    base: DrafterDynamics | None = None,
    history_base: HistoryModel | None = None,
) -> FitResult:
    """Both stages on one measured trace, and the history model from its history arms;
    ``base`` (and ``history_base``) supply the held parameters."""
    base = base or DrafterDynamics()
    observations = history_observations(trace, source)
    history = None
    if observations:
        history = fit_history(
            observations,
            history_base,
            tuple(f for f in config.fixed if f in (*LOGITS, "sibling_rate")),
        )
    steps = collect_steps(
        trace,
        source,
        config.strategy,
        is_history_fitted=history is not None,
        is_eagle_required=history is None,
    )
    if not any(s.hists for s in steps):  # history arms only: the dynamics stay at the base
        return FitResult(base, None, None, steps, history)
    has_trees = any(not d.is_chain for s in steps for d in s.hists)
    sibling_rate, sibling_se = base.sibling_rate, None
    if has_trees and "sibling_rate" not in config.fixed:
        sibling_rate, sibling_se = fit_sibling_rate(steps)
    for s in steps:
        if s.hists:
            s.accept_rate, s.stderr, _ = estimate_accept_rate(s.hists, sibling_rate)
    base = dataclasses.replace(base, sibling_rate=sibling_rate)
    fit = fit_dynamics(steps, base, tuple(f for f in config.fixed if f != "sibling_rate"))
    if sibling_se is None:  # why, recorded as the other held fields' (it said "no tree
        # verifies" of a --fixed one, and the fit file named it neither fitted nor held)
        fixed = "sibling_rate" in config.fixed
        fit.held["sibling_rate"] = "held by --fixed" if fixed else "no tree verifies in the trace"
    return FitResult(fit.dynamics, fit, sibling_se, steps, history)


def save_fit(
    result: FitResult, path: str | Path, source: str, config: FitConfig | None = None
) -> None:
    """Write the fit as JSON (``load_dynamics`` reads it back), with the resolved config."""
    obj = result.to_json(source)
    obj["config"] = dataclasses.asdict(config or FitConfig())
    # null for what is not a number: chi2_per_dof without degrees of freedom, a step's rate
    # without verifies
    Path(path).write_text(json.dumps(finite_json(obj), indent=2, allow_nan=False) + "\n")


def load_history(path: str | Path) -> HistoryModel | None:
    """The ``HistoryModel`` a ``tltsim fit --out`` file holds beside the dynamics (None: the
    fitted trace had no history-drafter verifies); bad input is one UsageError line."""
    path = Path(path)
    obj = read_json(path, "drafter-dynamics JSON file")
    if type(obj) is not dict or obj.get("format") != FORMAT or obj.get("version") != VERSION:
        raise UsageError(
            f"{path}: expected a '{FORMAT}' version {VERSION} file (written by tltsim fit --out)"
        )
    entry = obj.get("history")
    if entry is None:
        return None
    params = entry.get("model") if type(entry) is dict else None
    names = {f.name for f in dataclasses.fields(HistoryModel)}
    if type(params) is not dict or set(params) - names:
        raise UsageError(
            f"{path}: field 'history.model': expected an object of {', '.join(sorted(names))}"
        )
    try:
        return HistoryModel(**params)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{path}: field 'history.model': {err}") from None


def load_dynamics(path: str | Path) -> DrafterDynamics:
    """A ``DrafterDynamics`` from ``tltsim fit --out`` JSON; bad input is one UsageError line."""
    path = Path(path)
    obj = read_json(path, "drafter-dynamics JSON file")
    if type(obj) is not dict or obj.get("format") != FORMAT or obj.get("version") != VERSION:
        raise UsageError(
            f"{path}: expected a '{FORMAT}' version {VERSION} file (written by tltsim fit --out)"
        )
    params = obj.get("dynamics")
    names = {f.name for f in dataclasses.fields(DrafterDynamics)}
    if type(params) is not dict:
        raise UsageError(
            f"{path}: field 'dynamics': expected an object of {', '.join(sorted(names))}"
        )
    unknown = sorted(set(params) - names)
    if unknown:
        raise UsageError(
            f"{path}: field 'dynamics.{unknown[0]}': unknown (expected {', '.join(sorted(names))})"
        )
    bad = [k for k, v in params.items() if type(v) not in (int, float)]
    if bad:
        raise UsageError(
            f"{path}: field 'dynamics.{bad[0]}': expected a number, got {params[bad[0]]!r}"
        )
    try:
        return DrafterDynamics(**params)
    except ValueError as err:
        raise UsageError(f"{path}: {err}") from None


__all__ = [
    "FORMAT",
    "FitConfig",
    "FitResult",
    "SkippedArmWarning",
    "collect_steps",
    "estimate_accept_rate",
    "fit_sibling_rate",
    "fit_trace",
    "load_dynamics",
    "load_history",
    "save_fit",
]
