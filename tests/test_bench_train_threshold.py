"""benchmarks/bench_train.py's TLT threshold: the batch size where SD stops paying, interpolated
from benchmarks/bench_spec.py's measured speedups."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
_SPEC = importlib.util.spec_from_file_location("bench_train", _PATH)
bench_train = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_train"] = bench_train  # dataclasses look their module up
_SPEC.loader.exec_module(bench_train)
import spec_profile  # noqa: E402  (benchmarks/ is on sys.path now: bench_train put it there)


def _results(speedups: dict[int, dict[str, float]]) -> dict:
    return {
        "rows": [
            {
                "batch": b,
                "runs": {"off": {"speedup": 1.0}, **{k: {"speedup": v} for k, v in s.items()}},
            }
            for b, s in speedups.items()
        ]
    }


@pytest.mark.parametrize(
    "speedups, expected",
    [
        # bench_spec on this machine: best 1.58x at batch 4, 0.91x at 16 -> log2 crossing 13.3
        ({1: {"a": 2.2}, 4: {"a": 1.58, "b": 1.36}, 16: {"a": 0.85, "b": 0.91}}, 13),
        ({1: {"a": 1.5}, 2: {"a": 0.5}}, 1),  # crossing at log2 = 0.5 -> 1.41 -> 1
        ({1: {"a": 1.2}, 8: {"a": 1.1}}, 8),  # never stops paying: the largest measured batch
        ({1: {"a": 0.9}, 8: {"a": 0.5}}, 1),  # never pays
    ],
)
def test_crossover_batch(speedups, expected):
    assert spec_profile.crossover_batch(_results(speedups)) == expected


def test_chunk_ends():
    assert bench_train.chunk_ends(20, 5) == [5, 10, 15, 20]
    assert bench_train.chunk_ends(7, 3) == [3, 6, 7]
    assert bench_train.chunk_ends(20, 0) == [20]
    assert bench_train.chunk_ends(4, 9) == [4]


def test_chunk_start_resumes_a_killed_run():
    ends = [5, 10, 15, 20]
    # a fresh run: every chunk from the previous chunk's end (0: not a resume)
    assert [bench_train.chunk_start(ends, k, 0) for k in range(4)] == [0, 5, 10, 15]
    # killed at step 7 (checkpoint of step 7): chunk 0 skipped, chunk 1 continues from 7
    assert [bench_train.chunk_start(ends, k, 7) for k in range(4)] == [None, 7, 10, 15]
    # killed after the last checkpoint but before final/: only the last chunk, trains nothing
    assert [bench_train.chunk_start(ends, k, 20) for k in range(4)] == [None, None, None, 20]
    assert bench_train.chunk_start([20], 0, 12) == 12


@pytest.mark.slow
def test_runs_alternate_in_chunks_and_each_resumes_to_the_full_run(tmp_path, capsys):
    """The contenders run chunk by chunk, their order rotated per chunk; each chunk after the
    first resumes the run, so each run's log holds every step once."""
    from tiny_models import save_train_model

    from tltrun.train.compare import compare_runs
    from tltrun.train.tasks import TaskConfig

    model = save_train_model(tmp_path / "model", TaskConfig(median_ops=2, max_ops=4))
    cfg = bench_train.BenchTrainConfig(
        model_dir=str(model),
        drafter_dir=None,  # tlt-spot trains a fresh drafter
        out=str(tmp_path / "out"),
        runs=("nospec", "tlt-spot"),
        num_steps=3,
        chunk_steps=2,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=16,
        tlt_threshold=2,
    )
    results = bench_train.run_all(cfg)
    for name in cfg.runs:
        assert [r["step"] for r in results[name]["log"]] == [0, 1, 2]
        assert results[name]["engine"]["decode_tokens"] > 0
    table = {t["run"]: t for t in compare_runs(results)}  # the real runs' traces
    assert table["nospec"]["decode_speedup"] == pytest.approx(1.0)
    assert table["tlt-spot"]["decode_speedup"] > 0
    assert all(0 < t["prefill_share"] < 1 for t in table.values())
    order = [line for line in capsys.readouterr().err.splitlines() if line.startswith("run ")]
    assert order == [
        "run nospec steps 0-2 ...",
        "run tlt-spot steps 0-2 ...",
        "run tlt-spot steps 2-3 ...",
        "run nospec steps 2-3 ...",
    ]


