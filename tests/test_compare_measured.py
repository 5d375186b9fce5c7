"""``tltsim compare`` against what a tltrun run measured: training priced per worker (each
trains its own rollouts), and a trace measured on other hardware than the profile, or of other
prompts or another model than the baseline run (warnings).
The measured traces and profile: tests/test_compare.py's helpers.

Run: .venv/bin/python -m pytest tests/test_compare_measured.py -q
"""

# ruff: noqa: F811 (profile_path: the fixture imported from test_compare)
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from test_compare import (  # noqa: F401
    META,
    lengths_trace,
    profile_path,
    self_measured,
    worker_train_s,
)

from tltsim.cli.main import main
from tltsim.cost.measured import ProfileCost
from tltsim.cost.profile import load_profile, write_profile
from tltsim.trace.files import save_trace


def compare_edited(trace, profile, tmp_path, capsys, **measured) -> str:
    """stderr of ``tltsim compare`` of ``trace`` (one step) with its measured block's fields
    replaced by ``measured``, against ``profile``."""
    step = trace.steps[0]
    edited = dataclasses.replace(step, measured=dataclasses.replace(step.measured, **measured))
    path = tmp_path / "t.json"
    save_trace(dataclasses.replace(trace, steps=(edited,)), path)
    argv = ["compare", str(path), "--profile", str(profile), "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    return capsys.readouterr().err


def test_training_is_priced_per_worker_as_tltrun_trains(profile_path, tmp_path):
    """Hunt: compare priced training as the step's tokens split evenly, but each tltrun worker
    trains its own rollouts (gradients all-reduced, data not rebalanced): with --prompt-split
    1,3 the slowest worker trains 3/4 of the tokens. The slowest worker's share is priced."""
    trace = self_measured(lengths_trace(), "nospec", {}, profile_path, 2, 5)
    step = trace.steps[0]
    ids = [p.id for p in step.prompts]
    uneven = dataclasses.replace(step.measured, instance_prompts=(tuple(ids[:1]), tuple(ids[1:])))
    path = tmp_path / "uneven.json"
    save_trace(
        dataclasses.replace(trace, steps=(dataclasses.replace(step, measured=uneven),)), path
    )
    out = tmp_path / "cmp"
    assert main(["compare", str(path), "--profile", str(profile_path), "--out", str(out)]) == 0
    sim_train_s = pd.read_csv(out / "steps.csv")["sim_train_s"].iloc[0]
    cost = ProfileCost(load_profile(profile_path), is_warned=False)
    big = worker_train_s(cost, step.prompts[1:])
    assert sim_train_s == pytest.approx(big, rel=1e-9)
    assert big > max(
        worker_train_s(cost, step.prompts[:1]), 1.01 * worker_train_s(cost, step.prompts) / 2
    )


def test_a_trace_of_other_hardware_than_the_profile_is_a_warning(profile_path, tmp_path, capsys):
    """Hunt: generate's trace (torch's default threads) was compared with a 1-thread profile
    without a word. The old sidecar spelling ("N cores") names the same machine as "N CPUs"."""
    trace = self_measured(lengths_trace(1), "nospec", {}, profile_path, 1, 32)

    def compare_on(hardware: str) -> str:  # (profile_path: the one set when called)
        return compare_edited(trace, profile_path, tmp_path, capsys, hardware=hardware)

    assert compare_on("test") == ""
    assert compare_on("EPYC, 2 CPUs, 2 torch threads") == (
        f"warning: {tmp_path / 't.json'}: measured on 'EPYC, 2 CPUs, 2 torch threads', the "
        f"profile {profile_path} on 'test': simulated times are the profile's machine's (profile "
        "with the settings the run used)\n"
    )
    old = tmp_path / "old.csv"
    write_profile(
        load_profile(profile_path).rows, old, {**META, "hardware": "EPYC, 2 cores, 1 torch threads"}
    )
    profile_path = old
    assert compare_on("EPYC, 2 CPUs, 1 torch threads") == ""
    # a sidecar naming the GPU by its preset: the same GPU (review)
    preset = tmp_path / "preset.csv"
    write_profile(load_profile(old).rows, preset, {**META, "hardware": "H100-SXM"})
    profile_path = preset
    assert compare_on("NVIDIA H100 80GB HBM3") == ""
    assert "measured on 'NVIDIA H200'" in compare_on("NVIDIA H200")


def test_runs_that_rolled_out_other_prompts_or_models_are_a_warning(profile_path, tmp_path, capsys):
    """Hunt: two tltrun train runs of other seeds (other rows in every step) were paired step
    by step and their measured speedup printed without a word."""
    runs = {
        policy: self_measured(lengths_trace(2), policy, settings, profile_path, 1, 32)
        for policy, settings in (("nospec", {}), ("static", {"strategy": "4_1_4"}))
    }

    def compare(
        static_ids: dict[int, dict[str, str]],
        is_stable: bool = True,
        model: str = "m",
        static_steps: int = 2,
    ) -> str:
        paths = []
        for policy, trace in runs.items():
            steps = []
            for step in trace.steps:
                rename = static_ids.get(step.step, {}) if policy == "static" else {}
                prompts = tuple(dataclasses.replace(p, id=rename.get(p.id, p.id))
                                for p in step.prompts)  # fmt: skip
                measured = dataclasses.replace(step.measured, is_prompt_id_stable=is_stable,
                                               instance_prompts=None)  # fmt: skip
                steps.append(dataclasses.replace(step, prompts=prompts, measured=measured))
            if policy == "static":
                steps = steps[:static_steps]
            meta = {**trace.meta, "model": model if policy == "static" else "m"}
            paths.append(tmp_path / f"{policy}.json")
            save_trace(dataclasses.replace(trace, meta=meta, steps=tuple(steps)), paths[-1])
        argv = ["compare", *map(str, paths), "--profile", str(profile_path)]
        assert main([*argv, "--out", str(tmp_path / "c")]) == 0
        return capsys.readouterr().err

    first = runs["static"].steps[1].prompts[0].id
    assert compare({}) == ""
    assert compare({1: {first: "row 99"}}) == (
        f"warning: {tmp_path / 'static.json'}: step(s) 1 rolled out other prompts than "
        f"{tmp_path / 'nospec.json'}'s (another --seed, --data or data order): their speedups "
        "compare different work\n"
    )
    assert compare({1: {first: "row 99"}}, is_stable=False) == ""  # ids name no rows: unsaid
    assert "measured other, " in compare({}, model="other")
    assert compare({}, model="/elsewhere/m") == ""  # the same model directory's name
    # a run stopped early: its speedups are the common steps' (compare said nothing)
    assert compare({}, static_steps=1) == (
        f"warning: {tmp_path / 'static.json'}: measured 1 step(s), {tmp_path / 'nospec.json'} "
        "2: speedups compare the 1 step(s) both ran\n"
    )


def test_a_run_of_another_update_than_the_profiles_train_op_is_a_warning(
    profile_path, tmp_path, capsys
):
    """Hunt: a --num-epochs 4 run compared against a profile whose train op ran one epoch: 88%
    train error, no word (the trace did not record the update's settings)."""
    trace = self_measured(lengths_trace(1), "nospec", {}, profile_path, 1, 32)
    profile = tmp_path / "p.csv"
    write_profile(load_profile(profile_path).rows, profile,
                  {**META, "config": {"num_epochs": 1, "kl_coef": 0.04}})  # fmt: skip

    def compare_with(**update) -> str:
        return compare_edited(trace, profile, tmp_path, capsys, **update)

    assert compare_with(num_epochs=1, kl_coef=0.04) == ""
    assert compare_with() == ""  # a trace that records neither (older runs): nothing to say
    assert compare_with(num_epochs=4, kl_coef=0.04) == (
        f"warning: {tmp_path / 't.json'}: trained with --num-epochs 4, the profile {profile}'s "
        "train op with 1: simulated train times are of another update (tltrun profile "
        "--num-epochs as the run)\n"
    )
    assert "trained with --kl-coef 0.0, " in compare_with(num_epochs=1, kl_coef=0.0)


def test_a_profile_without_drafting_rows_names_the_flag_that_prices_them(
    profile_path, tmp_path, capsys
):
    """Hunt: a profile taken without --drafter refused every compare with "or give a fallback
    cost model", which names no flag; --hardware is the one."""
    trace = self_measured(lengths_trace(1), "nospec", {}, profile_path, 1, 32)
    rows = [r for r in load_profile(profile_path).rows if r.op not in ("verify", "drafter")]
    plain = tmp_path / "plain.csv"
    write_profile(rows, plain, META)
    path = tmp_path / "t.json"
    save_trace(trace, path)
    assert main(["compare", str(path), "--profile", str(plain), "--out", str(tmp_path / "c")]) == 2
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith(
            "or give a fallback cost model: --hardware GPU prices them by a roofline of the profiled "
            "model)"
        )
    )
