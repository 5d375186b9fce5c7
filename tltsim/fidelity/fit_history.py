"""``tltsim fit``'s history-drafter part (issue #20): ``HistoryModel``'s three logits from the
history arms of a measured trace, by maximum likelihood of each response's own verifies.

    from tltsim.fidelity.fit_history import fit_history, history_observations
    fit = fit_history(history_observations(trace, "runs/x/trace.json"))
    fit.model            # a tltsim.sim.history_acceptance.HistoryModel

Contract: what the trace must record (tltrun writes it)
-------------------------------------------------------
* per step ``measured.response_accept_hist_by_strategy``: each response's verify histograms by
  arm; the history drafter's arms are ``"history:STRATEGY"`` (``tltsim.trace.measured``).
* per step ``measured.instance_prompts`` (optional): which worker served which prompt; absent,
  one worker served the step. A worker's history index is its own (``HistoryModel.scope``
  "instance", as tltrun's engine keeps it).

Covariates, reconstructed from the trace (the trace records no per-verify group progress):

* h, the history flag of (step, prompt): an earlier step ran the same prompt id on the same
  worker, whose engine had drafted from the history by then (that step or before: tltrun keeps
  a rollout as history once its engine has drafted from the history; another worker's history
  verifies do not count). This needs prompt ids that name prompts
  across steps (``prompt_ids_name_prompts``): a measured block says so in
  ``is_prompt_id_stable`` (``tltrun train`` names each group by its dataset prompt id, the
  history drafter's key; ``tltrun bench``/``generate`` replays name a step's groups only). A
  tltrun trace written before that field existed named groups ``p0``, ``p1``, ... per step, so
  for it (a measured block naming a ``backend``) h = 0 and ``history_logit`` is held.
* f, the finished-sibling fraction, per verify: tltrun speculates from the policy's switch to
  the end of the rollout, so a response's SD verifies (all arms) emitted its last T tokens,
  T = sum over verifies of the accept length. Its siblings run in the same batch from the same
  admission; we take the sibling of length L_j as finished once the response has generated L_j
  tokens (decoding in lockstep: each running request gains about the same tokens per
  iteration). Over the window [L - T, L) f is a step function of position; a constant piece
  with a share t_k of the window's tokens holds a share of its verifies proportional to
  t_k / E[L | f_k, h] (fewer tokens per verify where acceptance is low: renewal theory). So
  each response's verifies are i.i.d. from the mixture sum_k w_k pmf(a(f_k, h)) with those
  weights w_k, which depend on the parameters and are recomputed with them.
  Both are approximations: admission waves (``max_running_requests`` below the group's share)
  and unequal speeds of siblings blur f; tests/test_history_fit.py checks that the fit recovers
  known parameters on data drawn with the simulator's own walk.

Fit: Nelder-Mead then BFGS (scipy, the ``fit`` extra) on the negative log-likelihood over
(base_logit, finished_logit, history_logit) and, where the history drafter verified trees,
``sibling_rate`` (as its logit); standard errors from the inverse Hessian (none for an estimate
at the optimiser's bound, |x| = 30). A parameter the data cannot determine (no h = 1
responses; f the same for every verify; no tree verifies) is held at its base value and
reported as such.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tltsim.errors import UsageError
from tltsim.policy import SpecDecision
from tltsim.sim.history_acceptance import HistoryModel, history_accept_len_pmf
from tltsim.trace.measured import arm_drafter
from tltsim.trace.schema import Trace

LOGITS = ("base_logit", "finished_logit", "history_logit")


@dataclass(frozen=True, kw_only=True)
class HistoryObservation:
    """One response's verifies under one history arm, with its covariates."""

    step: int
    prompt_id: str
    response: int  # index within the prompt's group
    decision: SpecDecision
    hist: np.ndarray  # hist[i] = verifies that accepted i drafts
    fractions: tuple[float, ...]  # f of each piece of its SD window
    weights: tuple[float, ...]  # each piece's share of the window's tokens (sums to 1)
    has_history: bool


