"""The ``measured`` block of a tlt-trace step: what ``tltrun`` measured while it ran the step, as
one keyword-only frozen dataclass, ``MeasuredStep``. ``tltrun.rollout.measured_trace`` builds it;
``tltsim.fidelity`` (``measured_run``, ``compare``, ``fit``) reads its attributes.

    m = trace.steps[0].measured                      # a MeasuredStep, or None
    m.rollout_s, m.policy.name, m.max_running_requests
    MeasuredStep.from_dict(obj, where="runs/x.json: step 3")   # validated; TraceError if bad
    m.to_dict()                                      # the JSON object, keys in field order

JSON keys are the field names. A field that is None is absent from the JSON (``to_dict`` omits
it, ``from_dict`` reads an absent key as None), so a block written before a field existed
still loads, and a loaded trace saves byte-identical. The one field whose JSON ``null`` is a
value is ``max_running_requests`` (null: each instance admitted its whole share); absent, it
is ``UNRECORDED``. What each reader needs of the block: ``tltsim.fidelity.measured_run``
(``tltsim compare``) and ``tltsim.fidelity.fit`` (``tltsim fit``) list their contracts.

Strategy keys (of ``accept_hist_by_strategy``, ``response_accept_hist_by_strategy``,
``policy.iterations_per_strategy``, ``strategy``) name what drafted: a plain strategy
(``"6_1_6"``, ``"off"``) is the learned EAGLE drafter's, as in every trace written before
issue #20; another drafter's verifies are keyed by its arm, ``"DRAFTER:STRATEGY"``
(``tltsim.policy.SpecDecision.arm``, e.g. ``"history:6_1_6"``). A block naming such an arm
makes its trace version 2 (``tltsim.trace.schema.version_of``; traces/README.md).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tltsim.policy.spec import DRAFTERS
from tltsim.trace.errors import TraceError, is_int, is_number, show

Hist = tuple[int, ...]  # hist[i] = verifies that accepted i draft tokens


class Unrecorded(enum.Enum):
    """A field absent from the block, where JSON ``null`` already means something else."""

    UNRECORDED = "unrecorded"


UNRECORDED = Unrecorded.UNRECORDED
CLOCKS = ("wall", "cpu")  # tltrun.profile.timing.CLOCKS: what the block's seconds are


def arm_drafter(key: str) -> str:
    """The drafter a strategy key names: ``"history:6_1_6"`` -> ``"history"``; a plain
    strategy (``"6_1_6"``, ``"off"``) -> ``"eagle"`` (module docstring)."""
    drafter, sep, _ = key.partition(":")
    return drafter if sep else "eagle"


def _is_arm(key: Any) -> bool:
    """A plain strategy, or ``DRAFTER:STRATEGY`` for a drafter other than EAGLE (whose keys
    stay plain, so that one drafter has one key form)."""
    if type(key) is not str:
        return False
    drafter, sep, strategy = key.partition(":")
    return not sep or (drafter in DRAFTERS and drafter != "eagle" and bool(strategy))


@dataclass(frozen=True, kw_only=True)
class PolicyRecord:
    """The SD policy that ran the step (``measured.policy``)."""

    name: str | None = None  # tltsim.policy.make_policy name: "nospec" | "static" | "tlt" | ...
    # decode iterations per strategy ("off" = plain decode; a non-EAGLE drafter's arm,
    # "history:6_1_6"), sorted by key
    iterations_per_strategy: dict[str, int] | None = None
    # make_policy keyword settings the policy was built with, as JSON (tuples as lists); their
    # schema is the named policy's (TLTConfig fields for "tlt"), checked by whoever rebuilds it
    config: dict[str, Any] | None = None
    seed: int | None = None  # the seed the policy object was built with

    def sd_strategies(self) -> list[str]:
        """Sorted SD strategies (not "off") that ran at least one iteration."""
        counts = self.iterations_per_strategy or {}
        return sorted(name for name, n in counts.items() if name != "off" and n)

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_dict(cls, obj: Any, where: str = "") -> PolicyRecord:
        if type(obj) is not dict:
            raise _error(where, "policy", "an object", obj)
        _check_known(obj, _POLICY_CHECKS, where, "policy.")
        for key, value in obj.items():
            is_valid, expected, _ = _POLICY_CHECKS[key]
            if not is_valid(value):
                raise _error(where, f"policy.{key}", expected, value)
        return cls(**obj)


@dataclass(frozen=True, kw_only=True)
class MeasuredStep:
    """What one RL step measured. Every field is optional (None: not recorded); writers:
    ``tltrun.rollout.measured_trace.measured_step`` (bench, generate, train) and its callers'
    extras (train: ``train_s`` .. ``max_running_requests``; benchmarks/fidelity_runs.py:
    ``clock``, ``rollout_s_replays``)."""

    # -- the rollout (tltrun.rollout.measured_trace.rollout_summary) --
    rollout_s: float | None = None  # seconds of the rollout (several workers: the slowest)
    prefill_s: float | None = None  # target prefill iterations
    drafter_prefill_s: float | None = None  # drafter re-prefills (the cost of switching SD on)
    decode_s: float | None = None  # decode iterations, plain and SD
    sd_s: float | None = None  # SD iterations (draft + verify)
    num_iterations: int | None = None  # decode iterations
    num_sd_iterations: int | None = None
    decode_tokens: int | None = None  # tokens emitted by decode iterations
    decode_tokens_per_s: float | None = None
    total_tokens: int | None = None  # generated tokens of all responses
    mean_accept_len: float | None = None  # tokens per request per verify incl. bonus; 0: none
    policy: PolicyRecord | None = None
    hardware: str | None = None  # tltrun.rollout.measured_trace.hardware_name
    backend: str | None = None  # "torch" | "vllm"
    share_prompts: bool | None = None  # requests with identical prompts shared their prefill
    prefix_block_tokens: int | None = None  # ... in whole blocks of this many tokens
    accept_hist_by_strategy: dict[str, Hist] | None = None  # the step's verifies by strategy/arm
    # {prompt id: one {strategy: hist} per response, in the prompt's order}: each response's own
    response_accept_hist_by_strategy: dict[str, tuple[dict[str, Hist], ...]] | None = None
    # -- what the caller adds --
    clock: str | None = None  # "wall" | "cpu" seconds (None: wall)
    train_s: float | None = None  # the actor update (several workers: the slowest)
    drafter_train_s: float | None = None  # spot drafter training (the slowest worker)
    drafter_trained_tokens: int | None = None  # tokens the drafter was trained on in the step
    worker_rollout_s: tuple[float, ...] | None = None  # per worker: seconds to its last token
    instance_prompts: tuple[tuple[str, ...], ...] | None = None  # per worker: prompt ids served
    # True: the step's prompt ids are dataset prompt ids (tltrun train), so an id seen in an
    # earlier step is the same prompt and its rollouts there are history-drafter history
    # (issue #20); False: ids name this step's groups only. None (not recorded): the reader
    # decides (tltsim.fidelity.fit_history.prompt_ids_name_prompts)
    is_prompt_id_stable: bool | None = None
    # continuous-batching cap per engine instance; None: each instance admitted its whole share
    max_running_requests: int | None | Unrecorded = UNRECORDED
    rollout_s_replays: tuple[float, ...] | None = None  # every replay's seconds (bench_fidelity)
    # what the actor update ran (tltrun train's --num-epochs, --kl-coef): a profile's train op
    # timed with others prices another update (tltsim.fidelity.compare warns)
    num_epochs: int | None = None
    kl_coef: float | None = None
    strategy: str | None = None  # the step's one SD strategy (tltsim.fidelity.fit's contract)

    def arm_drafters(self) -> set[str]:
        """Every drafter the block's strategy keys name (``arm_drafter``); empty if none."""
        keys = set(self.accept_hist_by_strategy or ())
        for per_response in (self.response_accept_hist_by_strategy or {}).values():
            for hists in per_response:
                keys |= set(hists)
        if self.policy is not None:
            keys |= set(self.policy.iterations_per_strategy or ())
        if self.strategy is not None:
            keys.add(self.strategy)
        return {arm_drafter(k) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: keys in field order, fields not recorded (None, or UNRECORDED
        where null is a value) left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            absent = UNRECORDED if f.default is UNRECORDED else None  # null may be a value
            if value is not absent:
                out[f.name] = _to_json(value)
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str = "") -> MeasuredStep:
        """Validate a parsed ``measured`` object; ``where`` ("FILE: step N") starts every
        error message. Raises one-line ``TraceError`` naming the field."""
        if type(obj) is not dict:
            raise _error(where, "", "an object", obj)
        _check_known(obj, _CHECKS, where, "")
        values = {}
        for key, value in obj.items():
            if key == "policy":
                values[key] = PolicyRecord.from_dict(value, where)
                continue
            is_valid, expected, convert = _CHECKS[key]
            if not is_valid(value):
                raise _error(where, key, expected, value)
            values[key] = convert(value)
        return cls(**values)

    def check_against(self, responses: dict[str, int], where: str) -> None:
        """The per-prompt fields against the step's prompts (``responses``: prompt id ->
        number of responses): per-response histograms of known prompts, one entry per
        response; a placement naming every prompt once. One-line TraceError otherwise (validate
        accepted such blocks, compare refused them and fit dropped their histograms unsaid)."""
        by_prompt = self.response_accept_hist_by_strategy or {}
        field = "measured.response_accept_hist_by_strategy"
        for pid, per in by_prompt.items():
            if pid not in responses:
                raise TraceError(f"{where}: field '{field}': prompt {pid!r} is not in the step")
            if len(per) != responses[pid]:
                raise TraceError(
                    f"{where}: field '{field}': prompt {pid!r}: expected one entry per response "
                    f"({responses[pid]}), got {len(per)}"
                )
        if self.instance_prompts is not None:
            named = [pid for owner in self.instance_prompts for pid in owner]
            if sorted(named) != sorted(responses) or any(not o for o in self.instance_prompts):
                raise TraceError(
                    f"{where}: field 'measured.instance_prompts': expected every prompt of the "
                    "step exactly once, on instances that have prompts"
                )