@pytest.mark.parametrize(
    "speedups, strategies, starts",
    [
        # this CPU's bench_spec on both tasks: 4_1_4 fastest at every measured batch
        (
            {
                1: {"2_1_2": 1.54, "4_1_4": 1.91},
                4: {"2_1_2": 1.81, "4_1_4": 2.09},
                8: {"2_1_2": 1.56, "4_1_4": 1.77},
            },
            ("4_1_4",),
            (1,),
        ),
        (
            {
                1: {"2_1_2": 1.6, "4_1_4": 2.1},
                4: {"2_1_2": 1.5, "4_1_4": 1.6},
                8: {"2_1_2": 1.3, "4_1_4": 1.2},
            },
            ("4_1_4", "2_1_2"),
            (1, 8),
        ),
        (
            {2: {"2_1_2": 1.2, "4_1_4": 1.5}, 16: {"2_1_2": 1.1, "4_1_4": 0.9}},
            ("4_1_4", "2_1_2"),
            (1, 16),
        ),
    ],
)
def test_profile_buckets(speedups, strategies, starts):
    assert spec_profile.profile_buckets(_results(speedups)) == (strategies, starts)


def test_profile_buckets_rejects_a_strategy_fastest_twice():
    speedups = {
        1: {"a_1_a": 2.0, "b": 1.0},
        4: {"a_1_a": 1.0, "b": 1.5},
        8: {"a_1_a": 1.2, "b": 1.1},
    }
    with pytest.raises(bench_train.UsageError, match="fastest at batch 8 after b"):
        spec_profile.profile_buckets(_results(speedups))


def test_spec_buckets_reach_the_tlt_policy(tmp_path):
    """--tlt-buckets spec: the profile's strategies and bucket starts, through a TLT run's
    TrainConfig, become the policy's buckets; fastrl keeps --tlt-strategies over the policy's
    starts."""
    import json

    from tltrun.train.config import TrainConfig
    from tltsim.policy import make_policy

    spec = tmp_path / "results.json"
    spec.write_text(
        json.dumps(_results({1: {"4_1_4": 2.0, "2_1_2": 1.5}, 8: {"4_1_4": 1.1, "2_1_2": 1.3}}))
    )
    cfg = bench_train.BenchTrainConfig(
        model_dir=str(tmp_path),
        drafter_dir=str(tmp_path),
        spec_results=str(spec),
        out=str(tmp_path / "out"),
        tlt_buckets="spec",
    )
    assert bench_train.tlt_buckets(cfg) == (("4_1_4", "2_1_2"), (1, 8))
    fastrl = bench_train.BenchTrainConfig(spec_results=str(spec), tlt_buckets="fastrl")
    assert bench_train.tlt_buckets(fastrl) == (("4_1_4", "3_1_3", "2_1_2", "1_1_1"), ())
    strategies, starts = bench_train.tlt_buckets(cfg)
    train = TrainConfig(
        model_dir=str(tmp_path),
        out=str(tmp_path / "run"),
        policy="tlt",
        tlt_strategies=strategies,
        tlt_bucket_starts=starts,
        tlt_threshold=8,
    )
    policy = make_policy(train.policy, **train.policy_settings())
    assert [(start, a[0].arm) for start, _, a in policy.config.buckets()] == [
        (1, "4_1_4"),
        (8, "2_1_2"),
    ]
    with pytest.raises(bench_train.UsageError, match="--tlt-buckets"):
        bench_train.BenchTrainConfig(tlt_buckets="gpu")


def test_reuse_runs_continues_a_run_whose_final_dir_is_from_an_earlier_chunk(tmp_path):
    from types import SimpleNamespace

    from test_run_integrity import NUM_WORKERS, fake_checkpoint

    def run(name: str, checkpointed: int, has_final: bool) -> SimpleNamespace:
        out = tmp_path / name
        if checkpointed:
            fake_checkpoint(out, checkpointed)
        if has_final:
            (out / "final" / "actor").mkdir(parents=True)
        return SimpleNamespace(out=str(out), num_workers=NUM_WORKERS, num_steps=20)

    configs = {
        "short": run("short", 15, True),  # final/ of its chunk 10-15: 5 steps to go
        "finished": run("finished", 20, True),
        "unwritten": run("unwritten", 20, False),  # killed before final/: the last chunk writes it
        "new": run("new", 0, False),
    }
    todo, done = bench_train.runs_to_do(configs, reuse_runs=True)
    assert todo == ["short", "unwritten", "new"]
    assert done == {"short": 15, "unwritten": 20, "new": 0}
    assert bench_train.runs_to_do(configs, reuse_runs=False) == (
        list(configs),
        dict.fromkeys(configs, 0),
    )