@dataclass(frozen=True, kw_only=True)
class HistoryFit:
    model: HistoryModel
    fitted: tuple[str, ...]
    held: dict[str, str]  # name -> why
    stderr: dict[str, float]
    num_responses: int
    num_verifies: int
    mean_accept_len: float  # measured, tokens per verify incl. the bonus token
    predicted_accept_len: float  # under the fitted model, same responses and windows

    def to_json(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "fitted": list(self.fitted),
            "held": self.held,
            "stderr": {k: (v if math.isfinite(v) else None) for k, v in self.stderr.items()},
            "num_responses": self.num_responses,
            "num_verifies": self.num_verifies,
            "mean_accept_len": self.mean_accept_len,
            "predicted_accept_len": self.predicted_accept_len,
        }


def window_pieces(length: int, sd_tokens: int, siblings: list[int]) -> tuple[tuple, tuple]:
    """(f per piece, weight per piece) of a response of ``length`` tokens whose last
    ``sd_tokens`` were emitted by SD verifies, among siblings of these lengths (module
    docstring: sibling j counts as finished from position L_j on)."""
    start = max(length - sd_tokens, 0)
    num = max(len(siblings), 1)
    cuts = sorted({start, length} | {j for j in siblings if start < j < length})
    fractions, weights = [], []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        fractions.append(sum(1 for j in siblings if j <= lo) / num)
        weights.append((hi - lo) / max(length - start, 1))
    if not fractions:  # an empty window: the response's end
        fractions, weights = [sum(1 for j in siblings if j <= start) / num], [1.0]
    return tuple(fractions), tuple(weights)


def prompt_ids_name_prompts(trace: Trace) -> bool:
    """Whether the same prompt id in two steps is the same prompt, i.e. earlier rollouts of it
    are history (module docstring): what the measured blocks record in
    ``is_prompt_id_stable`` (all must say True); where none records it, not for traces
    written by tltrun (a measured block naming its ``backend``), yes for the others."""
    recorded = [
        s.measured.is_prompt_id_stable
        for s in trace.steps
        if s.measured is not None and s.measured.is_prompt_id_stable is not None
    ]
    if recorded:
        return all(recorded)
    return not any(s.measured is not None and s.measured.backend for s in trace.steps)


def history_observations(
    trace: Trace, source: str, are_ids_stable: bool | None = None
) -> list[HistoryObservation]:
    """Every response's history-arm verifies with its covariates (module docstring);
    ``are_ids_stable`` overrides ``prompt_ids_name_prompts``."""
    if are_ids_stable is None:
        are_ids_stable = prompt_ids_name_prompts(trace)
    out: list[HistoryObservation] = []
    served: dict[str, set[int]] = {}  # prompt id -> workers that kept its rollouts as history
    # workers whose history drafter has drafted (rollout_history.RolloutHistory.is_used): only
    # they keep their rollouts as history; one worker's history verifies marked every worker's
    # prompts of the step (an eagle+history run's other workers kept nothing)
    drafting_workers: set[int] = set()
    for step in trace.steps:
        m = step.measured
        table = m.response_accept_hist_by_strategy if m is not None else None
        owners = m.instance_prompts if m is not None and m.instance_prompts else None
        worker = {pid: w for w, ids in enumerate(owners) for pid in ids} if owners else {}
        where = f"{source}: step {step.step}: field 'measured.response_accept_hist_by_strategy'"
        for p in step.prompts:
            per_response = (table or {}).get(p.id)
            if per_response is None:
                continue
            if len(per_response) != len(p.responses):
                raise UsageError(
                    f"{where}[{p.id!r}]: expected one entry per response ({len(p.responses)}), got {len(per_response)}"
                )
            lengths = [r.tokens for r in p.responses]
            has = worker.get(p.id, 0) in served.get(p.id, set())
            for i, by_arm in enumerate(per_response):
                sd_tokens = sum((n + 1) * c for h in by_arm.values() for n, c in enumerate(h))
                pieces = window_pieces(lengths[i], sd_tokens, lengths[:i] + lengths[i + 1 :])
                for arm, hist in by_arm.items():
                    if arm_drafter(arm) != "history" or not sum(hist):
                        continue
                    decision = _decision(arm, hist, f"{where}.{p.id}[{i}]")
                    drafting_workers.add(worker.get(p.id, 0))
                    out.append(
                        HistoryObservation(
                            step=step.step,
                            prompt_id=p.id,
                            response=i,
                            decision=decision,
                            hist=np.asarray(hist, dtype=np.float64),
                            fractions=pieces[0],
                            weights=pieces[1],
                            has_history=has,
                        )
                    )
        if are_ids_stable:
            for p in step.prompts:
                if worker.get(p.id, 0) in drafting_workers:
                    served.setdefault(p.id, set()).add(worker.get(p.id, 0))
    return out