# --- validation ------------------------------------------------------------------------------


def _error(where: str, name: str, expected: str, got: Any) -> TraceError:
    place = f"{where}: " if where else ""
    field = f"measured.{name}" if name else "measured"
    return TraceError(f"{place}field '{field}': expected {expected}, got {show(got)}")


def _check_known(obj: dict, checks: dict, where: str, prefix: str) -> None:
    unknown = sorted(set(obj) - set(checks))
    if unknown:
        place = f"{where}: " if where else ""
        raise TraceError(
            f"{place}unknown field {'measured.' + prefix + unknown[0]!r} (expected only {', '.join(checks)})"
        )


def _is_seconds(v: Any) -> bool:
    return is_number(v) and v >= 0


# Counts above this are no measurement (2^53: exact as a JSON/float number, and within int64:
# a prefix_block_tokens of 10^30 passed validate and overflowed compare's arrays)
MAX_MEASURED_COUNT = 2**53


def _is_count(v: Any) -> bool:
    return is_int(v) and 0 <= v <= MAX_MEASURED_COUNT


def _is_positive_count(v: Any) -> bool:
    return is_int(v) and 1 <= v <= MAX_MEASURED_COUNT


def _is_hist(v: Any) -> bool:
    return type(v) is list and all(_is_count(c) for c in v)


