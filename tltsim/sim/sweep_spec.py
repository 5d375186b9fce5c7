"""The spec of ``tltsim sweep`` (``tltsim.sim.sweep``): what a TOML spec may set, its checks
(``load_spec``: one UsageError line naming the file and key), and the points it expands to
(``spec_points``: grid, seeded random draws, a NoSpec baseline per speculating point)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltsim.cost.calibrated import is_preset_file
from tltsim.cost.specs import MODEL_PRESETS, is_model_path
from tltsim.errors import UsageError
from tltsim.jsonio import read_text, typed_value
from tltsim.policy import SpotTrainerConfig, TLTConfig
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import MAX_SEED, MAX_SIMULATIONS, SimConfig

MAX_SWEEP_POINTS = MAX_SIMULATIONS  # points x seeds
SECTIONS = {"tlt": TLTConfig, "drafter": DrafterDynamics, "spot": SpotTrainerConfig}
TOP_KEYS = {"policy", "preset", "static_strategy", "is_spot_training"}
TOP_KEY_TYPES = {"policy": str, "preset": str, "static_strategy": str, "is_spot_training": bool}
# Settings that only matter when the policy speculates: a NoSpec baseline drops them.
SPEC_ONLY = {"static_strategy", "is_spot_training"}
# Boolean settings whose ``is_`` a spec may leave out, as their flags do (--spot-training).
BOOL_KEYS = {"is_spot_training"} | {
    f.name for f in dataclasses.fields(SimConfig) if f.name.startswith("is_")
}


@dataclass(frozen=True)
class SweepSpec:
    """A parsed spec file (``tltsim sweep`` reads it from TOML)."""

    trace: str
    seeds: tuple[int, ...] = (0,)
    max_steps: int | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)
    out: str | None = None


def canonical_key(key: str) -> str:
    """The setting's field name: ``spot_training`` -> ``is_spot_training``. Points are stored
    under it, so both spellings give the same point (and the same resume key)."""
    return f"is_{key}" if f"is_{key}" in BOOL_KEYS else key


def _canonical(table: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = canonical_key(key)
        if name in out:
            raise UsageError(f"{source}: {key!r} and {name!r} name the same setting")
        out[name] = value
    return out


def _check_key(key: str, source: str) -> None:
    key = canonical_key(key)
    section, _, name = key.partition(".")
    if name:
        cls = SECTIONS.get(section)
        if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
            raise UsageError(
                f"{source}: unknown setting {key!r} (expected tlt.*, drafter.* or spot.* with a field of TLTConfig, DrafterDynamics, SpotTrainerConfig)"
            )
    elif key == "seed":  # (it clashed with the seeds' own in dataclasses.replace)
        raise UsageError(f"{source}: seed is set by the spec's 'seeds' list, not as a setting")
    elif key not in TOP_KEYS and key not in {f.name for f in dataclasses.fields(SimConfig)}:
        raise UsageError(
            f"{source}: unknown setting {key!r} (expected policy, preset, static_strategy, spot_training or a SimConfig field)"
        )


def _check_value(key: str, value: Any, source: str) -> Any:
    """A value of the setting's type (``typed_value``: an integer setting takes no 1.5, no
    "abc" and no true), checked when the spec is read, not in a worker's simulation; returned
    as that type (a float setting's 0 is 0.0: [0, 0.0] was two points, simulated twice)."""
    name = canonical_key(key)
    section, _, field_name = name.partition(".")
    if field_name:
        tp = typing.get_type_hints(SECTIONS[section])[field_name]
    else:
        tp = TOP_KEY_TYPES.get(name) or typing.get_type_hints(SimConfig)[name]
    typed = typed_value(tp, value, f"{source}: {key}")
    _check_int64(value, f"{source}: {key}")
    return typed


def _number(typed: Any, value: Any) -> Any:
    """A number as its setting's type (0 -> 0.0 for a float setting); anything else as the
    spec wrote it (a strategy list stays the comma string the summary and advise read)."""
    return typed if type(typed) in (int, float) else value


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# The sweep's table is Parquet: an integer setting beyond int64 failed there, after every
# simulation had run (an internal error)
INT64_MAX = 2**63 - 1


def _check_int64(value: Any, where: str) -> None:
    if isinstance(value, list):
        for item in value:
            _check_int64(item, where)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise UsageError(f"{where}: {value} is beyond what the sweep table holds (|x| <= 2^63 - 1)")


def load_spec(path: Path) -> SweepSpec:
    try:
        raw = tomllib.loads(read_text(path, "sweep spec"))
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{path}: cannot read the sweep spec ({err})") from None
    allowed = {"trace", "seeds", "max_steps", "fixed", "grid", "random", "out"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise UsageError(
            f"{path}: unknown top-level key(s) {', '.join(unknown)}; expected {', '.join(sorted(allowed))}"
        )
    if not isinstance(raw.get("trace"), str):
        raise UsageError(f"{path}: 'trace' must be a path string")
    trace = raw["trace"] if Path(raw["trace"]).is_absolute() else str(path.parent / raw["trace"])
    seeds = raw.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(type(s) is int and 0 <= s <= MAX_SEED for s in seeds)
    ):
        raise UsageError(f"{path}: 'seeds' must be a non-empty list of integers in [0, 2^63 - 1]")
    if len(set(seeds)) < len(seeds):  # a repeat is the same simulation, counted twice
        raise UsageError(f"{path}: 'seeds' repeats a seed: {seeds}")
    for name in ("fixed", "grid", "random"):
        if not isinstance(raw.get(name, {}), dict):
            raise UsageError(f"{path}: [{name}] must be a table")
    if "grid" in raw and not raw["grid"]:
        raise UsageError(f"{path}: [grid] is empty (name at least one setting, or drop the table)")
    for key, values in raw.get("grid", {}).items():
        _check_key(key, f"{path} [grid]")
        if not isinstance(values, list) or not values:
            raise UsageError(f"{path} [grid]: {key!r} must be a non-empty list")
        typed = [_number(_check_value(key, value, f"{path} [grid]"), value) for value in values]
        raw["grid"][key] = list(dict.fromkeys(typed)) if all(map(_hashable, typed)) else typed
    for key, value in raw.get("fixed", {}).items():
        _check_key(key, f"{path} [fixed]")
        raw["fixed"][key] = _number(_check_value(key, value, f"{path} [fixed]"), value)
    rnd = raw.get("random", {})
    for key, dist in rnd.items():
        if key in ("num_points", "seed"):
            continue
        _check_key(key, f"{path} [random]")
        if not isinstance(dist, dict) or not ({"low", "high"} <= set(dist) or "choices" in dist):
            raise UsageError(
                f"{path} [random]: {key!r} must be {{low = .., high = ..}} or {{choices = [..]}}"
            )
        _check_dist(dist, f"{path} [random]: {key!r}")
        for value in dist.get("choices", [dist.get("low"), dist.get("high")]):
            _check_value(key, value, f"{path} [random]")
        if "choices" not in dist:  # ends as the setting's type: a float setting's
            # {low = 0, high = 1} drew only the integers 0 and 1 (spec_points draws integers
            # where both ends are)
            for end in ("low", "high"):
                typed = _check_value(key, dist[end], f"{path} [random]")
                rnd[key] = dist = {**dist, end: _number(typed, dist[end])}
    if rnd and not (
        type(rnd.get("num_points")) is int and 1 <= rnd["num_points"] <= MAX_SWEEP_POINTS
    ):
        raise UsageError(
            f"{path} [random]: num_points must be an integer in [1, {MAX_SWEEP_POINTS}]"
        )
    if "seed" in rnd and not (type(rnd["seed"]) is int and 0 <= rnd["seed"] <= MAX_SEED):
        raise UsageError(f"{path} [random]: seed must be an integer in [0, 2^63 - 1]")
    num_grid = math.prod(len(v) for v in raw.get("grid", {}).values())
    if num_grid * len(seeds) > MAX_SWEEP_POINTS:
        raise UsageError(
            f"{path} [grid]: {num_grid} points x {len(seeds)} seeds: at most {MAX_SWEEP_POINTS} "
            "simulations per sweep"
        )
    max_steps = raw.get("max_steps")
    if max_steps is not None and not (type(max_steps) is int and max_steps >= 1):  # (no true)
        raise UsageError(f"{path}: max_steps must be an integer >= 1")
    if not isinstance(raw.get("out", ""), str):
        raise UsageError(f"{path}: out must be a directory path (a string)")
    out = raw.get("out")
    tables = {name: _canonical(raw.get(name, {}) if name != "random" else rnd, f"{path} [{name}]")
              for name in ("fixed", "grid", "random")}  # fmt: skip
    for a, b in (("fixed", "grid"), ("fixed", "random"), ("grid", "random")):
        both = sorted(set(tables[a]) & set(tables[b]) - {"num_points", "seed"})
        if both:  # (the later table's value silently won)
            raise UsageError(f"{path}: {', '.join(both)} set in both [{a}] and [{b}]; keep one")
    return SweepSpec(
        trace,
        tuple(seeds),
        max_steps,
        _relative_to(path, _canonical(raw.get("fixed", {}), f"{path} [fixed]")),
        _relative_to(path, _canonical(raw.get("grid", {}), f"{path} [grid]")),
        _relative_to(path, _canonical(rnd, f"{path} [random]")),
        None if out is None else str(_beside(path, out)),
    )


def _beside(spec: Path, name: str) -> Path:
    """A path the spec names, relative to the spec file (as ``trace`` is)."""
    return Path(name) if Path(name).is_absolute() else spec.parent / name


def _relative_to(spec: Path, table: dict[str, Any]) -> dict[str, Any]:
    """``hardware`` preset files (``*.json``; a GPU name stays) and ``model`` paths (a
    config.json or model directory; a preset name stays) resolved beside the spec, in a value,
    a grid's list or a random table's choices."""
    is_path = {
        "hardware": is_preset_file,
        "model": lambda name: (
            is_model_path(name) or (name not in MODEL_PRESETS and _beside(spec, name).is_dir())
        ),
    }

    def resolve(value: Any, key: str) -> Any:
        if not (isinstance(value, str) and is_path[key](value)):
            return value
        path = _beside(spec, value)
        # a model absolute: its rows' keys then hold wherever the sweep is run from (hardware
        # files stay as they were keyed: resolving them would recompute existing sweeps)
        return str(path.resolve() if key == "model" else path)

    resolved = dict(table)
    for key in is_path:
        value = table.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            value = [resolve(v, key) for v in value]
        elif isinstance(value, dict) and isinstance(value.get("choices"), list):
            value = {**value, "choices": [resolve(v, key) for v in value["choices"]]}
        else:
            value = resolve(value, key)
        resolved[key] = value
    return resolved


def _check_dist(dist: dict[str, Any], where: str) -> None:
    """A [random] distribution draws from a non-empty set: choices non-empty, low <= high."""
    if "choices" in dist:
        if not isinstance(dist["choices"], list) or not dist["choices"]:
            raise UsageError(f"{where}: choices must be a non-empty list")
        return
    low, high = dist["low"], dist["high"]
    for end in (low, high):
        if type(end) not in (int, float) or not math.isfinite(end):
            raise UsageError(f"{where}: low and high must be finite numbers, got {end!r}")
        _check_int64(end, where)
    if low > high:
        raise UsageError(f"{where}: empty range: low = {low} > high = {high}")


def spec_points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Grid points, then random draws, each over ``fixed``; NoSpec baselines appended."""
    points = []
    if spec.grid or not spec.random:
        keys = list(spec.grid)
        for combo in itertools.product(*(spec.grid[k] for k in keys)):
            points.append({**spec.fixed, **dict(zip(keys, combo, strict=True))})
    if spec.random:
        rng = random.Random(spec.random.get("seed", 0))
        dists = {k: v for k, v in spec.random.items() if k not in ("num_points", "seed")}
        for _ in range(spec.random["num_points"]):
            draw = {}
            for key, dist in dists.items():
                if "choices" in dist:
                    draw[key] = rng.choice(dist["choices"])
                elif isinstance(dist["low"], int) and isinstance(dist["high"], int):
                    draw[key] = rng.randint(dist["low"], dist["high"])
                else:
                    draw[key] = rng.uniform(float(dist["low"]), float(dist["high"]))
            points.append({**spec.fixed, **draw})
    for point in list(points):
        if point.get("policy", "tlt") != "nospec":
            points.append(baseline_of(point))
    unique = {json.dumps(p, sort_keys=True): p for p in points}
    return list(unique.values())


def baseline_of(point: dict[str, Any]) -> dict[str, Any]:
    """The NoSpec point with the same cluster settings."""
    base = {k: v for k, v in point.items() if "." not in k and k not in SPEC_ONLY}
    base["policy"] = "nospec"
    return base
