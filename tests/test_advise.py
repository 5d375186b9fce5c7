"""``tltsim advise``: the sweep a user would run, one recommendation, and what the trace cannot
tell (issue #21, part 5).

Run: ``python -m pytest tests/test_advise.py -q``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest

from tltsim.cli.main import main
from tltsim.cost.presets import apply_preset
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.replay import RunSettings, run_settings
from tltsim.trace.files import load_trace
from tltsim.trace.schema import Trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "synth_reasoning_rl.json"


def test_advise_on_the_shipped_trace(tmp_path, capsys):
    from tltrun.train.config import TrainConfig  # tests may import tltrun; tltsim may not

    out = tmp_path / "advise"
    argv = ["advise", str(TRACE), "--preset", "h100x8-qwen7b", "--max-steps", "3"]
    assert main([*argv, "--thresholds", "16,64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "expected step speedup vs NoSpec" in text
    report = json.loads((out / "advise.json").read_text())
    rec = report["recommendation"]
    assert rec["speedup_vs_nospec_low"] <= rec["speedup_vs_nospec"] <= rec["speedup_vs_nospec_high"]
    assert 0.0 <= rec["sd_on_fraction"] <= 1.0 and math.isfinite(
        rec["idle_gpu_s_reclaimed_per_step"]
    )
    assert rec["tlt"]["threshold"] in (16, 64)
    train = tomllib.loads((out / "train.toml").read_text())
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(train) <= fields, set(train) - fields
    assert train["tlt_threshold"] == rec["tlt"]["threshold"]
    assert (out / "fastrl.yaml").read_text().startswith("speculative:")
    assert (out / "sweep" / "summary.json").exists()


# The key paths of fastrl's speculative section that the block sets (mit-han-lab/fastrl,
# verl/trainer/config/fastrl_trainer.yaml at bce3df7); the block used other names and nesting
# (speculative.topk, train.enable), which fastrl's Hydra config does not read.
FASTRL_KEYS = {
    ("enable",), ("spec_strategy",), ("bs_threshold",), ("eagle", "spec_steps"),
    ("eagle", "spec_topk"), ("eagle", "spec_verify_tokens"), ("eagle", "tune_algorithm"),
    ("eagle", "mab_configs"), ("eagle", "mab_bs_threshold"), ("train", "enable_drafter_training"),
    ("train", "training_interval_steps"),
}  # fmt: skip


@pytest.mark.parametrize("is_spot_training", [True, False])
def test_the_fastrl_block_uses_fastrls_keys_and_quotes_strategies(is_spot_training):
    import yaml

    from tltsim.cli.advise import fastrl_yaml
    from tltsim.policy import TLTConfig

    tlt = TLTConfig(threshold=16, strategies=("3_1_3", "2_1_2", "1_1_1", "4_1_4"))
    doc = yaml.safe_load(fastrl_yaml(tlt, is_spot_training))["speculative"]

    def paths(node: dict, prefix: tuple = ()) -> set[tuple]:
        out = set()
        for key, value in node.items():
            out |= paths(value, (*prefix, key)) if isinstance(value, dict) else {(*prefix, key)}
        return out

    assert paths(doc) <= FASTRL_KEYS, paths(doc) - FASTRL_KEYS
    assert doc["enable"] is True and doc["bs_threshold"] == 16
    eagle = doc["eagle"]
    assert (eagle["spec_steps"], eagle["spec_topk"], eagle["spec_verify_tokens"]) == (3, 1, 3)
    # strings: YAML reads 2_1_2 unquoted as the integer 212
    assert eagle["mab_configs"] == ["2_1_2", "1_1_1", "4_1_4"]
    assert eagle["mab_bs_threshold"] == list(tlt.bucket_starts)
    assert doc["train"]["enable_drafter_training"] is is_spot_training
    # TLT as simulated trains every step; fastrl's default (10) collects every 10th
    assert doc["train"].get("training_interval_steps") == (1 if is_spot_training else None)


def test_advise_sweeps_on_every_core_by_default_as_sweep_does():
    """Hunt: advise's sweep ran on one worker (84 s of a 112 s advise on 2 cores)."""
    from tltsim.cli.advise import AdviseConfig

    assert AdviseConfig().workers is None  # run_sweep: None is every core


