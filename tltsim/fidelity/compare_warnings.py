"""Warnings of ``tltsim compare`` (tltsim.fidelity.compare): comparisons that run but may not
mean what they say — a profile of another machine or of another update, runs of other work
(other prompts, models or steps).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from tltsim.cost.hardware import preset_of_device
from tltsim.cost.profile import Profile
from tltsim.fidelity.measured_run import MeasuredRun


class CompareWarning(UserWarning):
    """A comparison that runs but may not mean what it says."""


def warn_other_machine(run: MeasuredRun, profile: Profile, path: Path) -> None:
    """Hunt: a trace of ``tltrun generate`` (torch's default threads) against a 1-thread
    ``tltrun profile`` compared without a word (54.7% vs 45.4% rollout error on one run)."""
    profiled = profile.meta.get("hardware")
    measured = {s.measured.hardware for s in run.trace.steps if s.measured is not None} - {None}
    if not isinstance(profiled, str) or not measured:
        return
    # tltrun profile wrote "N cores" until session 38, the measured trace "N CPUs"; a sidecar
    # may name a GPU by its preset ("H100-SXM" for "NVIDIA H100 80GB HBM3", review)
    profiled_preset = preset_of_device(profiled)
    other = sorted(
        m
        for m in measured
        if m != profiled.replace(" cores, ", " CPUs, ")
        and (profiled_preset is None or preset_of_device(m) != profiled_preset)
    )
    if other:
        warnings.warn(
            f"{path}: measured on {other[0]!r}, the profile {profile.source} on {profiled!r}: "
            "simulated times are the profile's machine's (profile with the settings the run used)",
            CompareWarning,
            stacklevel=2,
        )


def warn_other_update(run: MeasuredRun, profile: Profile, path: Path) -> None:
    """Hunt: a --num-epochs 4 run against a profile whose train op ran one epoch compared its
    train times (88% error) without a word: the update's settings, where both record them."""
    config = profile.meta.get("config")
    if not isinstance(config, dict):
        return
    for name, flag in (("num_epochs", "--num-epochs"), ("kl_coef", "--kl-coef")):
        ran = {getattr(s.measured, name) for s in run.trace.steps if s.measured is not None}
        ran.discard(None)
        profiled = config.get(name)
        if ran and isinstance(profiled, int | float) and ran != {profiled}:
            warnings.warn(
                f"{path}: trained with {flag} {', '.join(map(str, sorted(ran)))}, the profile "
                f"{profile.source}'s train op with {profiled}: simulated train times are of "
                f"another update (tltrun profile {flag} as the run)",
                CompareWarning,
                stacklevel=3,
            )


def warn_other_work(run: MeasuredRun, path: Path, base: MeasuredRun, base_path: Path) -> None:
    """Hunt: two train runs of other seeds (step 0 rolled out other rows) were paired step by
    step, and their 'measured speedup' compared different work without a word. Prompt ids
    are compared where both traces name prompts by their data rows (is_prompt_id_stable)."""
    models = (run.trace.meta.get("model"), base.trace.meta.get("model"))
    # by name: tltrun records the model directory's path, another on another machine (review)
    if all(isinstance(m, str) for m in models) and len({Path(m).name for m in models}) > 1:
        warnings.warn(
            f"{path}: measured {models[0]}, {base_path} {models[1]}: the speedup compares "
            "two models",
            CompareWarning,
            stacklevel=3,
        )

    # speedups pair the steps both ran (a run stopped early, or one resumed for more steps)
    ran = [{s.step for s in r.trace.steps if s.measured is not None} for r in (run, base)]
    if ran[0] != ran[1]:
        common = len(ran[0] & ran[1])
        warnings.warn(
            f"{path}: measured {len(ran[0])} step(s), {base_path} {len(ran[1])}: speedups "
            + (f"compare the {common} step(s) both ran" if common else "need a step both ran"),
            CompareWarning,
            stacklevel=3,
        )

    def prompts(r: MeasuredRun) -> dict[int, frozenset[str]]:
        steps = [s for s in r.trace.steps if s.measured is not None]
        if not steps or not all(s.measured.is_prompt_id_stable for s in steps):
            return {}
        return {s.step: frozenset(p.id for p in s.prompts) for s in steps}

    mine, theirs = prompts(run), prompts(base)
    other = [s for s in mine if s in theirs and mine[s] != theirs[s]]
    if other:
        shown = ", ".join(map(str, other[:5])) + (", ..." if len(other) > 5 else "")
        warnings.warn(
            f"{path}: step(s) {shown} rolled out other prompts than {base_path}'s (another "
            "--seed, --data or data order): their speedups compare different work",
            CompareWarning,
            stacklevel=3,
        )
