"""tltrun.train.compare: finished runs read back from their directories and compared."""

from __future__ import annotations

import json

import pytest

from tltrun.train.compare import COLUMNS, FORMATS, compare_runs, engine_totals
from tltsim.cli.table import format_table


def log_row(**fields: float) -> dict:
    """One ``log.jsonl`` row with the keys compare_runs reads; zeros unless given."""
    keys = ("rollout_s", "step_s", "response_tokens_mean", "accept_len", "reward_mean")
    row = dict.fromkeys(keys + ("drafter_train_s", "idle_worker_s"), 0.0)
    return row | fields


def test_decode_speedup_and_prefill_share_come_from_the_measured_trace(tmp_path):
    """decode x = decode tokens per decode second vs NoSpec's; prefill % = (target + drafter
    prefill) / engine seconds; a trace without the fields (vLLM measures no prefill) gives -."""

    def run(name: str, steps: list[dict] | None) -> dict:
        out = tmp_path / name
        out.mkdir()
        if steps is not None:
            trace = {"steps": [{"step": k, "measured": m} for k, m in enumerate(steps)]}
            (out / "trace.json").write_text(json.dumps(trace))
        log = [log_row(rollout_s=1.0, step_s=2.0, response_tokens_mean=4.0, accept_len=1.0)]
        cfg = {"prompts_per_step": 1, "group_size": 1}
        return {"config": cfg, "log": log, "engine": engine_totals(out)}

    def m(prefill: float, dprefill: float, decode: float, tokens: int) -> dict:
        return {
            "prefill_s": prefill,
            "drafter_prefill_s": dprefill,
            "decode_s": decode,
            "decode_tokens": tokens,
        }

    results = {
        "nospec": run("nospec", [m(1.0, 0.0, 3.0, 300), m(1.0, 0.0, 5.0, 500)]),
        "tlt-spot": run("tlt-spot", [m(1.0, 0.5, 2.0, 400), m(0.5, 0.0, 2.0, 400)]),
        "vllm": run("vllm", [{"decode_s": 1.0, "decode_tokens": 10}]),
        "none": run("none", None),
    }
    table = {t["run"]: t for t in compare_runs(results)}
    assert table["nospec"]["decode_speedup"] == pytest.approx(1.0)
    assert table["nospec"]["prefill_share"] == pytest.approx(2.0 / 10.0)
    assert table["tlt-spot"]["decode_speedup"] == pytest.approx((800 / 4.0) / (800 / 8.0))
    assert table["tlt-spot"]["prefill_share"] == pytest.approx(2.0 / 6.0)
    for name in ("vllm", "none"):
        assert table[name]["decode_speedup"] is None and table[name]["prefill_share"] is None
    shown = {k: COLUMNS[k] for k in ("run", "decode_speedup", "prefill_share")}
    text = format_table(list(table.values()), shown, FORMATS)
    assert [line.split()[1:] for line in text.splitlines()[2:]] == [
        ["1.00", "20%"],
        ["2.00", "33%"],
        ["-", "-"],
        ["-", "-"],
    ]


def test_speedup_standard_error_from_the_steps_spread():
    """se of mean(base) / mean(run): relative standard errors of the two means in quadrature."""
    from tltrun.train.compare import relative_se

    def res(times: tuple[float, ...]) -> dict:
        log = [log_row(rollout_s=t, step_s=1.0, response_tokens_mean=1.0) for t in times]
        return {"config": {"prompts_per_step": 1, "group_size": 1}, "log": log}

    noisy, steady = (1.0, 1.2, 0.8, 1.0), (2.0,) * 4
    rel = (0.08 / 3) ** 0.5 / 4**0.5  # sample sd / sqrt(n), over the mean 1.0
    assert relative_se(list(noisy)) == pytest.approx(rel)

    def se(base: tuple, run: tuple) -> float:
        return compare_runs({"nospec": res(base), "run": res(run)})[1]["rollout_speedup_se"]

    assert se(steady, noisy) == pytest.approx(2.0 * rel)
    assert se(noisy, noisy) == pytest.approx(2**0.5 * rel)
    assert se(steady, steady) == 0.0


def test_prefill_time_ratio_flags_runs_timed_on_a_slower_or_faster_machine():
    """The target's prefill is the same work in every run of the same prompts: its seconds over
    the baseline's measure the machine; beyond DRIFT_TOLERANCE either way a run is named."""
    from tltrun.train.compare import DRIFT_TOLERANCE, drift_warnings

    log = [log_row(rollout_s=1.0, step_s=2.0, response_tokens_mean=4.0, accept_len=1.0)]

    def res(prefill_s: float | None) -> dict:
        engine = None
        if prefill_s is not None:
            engine = {
                "prefill_s": prefill_s,
                "drafter_prefill_s": 0.3,  # the drafter's prefill is not the shared work
                "decode_s": 1.0,
                "decode_tokens": 10.0,
            }
        return {"config": {"prompts_per_step": 1, "group_size": 1}, "log": log, "engine": engine}

    results = {
        "nospec": res(2.0),
        "same": res(2.2),
        "slower": res(2.0 * 1.25),
        "faster": res(2.0 / 1.25),
        "vllm": res(None),
    }
    table = compare_runs(results)
    ratios = {t["run"]: t["prefill_time_ratio"] for t in table}
    assert ratios == pytest.approx(
        {"nospec": 1.0, "same": 1.1, "slower": 1.25, "faster": 0.8, "vllm": None}
    )
    assert 1.1 < DRIFT_TOLERANCE < 1.25
    warned = [line.split(":")[1].strip() for line in drift_warnings(table)]
    assert warned == ["slower", "faster"]
    assert drift_warnings(table, tolerance=1.3) == []
    text = format_table(table, {"run": "run", "prefill_time_ratio": "prefill t"}, FORMATS)
    assert [line.split()[1] for line in text.splitlines()[2:]] == [
        "1.00",
        "1.10",
        "1.25",
        "0.80",
        "-",
    ]
