"""Weighted least squares of per-step drafter acceptance on ``DrafterDynamics`` (stage 2 of
``tltsim fit``; stage 1 and the contract with measured traces are in ``tltsim.fidelity.fit``).

The model is the simulator's own: ``predict`` runs ``DrafterDynamics.initial_state``,
``after_rl_step`` once per RL update between recorded steps, and ``after_training`` with each
step's trained tokens after its rollout, exactly as ``tltsim.sim.simulator`` does. Free parameters are
mapped to coordinates (rates through a logistic, scaled so that initial and stale acceptance
never exceed the maximum; learn_tokens through a logarithm, bounded to 1 .. e^40 tokens), and
``scipy.optimize.least_squares`` (trust-region reflective, bounded, numeric Jacobian), started
from a few points, minimises ``sum(((a_observed - a_predicted) / stderr)^2)``. scipy is the
``fit`` extra (``pip install -e .[fit]``): only ``tltsim fit`` needs it, and without it
``fit_dynamics`` raises one ``UsageError`` line saying so.

    fit = fit_dynamics(steps, DrafterDynamics(), fixed=())
    fit.dynamics, fit.stderr, fit.held, fit.chi2_per_dof
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from tltsim.errors import UsageError
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DrafterDynamics

DYNAMICS_FIELDS = (
    "initial_accept_rate",
    "max_accept_rate",
    "stale_accept_rate",
    "drift_per_step",
    "learn_tokens",
)
# When the data cannot support every parameter, these are held first (least determined first).
_DROP_ORDER = ("stale_accept_rate", "learn_tokens", "max_accept_rate", "drift_per_step")
_MIN_STDERR = 1e-4  # floor of a step's standard error: one step never gets unbounded weight
# log(learn_tokens) in [0, 40] (1 .. 2e17 tokens): a flat direction must not overflow the search
_LOG_LEARN_BOUNDS = (0.0, 40.0)


@dataclass
class StepAcceptance:
    """One RL step of a measured trace: verify histograms by strategy, tokens the drafter was
    trained on during the step, and (filled by stage 1) the step's acceptance estimate."""

    step: int
    hists: dict[SpecDecision, np.ndarray]
    trained_tokens: int = 0
    accept_rate: float = math.nan
    stderr: float = math.nan

    @property
    def num_verifies(self) -> int:
        return int(sum(h.sum() for h in self.hists.values()))


@dataclass
class DynamicsFit:
    dynamics: DrafterDynamics
    fitted: tuple[str, ...]
    held: dict[str, str]  # parameter -> why it was held at its base value
    stderr: dict[str, float]
    chi2_per_dof: float
    predicted: list[float] = field(default_factory=list)  # per step, observed or not
    # fitted parameter -> why its value says little: at a bound (one a held value sets, too),
    # or not determined by the data (an infinite standard error)
    caveats: dict[str, str] = field(default_factory=dict)


def predict(dynamics: DrafterDynamics, steps: list[StepAcceptance]) -> list[float]:
    """Acceptance during each step's rollout under ``dynamics`` (the simulator's recursion)."""
    state, out, prev = dynamics.initial_state(), [], None
    for s in steps:
        if prev is not None:
            for _ in range(s.step - prev):
                state = dynamics.after_rl_step(state)
        out.append(state.accept_rate)
        if s.trained_tokens:
            state = dynamics.after_training(state, s.trained_tokens)
        prev = s.step
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


