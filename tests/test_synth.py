"""Tests of the synthetic trace generator (``tltsim.trace.synth``, ``tltsim gen``).

Run: ``.venv/bin/python -m pytest tests/test_synth.py -q``
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltsim.cli.main import build_parser, main
from tltsim.trace.files import load_trace
from tltsim.trace.schema import trace_from_dict, trace_to_dict
from tltsim.trace.synth import GenConfig, generate, generate_arrays


def _gen_cli(out: Path, *flags: str) -> bytes:
    assert main(["gen", *flags, "--out", str(out)]) == 0
    return out.read_bytes()


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    flags = ("--num-steps", "3", "--prompts-per-step", "16")
    first = _gen_cli(tmp_path / "a.json", *flags, "--seed", "7")
    again = _gen_cli(tmp_path / "b.json", *flags, "--seed", "7")
    other = _gen_cli(tmp_path / "c.json", *flags, "--seed", "8")
    assert first == again
    assert first != other
    assert _gen_cli(tmp_path / "a.csv", *flags, "--seed", "7") == _gen_cli(
        tmp_path / "b.csv", *flags, "--seed", "7"
    )


def test_cli_flags_map_one_to_one_onto_genconfig(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    _gen_cli(
        out,
        "--num-steps",
        "2",
        "--prompts-per-step",
        "3",
        "--group-size",
        "5",
        "--max-response-tokens",
        "999",
        "--model",
        "M",
        "--seed",
        "4",
    )
    trace = load_trace(out)
    expected = GenConfig(
        num_steps=2, prompts_per_step=3, group_size=5, max_response_tokens=999, model="M", seed=4
    )
    assert trace.meta["generator"] == dataclasses.asdict(expected)
    assert (trace.num_steps, trace.num_prompts, trace.num_responses) == (2, 6, 30)
    assert trace.meta["max_response_tokens"] == 999 and trace.meta["group_size"] == 5
    gen_parser = build_parser()._subparsers._group_actions[0].choices["gen"]
    dests = {a.dest for a in gen_parser._actions} - {"help", "out"}
    assert dests == {f.name for f in dataclasses.fields(GenConfig)}


def test_cap_respected_and_length_exactly_at_cap() -> None:
    cfg = GenConfig(num_steps=4, prompts_per_step=64, max_response_tokens=2000, seed=3)
    trace = generate(cfg)
    responses = [r for s in trace.steps for p in s.prompts for r in p.responses]
    assert max(r.tokens for r in responses) == 2000
    assert all(1 <= r.tokens <= 2000 for r in responses)
    assert all((r.finish == "length") == (r.tokens == 2000) for r in responses)
    num_capped = sum(r.is_truncated for r in responses)
    assert 0 < num_capped < len(responses) // 2
    # and through a file: the cap's "length" survives JSON
    assert trace_from_dict(trace_to_dict(trace), "mem") == trace


def test_drift_makes_later_steps_longer() -> None:
    drift = 0.1
    lengths, _ = generate_arrays(
        GenConfig(num_steps=12, prompts_per_step=128, drift_per_step=drift, seed=1)
    )
    mean_log = np.log(lengths).mean(axis=(1, 2))  # per step
    slope = np.polyfit(np.arange(12), mean_log, 1)[0]
    assert slope == pytest.approx(drift, abs=0.02)
    flat, _ = generate_arrays(
        GenConfig(num_steps=12, prompts_per_step=128, drift_per_step=0.0, seed=1)
    )
    assert abs(np.polyfit(np.arange(12), np.log(flat).mean(axis=(1, 2)), 1)[0]) < 0.02
    assert lengths[-1].mean() > 2 * flat[-1].mean()


def _group_facts(lengths: np.ndarray) -> tuple[float, float, float]:
    """(step max/median, spread of the median prompt's group, spread of the worst group),
    each the median over steps; a group's spread is its max/min."""
    step_ratio, median_spread, worst_spread = [], [], []
    for step in lengths:  # (P, G)
        spread = step.max(axis=1) / step.min(axis=1)
        by_difficulty = np.argsort(np.median(step, axis=1))
        step_ratio.append(step.max() / np.median(step))
        median_spread.append(spread[by_difficulty[len(step) // 2]])
        worst_spread.append(spread.max())
    return (
        float(np.median(step_ratio)),
        float(np.median(median_spread)),
        float(np.median(worst_spread)),
    )


def test_defaults_reproduce_the_published_long_tail_facts() -> None:
    # /work/shared/traces/README.md: a step's longest response is 10-25x its median; a prompt's
    # 8 samples differ by 2x at the median prompt and 5-20x at the worst.
    lengths, _ = generate_arrays(GenConfig(num_steps=60, drift_per_step=0.0, seed=11))
    step_ratio, median_spread, worst_spread = _group_facts(lengths)
    assert 10 <= step_ratio <= 25
    assert 1.5 <= median_spread <= 2.7
    assert 5 <= worst_spread <= 20
    assert np.median(lengths) == pytest.approx(GenConfig().median_response_tokens, rel=0.15)


def test_groups_are_correlated() -> None:
    lengths, _ = generate_arrays(GenConfig(num_steps=4, seed=5))
    logs = np.log(lengths)  # (S, P, G)
    within = logs.std(axis=2).mean()
    across = logs.mean(axis=2).std(axis=1).mean()
    assert within < 0.5 * across


@settings(max_examples=30, deadline=None)
@given(
    num_steps=st.integers(1, 3),
    prompts=st.integers(1, 5),
    group=st.integers(1, 4),
    cap=st.integers(1, 50_000),
    median=st.floats(1, 1e5),
    sigma=st.floats(0, 3),
    seed=st.integers(0, 2**32),
)
def test_any_valid_config_gives_a_valid_trace(
    num_steps, prompts, group, cap, median, sigma, seed
) -> None:
    cfg = GenConfig(
        num_steps=num_steps,
        prompts_per_step=prompts,
        group_size=group,
        max_response_tokens=cap,
        median_response_tokens=median,
        difficulty_sigma=sigma,
        seed=seed,
    )
    trace = generate(cfg)
    assert trace_from_dict(trace_to_dict(trace), "mem") == trace  # passes full validation
    assert trace.num_responses == num_steps * prompts * group
    assert all(1 <= n <= cap for s in trace.steps for n in s.response_lengths())


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--num-steps", "0"], "--num-steps must be"),
        (["--group-size", "-2"], "--group-size must be"),
        (["--median-response-tokens", "0"], "--median-response-tokens must be"),
        (["--seed", "-1"], "--seed"),
        (["--group-sigma", "-0.1"], "--group-sigma"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], fragment: str
) -> None:
    assert main(["gen", *flags, "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err and "Traceback" not in err
    assert not (tmp_path / "t.json").exists()


def test_bad_out_suffix_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["gen", "--out", str(tmp_path / "t.txt")]) == 2
    assert "--out" in capsys.readouterr().err


def test_sample_trace_regenerates_byte_for_byte(tmp_path: Path) -> None:
    # The command documented in traces/README.md.
    argv = [
        "--num-steps",
        "8",
        "--prompts-per-step",
        "64",
        "--group-size",
        "8",
        "--max-response-tokens",
        "32768",
        "--drift-per-step",
        "0.05",
        "--seed",
        "0",
    ]
    sample = Path(__file__).resolve().parents[1] / "traces" / "synth_reasoning_rl.json"
    assert _gen_cli(tmp_path / "s.json", *argv) == sample.read_bytes()