def _decision(arm: str, hist: tuple[int, ...], where: str) -> SpecDecision:
    try:
        decision = SpecDecision.parse(arm)
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None
    if not decision.enabled:
        raise UsageError(f"{where}: verifies recorded under strategy 'off'")
    last = max((i for i, c in enumerate(hist) if c), default=0)
    most = min(decision.draft_steps, decision.verify_tokens)  # no more than it verifies
    if last > most:
        raise UsageError(
            f"{where}: arm {arm} accepted {last} drafts but accepts at most {most} draft tokens per verify"
        )
    return decision


def _pieces(obs: list[HistoryObservation]) -> tuple[np.ndarray, ...]:
    """Flattened (observation index, f, h, weight) per window piece."""
    index = np.concatenate([np.full(len(o.fractions), k) for k, o in enumerate(obs)])
    f = np.concatenate([np.asarray(o.fractions) for o in obs])
    h = np.concatenate([np.full(len(o.fractions), float(o.has_history)) for o in obs])
    w = np.concatenate([np.asarray(o.weights) for o in obs])
    return index, f, h, w


def _neg_loglik(
    model: HistoryModel, obs: list[HistoryObservation], pieces: tuple[np.ndarray, ...]
) -> float:
    index, f, h, w = pieces
    total = 0.0
    start = 0
    for o in obs:
        num = len(o.fractions)
        mix = np.zeros(o.decision.draft_steps + 1)
        lengths = np.arange(1, mix.size + 1)
        total_weight = 0.0
        for j in range(start, start + num):
            rate = model.accept_rate(min(f[j], 1.0), bool(h[j]))
            pmf = history_accept_len_pmf(o.decision, rate, model.sibling_rate)
            verifies = w[j] / float(pmf @ lengths)  # a piece's verifies: its tokens / E[L]
            mix += verifies * pmf
            total_weight += verifies
        mix /= total_weight
        start += num
        total -= float(o.hist @ np.log(np.maximum(mix[: o.hist.size], 1e-300)))
    return total


def _predicted_len(model: HistoryModel, obs: list[HistoryObservation]) -> float:
    """Mean accept length the model gives the observed verifies (same windows and arms)."""
    tokens = verifies = 0.0
    for o in obs:
        # tokens per verify over the window: its tokens over its expected verifies
        per_token = sum(
            w / model.expected_accept_len(o.decision, f, o.has_history)
            for f, w in zip(o.fractions, o.weights, strict=True)
        )
        tokens += float(o.hist.sum()) / per_token
        verifies += float(o.hist.sum())
    return tokens / verifies if verifies else 0.0


@dataclass
class _Free:
    names: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)


def _free_logits(obs: list[HistoryObservation], fixed: tuple[str, ...]) -> _Free:
    free = _Free()
    has = {o.has_history for o in obs}
    fractions = {round(f, 9) for o in obs for f in o.fractions}
    for name in LOGITS:
        if name in fixed:
            free.held[name] = "fixed by --fixed"
        elif name == "history_logit" and has != {False, True}:
            free.held[name] = "every response had the same history flag"
        elif name == "finished_logit" and len(fractions) < 2:
            free.held[name] = "the finished-sibling fraction never varied"
        else:
            free.names.append(name)
    # a tree's other branches: fitted where the history drafter verified trees (held at the
    # base value, a top-4 tree's 1.58 accept length could not come down to a measured 1.01)
    if "sibling_rate" in fixed:
        free.held["sibling_rate"] = "fixed by --fixed"
    elif not any(o.decision.topk > 1 for o in obs):
        free.held["sibling_rate"] = "no tree verifies of the history drafter"
    else:
        free.names.append("sibling_rate")
    return free