def _is_hists(v: Any) -> bool:
    return type(v) is dict and all(_is_arm(k) and _is_hist(h) for k, h in v.items())


def _is_list_of(v: Any, item: Callable[[Any], bool]) -> bool:
    return type(v) is list and all(item(x) for x in v)


def _hists(v: dict[str, list[int]]) -> dict[str, Hist]:
    return {k: tuple(h) for k, h in v.items()}


def _to_json(value: Any) -> Any:
    if isinstance(value, PolicyRecord):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_to_json(x) for x in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _same(v: Any) -> Any:
    return v


_SECONDS = (_is_seconds, "seconds >= 0", _same)
_COUNT = (_is_count, f"an integer in [0, {MAX_MEASURED_COUNT}]", _same)
_STRING = (lambda v: type(v) is str, "a string", _same)
_ARM = "strategy or DRAFTER:strategy with DRAFTER among " + ", ".join(
    d for d in DRAFTERS if d != "eagle"
)
# field -> (is valid JSON, what was expected, JSON -> field value); in MeasuredStep's order
_CHECKS: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    "rollout_s": _SECONDS,
    "prefill_s": _SECONDS,
    "drafter_prefill_s": _SECONDS,
    "decode_s": _SECONDS,
    "sd_s": _SECONDS,
    "num_iterations": _COUNT,
    "num_sd_iterations": _COUNT,
    "decode_tokens": _COUNT,
    "decode_tokens_per_s": (_is_seconds, "a number >= 0", _same),
    "total_tokens": _COUNT,
    "mean_accept_len": (_is_seconds, "a number >= 0", _same),
    "policy": (lambda v: True, "an object", _same),  # PolicyRecord.from_dict checks it
    "hardware": _STRING,
    "backend": _STRING,
    "share_prompts": (lambda v: type(v) is bool, "true or false", _same),
    "prefix_block_tokens": (_is_positive_count, f"an integer in [1, {MAX_MEASURED_COUNT}]", _same),
    "accept_hist_by_strategy": (_is_hists, "{" + _ARM + ": list of integers >= 0}", _hists),
    "response_accept_hist_by_strategy": (
        lambda v: type(v) is dict and all(_is_list_of(r, _is_hists) for r in v.values()),
        "{prompt id: [{" + _ARM + ": list of integers >= 0} per response]}",
        lambda v: {pid: tuple(_hists(h) for h in per) for pid, per in v.items()},
    ),
    "clock": (lambda v: v in CLOCKS, " or ".join(f"'{c}'" for c in CLOCKS), _same),
    "train_s": _SECONDS,
    "drafter_train_s": _SECONDS,
    "drafter_trained_tokens": _COUNT,
    "worker_rollout_s": (lambda v: _is_list_of(v, _is_seconds), "a list of seconds >= 0", tuple),
    "instance_prompts": (
        lambda v: _is_list_of(v, lambda o: _is_list_of(o, lambda p: type(p) is str)),
        "a list of lists of prompt ids",
        lambda v: tuple(tuple(o) for o in v),
    ),
    "is_prompt_id_stable": (lambda v: type(v) is bool, "true or false", _same),
    "max_running_requests": (
        lambda v: v is None or _is_positive_count(v),
        "an integer >= 1 or null",
        _same,
    ),
    "rollout_s_replays": (lambda v: _is_list_of(v, _is_seconds), "a list of seconds >= 0", tuple),
    "num_epochs": (_is_positive_count, f"an integer in [1, {MAX_MEASURED_COUNT}]", _same),
    "kl_coef": (_is_seconds, "a number >= 0", _same),
    "strategy": (_is_arm, _ARM, _same),
}
_POLICY_CHECKS: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    "name": _STRING,
    "iterations_per_strategy": (
        lambda v: type(v) is dict and all(_is_arm(k) and _is_count(n) for k, n in v.items()),
        "{" + _ARM + ": integer >= 0}",
        _same,
    ),
    "config": (lambda v: type(v) is dict, "an object", _same),
    # a seed is an identifier, not a count: the engines take any in torch's int64 range (a
    # generate --seed above 2^53 wrote a trace that its own readers refused)
    "seed": (lambda v: is_int(v) and 0 <= v < 2**63, "an integer in [0, 2^63)", _same),
}
__all__ = [
    "CLOCKS",
    "UNRECORDED",
    "Hist",
    "MeasuredStep",
    "PolicyRecord",
    "Unrecorded",
    "arm_drafter",
]
