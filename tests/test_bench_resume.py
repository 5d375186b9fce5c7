"""``tltrun bench`` keeps each finished row (backend x policy) as its trace file: a bench killed
with SIGKILL keeps them, and ``--resume`` loads those rows and runs the others, ending with the
uninterrupted run's rows (greedy: the same accept lengths); a damaged row trace runs again with
a note; the refusals (a fresh run over an unfinished one, flags with --resume, nothing to
resume) are one ``error:`` line. ``save_trace`` replaces a trace file whole.

Run: ``.venv/bin/python -m pytest tests/test_bench_resume.py -q``
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from process_tools import sigkill_when
from test_generate_resume import SLOW_CLI, assert_other_weights_refused
from test_hostile import assert_one_error_line, run
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltsim.trace.files import load_trace, save_trace

ROWS = ["torch/nospec", "torch/static", "torch/tlt"]
LENGTHS = [12, 3, 20, 9, 9]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_resume")
    model = tiny_model(seed=0)
    save_hf(model, root / "model")
    export_vllm(EagleDrafter.for_target(model, seed=1), root / "drafter")
    prompts = [
        {"id": "a", "prompt_tokens": 7, "responses": LENGTHS[:3]},
        {"id": "b", "prompt_tokens": 4, "responses": LENGTHS[3:]},
    ]
    trace = {"format": "tlt-trace", "version": 1, "meta": {"source": "test"},
             "steps": [{"step": 0, "prompts": prompts}, {"step": 1, "prompts": prompts}]}  # fmt: skip
    (root / "trace.json").write_text(json.dumps(trace))
    return root


def argv(inputs: Path, out: Path) -> list[str]:
    return ["bench", "--trace", str(inputs / "trace.json"), "--model", str(inputs / "model"),
            "--drafter", str(inputs / "drafter"), "--policy", "nospec,static,tlt",
            "--strategy", "2_2_4", "--out", str(out), "--no-progress-shown",
            "--max-running-requests", "3", "--max-model-len", "64", "--temperature", "0"]  # fmt: skip


def results_of(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def accept_hists(out: Path, row: str) -> list:
    trace = load_trace(out / f"trace_{row.replace('/', '_')}.json")
    return [r.accept_hist for s in trace.steps for p in s.prompts for r in p.responses]


def test_killed_bench_resumes_with_its_finished_rows(inputs, tmp_path, capsys):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(argv(inputs, whole)) == 0, capsys.readouterr().err
    first = killed / "trace_torch_nospec.json"
    sigkill_when(
        [sys.executable, "-c", SLOW_CLI, *argv(inputs, killed)],
        first.is_file,
        "the first row's trace",
    )
    moved = tmp_path / "moved"  # the bench resumes where it now is, not where it started
    killed = killed.rename(moved)
    kept = (killed / "trace_torch_nospec.json").read_bytes()
    assert not (killed / "results.json").exists()
    assert not (killed / "trace_torch_tlt.json").exists()  # killed in the second row
    capsys.readouterr()
    assert main(["bench", "--out", str(killed), "--resume"]) == 0, capsys.readouterr().err
    assert "resumed: torch/nospec timed by the killed run" in capsys.readouterr().out
    results = results_of(killed)
    assert list(results) == ROWS
    assert [r["is_resumed"] for r in results.values()] == [True, False, False]
    # the kept row is totalled from its trace, not run again
    assert (killed / "trace_torch_nospec.json").read_bytes() == kept
    recorded = load_trace(killed / "trace_torch_nospec.json")
    assert results["torch/nospec"]["rollout_s"] == sum(s.measured.rollout_s for s in recorded.steps)
    assert all(r["total_tokens"] == 2 * sum(LENGTHS) for r in results.values())
    for row in ROWS:  # greedy: the resumed bench's rows are the uninterrupted run's
        assert accept_hists(killed, row) == accept_hists(whole, row), row
    assert results["torch/static"]["speedup"] == pytest.approx(
        results["torch/nospec"]["rollout_s"] / results["torch/static"]["rollout_s"]
    )
    assert main(["bench", "--out", str(killed), "--resume"]) == 0
    assert "the bench already finished" in capsys.readouterr().out


def test_a_damaged_row_trace_runs_again(inputs, tmp_path, capsys):
    out = tmp_path / "damaged"
    assert main(argv(inputs, out)) == 0, capsys.readouterr().err
    (out / "results.json").unlink()  # killed after the rows, before results.json
    torn = out / "trace_torch_static.json"
    torn.write_bytes(torn.read_bytes()[:100])  # a file torn by something other than bench
    # another row's trace in tlt's place: the same steps, measured under nospec
    (out / "trace_torch_tlt.json").write_bytes((out / "trace_torch_nospec.json").read_bytes())
    # the nospec row replayed other lengths (the trace file changed under the run)
    other = load_trace(out / "trace_torch_nospec.json")
    shorter = [replace(s, prompts=s.prompts[:1]) for s in other.steps]
    save_trace(replace(other, steps=tuple(shorter)), out / "trace_torch_nospec.json")
    capsys.readouterr()
    assert main(["bench", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "note: torch/static runs again" in printed and "truncated file?" in printed
    for row in ("torch/tlt", "torch/nospec"):
        name = f"trace_{row.replace('/', '_')}.json"
        assert f"note: {row} runs again: {out / name} is not this run's replay" in printed
    results = results_of(out)
    assert [r["is_resumed"] for r in results.values()] == [False, False, False]
    assert load_trace(out / "trace_torch_nospec.json").steps[0].response_lengths() == LENGTHS
    assert load_trace(out / "trace_torch_tlt.json").steps[0].measured.policy.name == "tlt"
    assert len(load_trace(out / "trace_torch_tlt.json").steps) == 2


def test_refusals_are_one_error_line(inputs, tmp_path, capsys):
    out = tmp_path / "unfinished"
    assert main(argv(inputs, out)) == 0
    (out / "results.json").unlink()
    (out / "trace_torch_tlt.json").unlink()
    cases = {
        "fresh run over an unfinished one": (argv(inputs, out), "pass --resume to continue it"),
        "flags with --resume": (
            ["bench", "--out", str(out), "--resume", "--temperature", "1"],
            "drop --temperature",
        ),
        "--resume without --out": (["bench", "--resume"], "--resume needs --out"),
        "--resume of no run": (
            ["bench", "--out", str(tmp_path / "empty"), "--resume"],
            "no config.json of a tltrun bench run",
        ),
    }
    kept = (out / "trace_torch_nospec.json").read_bytes()
    for name, (args, says) in cases.items():
        rc, stdout, err = run("tltrun", args, capsys)
        assert_one_error_line(rc, stdout, err)
        assert says in err, name
    assert_other_weights_refused(inputs, out, "bench", ["model", "drafter"], capsys)
    assert (out / "trace_torch_nospec.json").read_bytes() == kept  # refused runs wrote nothing
    assert not (out / "results.json").exists()


def test_a_fresh_bench_over_a_finished_one_forgets_its_rows(inputs, tmp_path, capsys, monkeypatch):
    """A new bench in a finished bench's directory, killed before its first row finished, must
    not be resumed with the earlier bench's rows."""
    import tltrun.cli.bench

    out = tmp_path / "again"
    assert main(argv(inputs, out)) == 0

    def killed(*args, **kwargs):
        raise SystemExit("killed")

    monkeypatch.setattr(tltrun.cli.bench, "run_bench", killed)
    with pytest.raises(SystemExit):
        main(argv(inputs, out))
    monkeypatch.undo()
    assert not (out / "results.json").exists()
    assert main(["bench", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert [r["is_resumed"] for r in results_of(out).values()] == [False, False, False]
    # one of fewer rows: the earlier rows of other policies go too (hunt: they stayed beside
    # the new results.json, as if of this run)
    args = argv(inputs, out)
    args[args.index("--policy") + 1] = "nospec,static"
    assert main(args) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.glob("trace_*.json")) == [
        "trace_torch_nospec.json",
        "trace_torch_static.json",
    ]


def test_save_trace_killed_mid_write_leaves_the_previous_file(inputs, tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    trace = load_trace(inputs / "trace.json")
    save_trace(trace, path)
    before = path.read_bytes()

    def torn_write(self, data):  # the process dies after writing half the bytes
        with open(self, "wb") as f:
            f.write(data[: len(data) // 2])
        raise SystemExit("killed")

    monkeypatch.setattr(Path, "write_bytes", torn_write)
    with pytest.raises(SystemExit):
        save_trace(type(trace)(meta={"source": "new"}, steps=trace.steps), path)
    monkeypatch.undo()
    assert path.read_bytes() == before


def test_a_rows_accept_length_pools_the_steps_verifies():
    """Each step's mean accept length is per request-verify; the row weighted the steps by SD
    iterations, so a step of 24 iterations x 14 requests counted 4x less than one of 96 x 1
    (1.523 reported where the verifies pool to 1.439)."""
    from types import SimpleNamespace

    from tltrun.rollout.bench import _totals

    def step(mean: float, hist: list[int], iterations: int) -> SimpleNamespace:
        measured = SimpleNamespace(
            total_tokens=10, rollout_s=1.0, num_sd_iterations=iterations, num_iterations=100,
            mean_accept_len=mean, accept_hist_by_strategy={"4_1_4": hist},
            drafter_prefill_s=0.0, to_dict=dict,
        )  # fmt: skip
        return SimpleNamespace(measured=measured)

    # 332 verifies at 1.407 (accepting 0 or 1: 197 x 1 + 135 x 2 = 467 tokens) and 96 at 1.552
    first, second = step(467 / 332, [197, 135], 24), step(149 / 96, [43, 53], 96)
    assert _totals([first, second])["mean_accept_len"] == pytest.approx((467 + 149) / 428)
    assert _totals([first, second])["sd_iteration_share"] == pytest.approx(120 / 200)


def test_steps_given_out_of_order_run_in_the_traces_order(inputs, tmp_path, capsys):
    """Hunt: ``--steps 1,0`` wrote a row trace whose steps descend, which tltsim refuses and a
    --resume took for another run's (the finished row ran again)."""
    assert main([*argv(inputs, tmp_path / "o"), "--steps", "1,0"]) == 0, capsys.readouterr().err
    row = load_trace(tmp_path / "o" / "trace_torch_nospec.json")
    assert [s.step for s in row.steps] == [0, 1]
    assert row.meta["model"] == str(inputs / "model")  # (it claimed the source trace's model)


def test_one_untimed_warm_up_rollout_runs_before_the_rows(inputs, tmp_path, monkeypatch):
    """Hunt: whichever row ran first was slower (a process's first rollout pays one-time
    costs): one short NoSpec rollout on its own engine runs first, none before a resume whose
    torch rows are all done."""
    from tltrun.rollout import bench

    calls = []
    real = bench.warm_up
    monkeypatch.setattr(bench, "warm_up", lambda *a: calls.append(a) or real(*a))
    assert main(argv(inputs, tmp_path / "o")) == 0
    assert len(calls) == 1
    (tmp_path / "o" / "results.json").unlink()
    assert main(["bench", "--out", str(tmp_path / "o"), "--resume"]) == 0  # every row done
    assert len(calls) == 1