def test_advise_writes_a_sweep_spec_toml_reads_whatever_the_paths_hold():
    """json.dumps escaped characters beyond U+FFFF as surrogate pairs, which TOML refuses:
    advise then failed on its own sweep.toml for a trace named with an emoji."""
    from tltsim.cli.advise import AdviseConfig, sweep_toml

    text = sweep_toml(Path('/tmp/run\U0001f600 "q".json'), AdviseConfig(), "/x/gpu\u00e9.json")
    spec = tomllib.loads(text)
    assert spec["trace"].endswith('run\U0001f600 "q".json')
    assert spec["fixed"]["hardware"] == "/x/gpu\u00e9.json"


def test_advise_recommends_the_settings_it_swept_even_when_held_at_one_value():
    """The sweep's summary names only the settings that varied; a threshold or strategy set
    given alone is the user's, not TLTConfig's default (32, the 8_4_* trees)."""
    from tltsim.cli.advise import STRATEGY_SETS, AdviseConfig, best_settings

    config = AdviseConfig(thresholds=(4,), strategy_sets=("chains",))
    best = {"policy": "tlt", "is_spot_training": False, "speedup_vs_nospec": 2.1}
    tlt, is_spot = best_settings({"best": best}, config)
    assert (tlt.threshold, tlt.strategies, is_spot) == (4, STRATEGY_SETS["chains"], False)
    varied = best | {"tlt.threshold": 16, "tlt.strategies": ",".join(STRATEGY_SETS["chains"])}
    tlt, _ = best_settings({"best": varied}, AdviseConfig(thresholds=(4, 16)))
    assert (tlt.threshold, tlt.strategies) == (16, STRATEGY_SETS["chains"])