def test_reuse_runs_keeps_a_finished_run_whose_checkpoints_were_deleted(tmp_path):
    """A finished run is its full log plus a final/ written after it; a log cut short, a
    final/ older than the log (a chunk's, with later steps logged) or a torn line is not."""
    import os
    from types import SimpleNamespace

    def run(name: str, steps: int, final_after_log: bool, torn: bool = False) -> SimpleNamespace:
        out = tmp_path / name
        (out / "final" / "actor").mkdir(parents=True)
        weights = out / "final" / "actor" / "model.safetensors"
        weights.write_bytes(b"x")
        rows = "".join(json.dumps({"step": k}) + "\n" for k in range(steps))
        (out / "log.jsonl").write_text(rows + ('{"step": ' if torn else ""))
        log_time = (out / "log.jsonl").stat().st_mtime
        os.utime(weights, (log_time + (5 if final_after_log else -5),) * 2)
        return SimpleNamespace(out=str(out), num_workers=2, num_steps=20)

    configs = {
        "pruned": run("pruned", 20, True),
        "short": run("short", 15, True),
        "stale_final": run("stale_final", 20, False),
        "torn": run("torn", 20, True, torn=True),
    }
    todo, done = bench_train.runs_to_do(configs, reuse_runs=True)
    assert todo == ["short", "stale_final", "torn"]
    assert done == {"short": 0, "stale_final": 0, "torn": 0}


def test_reuse_runs_refuses_a_finished_run_trained_with_other_settings(tmp_path):
    """--reuse-runs keeps a finished run only if it was trained as asked: a changed setting
    (here tlt-mix's drafter exploration) stops the benchmark with the change named, and a
    field the run's config.json lacks (older code) counts as its default."""
    import os
    from dataclasses import asdict, replace

    from tltrun.train.config import TrainConfig

    asked = TrainConfig(model_dir="m", out=str(tmp_path / "tlt-mix"), policy="tlt",
                        tlt_drafters=("eagle", "history"), num_steps=20)  # fmt: skip
    out = Path(asked.out)
    (out / "final" / "actor").mkdir(parents=True)
    rows = "".join(json.dumps({"step": k}) + "\n" for k in range(20))
    (out / "log.jsonl").write_text(rows)
    weights = out / "final" / "actor" / "model.safetensors"
    weights.write_bytes(b"x")
    log_time = (out / "log.jsonl").stat().st_mtime
    os.utime(weights, (log_time + 5,) * 2)  # final/ written after the log: the run finished
    saved = asdict(asked)
    (out / "config.json").write_text(json.dumps({"train": saved, "task": {}, "data": {}}))
    assert bench_train.runs_to_do({"tlt-mix": asked}, reuse_runs=True) == ([], {})
    # more steps (num_steps is resume-neutral) is not a change of what was trained
    assert bench_train.reused_changes(replace(asked, num_steps=30)) == ""
    rounds = replace(asked, tlt_drafter_explore="rollout")
    with pytest.raises(SystemExit, match="tlt_drafter_explore: 'iteration' -> 'rollout'"):
        bench_train.runs_to_do({"tlt-mix": rounds}, reuse_runs=True)
    assert bench_train.runs_to_do({"tlt-mix": rounds}, reuse_runs=False)[0] == ["tlt-mix"]
    del saved["tlt_drafter_explore"]  # a run of code before the field existed
    (out / "config.json").write_text(json.dumps({"train": saved, "task": {}, "data": {}}))
    assert bench_train.reused_changes(asked) == ""
    assert "tlt_drafter_explore" in bench_train.reused_changes(rounds)


def test_rollout_dtype_reaches_every_run(tmp_path):
    """--dtype sets every contender's TrainConfig.dtype (the engine's weights and KV cache);
    a dtype the engine does not know is one line, not a traceback from TrainConfig."""
    cfg = bench_train.BenchTrainConfig(
        model_dir=str(tmp_path), out=str(tmp_path / "out"), tlt_threshold=8, dtype="bfloat16"
    )
    buckets = bench_train.tlt_buckets(cfg)
    import unittest.mock as mock

    with mock.patch.object(bench_train, "check_inputs"):
        trains = [bench_train.train_config(cfg, n, 8, buckets) for n in ("nospec", "tlt-spot")]
    assert [t.dtype for t in trains] == ["bfloat16", "bfloat16"]
    with pytest.raises(bench_train.UsageError, match="--dtype float16x: expected one of"):
        bench_train.BenchTrainConfig(dtype="float16x")
