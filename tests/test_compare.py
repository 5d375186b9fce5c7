"""``tltsim compare``: a run fed its own simulated timings compares with zero error (the
plumbing: policy, placement, cap, acceptance and training cost reach the simulator intact);
measured traces of the torch engine on a tiny model give finite errors and the plots; bad input
is one line and exit code 2.

Run: .venv/bin/python -m pytest tests/test_compare.py -q
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math

import numpy as np
import pandas as pd
import pytest
from tiny_models import VOCAB, tiny_model

from tltsim.cli.main import main
from tltsim.cost.measured import ProfileCost, profile_from_cost
from tltsim.cost.profile import ProfileGrid, grid_points, load_profile, write_profile
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import HARDWARE_PRESETS, MODEL_PRESETS
from tltsim.policy import TLTConfig, make_policy
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.simulator import simulate
from tltsim.trace.files import save_trace
from tltsim.trace.measured import MeasuredStep
from tltsim.trace.schema import Prompt, Response, Step, Trace, trace_to_dict

META = {
    "hardware": "test",
    "backend": "torch",
    "tp": 1,
    "model": "Qwen2.5-0.5B",
    "software": {},
    "date": "2026-01-01",
}
GRID = ProfileGrid(
    batches=(1, 2, 4, 8, 16),
    context_per_seq=(16, 64, 256, 1024),
    verify_tokens_per_seq=(3, 5, 9),
    drafter_tokens_per_seq=(1, 2),
    prefill_batches=(1, 4, 16),
    prefill_tokens_per_seq=(16, 64, 256),
    train_batches=(1, 4, 16),
    train_tokens_per_seq=(64, 256, 1024),
)
TLT = TLTConfig(threshold=6, warmup_checks=3, strategies=("4_1_4", "2_1_2"), bucket_starts=(1, 3))
# accept rate 1: every verify accepts all drafts, so accept lengths are deterministic
SURE = DrafterDynamics(max_accept_rate=1.0, initial_accept_rate=1.0, stale_accept_rate=1.0)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A noiseless profile of a GPU roofline (the plumbing test needs exact costs only)."""
    cost = RooflineCost(MODEL_PRESETS["Qwen2.5-0.5B"], HARDWARE_PRESETS["H100-SXM"])
    path = tmp_path_factory.mktemp("cmp") / "profile.csv"
    write_profile(profile_from_cost(grid_points(GRID), cost), path, META)
    return path