@pytest.mark.parametrize(
    "extra",
    [
        ["--strategy-sets", "warp"],
        ["--preset", "nope"],
        ["--thresholds", "0"],
        # refused before the sweep runs (they were checked after all of it, then refused)
        ["--cost-error", "1.5"],
        ["--accept-rate-range", "1.2,0.8"],
        ["--accept-rate-range", "fit"],  # a fitted band needs a file only replay takes
        ["--accept-rate-range", "abc"],  # (it offered 'fit', which advise refuses)
        ["--thresholds", "99999999999999999999"],  # (it wrote sweep.toml, then failed)
        ["--workers", "0"],
    ],
)
def test_advise_bad_input_is_one_line_exit_2(tmp_path, capsys, extra):
    assert main(["advise", str(TRACE), "--out", str(tmp_path / "a"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "--drafter-dynamics FILE)" not in err
    assert "'fit'" not in err
    assert not (tmp_path / "a").exists()


def test_advise_missing_trace_is_exit_2(tmp_path, capsys):
    assert main(["advise", str(tmp_path / "nope.json"), "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize(
    "dynamics",
    [
        DrafterDynamics(),  # starts fully trained: step 0's drift first leaves it something
        DrafterDynamics(initial_accept_rate=0.6),  # starts short of its maximum
        DrafterDynamics(learn_tokens=math.inf),  # never learns
    ],
)
def test_the_first_step_spot_training_shows_in_is_the_simulators(dynamics):
    """first_step_training_shows() against the simulator itself: the first step whose drafter
    acceptance differs between spot training on and off."""
    full = load_trace(TRACE)
    trace = Trace(meta=full.meta, steps=full.steps[:4])
    sim = dataclasses.replace(apply_preset(SimConfig(), "h100x8-qwen7b"), exact=False)
    accept = {
        is_on: [
            s.drafter_acceptance
            for s in run_settings(
                RunSettings(sim=sim, policy="tlt", drafter=dynamics, is_spot_training=is_on),
                trace,
            ).steps
        ]
        for is_on in (True, False)
    }
    differ = [i for i, (a, b) in enumerate(zip(*accept.values(), strict=True)) if a != b]
    assert (differ[0] if differ else None) == dynamics.first_step_training_shows()


def test_advise_says_when_the_trace_is_too_short_to_judge_spot_training(tmp_path, capsys):
    """In 2 steps spot training cannot raise acceptance: advise chose 'spot training off' for
    its checkpoint cost (0.1 s a step) and did not say why; from 3 steps it is judged."""
    argv = ["advise", str(TRACE), "--thresholds", "64", "--strategy-sets", "fastrl"]
    for num_steps, is_noted in ((2, True), (3, False)):
        out = tmp_path / f"a{num_steps}"
        assert main([*argv, "--max-steps", str(num_steps), "--out", str(out)]) == 0
        noted = "note: in 2 steps spot training cannot raise" in capsys.readouterr().out
        notes = json.loads((out / "advise.json").read_text())["notes"]
        assert noted == is_noted and bool(notes) == is_noted, notes


def test_a_workload_where_tlt_is_slower_says_do_not_use_it(tmp_path, capsys):
    """A hunt's case: every setting slower than NoSpec (0.99x [0.98-0.99]) read 'does not
    reliably pay' and printed ready TLT configs."""
    trace = ROOT / "traces" / "azure_conv_rl.json"
    out = tmp_path / "advise"
    assert main(["advise", str(trace), "--preset", "h20x8-qwen7b", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rec = json.loads((out / "advise.json").read_text())["recommendation"]
    assert rec["speedup_vs_nospec_high"] < 1.0
    assert "recommendation: do not use TLT: its best setting is slower than NoSpec" in text
    assert "for reference only" in text


@pytest.mark.parametrize(("reclaimed", "expected"), [
    (6.34, "idle GPU-seconds reclaimed per step: 6.3"),
    (0.0, "idle GPU-seconds per step: as NoSpec's"),
    (-0.04, "idle GPU-seconds per step: as NoSpec's"),  # (hunt: "0.0 MORE than NoSpec")
    (-0.06, "idle GPU-seconds per step: 0.1 MORE than NoSpec"),
    (-1234.5, "idle GPU-seconds per step: 1,234.5 MORE than NoSpec"),
])  # fmt: skip
def test_more_idle_time_than_nospec_is_said_as_a_loss(reclaimed, expected):
    from tltsim.cli.advise import idle_line

    assert idle_line({"idle_gpu_s_reclaimed_per_step": reclaimed}) == expected


def test_an_interrupted_advice_leaves_no_earlier_advice_beside_its_sweep(
    tmp_path, capsys, monkeypatch
):
    """A new advice killed in its sweep left the earlier run's advise.json and train.toml (a
    block users paste) beside the new sweep.toml."""
    import tltsim.cli.advise as advise_cli

    out = tmp_path / "a"
    argv = ["advise", str(TRACE), "--thresholds", "64", "--strategy-sets", "fastrl"]
    assert main([*argv, "--max-steps", "3", "--out", str(out)]) == 0
    assert {"advise.json", "train.toml", "fastrl.yaml"} <= {p.name for p in out.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(advise_cli, "run_sweep", interrupted)
    assert main([*argv, "--max-steps", "2", "--out", str(out)]) == 130
    left = {p.name for p in out.iterdir()}
    assert "sweep.toml" in left and not left & {"advise.json", "train.toml", "fastrl.yaml"}


def test_advise_takes_a_gpu_as_replay_does(tmp_path, capsys):
    """Hunt: users type replay's --hardware here too; argparse took it for --hardware-file and
    answered about a preset file. The GPU replaces the preset's; beside a file it is refused."""
    argv = ["advise", str(TRACE), "--max-steps", "1", "--num-seeds", "1", "--thresholds", "32",
            "--strategy-sets", "chains", "--hardware", "H200"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "simulated: Qwen2.5-7B on 8 x H200 (TP 1)" in out
    assert "interval: min-max over accept rates x0.9-x1.1; SD iteration cost +/-10%)" in out
    assert 'hardware = "H200"' in (tmp_path / "a" / "sweep.toml").read_text()
    assert main([*argv, "--hardware-file", str(tmp_path / "x.json")]) == 2
    assert "--hardware H200 and --hardware-file" in capsys.readouterr().err