class _Model:
    """Maps free coordinates to DrafterDynamics and residuals; held values come from ``base``."""

    def __init__(
        self,
        steps: list[StepAcceptance],
        base: DrafterDynamics,
        free: tuple[str, ...],
        max_hold: float,
    ):
        self.steps, self.base, self.free = steps, base, free
        self.observed = [i for i, s in enumerate(steps) if s.hists]
        self.obs = np.array([steps[i].accept_rate for i in self.observed])
        self.se = np.array([max(steps[i].stderr, _MIN_STDERR) for i in self.observed])
        self.max_hold = max_hold
        # max_accept_rate never drops below a held initial or stale rate
        self.floor = max(
            [
                getattr(base, n)
                for n in ("initial_accept_rate", "stale_accept_rate")
                if n not in free
            ]
            + [0.0]
        )

    def theta(self, p: np.ndarray) -> dict[str, float]:
        v = dict(zip(self.free, p, strict=True))
        t = {n: getattr(self.base, n) for n in DYNAMICS_FIELDS}
        t["max_accept_rate"] = (
            self.floor + (1 - self.floor) * _sigmoid(v["max_accept_rate"])
            if "max_accept_rate" in v
            else self.max_hold
        )
        for n in ("initial_accept_rate", "stale_accept_rate"):
            if n in v:
                t[n] = t["max_accept_rate"] * _sigmoid(v[n])
        if "drift_per_step" in v:
            t["drift_per_step"] = _sigmoid(v["drift_per_step"])
        if "learn_tokens" in v:
            t["learn_tokens"] = math.exp(v["learn_tokens"])  # within _LOG_LEARN_BOUNDS
        return t

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) of the coordinates: only log(learn_tokens) is bounded (the logistic
        coordinates map all of R into their ranges)."""
        lo = [_LOG_LEARN_BOUNDS[0] if n == "learn_tokens" else -np.inf for n in self.free]
        hi = [_LOG_LEARN_BOUNDS[1] if n == "learn_tokens" else np.inf for n in self.free]
        return np.array(lo), np.array(hi)

    def p_of(self, t: dict[str, float]) -> np.ndarray:
        m = t["max_accept_rate"]
        to_p = {
            "max_accept_rate": lambda: _logit((m - self.floor) / max(1 - self.floor, 1e-9)),
            "initial_accept_rate": lambda: _logit(t["initial_accept_rate"] / m),
            "stale_accept_rate": lambda: _logit(t["stale_accept_rate"] / m),
            "drift_per_step": lambda: _logit(t["drift_per_step"]),
            "learn_tokens": lambda: math.log(t["learn_tokens"]),
        }
        return np.array([to_p[n]() for n in self.free])

    def residuals_theta(self, t: dict[str, float]) -> np.ndarray:
        dyn = dataclasses.replace(self.base, **t)  # ValueError if t violates an invariant
        pred = predict(dyn, self.steps)
        return (self.obs - np.array([pred[i] for i in self.observed])) / self.se

    def residuals(self, p: np.ndarray) -> np.ndarray:
        try:
            return self.residuals_theta(self.theta(p))
        except ValueError:
            return np.full(len(self.observed), 1e6)


def _least_squares():
    """``scipy.optimize.least_squares``, or one UsageError line when scipy is not installed."""
    try:
        from scipy.optimize import least_squares
    except ImportError:
        raise UsageError(
            "tltsim fit needs scipy, which is not installed: pip install -e '.[fit]'"
        ) from None
    return least_squares


def _choose_free(
    steps: list[StepAcceptance], fixed: tuple[str, ...]
) -> tuple[tuple[str, ...], dict[str, str]]:
    held = {n: "held by --fixed" for n in fixed}
    observed = [i for i, s in enumerate(steps) if s.hists]
    trained_before_last = sum(s.trained_tokens for s in steps[: observed[-1]])
    if trained_before_last == 0:
        for n in ("max_accept_rate", "learn_tokens"):
            held.setdefault(
                n,
                "no drafter training before the last step with SD verifies (measured.drafter_trained_tokens)",
            )
    if len(observed) < 3:
        held.setdefault(
            "stale_accept_rate", f"needs >= 3 steps with SD verifies, got {len(observed)}"
        )
    free = [n for n in DYNAMICS_FIELDS if n not in held]
    for n in _DROP_ORDER:
        if len(free) <= len(observed):
            break
        if n in free:
            free.remove(n)
            held[n] = f"too few steps with SD verifies ({len(observed)}) for more parameters"
    return tuple(free), held


def _starts(model: _Model) -> list[np.ndarray]:
    obs = model.obs
    trained = [s.trained_tokens for s in model.steps if s.trained_tokens]
    learn = float(np.mean(trained)) if trained else model.base.learn_tokens
    starts = []
    for drift in (0.02, 0.1, 0.3):
        for scale in (0.3, 1.0, 3.0):
            t = {n: getattr(model.base, n) for n in DYNAMICS_FIELDS}
            t["max_accept_rate"] = (
                min(max(float(obs.max()) + 0.02, model.floor + 1e-3), 0.999)
                if "max_accept_rate" in model.free
                else model.max_hold
            )
            m = t["max_accept_rate"]
            t["initial_accept_rate"] = min(float(obs[0]), 0.99 * m)
            t["stale_accept_rate"] = min(0.8 * float(obs.min()), 0.99 * m)
            t["drift_per_step"], t["learn_tokens"] = drift, learn * scale
            starts.append(model.p_of(t))
    return starts


def _stderr(model: _Model, t: dict[str, float], r0: np.ndarray, scale: float) -> dict[str, float]:
    """Standard errors from the Jacobian in the natural parameters (central differences, or one
    side where the other would break an invariant such as stale <= max)."""
    cols = []
    for n in model.free:
        h = 1e-5 * max(abs(t[n]), 1e-3)
        sides = []
        for sign in (1, -1):
            with contextlib.suppress(ValueError):  # this side would break an invariant
                sides.append((sign, model.residuals_theta({**t, n: t[n] + sign * h})))
        if len(sides) == 2:
            cols.append((sides[0][1] - sides[1][1]) / (2 * h))
        elif sides:
            cols.append(sides[0][0] * (sides[0][1] - r0) / h)
        else:
            cols.append(np.zeros_like(r0))
    jac = np.column_stack(cols)
    # A parameter the residuals do not move (a zero column: drift at its bound 0 leaves the
    # stale rate nothing to act on) has an infinite standard error; the others' come from the
    # rest of the information matrix (one zero column made the whole matrix singular, and
    # every standard error was reported infinite: the tour's 20-step run, review)
    norms = np.linalg.norm(jac, axis=0)
    keep = norms > 1e-12 * max(float(norms.max(initial=0.0)), 1e-300)
    diag = np.full(len(model.free), math.inf)
    if keep.any():
        sub = jac[:, keep]
        # still singular: every kept parameter is undetermined too
        with contextlib.suppress(np.linalg.LinAlgError):
            diag[keep] = np.diag(np.linalg.inv(sub.T @ sub)) * scale
    return {
        n: (math.sqrt(d) if d >= 0 and math.isfinite(d) else math.inf)
        for n, d in zip(model.free, diag, strict=True)
    }


def fit_dynamics(
    steps: list[StepAcceptance], base: DrafterDynamics, fixed: tuple[str, ...] = ()
) -> DynamicsFit:
    """Fit the free DrafterDynamics fields to the steps' acceptance estimates (stage 1 filled
    ``accept_rate`` and ``stderr`` of every step with verifies)."""
    free, held = _choose_free(steps, fixed)
    no_training = held.get("max_accept_rate", "").startswith("no drafter training")
    # Without training max_accept_rate does not act on the fit; 1.0 keeps initial/stale free.
    model = _Model(steps, base, free, 1.0 if no_training else base.max_accept_rate)
    if free:
        least_squares = _least_squares()
        lower, upper = model.bounds()
        best = min(
            (
                least_squares(model.residuals, np.clip(p0, lower, upper), bounds=(lower, upper))
                for p0 in _starts(model)
            ),
            key=lambda result: result.cost,
        )
        t = model.theta(best.x)
    else:
        t = {n: getattr(base, n) for n in DYNAMICS_FIELDS}
    if no_training:
        # not determined, but never below a rate the drafter was seen at (DrafterDynamics
        # requires initial and stale <= max): say so where that moves it off the base value
        t["max_accept_rate"] = max(
            base.max_accept_rate, t["initial_accept_rate"], t["stale_accept_rate"]
        )
        if t["max_accept_rate"] != base.max_accept_rate:
            held["max_accept_rate"] += (
                f"; raised from the base {base.max_accept_rate:g} to the fitted"
                f" {'initial' if t['max_accept_rate'] == t['initial_accept_rate'] else 'stale'}"
                " rate (a drafter's max is at least the rates it was seen at)"
            )
    r0 = model.residuals_theta(t)
    chi2 = float(r0 @ r0)
    dof = len(model.observed) - len(free)
    scale = max(1.0, chi2 / dof) if dof > 0 else 1.0
    stderr = _stderr(model, t, r0, scale) if free else {}
    dynamics = dataclasses.replace(base, **t)
    return DynamicsFit(
        dynamics,
        free,
        held,
        stderr,
        chi2 / dof if dof > 0 else math.nan,
        predict(dynamics, steps),
        _caveats(model, t, stderr),
    )


_AT_BOUND = 1e-6  # a logistic coordinate's value this close to its end is at its bound


def _caveats(model: _Model, t: dict[str, float], stderr: dict[str, float]) -> dict[str, str]:
    """Fitted parameters whose value the data did not set (hunt: max_accept_rate printed as
    'fitted' at exactly the held stale rate, 0.5, above every measured rate of 0.27-0.35, and
    a drift that acted on nothing): at a bound, or with an infinite standard error."""
    out = {}
    m = t["max_accept_rate"]
    for n in model.free:
        if n == "max_accept_rate" and m - model.floor <= _AT_BOUND * max(1 - model.floor, 1e-9):
            setters = [
                h for h in ("initial_accept_rate", "stale_accept_rate")
                if h not in model.free and getattr(model.base, h) == model.floor
            ]  # fmt: skip
            if setters:
                out[n] = (
                    f"at its floor, the held {setters[0]} {model.floor:g}: hold that lower "
                    "(--base) or measure more steps"
                )
            else:
                out[n] = f"at its bound {model.floor:g}"
        elif n == "max_accept_rate" and m >= 1 - _AT_BOUND:
            out[n] = "at its bound 1"
        elif n in ("initial_accept_rate", "stale_accept_rate") and t[n] >= m * (1 - _AT_BOUND):
            out[n] = f"at its bound, max_accept_rate {m:g}"
        elif n in ("initial_accept_rate", "stale_accept_rate") and t[n] <= m * _AT_BOUND:
            out[n] = "at its bound 0"
        elif n == "drift_per_step" and not _AT_BOUND < t[n] < 1 - _AT_BOUND:
            out[n] = f"at its bound {round(t[n]):d}"
        elif n == "learn_tokens" and not (
            _LOG_LEARN_BOUNDS[0] + _AT_BOUND < math.log(t[n]) < _LOG_LEARN_BOUNDS[1] - _AT_BOUND
        ):
            out[n] = f"at its bound e^{round(math.log(t[n])):d} tokens"
        if not math.isfinite(stderr.get(n, math.inf)):
            reason = "not determined by the data: infinite standard error"
            out[n] = f"{out[n]}; {reason}" if n in out else reason
    return out


__all__ = [
    "DYNAMICS_FIELDS",
    "DynamicsFit",
    "StepAcceptance",
    "fit_dynamics",
    "predict",
]