def lengths_trace(num_steps: int = 3, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(num_steps):
        prompts = tuple(
            Prompt(
                f"p{i}",
                int(rng.integers(20, 80)),
                tuple(Response(int(n)) for n in rng.lognormal(4.0, 0.9, 4).astype(int) + 1),
            )
            for i in range(6)
        )
        steps.append(Step(s, prompts))
    return Trace(meta={"source": "test"}, steps=tuple(steps))


def worker_train_s(cost: ProfileCost, prompts) -> float:
    tokens = sum(p.prompt_tokens * len(p.responses) + sum(p.response_lengths()) for p in prompts)
    return cost.train_s(tokens, tokens / sum(len(p.responses) for p in prompts))


def self_measured(
    trace: Trace,
    policy: str,
    settings: dict,
    profile,
    num_instances: int,
    cap: int,
    share_prompts: bool = True,
):
    """Simulate ``trace`` on ``num_instances`` instances (chunked: whole prompts per instance)
    and write what a runtime would: measured = simulated, accept_hist per response."""
    cost = ProfileCost(load_profile(profile), is_warned=False)
    sim = SimConfig(
        num_gpus=num_instances,
        max_running_requests=cap,
        placement="chunked",
        exact=True,
        share_prompts=share_prompts,
    )
    result = simulate(trace, sim, cost, make_policy(policy, seed=3, **settings), None, SURE)
    steps = []
    for step, rec in zip(trace.steps, result.steps, strict=True):
        k = int(settings["strategy"].split("_")[0]) if policy == "static" else 0
        prompts = tuple(
            Prompt(
                p.id,
                p.prompt_tokens,
                tuple(
                    Response(r.tokens, accept_hist=(0,) * k + (1,) if k else None)
                    for r in p.responses
                ),
            )
            for p in step.prompts
        )
        share = len(step.prompts) // num_instances
        owners = [step.prompts[i * share : (i + 1) * share] for i in range(num_instances)]
        measured = {
            "rollout_s": rec.rollout_s,
            # what tltrun records: each worker trains the sequences it rolled out, the step
            # waits for the slowest (the simulator's rec.train_s splits the tokens evenly)
            "train_s": max(worker_train_s(cost, owner) for owner in owners),
            "policy": {"name": policy, "config": settings, "seed": 3},
            "max_running_requests": cap,
            "share_prompts": sim.share_prompts,
            "instance_prompts": [[p.id for p in owner] for owner in owners],
        }
        if policy == "tlt":  # verifies of both strategies, all drafts accepted
            measured["accept_hist_by_strategy"] = {"4_1_4": [0, 0, 0, 0, 5], "2_1_2": [0, 0, 5]}
        steps.append(Step(step.step, prompts, MeasuredStep.from_dict(measured)))
    return Trace(meta={"source": "self"}, steps=tuple(steps))


@pytest.mark.parametrize(
    "policy, settings",
    [("nospec", {}), ("static", {"strategy": "4_1_4"}), ("tlt", dataclasses.asdict(TLT))],
)
@pytest.mark.parametrize("num_instances, cap, share", [(1, 32, True), (2, 5, True), (2, 5, False)])
def test_own_simulated_timings_compare_with_zero_error(
    policy, settings, num_instances, cap, share, profile_path, tmp_path, capsys
):
    # share: the measured block's share_prompts reaches the replay (a replay that ignored it
    # would prefill differently from the "measurement" and miss it)
    trace = self_measured(
        lengths_trace(), policy, settings, profile_path, num_instances, cap, share
    )
    path = tmp_path / "measured.json"
    save_trace(trace, path)
    out = tmp_path / "cmp"
    argv = ["compare", str(path), "--profile", str(profile_path), "--out", str(out)]
    assert main(argv) == 0
    steps = json.loads((out / "summary.json").read_text())
    assert steps["rollout_err_pct"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert steps["rollout_err_pct"]["p90"] == pytest.approx(0.0, abs=1e-9)
    assert steps["train_err_pct"]["p90"] == pytest.approx(0.0, abs=1e-9)
    config = json.loads((out / "config.json").read_text())
    assert config["runs"][0]["num_instances"] == num_instances
    assert config["runs"][0]["policy"] == policy
    assert "rollout" in capsys.readouterr().out


def test_speedups_between_policies(profile_path, tmp_path, capsys):
    paths = []
    for policy, settings in (("nospec", {}), ("static", {"strategy": "4_1_4"})):
        paths.append(tmp_path / f"{policy}.json")
        save_trace(self_measured(lengths_trace(), policy, settings, profile_path, 1, 32), paths[-1])
    out = tmp_path / "cmp"
    assert (
        main(["compare", *map(str, paths), "--profile", str(profile_path), "--out", str(out)]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    up = summary["speedups"]["static"]
    assert up["sim_speedup"] == pytest.approx(up["measured_speedup"], rel=1e-9)
    assert up["measured_speedup"] > 1.0  # SD at accept rate 1 on a GPU roofline pays
    assert (out / "parity.png").stat().st_size > 0 and (out / "steps.png").stat().st_size > 0
    # a --tlt-* flag no trace's policy takes was dropped without a word
    argv = ["compare", *map(str, paths), "--profile", str(profile_path), "--out", str(out)]
    capsys.readouterr()
    assert main([*argv, "--tlt-threshold", "2"]) == 0
    assert (
        "warning: --tlt-threshold: no trace ran a policy that takes it" in capsys.readouterr().err
    )


def test_two_runs_of_one_policy_are_one_error_line(profile_path, tmp_path, capsys):
    """Two NoSpec runs (e.g. torch and vLLM) beside a static one: the speedups' baseline
    pairing was ambiguous and ended as 'internal error: TypeError: Could not convert step'."""
    paths = []
    for name, policy, settings in (
        ("a", "nospec", {}),
        ("b", "nospec", {}),
        ("c", "static", {"strategy": "4_1_4"}),
    ):
        paths.append(tmp_path / f"{name}.json")
        save_trace(self_measured(lengths_trace(), policy, settings, profile_path, 1, 32), paths[-1])
    argv = [
        "compare",
        *map(str, paths),
        "--profile",
        str(profile_path),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b.json: measures policy 'nospec', as" in err, err


def test_torch_engine_traces_give_finite_errors_and_plots(tmp_path):
    """profile -> run -> compare on a tiny model (the recipe, in miniature)."""
    from tltrun.model.drafter import EagleDrafter, export_vllm
    from tltrun.model.hf_checkpoint import save_hf
    from tltrun.profile.measure import ProfileRunConfig, run_profile
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import SamplingParams
    from tltrun.rollout.measured_trace import measured_step, requests_from_step

    target = tiny_model(seed=0)
    drafter = EagleDrafter.for_target(target, seed=1)
    save_hf(target, tmp_path / "target")
    export_vllm(drafter, tmp_path / "drafter")
    profile = tmp_path / "profile.csv"
    pcfg = ProfileRunConfig(
        model=str(tmp_path / "target"),
        drafter=str(tmp_path / "drafter"),
        out=str(profile),
        batches=(1, 2, 4),
        context_per_seq=(8, 32, 64),
        strategies=("2_1_2",),
        prefill_batches=(1, 4),
        prefill_tokens_per_seq=(8, 32),
        train_batches=(1, 4),
        train_tokens_per_seq=(16, 64),
        num_warmup=1,
        num_repeats=2,
        is_progress_shown=False,
    )
    run_profile(pcfg, datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
    trace = Trace(
        meta={},
        steps=(
            Step(0, (Prompt("a", 6, (Response(9), Response(30))), Prompt("b", 10, (Response(4),)))),
        ),
    )
    paths = []
    for name, settings in (("nospec", {}), ("static", {"strategy": "2_1_2"})):
        engine = RolloutEngine(target, drafter, EngineConfig(4, 64, SamplingParams(1.0), seed=0))
        result = engine.generate(
            requests_from_step(trace.steps[0], VOCAB, seed=0), make_policy(name, **settings)
        )
        step = measured_step(0, result, None, name, "test", {"max_running_requests": 4})
        paths.append(tmp_path / f"{name}.json")
        save_trace(Trace({}, (step,)), paths[-1])
    out = tmp_path / "cmp"
    assert main(["compare", *map(str, paths), "--profile", str(profile), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("nospec", "static"):
        assert math.isfinite(summary["policies"][policy]["rollout_err_pct"]["median"])
    assert math.isfinite(summary["speedups"]["static"]["sim_speedup"])
    for name in ("parity.png", "steps.png", "steps.csv", "speedups.csv", "config.json"):
        assert (out / name).stat().st_size > 0


def _measured_trace(**measured) -> dict:
    """A one-step trace document (JSON, so that it may hold a block that fails to load)."""
    base = {"rollout_s": 1.0, "policy": {"name": "nospec"}, "max_running_requests": 8}
    base.update(measured)
    base = {k: v for k, v in base.items() if v is not None}
    prompts = (Prompt("p0", 10, (Response(5), Response(7))), Prompt("p1", 12, (Response(3),)))
    doc = trace_to_dict(Trace({}, (Step(0, prompts),)))
    doc["steps"][0]["measured"] = base
    return doc


@pytest.mark.parametrize(
    "trace, extra, expected",
    [
        (_measured_trace(rollout_s=None), [], "measured.rollout_s"),
        (_measured_trace(policy={"name": "fast"}), [], "measured.policy.name"),
        (_measured_trace(max_running_requests=None), [], "max_running_requests"),
        (_measured_trace(instance_prompts=[["p0"]]), [], "every prompt"),
        (_measured_trace(worker_rollout_s=[1.0, 0.5]), [], "2 workers"),
        (
            _measured_trace(policy={"name": "tlt", "config": {"speed": 1}}),
            [],
            "policy.config.speed",
        ),
        (_measured_trace(clock="cpu"), [], "measured in cpu seconds"),
        (_measured_trace(clock="gpu"), [], "measured.clock"),
        (_measured_trace(share_prompts="yes"), [], "measured.share_prompts"),
        (_measured_trace(prefix_block_tokens=0), [], "measured.prefix_block_tokens"),
        (_measured_trace(), ["--profile", "/nonexistent.csv"], "/nonexistent.csv"),
        (_measured_trace(), ["--hardware", "TPU"], "hardware"),
        # history-drafter runs are replayed (issue #20; tests/test_history_fit.py), but a
        # tltbase config that is not TLTConfig's is still refused
        (
            _measured_trace(policy={"name": "tltbase", "config": {"speed": 1}}),
            [],
            "policy.config.speed",
        ),
        (
            _measured_trace(
                response_accept_hist_by_strategy={
                    "p0": [{"history:2_1_2": [0, 0, 0, 4]}, {}],
                    "p1": [{}],
                }
            ),
            [],
            "accepts at most 2 draft tokens",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(trace, extra, expected, profile_path, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    argv = ["compare", str(path), "--profile", str(profile_path), "--out", str(tmp_path / "o")]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and expected in err


def test_a_tltbase_run_with_its_own_strategies_replays_with_the_buckets_it_ran():
    """tltrun train --policy tltbase --tlt-strategies 8_4_48,...: the run drops TLT-Base's
    one-bucket default beside its own strategies; the replay kept it and refused the run."""
    from tltsim.fidelity.measured_run import measured_run
    from tltsim.policy import TLTBase
    from tltsim.trace.schema import trace_from_dict

    strategies = ["8_4_48", "8_4_32", "8_4_16", "8_4_8"]
    doc = _measured_trace(policy={"name": "tltbase", "config": {"strategies": strategies}})
    run = measured_run(trace_from_dict(doc, "run.json"), "run.json")
    ran = TLTBase(strategies=tuple(strategies)).config.bucket_starts
    assert tuple(run.settings["bucket_starts"]) == ran == (1, 2, 5, 21)


def test_a_change_of_instance_count_names_the_steps(profile_path, tmp_path, capsys):
    """A run resumed on more workers: which steps ran on how many instances, not just 'changes'."""
    one, two = _measured_trace(), _measured_trace(instance_prompts=[["p0"], ["p1"]])
    steps = [dict(one["steps"][0], step=0), dict(one["steps"][0], step=1)]
    steps.append(dict(two["steps"][0], step=2))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(one, steps=steps)))
    argv = ["compare", str(path), "--profile", str(profile_path), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "(steps 0-1 on 1 instance, step 2 on 2 instances:" in err and err.count("\n") == 1


def test_replayed_acceptance_is_per_step_and_strategy():
    from tltsim.fidelity.measured_run import replayed_acceptance
    from tltsim.policy import SpecDecision

    prompts = (Prompt("p0", 10, (Response(50),)),)
    hists = [{"2_1_2": [10, 0, 30]}, {"4_1_4": [5, 5, 0, 0, 10]}]
    trace = Trace(
        {},
        tuple(
            Step(i, prompts, MeasuredStep.from_dict({"accept_hist_by_strategy": h}))
            for i, h in enumerate(hists)
        ),
    )
    acc = replayed_acceptance(trace, "t")
    chain2, chain4 = SpecDecision.parse("2_1_2"), SpecDecision.parse("4_1_4")
    step0 = acc.initial_state()
    step1 = acc.after_rl_step(step0)
    assert acc.accept_len_pmf(step0, chain2).tolist() == [0.25, 0.0, 0.75]
    assert acc.accept_len_pmf(step1, chain4).tolist() == [0.25, 0.25, 0.0, 0.0, 0.5]
    assert acc.accept_len_pmf(step0, chain4) is None  # not measured in step 0: the model's
    assert acc.rates[0] == pytest.approx(
        60 / (60 + 10)
    )  # chain ML: accepted / (accepted + rejected)


def _two_response_trace(by_strategy: list) -> Trace:
    prompts = (Prompt("p0", 10, (Response(101), Response(101), Response(101))),)
    measured = {
        "accept_hist_by_strategy": {"4_1_4": [1, 0, 0, 0, 1]},
        "response_accept_hist_by_strategy": {"p0": by_strategy},
    }
    return Trace({}, (Step(0, prompts, MeasuredStep.from_dict(measured)),))


@pytest.mark.parametrize("exact", [True, False])
def test_each_response_replays_its_own_acceptance(exact):
    from tltsim.fidelity.measured_run import replayed_acceptance
    from tltsim.policy import StaticSpec

    # response 0 never accepted a draft (rate 0), responses 1 and 2 always all four (rate 1);
    # the step's histogram (accept 0 or 4, half each) would make every count random
    all_four = {"4_1_4": [0, 0, 0, 0, 7]}
    trace = _two_response_trace([{"4_1_4": [30]}, all_four, all_four])
    acc = replayed_acceptance(trace, "t")
    assert acc.request_accept_rates(acc.initial_state(), trace.steps[0]).tolist() == [0, 1, 1]
    sim = SimConfig(num_gpus=1, exact=exact, share_prompts=False, seed=1)
    cost = RooflineCost(MODEL_PRESETS["Qwen2.5-0.5B"], HARDWARE_PRESETS["H100-SXM"])
    result = simulate(trace, sim, cost, StaticSpec(4, 1, 4), None, acc)
    # 100 tokens after the first: 20 verifies of 5 tokens each for 1 and 2, 100 of 1 for 0
    rec = result.steps[0]
    assert rec.sd_verifies == 100 + 20 + 20 and rec.sd_tokens == 300
    finish = result.finish_s[0]
    assert finish[1] == finish[2] < finish[0]
    # a response that verified nothing draws from the step's histogram (nan rate)
    trace = _two_response_trace([{"4_1_4": [30]}, all_four, {}])
    rates = replayed_acceptance(trace, "t").request_accept_rates(
        acc.initial_state(), trace.steps[0]
    )
    assert rates[:2].tolist() == [0, 1] and math.isnan(rates[2])


@pytest.mark.parametrize(
    "by_strategy, expected",
    [
        ([{"4_1_4": [1]}], "one entry per response (3)"),
        ([{"4_1_4": [1]}, {"x_1_4": [1]}, {}], "[1]"),
        ([{"4_1_4": [1, 0, 0, 0, 0, 1]}, {}, {}], "accepts at most 4 draft tokens"),
    ],  # (a negative count fails to load: test_trace_validation.py "measured bad response hist")
)
def test_bad_response_histograms_name_the_field(by_strategy, expected):
    from tltsim.errors import UsageError
    from tltsim.fidelity.measured_run import replayed_acceptance

    with pytest.raises(UsageError, match="response_accept_hist_by_strategy") as err:
        replayed_acceptance(_two_response_trace(by_strategy), "t.json")
    assert expected in str(err.value) and "t.json: step 0" in str(err.value)


def test_drafter_dynamics_learn_the_tokens_the_run_trained(profile_path, tmp_path):
    """--drafter-dynamics replays the fitted model, which learns from each step's measured
    drafter_trained_tokens (as fit fitted it); it never learned before, so its acceptance
    stayed at the initial rate and the steps after training were simulated far too slow."""
    trace = self_measured(lengths_trace(), "static", {"strategy": "4_1_4"}, profile_path, 1, 32)
    trained = (2_000, 0, 0)  # tokens the drafter trained on during each step's rollout
    steps = tuple(
        dataclasses.replace(s, measured=dataclasses.replace(s.measured, drafter_trained_tokens=n))
        for s, n in zip(trace.steps, trained, strict=True)
    )
    save_trace(dataclasses.replace(trace, steps=steps), tmp_path / "m.json")
    # learns fast, no drift: 0.1 during step 0, ~0.9 after its 2000 tokens
    dynamics = DrafterDynamics(initial_accept_rate=0.1, max_accept_rate=0.9,
                               stale_accept_rate=0.1, drift_per_step=0.0, learn_tokens=200.0)  # fmt: skip
    path = tmp_path / "dyn.json"
    fields = dataclasses.asdict(dynamics)
    path.write_text(
        json.dumps({"format": "tlt-drafter-dynamics", "version": 1, "dynamics": fields})
    )
    out = tmp_path / "cmp"
    argv = ["compare", str(tmp_path / "m.json"), "--profile", str(profile_path), "--out", str(out),
            "--drafter-dynamics", str(path)]  # fmt: skip
    assert main(argv) == 0

    accept = pd.read_csv(out / "steps.csv").sim_accept_len.tolist()
    # chain 4: expected accept length (1 - a^5) / (1 - a): 1.11 at a = 0.1, 4.1 at a = 0.9
    assert accept[0] == pytest.approx(1.11, abs=0.1)
    assert accept[1] == pytest.approx(4.1, abs=0.4) and accept[2] == pytest.approx(4.1, abs=0.4)


def test_a_tlt_flag_replaces_that_field_of_the_recorded_config(profile_path, tmp_path, capsys):
    """--tlt-threshold 2 asks "what if the threshold were 2": the run's recorded strategies,
    buckets and warm-up stay (one flag replaced the whole config with defaults)."""
    settings = dataclasses.asdict(TLT)
    trace = self_measured(lengths_trace(), "tlt", settings, profile_path, 1, 32)
    save_trace(trace, tmp_path / "m.json")
    base = ["compare", str(tmp_path / "m.json"), "--profile", str(profile_path)]
    assert main([*base, "--out", str(tmp_path / "a"), "--tlt-threshold", "2"]) == 0
    used = json.loads((tmp_path / "a" / "config.json").read_text())["runs"][0]["settings"]
    assert used == {**json.loads(json.dumps(settings)), "threshold": 2}
    # what the flags and the recorded config make together is checked: one line naming the run
    code = main([*base, "--out", str(tmp_path / "b"), "--tlt-bucket-starts", "1,2,4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "m.json" in err and "\n" not in err


def test_each_instance_admits_its_prompts_in_the_recorded_order(profile_path, tmp_path):
    """measured.instance_prompts lists the prompts in the order the engine admitted them; under
    a batching cap that order decides which responses wait, so the replay follows it (it took
    the trace's prompt order)."""
    trace = lengths_trace()
    reordered = Trace(trace.meta, tuple(Step(s.step, s.prompts[::-1]) for s in trace.steps))
    measured = self_measured(reordered, "nospec", {}, profile_path, 1, 5)
    # the same measurement, its prompts listed in the original order (admission order kept)
    steps = tuple(
        dataclasses.replace(m, prompts=s.prompts)
        for m, s in zip(measured.steps, trace.steps, strict=True)
    )
    save_trace(dataclasses.replace(measured, steps=steps), tmp_path / "m.json")
    out = tmp_path / "cmp"
    argv = ["compare", str(tmp_path / "m.json"), "--profile", str(profile_path), "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_err_pct"]["p90"] == pytest.approx(0.0, abs=1e-9)
