"""The ``tlt-trace`` format (versions 1 and 2): the dataclasses, validation, and JSON
(de)serialisation.

A trace is a list of RL steps; each step holds prompts; each prompt holds the lengths of its
group's responses (DESIGN.md, "Trace format"; traces/README.md has the full description). Both
tltsim (replay) and tltrun (measured runs) read and write this one format.

    from tltsim.trace.files import load_trace, save_trace
    trace = load_trace("traces/synth_reasoning_rl.json")   # .json, .json.gz, .csv, .parquet
    trace.steps[0].response_lengths()                       # [812, 1290, ...] in prompt order
    save_trace(trace, "out/trace.csv")                       # the pandas-friendly twin

``tltsim validate FILE`` checks a file from the shell. Bad input raises ``TraceError`` whose text
is one line: the file, the step and prompt where known, the field, what was expected, what was
found. The tabular twin (CSV/Parquet, one row per response) lives in ``tltsim.trace.table``;
``tltsim.trace.files`` picks JSON or the twin by file suffix (it imports both, neither imports it).

Versions (traces/README.md): 2 adds one thing, measured blocks whose strategy keys name a
drafter other than EAGLE (``"history:6_1_6"``, issue #20; ``tltsim.trace.measured``). A trace is
written as the lowest version that holds it (``version_of``): 1 unless such an arm is present,
so traces without one stay byte-identical and readable by a version-1 reader, which refuses one
with an arm by its version instead of mistaking the arm for an EAGLE strategy. Both load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tltsim.trace.errors import TraceError
from tltsim.trace.errors import is_int as _is_int
from tltsim.trace.errors import show as _show
from tltsim.trace.measured import MeasuredStep

FORMAT = "tlt-trace"
VERSION = 1  # what a trace without drafter arms is written as (and the tabular twin's header)
VERSIONS = (1, 2)  # what this tltsim reads; 2: measured blocks may name drafter arms
FINISH_REASONS = ("stop", "length")
SUFFIXES = (".json", ".json.gz", ".csv", ".parquet")
_STEP_KEYS = frozenset({"step", "prompts", "measured"})
_PROMPT_KEYS = frozenset({"id", "prompt_tokens", "responses"})
_RESPONSE_KEYS = frozenset({"tokens", "finish", "accept_hist"})
_TOP_KEYS = frozenset({"format", "version", "meta", "steps"})
# Largest token count, step number or count a trace may hold: int32, the token-position range
# of the engines (torch, vLLM), 200x the longest context of any released model (10M tokens).
# A larger value is a corrupted file, not a long response (10^30 tokens overflowed int64 and a
# few 2^63 - 1 responses summed to a negative total); sums of such counts fit int64.
MAX_COUNT = 2**31 - 1
_BOUND = f" <= {MAX_COUNT}"


@dataclass(frozen=True)
class Response:
    tokens: int  # generated tokens, >= 1
    finish: str = "stop"  # "stop" (EOS) or "length" (hit max_response_tokens)
    accept_hist: tuple[int, ...] | None = None  # measured: count of verifies that accepted i tokens

    @property
    def is_truncated(self) -> bool:
        return self.finish == "length"


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_tokens: int
    responses: tuple[Response, ...]

    def response_lengths(self) -> list[int]:
        return [r.tokens for r in self.responses]


@dataclass(frozen=True)
class Step:
    step: int
    prompts: tuple[Prompt, ...]
    measured: MeasuredStep | None = None  # written by tltrun: rollout_s, train_s, ...

    @property
    def num_responses(self) -> int:
        return sum(len(p.responses) for p in self.prompts)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def response_lengths(self) -> list[int]:
        """Generated tokens of every response (request) of the step, flat, in prompt order."""
        return [r.tokens for p in self.prompts for r in p.responses]

    def prompt_lengths(self) -> list[int]:
        """Prompt tokens of every response, aligned with ``response_lengths()``."""
        return [p.prompt_tokens for p in self.prompts for _ in p.responses]

    @property
    def total_response_tokens(self) -> int:
        return sum(r.tokens for p in self.prompts for r in p.responses)


@dataclass(frozen=True)
class Trace:
    meta: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_prompts(self) -> int:
        return sum(len(s.prompts) for s in self.steps)

    @property
    def num_responses(self) -> int:
        return sum(s.num_responses for s in self.steps)

    @property
    def total_response_tokens(self) -> int:
        return sum(s.total_response_tokens for s in self.steps)

    @property
    def max_response_tokens(self) -> int | None:
        """The response cap the trace was generated under (``meta``), if it says."""
        return self.meta.get("max_response_tokens")

    @property
    def group_size(self) -> int | None:
        return self.meta.get("group_size")

    def response_lengths(self) -> np.ndarray:
        """All response lengths, step by step in prompt order, as an int64 array."""
        return np.fromiter(
            (r.tokens for s in self.steps for p in s.prompts for r in p.responses),
            dtype=np.int64,
            count=self.num_responses,
        )

    def summary(self) -> dict[str, Any]:
        """Counts and the length distribution (median / p99 / max) of all responses."""
        lengths = self.response_lengths()
        num_truncated = sum(
            r.is_truncated for s in self.steps for p in s.prompts for r in p.responses
        )
        return {
            "num_steps": self.num_steps,
            "num_prompts": self.num_prompts,
            "num_responses": int(lengths.size),
            "total_response_tokens": int(lengths.sum()),
            "median_tokens": float(np.median(lengths)),
            "p99_tokens": float(np.quantile(lengths, 0.99)),
            "max_tokens": int(lengths.max()),
            "num_truncated": int(num_truncated),
            "max_response_tokens": self.max_response_tokens,
        }


def inferred_finish(tokens: int, cap: int | None) -> str:
    """Finish reason of a bare-int response: "length" exactly when it reached the cap."""
    return "length" if cap is not None and tokens == cap else "stop"


# --- validation: dict (parsed JSON) -> Trace -------------------------------------------------


def _fail(source: str, where: str, name: str, expected: str, got: Any) -> TraceError:
    place = f"{source}: {where}: " if where else f"{source}: "
    return TraceError(f"{place}field '{name}': expected {expected}, got {_show(got)}")


def _get(obj: dict, key: str, source: str, where: str, expected: str) -> Any:
    if key not in obj:
        place = f"{source}: {where}: " if where else f"{source}: "
        raise TraceError(f"{place}missing field '{key}' (expected {expected})")
    return obj[key]


def _check_keys(obj: dict, allowed: frozenset, source: str, where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        place = f"{source}: {where}: " if where else f"{source}: "
        raise TraceError(
            # repr: a key may hold a newline or carriage return, the error stays one line
            f"{place}unknown field {extra[0]!r} (expected only {', '.join(sorted(allowed))})"
        )


def _meta_from_dict(meta: Any, source: str) -> dict[str, Any]:
    if type(meta) is not dict:
        raise _fail(source, "", "meta", "an object", meta)
    for key in ("max_response_tokens", "group_size"):
        if key in meta and not (_is_int(meta[key]) and 1 <= meta[key] <= MAX_COUNT):
            raise _fail(source, "meta", key, "a positive integer" + _BOUND, meta[key])
    for key in ("source", "model"):
        if key in meta and not isinstance(meta[key], str):
            raise _fail(source, "meta", key, "a string", meta[key])
    bad = _non_finite(meta, "")
    if bad is not None:  # Python's json reads NaN / Infinity; a saved trace would not be JSON
        raise _fail(source, "meta", bad[0], "a finite number (JSON has no NaN or Infinity)", bad[1])
    return meta


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """(dotted path, value) of the first non-finite float inside ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, inner in items:
        found = _non_finite(inner, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_header(obj: Any, source: str, is_table_header: bool = False) -> dict[str, Any]:
    """Check ``format`` and ``version`` of a parsed header object; return its validated meta.
    A table's header (Parquet metadata) holds no other field: one is refused as in a JSON
    trace (a misspelt "meta" was ignored with all it held)."""
    if type(obj) is not dict:
        raise TraceError(
            f"{source}: expected a JSON object at the top level, got {type(obj).__name__}"
        )
    fmt = _get(obj, "format", source, "", f"'{FORMAT}'")
    if fmt != FORMAT:
        raise _fail(source, "", "format", f"'{FORMAT}'", fmt)
    expected = " or ".join(map(str, VERSIONS))
    version = _get(obj, "version", source, "", expected)
    if not _is_int(version) or version not in VERSIONS:
        raise _fail(source, "", "version", f"{expected} (the versions this tltsim reads)", version)
    if is_table_header:
        _check_keys(obj, _TOP_KEYS - {"steps"}, source, "")
    return _meta_from_dict(_get(obj, "meta", source, "", "an object"), source)


def trace_from_dict(obj: Any, source: str) -> Trace:
    """Validate a parsed ``tlt-trace`` document and build the Trace. ``source`` names the file
    in error messages. Every violation raises one-line ``TraceError``; nothing is skipped."""
    meta = check_header(obj, source)
    _check_keys(obj, _TOP_KEYS, source, "")
    raw_steps = _get(obj, "steps", source, "", "a non-empty list of steps")
    if type(raw_steps) is not list or not raw_steps:
        raise _fail(source, "", "steps", "a non-empty list of steps", raw_steps)
    cap = meta.get("max_response_tokens")
    group_size = meta.get("group_size")
    cache: dict[Any, Response] = {}  # Responses are immutable: equal ones are shared
    steps: list[Step] = []
    for i, raw in enumerate(raw_steps):
        step = _step_from_dict(raw, f"steps[{i}]", source, cap, group_size, cache)
        if steps and step.step <= steps[-1].step:
            raise _fail(
                source,
                f"steps[{i}]",
                "step",
                f"a step number > {steps[-1].step} (steps ascend)",
                step.step,
            )
        steps.append(step)
    return Trace(meta=meta, steps=tuple(steps))


def _step_from_dict(
    raw: Any, where: str, source: str, cap: int | None, group_size: int | None, cache: dict
) -> Step:
    if type(raw) is not dict:
        raise TraceError(f"{source}: {where}: expected a step object, got {_show(raw)}")
    number = _get(raw, "step", source, where, "a step number >= 0")
    if not _is_int(number) or not 0 <= number <= MAX_COUNT:
        raise _fail(source, where, "step", "an integer >= 0 and" + _BOUND, number)
    where = f"step {number}"
    _check_keys(raw, _STEP_KEYS, source, where)
    raw_prompts = _get(raw, "prompts", source, where, "a non-empty list of prompts")
    if type(raw_prompts) is not list or not raw_prompts:
        raise _fail(source, where, "prompts", "a non-empty list of prompts", raw_prompts)
    measured = raw.get("measured")
    if measured is not None:
        measured = MeasuredStep.from_dict(measured, f"{source}: {where}")
    prompts = []
    seen: set[str] = set()
    for j, raw_prompt in enumerate(raw_prompts):
        prompt = _prompt_from_dict(raw_prompt, f"{where} prompts[{j}]", source, cap, cache)
        if prompt.id in seen:
            raise _fail(
                source, f"{where} prompts[{j}]", "id", "an id unique within the step", prompt.id
            )
        if group_size is not None and len(prompt.responses) != group_size:
            place = f"{source}: {where} prompt {prompt.id!r}"
            raise TraceError(
                f"{place}: field 'responses': expected {group_size} responses (meta.group_size), got {len(prompt.responses)}"
            )
        seen.add(prompt.id)
        prompts.append(prompt)
    if measured is not None:
        measured.check_against({p.id: len(p.responses) for p in prompts}, f"{source}: {where}")
    return Step(step=number, prompts=tuple(prompts), measured=measured)


def _prompt_from_dict(raw: Any, where: str, source: str, cap: int | None, cache: dict) -> Prompt:
    if type(raw) is not dict:
        raise TraceError(f"{source}: {where}: expected a prompt object, got {_show(raw)}")
    pid = _get(raw, "id", source, where, "a non-empty string")
    if type(pid) is not str or not pid:
        raise _fail(source, where, "id", "a non-empty string", pid)
    where = f"{where.rsplit(' ', 1)[0]} prompt {pid!r}"
    _check_keys(raw, _PROMPT_KEYS, source, where)
    prompt_tokens = _get(raw, "prompt_tokens", source, where, "a positive integer")
    if not _is_int(prompt_tokens) or not 1 <= prompt_tokens <= MAX_COUNT:
        raise _fail(source, where, "prompt_tokens", "a positive integer" + _BOUND, prompt_tokens)
    raw_responses = _get(raw, "responses", source, where, "a non-empty list of responses")
    if type(raw_responses) is not list or not raw_responses:
        raise _fail(source, where, "responses", "a non-empty list of responses", raw_responses)
    limit = cap if cap is not None else MAX_COUNT
    expected = "a positive integer" + (
        f" <= max_response_tokens ({cap})" if cap is not None else _BOUND
    )
    responses = []
    for k, r in enumerate(raw_responses):
        if _is_int(r):  # fast path: the common bare-int response
            if not 0 < r <= limit:
                raise _fail(source, f"{where} response {k}", "tokens", expected, r)
            resp = cache.get(r)
            if resp is None:
                resp = cache[r] = Response(tokens=r, finish=inferred_finish(r, cap))
        elif type(r) is dict:
            resp = _response_from_dict(r, f"{where} response {k}", source, cap, expected, cache)
        else:
            raise _fail(
                source, f"{where} response {k}", "tokens", expected + " or a response object", r
            )
        responses.append(resp)
    return Prompt(id=pid, prompt_tokens=prompt_tokens, responses=tuple(responses))


def _response_from_dict(
    raw: dict, where: str, source: str, cap: int | None, expected: str, cache: dict
) -> Response:
    _check_keys(raw, _RESPONSE_KEYS, source, where)
    tokens = _get(raw, "tokens", source, where, expected)
    if not _is_int(tokens) or not 1 <= tokens <= (MAX_COUNT if cap is None else cap):
        raise _fail(source, where, "tokens", expected, tokens)
    finish = raw.get("finish", inferred_finish(tokens, cap))
    if finish not in FINISH_REASONS:
        raise _fail(source, where, "finish", "'stop' or 'length'", finish)
    hist = raw.get("accept_hist")
    if hist is None:
        key = (tokens, finish)
        resp = cache.get(key)
        if resp is None:
            resp = cache[key] = Response(tokens=tokens, finish=finish)
        return resp
    if type(hist) is not list or not all(_is_int(c) and 0 <= c <= MAX_COUNT for c in hist):
        raise _fail(source, where, "accept_hist", "a list of integers >= 0 and" + _BOUND, hist)
    return Response(tokens=tokens, finish=finish, accept_hist=tuple(hist))


# --- Trace -> dict / JSON text ----------------------------------------------------------------


def _response_to_json(r: Response, cap: int | None) -> int | dict[str, Any]:
    if r.accept_hist is None and r.finish == inferred_finish(r.tokens, cap):
        return r.tokens  # bare int: finish is implied by the cap (see inferred_finish)
    obj: dict[str, Any] = {"tokens": r.tokens, "finish": r.finish}
    if r.accept_hist is not None:
        obj["accept_hist"] = list(r.accept_hist)
    return obj


def _prompt_to_dict(p: Prompt, cap: int | None) -> dict[str, Any]:
    responses = [_response_to_json(r, cap) for r in p.responses]
    return {"id": p.id, "prompt_tokens": p.prompt_tokens, "responses": responses}


def _step_to_dict(step: Step, cap: int | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"step": step.step}
    if step.measured is not None:
        obj["measured"] = step.measured.to_dict()
    obj["prompts"] = [_prompt_to_dict(p, cap) for p in step.prompts]
    return obj


def version_of(trace: Trace) -> int:
    """The version ``trace`` is written as: 2 if a measured block names a drafter other than
    EAGLE (an arm ``"history:6_1_6"``), else 1 (module docstring)."""
    for step in trace.steps:
        if step.measured is not None and step.measured.arm_drafters() - {"eagle"}:
            return 2
    return VERSION


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """The JSON document of ``trace`` (plain dicts, lists, ints and strings)."""
    cap = trace.max_response_tokens
    return {
        "format": FORMAT,
        "version": version_of(trace),
        "meta": trace.meta,
        "steps": [_step_to_dict(s, cap) for s in trace.steps],
    }


def dumps_trace(trace: Trace) -> str:
    """JSON text with one prompt per line: diff-friendly, compact, byte-identical for equal traces."""
    lines = header_lines(trace.meta, version_of(trace))
    for i, step in enumerate(trace.steps):
        lines += step_lines(step, trace.max_response_tokens)
        if i + 1 < len(trace.steps):
            lines[-1] += ","
    lines.append(TRACE_END)
    return "\n".join(lines) + "\n"


TRACE_END = " ]}"  # dumps_trace's last line (files.append_steps finds it there)


def header_lines(meta: dict[str, Any], version: int) -> list[str]:
    """``dumps_trace``'s lines before the first step."""
    return [
        f'{{"format": "{FORMAT}", "version": {version},',
        f' "meta": {json.dumps(meta)},',
        ' "steps": [',
    ]


def step_lines(step: Step, cap: int | None) -> list[str]:
    """``dumps_trace``'s lines of one step (no comma after its last)."""
    head = _step_to_dict(Step(step.step, (), step.measured), cap)
    del head["prompts"]
    lines = ["  " + json.dumps(head)[:-1] + ', "prompts": [']
    for j, p in enumerate(step.prompts):
        comma = "," if j + 1 < len(step.prompts) else ""
        lines.append("   " + json.dumps(_prompt_to_dict(p, cap)) + comma)
    lines.append("  ]}")
    return lines


# --- building from arrays (generators, importers) --------------------------------------------


def trace_from_arrays(
    lengths: np.ndarray, prompt_tokens: np.ndarray, meta: dict[str, Any]
) -> Trace:
    """Trace from ``lengths`` (steps, prompts, group) and ``prompt_tokens`` (steps, prompts).

    Steps are numbered 0.., prompt ids are ``s{step}p{index}``; a response whose length equals
    ``meta["max_response_tokens"]`` gets ``finish="length"``. Inputs must already be valid
    (positive, capped); this is the fast path for generated traces, not a validator."""
    if lengths.ndim != 3 or prompt_tokens.shape != lengths.shape[:2]:
        raise ValueError(
            f"shapes: lengths {lengths.shape} needs prompt_tokens {lengths.shape[:2]}, got {prompt_tokens.shape}"
        )
    cap = meta.get("max_response_tokens")
    cache: dict[int, Response] = {}
    steps = []
    for s, (step_lengths, step_prompts) in enumerate(
        zip(lengths.tolist(), prompt_tokens.tolist(), strict=True)
    ):
        prompts = []
        for j, (group, num_prompt_tokens) in enumerate(
            zip(step_lengths, step_prompts, strict=True)
        ):
            responses = []
            for n in group:
                resp = cache.get(n)
                if resp is None:
                    resp = cache[n] = Response(tokens=n, finish=inferred_finish(n, cap))
                responses.append(resp)
            prompts.append(
                Prompt(id=f"s{s}p{j}", prompt_tokens=num_prompt_tokens, responses=tuple(responses))
            )
        steps.append(Step(step=s, prompts=tuple(prompts)))
    return Trace(meta=meta, steps=tuple(steps))
