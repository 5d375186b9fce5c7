"""``tltsim sweep SPEC.toml``: grid and random search over policy and cluster settings.

    tltsim sweep sweep.toml --workers 8
    tltsim report results/sweep-sweep

A spec (TOML) names a trace and the settings to vary. Setting names: ``policy``, ``preset``,
``static_strategy``, ``spot_training``, any ``SimConfig`` field (``num_gpus``, ``tp``, ...),
``tlt.<TLTConfig field>``, ``drafter.<DrafterDynamics field>``, ``spot.<SpotTrainerConfig field>``.
Boolean settings are named as their flags (``spot_training``, ``timeline_recorded``); the
Python field names (``is_spot_training``) are accepted too. Paths in a spec (``trace``, ``out``,
a ``hardware`` preset file, a ``model`` config.json or directory) are relative to the spec file.

    trace = "../traces/synth_reasoning_rl.json"   # relative to the spec file
    seeds = [0, 1]
    max_steps = 4                                  # optional: first N steps only
    [fixed]                                        # every point
    preset = "h100x8-qwen7b"
    [grid]                                         # every combination
    policy = ["static", "tlt"]
    "tlt.threshold" = [16, 32, 64]
    [random]                                       # num_points seeded draws (added to the grid)
    num_points = 8
    seed = 0
    "tlt.epsilon" = {low = 0.0, high = 0.3}        # uniform (integers for an integer setting)
    num_gpus = {choices = [8, 16]}

Every point runs once per seed, on all cores (multiprocessing). For each speculating point a
NoSpec baseline with the same cluster settings is added, so the table has ``speedup_vs_nospec``.
Resumable: each finished (point, seed) is appended to ``points.jsonl`` in the output directory
and never recomputed. Outputs: ``sweep.parquet`` and ``sweep.csv`` (one row per point x seed),
``config.json`` (the resolved spec), ``summary.json`` (best setting, runner-up, and whether their
speedup intervals over seeds overlap).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from tltsim.cost.calibrated import is_preset_file
from tltsim.cost.presets import apply_preset
from tltsim.cost.specs import is_model_path, model_config_file
from tltsim.errors import UsageError
from tltsim.jsonio import remove_stale_outputs, write_json
from tltsim.lifetime import pool_worker_init
from tltsim.policy import POLICY_NAMES, SpotTrainerConfig, TLTConfig, make_policy
from tltsim.policy.tlt import TLTBASE_FIELDS
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.replay import RunSettings, cost_model, fit_domain_note, run_settings
from tltsim.sim.sweep_spec import (
    SECTIONS,
    TOP_KEYS,
    SweepSpec,
    baseline_of,
    load_spec,
    spec_points,
)
from tltsim.trace.files import load_trace
from tltsim.trace.schema import Trace, TraceError, dumps_trace

RESULT_COLUMNS = (
    "mean_step_s", "mean_rollout_s", "mean_train_s", "total_s", "rollout_share",
    "bubble_fraction", "bubble_gpu_s", "idle_gpu_s", "drafter_train_gpu_s", "sd_on_fraction",
    "mean_accept_len", "mean_ideal_rollout_s", "mean_ideal_work_s", "mean_ideal_critical_path_s",
    "wall_s",
)  # fmt: skip


def effective(point: dict[str, Any]) -> dict[str, Any]:
    """The settings that can change the point's result: tlt.* for TLTAdaptive, and for TLTBase
    the switch and bandit fields it takes from them (``tltbase_settings``); static_strategy
    only for StaticSpec; the EAGLE drafter's dynamics and its spot training for neither NoSpec
    nor TLTBase (history drafter only, no trainer: ``tltsim.sim.replay.run_settings``). A
    setting kept that cannot matter costs a duplicate simulation; one dropped that can matter
    gives two settings one result."""
    policy = point.get("policy", "tlt")
    return {k: v for k, v in point.items() if setting_matters(policy, k)}


def setting_matters(policy: str, key: str) -> bool:
    """Whether the sweep setting ``key`` can change a result of ``policy`` (``effective``)."""
    section, _, name = key.partition(".")
    if name and section == "tlt":
        return policy == "tlt" or (policy == "tltbase" and name in TLTBASE_FIELDS)
    if key == "static_strategy":
        return policy == "static"
    if (name and section in ("drafter", "spot")) or key == "is_spot_training":
        return policy not in ("nospec", "tltbase")
    return True


def point_key(point: dict[str, Any], seed: int | None = None, trace_id: str = "") -> str:
    """Identity of a (point, seed) simulation of the trace ``trace_id`` names (``trace_digest``):
    equal keys give equal results, so a resumed sweep of another trace or ``max_steps`` reuses
    nothing."""
    text = json.dumps({"point": effective(point), "seed": seed, "trace": trace_id}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def inputs_id(point: dict[str, Any], trace_id: str) -> str:
    """What a point reads besides its settings: the trace (``trace_id``) and, where its
    ``hardware`` is a preset file or its ``model`` a config.json, the file's contents (a
    recalibrated file reused the rows simulated with the old one)."""
    files = []
    hardware, model = point.get("hardware"), point.get("model")
    if isinstance(hardware, str) and is_preset_file(hardware):
        files.append((Path(hardware), "hardware preset"))
    if isinstance(model, str) and is_model_path(model):
        files.append((model_config_file(model), "model config"))
    digests = [trace_id]
    for path, what in files:
        try:
            digests.append(hashlib.sha1(path.read_bytes()).hexdigest()[:16])
        except OSError as err:
            raise UsageError(f"{path}: cannot read the {what} ({err.strerror})") from None
    return ":".join(digests)


def settings_of(point: dict[str, Any], seed: int) -> RunSettings:
    """RunSettings of one point; bad values (an unknown preset, policy or strategy too) raise
    UsageError naming the setting."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in point.items():
        section, _, name = key.partition(".")
        if name:
            sections[section][name] = tuple(value) if isinstance(value, list) else value
        elif key in TOP_KEYS:
            top[key] = value
        else:
            top.setdefault("sim", {})[key] = value
    try:
        # a sweep keeps summaries only: no timeline unless the spec asks (a quarter of a
        # sweep's time and memory went to timelines it dropped)
        sim = SimConfig(is_timeline_recorded=False)
        sim = apply_preset(sim, point["preset"]) if "preset" in point else sim
        sim = dataclasses.replace(sim, **top.get("sim", {}), seed=seed)
        policy = top.get("policy", "tlt")
        if policy not in POLICY_NAMES:
            raise ValueError(
                f"unknown policy {policy!r}; expected one of {', '.join(POLICY_NAMES)}"
            )
        if policy == "static":  # the policy validates its strategy (a one-line ValueError)
            make_policy("static", strategy=top.get("static_strategy", "8_4_32"))
        return RunSettings(
            sim=sim,
            policy=policy,
            tlt=TLTConfig(**sections["tlt"]),
            static_strategy=top.get("static_strategy", "8_4_32"),
            drafter=DrafterDynamics(**sections["drafter"]),
            spot=SpotTrainerConfig(**sections["spot"]),
            is_spot_training=top.get("is_spot_training", True),
        )
    except (TypeError, ValueError) as err:
        raise UsageError(f"sweep point {point}: {err}") from None