# The optimiser's coordinates: the logits as they are, sibling_rate as its logit (in (0, 1));
# |x| past BOUND is refused, so an estimate there is at its bound (the data push it further)
BOUND = 30.0


def _to_x(name: str, value: float) -> float:
    if name != "sibling_rate":
        return value
    v = min(max(value, 1e-9), 1 - 1e-9)
    return math.log(v / (1 - v))


def _from_x(name: str, x: float) -> float:
    return 1 / (1 + math.exp(-x)) if name == "sibling_rate" else x


def fit_history(
    obs: list[HistoryObservation],
    base: HistoryModel | None = None,
    fixed: tuple[str, ...] = (),
) -> HistoryFit:
    """Maximum-likelihood ``HistoryModel`` logits (module docstring); ``base`` supplies the held
    values and the start. Needs scipy (the ``fit`` extra)."""
    base = base or HistoryModel()
    if not obs:
        raise UsageError("no history-drafter verifies per response to fit")
    try:
        from scipy.optimize import minimize
    except ImportError:  # pragma: no cover - scipy ships with the fit extra
        raise UsageError("fitting the history model needs scipy: pip install 'tlt[fit]'") from None
    free = _free_logits(obs, fixed)
    pieces = _pieces(obs)

    def model_at(x: np.ndarray) -> HistoryModel:
        values = {n: _from_x(n, float(v)) for n, v in zip(free.names, x, strict=True)}
        return dataclasses.replace(base, **values)

    def nll(x: np.ndarray) -> float:
        if not np.all(np.isfinite(x)) or np.any(np.abs(x) > BOUND):
            return 1e300
        return _neg_loglik(model_at(x), obs, pieces)

    x0 = np.array([_to_x(n, getattr(base, n)) for n in free.names], dtype=np.float64)
    stderr: dict[str, float] = {}
    if free.names:
        first = minimize(nll, x0, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9})
        best = minimize(nll, first.x, method="BFGS")
        x = best.x if best.fun <= first.fun else first.x
        hess = _hessian(nll, x)
        try:
            cov = np.linalg.inv(hess)
            diag = np.diag(cov)
        except np.linalg.LinAlgError:
            diag = np.full(x.size, np.inf)
        for name, var, xi in zip(free.names, diag, x, strict=True):
            se = math.sqrt(var) if var > 0 else math.inf
            if name == "sibling_rate":  # the delta method: d rate / d logit = rate (1 - rate)
                se *= _from_x(name, xi) * (1 - _from_x(name, xi))
            # at the bound the curvature says nothing: no error bar (it printed a number)
            stderr[name] = math.inf if abs(xi) > BOUND - 0.01 else se
        model = model_at(x)
    else:
        model = base
    verifies = sum(float(o.hist.sum()) for o in obs)
    tokens = sum(float(o.hist @ np.arange(1, o.hist.size + 1)) for o in obs)
    return HistoryFit(
        model=model,
        fitted=tuple(free.names),
        held=free.held,
        stderr=stderr,
        num_responses=len({(o.step, o.prompt_id, o.response) for o in obs}),
        num_verifies=int(verifies),
        mean_accept_len=tokens / verifies,
        predicted_accept_len=_predicted_len(model, obs),
    )


def _hessian(f, x: np.ndarray, step: float = 1e-3) -> np.ndarray:
    """Central-difference Hessian of ``f`` at ``x``."""
    n = x.size
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i, n):
            ei, ej = np.eye(n)[i] * step, np.eye(n)[j] * step
            value = (f(x + ei + ej) - f(x + ei - ej) - f(x - ei + ej) + f(x - ei - ej)) / (
                4 * step * step
            )
            out[i, j] = out[j, i] = value
    return out


__all__ = [
    "HistoryFit",
    "HistoryObservation",
    "LOGITS",
    "fit_history",
    "history_observations",
    "prompt_ids_name_prompts",
    "window_pieces",
]