def _run_task(task: tuple[str, dict[str, Any], int], trace: Trace) -> dict[str, Any]:
    """One (point, seed): a row of the sweep table (runs in a worker process)."""
    key, point, seed = task
    summary = run_settings(settings_of(point, seed), trace).summary()
    return {
        "key": key,
        "point": point,
        "seed": seed,
        "result": {c: summary[c] for c in RESULT_COLUMNS},
    }


def _read_done(path: Path) -> dict[str, dict[str, Any]]:
    """Finished tasks recorded by earlier runs; a torn last line (interrupted write) is dropped."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("key"), str):  # else not a row
                done[row["key"]] = row
    return done


@dataclass
class SweepOutcome:
    table: pd.DataFrame
    num_computed: int
    num_reused: int
    out: Path
    notes: list[str]  # hardware preset files extrapolated (replay's "calibration:" lines)


def sweep_out(spec_path: Path) -> Path:
    """Where a sweep of ``spec_path`` without --out writes: the spec's ``out``, else
    ``results/sweep-<spec stem>``."""
    spec = load_spec(spec_path)
    return Path(spec.out or Path("results") / f"sweep-{spec_path.stem}")


def run_sweep(spec_path: Path, out: Path | None = None, workers: int | None = None) -> SweepOutcome:
    spec = load_spec(spec_path)
    out = out or sweep_out(spec_path)
    if out.exists() and not out.is_dir():  # (the spec's out or --out: "File exists" named none)
        raise UsageError(f"{spec_path}: out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    try:
        trace = load_trace(spec.trace)
    except TraceError as err:
        raise UsageError(f"{spec_path}: trace: {err}") from None
    if spec.max_steps is not None:
        trace = Trace(meta=trace.meta, steps=trace.steps[: spec.max_steps])
    points = spec_points(spec)
    notes: list[str] = []
    seen: set[tuple] = set()  # (a note reads the whole trace: once per hardware and cluster)
    for point in points:  # validate every point before spending any time
        try:  # (the error named the point, not the spec file it came from)
            sim = settings_of(point, spec.seeds[0]).sim
            cost_model(sim)  # a bad model or hardware too
        except UsageError as err:
            raise UsageError(f"{spec_path}: {err}") from None
        # a preset file fitted on smaller shapes than the trace runs: said, as replay says it
        # (a sweep said nothing)
        shape = (sim.hardware, sim.num_gpus, sim.tp, sim.max_running_requests)
        if shape not in seen and (note := fit_domain_note(trace, sim)) and note not in notes:
            notes.append(note)
        seen.add(shape)
    # points.jsonl stays: its rows are keyed by what they simulated (resume, reuse)
    remove_stale_outputs(out, ("summary.json", "sweep.csv", "sweep.parquet"))
    write_json(
        out / "config.json",
        {
            "kind": "sweep",
            "spec_file": str(spec_path),
            "spec": dataclasses.asdict(spec),
            "points": points,
        },
    )
    trace_id = hashlib.sha1(dumps_trace(trace).encode()).hexdigest()[:16]  # as simulated
    tasks = [(point_key(p, s, inputs_id(p, trace_id)), p, s) for p in points for s in spec.seeds]
    log = out / "points.jsonl"
    done = _read_done(log)
    # Points that differ only in settings their policy ignores share one simulation.
    todo = list({t[0]: t for t in tasks if t[0] not in done}.values())
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    # disable=None: a bar on a terminal only
    with (
        tqdm(total=len(todo), desc="sweep", unit="point", disable=None if todo else True) as bar,
        log.open("a") as sink,
    ):
        if sink.tell() and not log.read_bytes().endswith(b"\n"):
            sink.write("\n")  # a torn last line (an interrupted write) ends before the new rows
        if workers == 1:
            rows = (_run_task(t, trace) for t in todo)
            _collect(rows, done, sink, bar)
        else:
            context = multiprocessing.get_context("spawn")
            # workers end with this process and leave Ctrl-C to it (tltsim.lifetime)
            with context.Pool(workers, pool_worker_init, (os.getpid(),)) as pool:
                _collect(
                    pool.imap_unordered(partial(_run_task, trace=trace), todo), done, sink, bar
                )
    rows = [{**done[key], "point": point, "seed": seed} for key, point, seed in tasks]
    table = sweep_table(rows, trace_id)
    table.to_parquet(out / "sweep.parquet", index=False)
    table.to_csv(out / "sweep.csv", index=False)
    write_json(out / "summary.json", {**sweep_summary(table, spec), "notes": notes})
    return SweepOutcome(table, len(todo), len({t[0] for t in tasks}) - len(todo), out, notes)


def _collect(rows, done: dict, sink, bar) -> None:
    for row in rows:
        sink.write(json.dumps(row) + "\n")
        sink.flush()  # a finished point survives an interruption
        done[row["key"]] = row
        bar.update()


def sweep_table(rows: list[dict[str, Any]], trace_id: str = "") -> pd.DataFrame:
    """One row per point x seed: settings, seed, results, speedup vs the NoSpec baseline."""
    records = []
    for row in rows:
        point = row["point"]
        rec = {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in point.items()}
        rec.setdefault("policy", "tlt")
        rec["seed"] = row["seed"]
        rec.update(row["result"])
        rec["baseline_key"] = point_key(
            baseline_of(point), row["seed"], inputs_id(baseline_of(point), trace_id)
        )
        rec["key"] = row["key"]
        records.append(rec)
    table = pd.DataFrame(records)
    for name in {k for row in rows for k in row["point"]}:  # an integer setting stays one
        values = [r[name] for r in records if r.get(name) is not None]
        if values and all(type(v) is int for v in values) and table[name].isna().any():
            table[name] = table[name].astype("Int64")  # (a point without it made it 16.0)
    # NoSpec points differing only in settings NoSpec ignores are one simulation (one key)
    base = table[table.policy == "nospec"].drop_duplicates("key").set_index("key")
    step = base["mean_step_s"].reindex(table["baseline_key"]).to_numpy()
    rollout = base["mean_rollout_s"].reindex(table["baseline_key"]).to_numpy()
    table["speedup_vs_nospec"] = step / table["mean_step_s"]
    table["rollout_speedup_vs_nospec"] = rollout / table["mean_rollout_s"]
    return table.drop(columns=["baseline_key"])


# the sweep table's columns that are neither a setting nor a result of one simulation
_NOT_SETTINGS = ("seed", "key", "speedup_vs_nospec", "rollout_speedup_vs_nospec")


def varying_settings(table: pd.DataFrame) -> list[str]:
    """Setting columns that take more than one value among the speculating points."""
    skip = {*RESULT_COLUMNS, *_NOT_SETTINGS, "policy"}
    spec = table[table.policy != "nospec"]
    return [c for c in table.columns if c not in skip and spec[c].nunique(dropna=False) > 1]


def _setting_values(row: pd.Series) -> dict[str, Any]:
    """A grouped row as plain values; settings columns turn float when NoSpec rows lack them,
    so integers are given back."""
    out = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
    return {
        k: int(v) if k != "speedup_vs_nospec" and isinstance(v, float) and v.is_integer() else v
        for k, v in out.items()
    }


def _is_blank(value: Any) -> bool:
    """None, NaN or pandas' NA (an integer column's blank); a list value is never blank."""
    return not isinstance(value, list | tuple | dict) and bool(pd.isna(value))


def _fill_defaults(rows: pd.DataFrame, varying: list[str]) -> None:
    """A varying setting a point left out (a random section's point beside a grid's) ran with
    its default: written in, so the best setting names it (it was left out of the best, and a
    point of the default value was another setting than one that named it). A default depends
    on the point's policy and preset only (a preset sets SimConfig fields); a list default is
    written as ``sweep_table`` writes lists, comma-joined."""
    for index, row in rows.iterrows():
        missing = [
            c
            for c in varying
            if c != "preset" and _is_blank(row[c]) and setting_matters(row.policy, c)
        ]
        if not missing:
            continue
        preset = row.get("preset")
        base = {"policy": row.policy, **({} if _is_blank(preset) else {"preset": preset})}
        ran = settings_of(base, 0)
        for column in missing:
            section, _, name = column.partition(".")
            if name:
                value = getattr(getattr(ran, section), name)
            elif hasattr(ran, column):
                value = getattr(ran, column)
            else:
                value = getattr(ran.sim, column)
            rows.at[index, column] = (
                ",".join(map(str, value)) if isinstance(value, tuple | list) else value
            )


def sweep_summary(table: pd.DataFrame, spec: SweepSpec) -> dict[str, Any]:
    """The best setting (highest mean speedup vs NoSpec over seeds), the runner-up, each one's
    min-max interval over seeds, and whether the best is distinguishable from the runner-up:
    True when the two intervals do not overlap, False when they do, None when there is no
    runner-up or only one seed (no interval to judge by)."""
    varying = varying_settings(table)
    # one row per simulation: a setting its policy ignores (tlt.threshold of a StaticSpec
    # point) is blank, so two such points are one setting, not a best and its runner-up
    spec_rows = table[table.policy != "nospec"].drop_duplicates("key").copy()
    for column in varying:
        ignored = [p for p in spec_rows.policy.unique() if not setting_matters(p, column)]
        spec_rows[column] = spec_rows[column].astype(object)
        spec_rows.loc[spec_rows.policy.isin(ignored), column] = None
    _fill_defaults(spec_rows, varying)
    best: dict[str, Any] = {}
    runner_up: dict[str, Any] = {}
    intervals: dict[str, list[float]] = {}
    is_distinguishable = None
    if len(spec_rows):
        group = ["policy", *varying]
        stats = (
            spec_rows.groupby(group, dropna=False)["speedup_vs_nospec"]
            .agg(["mean", "min", "max", "count"])
            .reset_index()
            .sort_values("mean", ascending=False, kind="stable")
        )
        ranked = [
            (_setting_values(row[group].dropna()) | {"speedup_vs_nospec": float(row["mean"])}, row)
            for _, row in stats.iterrows()
        ]
        best = ranked[0][0]
        intervals["best"] = [float(ranked[0][1]["min"]), float(ranked[0][1]["max"])]
        if len(ranked) > 1:
            runner_up = ranked[1][0]
            intervals["runner_up"] = [float(ranked[1][1]["min"]), float(ranked[1][1]["max"])]
            if min(ranked[0][1]["count"], ranked[1][1]["count"]) > 1:
                is_distinguishable = bool(intervals["best"][0] > intervals["runner_up"][1])
    return {
        "kind": "sweep",
        "trace": spec.trace,
        "num_rows": len(table),
        "seeds": list(spec.seeds),
        "varying": varying,
        "best": best,
        "runner_up": runner_up,
        "speedup_interval_over_seeds": intervals,  # min-max of speedup_vs_nospec over seeds
        "is_best_distinguishable": is_distinguishable,
    }
