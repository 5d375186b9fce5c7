"""Tests of the ``tlt-trace`` v1 format: round trips (JSON, CSV, Parquet), accessors and the
measured block. One-line errors on bad input: tests/test_trace_validation.py, which breaks
``GOOD`` below one field at a time.

Run: ``.venv/bin/python -m pytest tests/test_trace.py -q``
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tltsim.cli.main import main
from tltsim.trace.files import load_trace, save_trace
from tltsim.trace.measured import UNRECORDED, MeasuredStep, PolicyRecord
from tltsim.trace.schema import (
    Prompt,
    Response,
    Step,
    Trace,
    TraceError,
    dumps_trace,
    trace_from_dict,
    trace_to_dict,
)

REPO = Path(__file__).resolve().parents[1]
CAP = 32768

# --- random traces ---------------------------------------------------------------------------

_ids = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=8)
_meta_extra = st.dictionaries(
    st.sampled_from(["model", "source", "note"]), st.text(max_size=10), max_size=2
)
# The measured block of a 2-worker `tltrun train` step as written before MeasuredStep existed
# (a free-form dict): it must load and save byte-identical.
TRAIN_BLOCK = (
    '{"rollout_s": 1.2345678901234, "prefill_s": 0.5, "drafter_prefill_s": 0.01, '
    '"decode_s": 0.7083333333333333, "sd_s": 0.25, "num_iterations": 4, "num_sd_iterations": 2, '
    '"decode_tokens": 13, "decode_tokens_per_s": 18.35294117647059, "total_tokens": 14, '
    '"mean_accept_len": 2.25, "policy": {"name": "tlt", "iterations_per_strategy": '
    '{"2_1_2": 1, "3_1_3": 1, "off": 2}, "config": {"strategies": ["2_1_2", "3_1_3"], '
    '"threshold": 4}, "seed": 7}, "hardware": "cpu x", "backend": "torch", "share_prompts": true, '
    '"prefix_block_tokens": 1, "accept_hist_by_strategy": {"2_1_2": [1, 0, 2], "3_1_3": [0, 1]}, '
    '"response_accept_hist_by_strategy": {"p0": [{"2_1_2": [1, 0, 2]}, {}], "p1": '
    '[{"3_1_3": [0, 1]}]}, "train_s": 0.75, "drafter_train_s": 0.0, "drafter_trained_tokens": '
    '123, "worker_rollout_s": [1.2, 0.9], "instance_prompts": [["p0"], ["p1"]], '
    '"is_prompt_id_stable": true, "max_running_requests": null}'
)
_seconds = st.floats(0, 1e6, allow_nan=False)
_measured_blocks = st.one_of(
    st.none(),
    st.just(MeasuredStep(rollout_s=1.5, policy=PolicyRecord(name="tlt"))),
    st.just(MeasuredStep.from_dict(json.loads(TRAIN_BLOCK))),
    st.builds(
        MeasuredStep,
        rollout_s=_seconds,
        train_s=st.one_of(st.none(), _seconds),
        clock=st.sampled_from([None, "wall", "cpu"]),
        worker_rollout_s=st.one_of(st.none(), st.lists(_seconds, max_size=3).map(tuple)),
        max_running_requests=st.one_of(st.just(UNRECORDED), st.none(), st.integers(1, 64)),
        strategy=st.one_of(st.none(), st.just("4_1_4")),
    ),
)


@st.composite
def traces(draw, is_tabular: bool = False) -> Trace:
    """Random valid traces; ``is_tabular`` leaves out what only JSON can hold."""
    cap = draw(st.one_of(st.none(), st.integers(1, 5000)))
    group_size = draw(st.one_of(st.none(), st.integers(1, 4)))
    max_tokens = cap or 10**6
    numbers = sorted(draw(st.sets(st.integers(0, 10_000), min_size=1, max_size=4)))
    steps = []
    for number in numbers:
        ids = draw(st.lists(_ids, min_size=1, max_size=4, unique=True))
        prompts = []
        for pid in ids:
            size = group_size or draw(st.integers(1, 4))
            responses = []
            for _ in range(size):
                tokens = draw(st.integers(1, max_tokens))
                finish = draw(st.sampled_from(["stop", "length"]))
                hist = (
                    None
                    if is_tabular
                    else draw(
                        st.one_of(st.none(), st.lists(st.integers(0, 99), max_size=4).map(tuple))
                    )
                )
                responses.append(Response(tokens=tokens, finish=finish, accept_hist=hist))
            prompts.append(
                Prompt(
                    id=pid, prompt_tokens=draw(st.integers(1, 10**6)), responses=tuple(responses)
                )
            )
        measured = None if is_tabular else draw(_measured_blocks)
        if measured is not None and measured.instance_prompts is not None:
            # the per-prompt fields name this step's prompts (validated against them)
            measured = dataclasses.replace(
                measured,
                response_accept_hist_by_strategy={
                    p.id: tuple({"2_1_2": (1, 0, 2)} for _ in p.responses) for p in prompts
                },
                instance_prompts=(tuple(p.id for p in prompts),),
            )
        steps.append(Step(step=number, prompts=tuple(prompts), measured=measured))
    meta = draw(_meta_extra)
    if cap is not None:
        meta["max_response_tokens"] = cap
    if group_size is not None:
        meta["group_size"] = group_size
    return Trace(meta=meta, steps=tuple(steps))


_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_settings
@given(trace=traces())
def test_json_round_trip_is_lossless(tmp_path: Path, trace: Trace) -> None:
    for name in ("t.json", "t.json.gz"):
        save_trace(trace, tmp_path / name)
        assert load_trace(tmp_path / name) == trace
    assert trace_from_dict(json.loads(json.dumps(trace_to_dict(trace))), "mem") == trace


_COMMA_META = Trace(  # a field of the meta line that starts with '"' after a comma (hypothesis)
    meta={"model": ","},
    steps=(
        Step(
            step=0,
            prompts=(Prompt(id="0", prompt_tokens=1, responses=(Response(tokens=1),)),),
        ),
    ),
)


_CR_ID = Trace(  # a bare "\r" in an id: csv quotes "\n" but not "\r", read back as a line end
    meta={},
    steps=(
        Step(
            step=0,
            prompts=(
                Prompt(id="a\rb", prompt_tokens=5, responses=(Response(tokens=3),)),
                Prompt(id="c", prompt_tokens=6, responses=(Response(tokens=4),)),
            ),
        ),
    ),
)


@_settings
@given(trace=traces(is_tabular=True))
@example(trace=_COMMA_META)
@example(trace=_CR_ID)
def test_csv_and_parquet_round_trips_are_lossless(tmp_path: Path, trace: Trace) -> None:
    save_trace(trace, tmp_path / "t.csv")
    from_csv = load_trace(tmp_path / "t.csv")
    assert from_csv == trace
    # the recipe the format's README gives (a meta string ending in ',' broke it)
    assert len(pd.read_csv(tmp_path / "t.csv", skiprows=1)) == trace.num_responses
    save_trace(from_csv, tmp_path / "back.json")
    assert (tmp_path / "back.json").read_text() == dumps_trace(
        trace
    )  # JSON -> CSV -> JSON, same bytes
    save_trace(trace, tmp_path / "t.parquet")
    assert load_trace(tmp_path / "t.parquet") == trace


def _example() -> Trace:
    return Trace(
        meta={"max_response_tokens": 100, "group_size": 2},
        steps=(
            Step(
                0,
                (
                    Prompt("a", 5, (Response(10), Response(100, "length"))),
                    Prompt("b", 7, (Response(3), Response(4))),
                ),
            ),
            Step(3, (Prompt("a", 6, (Response(100, "stop"), Response(1))),)),
        ),
    )


def test_accessors() -> None:
    trace = _example()
    assert trace.num_steps == 2 and trace.num_prompts == 3 and trace.num_responses == 6
    assert trace.steps[0].response_lengths() == [10, 100, 3, 4]
    assert trace.steps[0].prompt_lengths() == [5, 5, 7, 7]
    assert trace.steps[1].total_response_tokens == 101
    assert trace.total_response_tokens == 218
    assert trace.response_lengths().tolist() == [10, 100, 3, 4, 100, 1]
    summary = trace.summary()
    assert (summary["max_tokens"], summary["num_truncated"], summary["median_tokens"]) == (
        100,
        1,
        7.0,
    )


def test_bare_int_at_cap_means_length_and_explicit_finish_survives(tmp_path: Path) -> None:
    doc = trace_to_dict(_example())
    assert doc["steps"][0]["prompts"][0]["responses"] == [10, 100]  # finish implied by the cap
    assert doc["steps"][1]["prompts"][0]["responses"][0] == {"tokens": 100, "finish": "stop"}
    assert trace_from_dict(doc, "mem") == _example()


def test_csv_is_pandas_friendly_and_refuses_json_only_fields(tmp_path: Path) -> None:
    save_trace(_example(), tmp_path / "t.csv")
    frame = pd.read_csv(tmp_path / "t.csv", comment="#")
    assert list(frame.columns) == [
        "step",
        "prompt_id",
        "prompt_tokens",
        "response_tokens",
        "finish",
    ]
    assert frame["response_tokens"].sum() == 218
    measured = Trace(
        meta={},
        steps=(Step(0, (Prompt("a", 1, (Response(2),)),), measured=MeasuredStep(rollout_s=1.0)),),
    )
    with pytest.raises(TraceError, match="measured"):
        save_trace(measured, tmp_path / "m.csv")
    save_trace(measured, tmp_path / "m.csv", allow_lossy=True)
    assert load_trace(tmp_path / "m.csv").steps[0].measured is None


def test_measured_block_loads_typed_and_saves_byte_identical() -> None:
    """A block written as a free-form dict loads as a MeasuredStep and dumps to the same text;
    every field is JSON's key of the same name, in field order."""
    doc = json.loads(json.dumps(GOOD))
    doc["meta"].pop("group_size")  # the block's prompts: p0 with 2 responses, p1 with 1
    doc["steps"][0]["prompts"].append({"id": "p1", "prompt_tokens": 4, "responses": [3]})
    doc["steps"][0]["measured"] = json.loads(TRAIN_BLOCK)
    trace = trace_from_dict(doc, "mem")
    m = trace.steps[0].measured
    assert isinstance(m, MeasuredStep) and isinstance(m.policy, PolicyRecord)
    assert (m.rollout_s, m.policy.name, m.policy.seed, m.drafter_trained_tokens) == (
        1.2345678901234,
        "tlt",
        7,
        123,
    )
    assert m.accept_hist_by_strategy == {"2_1_2": (1, 0, 2), "3_1_3": (0, 1)}
    assert m.response_accept_hist_by_strategy["p0"] == ({"2_1_2": (1, 0, 2)}, {})
    assert m.instance_prompts == (("p0",), ("p1",)) and m.worker_rollout_s == (1.2, 0.9)
    assert m.max_running_requests is None  # null: each instance admitted its whole share
    assert json.dumps(m.to_dict()) == TRAIN_BLOCK
    assert list(m.to_dict()) == [
        f.name for f in dataclasses.fields(MeasuredStep) if f.name in m.to_dict()
    ]
    text = dumps_trace(trace)
    assert dumps_trace(trace_from_dict(json.loads(text), "mem")) == text
    assert m.policy.sd_strategies() == ["2_1_2", "3_1_3"]


def test_history_arms_make_version_2_and_both_versions_load(tmp_path: Path) -> None:
    """A measured block naming the history drafter's arm is written as version 2 (JSON and the
    one-prompt-per-line text alike) and loads back equal; without one a trace stays version 1
    and byte-identical; a reader takes 1 and 2 (the stated version is not checked against the
    content) and refuses 3."""
    from tltsim.trace.schema import version_of

    block = {
        "accept_hist_by_strategy": {"4_1_4": [1, 2], "history:6_1_6": [0, 1, 0, 0, 0, 0, 3]},
        "policy": {"name": "tlt", "iterations_per_strategy": {"history:6_1_6": 4, "off": 2}},
        "response_accept_hist_by_strategy": {"a": [{"history:6_1_6": [0, 1]}, {}]},
    }
    plain = _example()
    arms = dataclasses.replace(
        plain,
        steps=(dataclasses.replace(plain.steps[0], measured=MeasuredStep.from_dict(block)),)
        + plain.steps[1:],
    )
    assert arms.steps[0].measured.arm_drafters() == {"eagle", "history"}
    assert (version_of(plain), version_of(arms)) == (1, 2)
    assert trace_to_dict(arms)["version"] == 2 and trace_to_dict(plain)["version"] == 1
    assert json.loads(dumps_trace(arms))["version"] == 2
    path = tmp_path / "v2.json"
    save_trace(arms, path)
    assert load_trace(path) == arms
    doc = trace_to_dict(arms)
    doc["version"] = 1  # e.g. tltrun train's step log rebuilt under a version-1 header
    assert trace_from_dict(doc, "mem") == arms
    doc = trace_to_dict(plain)
    doc["version"] = 2
    assert trace_from_dict(doc, "mem") == plain and trace_to_dict(plain)["version"] == 1
    doc["version"] = 3
    with pytest.raises(TraceError, match="'version': expected 1 or 2"):
        trace_from_dict(doc, "mem")


def test_measured_block_absent_and_null_differ() -> None:
    """Absent fields are None (UNRECORDED for the cap, whose null is a value) and stay absent."""
    empty = MeasuredStep.from_dict({})
    assert empty == MeasuredStep() and empty.to_dict() == {}
    assert empty.max_running_requests is UNRECORDED and empty.rollout_s is None
    full = MeasuredStep(**_FULL)  # every field recorded: every field round-trips through JSON
    assert list(full.to_dict()) == [f.name for f in dataclasses.fields(MeasuredStep)]
    assert MeasuredStep.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    with pytest.raises(TraceError, match=r"^f\.json: step 2: field 'measured.sd_s'"):
        MeasuredStep.from_dict({"sd_s": -1.0}, where="f.json: step 2")


# one valid value of every MeasuredStep field (as the dataclass holds it)
_FULL = {
    **vars(MeasuredStep.from_dict(json.loads(TRAIN_BLOCK))),
    "policy": PolicyRecord(name="static", iterations_per_strategy={"4_1_4": 3}, config={}, seed=0),
    "clock": "cpu",
    "max_running_requests": 8,
    "rollout_s_replays": (1.0, 1.5),
    "num_epochs": 2,
    "kl_coef": 0.04,
    "strategy": "4_1_4",
}


def test_csv_rows_in_any_order(tmp_path: Path) -> None:
    text = "step,prompt_id,prompt_tokens,response_tokens\n2,x,9,5\n0,b,3,7\n0,a,4,1\n0,b,3,8\n"
    (tmp_path / "t.csv").write_text(text)
    trace = load_trace(tmp_path / "t.csv")
    assert [s.step for s in trace.steps] == [0, 2]
    assert [(p.id, p.response_lengths()) for p in trace.steps[0].prompts] == [
        ("b", [7, 8]),
        ("a", [1]),
    ]
    assert trace.meta == {"source": "t.csv"}


def test_sample_traces_validate_and_stay_small() -> None:
    samples = sorted((REPO / "traces").glob("*.json"))
    assert {"synth_reasoning_rl.json", "servegen_r1_rl.json"} <= {p.name for p in samples}
    for path in samples:
        assert path.stat().st_size < 1_000_000
        assert main(["validate", str(path)]) == 0


# a small valid document (tests/test_trace_validation.py breaks it one field at a time)
GOOD = {
    "format": "tlt-trace",
    "version": 1,
    "meta": {"max_response_tokens": 1000, "group_size": 2},
    "steps": [{"step": 0, "prompts": [{"id": "p0", "prompt_tokens": 10, "responses": [5, 7]}]}],
}


def test_default_output_names_keep_the_dots_of_a_trace_name(tmp_path, monkeypatch):
    """results/replay-<trace stem>: the stem was cut at the first dot, so qwen2.5-7b.json and
    qwen2.5-1.5b.json both wrote results/replay-qwen2."""
    from tltsim.trace.files import trace_stem

    cases = {"qwen2.5-7b.json.gz": "qwen2.5-7b", "exp.1.JSON": "exp.1", "a.b.csv": "a.b",
             "run.parquet": "run", "noext": "noext", ".json": ".json"}  # fmt: skip
    assert {name: trace_stem(Path(name)) for name in cases} == cases
    # every tltrun run names its trace trace.json: its directory names it (all wrote
    # results/compare-trace, one replacing the other)
    assert trace_stem(Path("runs/static/trace.json")) == "static"
    monkeypatch.chdir(tmp_path)
    assert trace_stem(Path("trace.json.gz")) == tmp_path.name
    shipped = Path(__file__).resolve().parents[1] / "traces" / "synth_reasoning_rl.json"
    trace = load_trace(shipped)
    short = dataclasses.replace(trace, steps=trace.steps[:1])
    for name in ("exp.1.json", "exp.2.json"):
        save_trace(short, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    for name in ("exp.1.json", "exp.2.json"):
        argv = ["replay", name, "--preset", "h100x8-qwen7b", "--policy", "nospec"]
        assert main([*argv, "--no-timeline-recorded"]) == 0
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "replay-exp.1",
        "replay-exp.2",
    ]


def test_a_failed_write_names_the_path_asked_for_and_leaves_no_temporary(tmp_path: Path) -> None:
    """A write error named the temporary file (x.json.tmp) the user never typed."""
    if Path("/proc/self").is_dir():  # Linux: /proc takes no new files (ENOENT on create)
        with pytest.raises(FileNotFoundError) as err:
            save_trace(_example(), "/proc/t.json")
        assert err.value.filename == "/proc/t.json"
    (tmp_path / "d.json.tmp").mkdir()  # the temporary's place taken: that is what is named
    with pytest.raises(IsADirectoryError, match="d.json.tmp"):
        save_trace(_example(), tmp_path / "d.json")


def test_appended_steps_write_the_bytes_a_whole_save_writes(tmp_path: Path, monkeypatch) -> None:
    """``append_steps`` (tltrun train after each step: a whole rebuild was quadratic in the
    run's length) gives the file ``save_trace`` gives for all the steps, the version raised
    where a new step holds a history arm; it writes nothing where it cannot append (no file,
    another meta, a gzipped or foreign layout)."""
    from tltsim.trace.files import append_steps

    trace = load_trace(REPO / "traces" / "synth_reasoning_rl.json")
    path = tmp_path / "t.json"
    for k in (1, len(trace.steps) - 1, 2):
        if k == 2:  # the copy a chunk at a time, where the kernel's copy_file_range is not
            monkeypatch.delattr("os.copy_file_range")
        save_trace(dataclasses.replace(trace, steps=trace.steps[:k]), path)
        assert append_steps(dataclasses.replace(trace, steps=trace.steps[k:]), path)
        assert path.read_text() == dumps_trace(trace)
    block = {"accept_hist_by_strategy": {"history:6_1_6": [0, 1]}, "policy": {"name": "tltbase"}}
    arm = dataclasses.replace(trace.steps[-1], measured=MeasuredStep.from_dict(block))
    save_trace(dataclasses.replace(trace, steps=trace.steps[:-1]), path)
    assert append_steps(dataclasses.replace(trace, steps=(arm,)), path)
    whole = dataclasses.replace(trace, steps=trace.steps[:-1] + (arm,))
    assert path.read_text() == dumps_trace(whole) and json.loads(path.read_text())["version"] == 2
    first = dataclasses.replace(trace, steps=trace.steps[:1])
    rest = dataclasses.replace(trace, steps=trace.steps[1:])
    save_trace(first, path)
    before = path.read_bytes()
    assert not append_steps(dataclasses.replace(rest, meta={**trace.meta, "source": "x"}), path)
    path.write_text(json.dumps(trace_to_dict(first)))  # valid, but not dumps_trace's layout
    assert not append_steps(rest, path)
    save_trace(first, tmp_path / "t.json.gz")
    assert not append_steps(rest, tmp_path / "t.json.gz")
    assert not append_steps(rest, tmp_path / "none.json") and not (tmp_path / "none.json").exists()
    save_trace(first, path)
    assert not append_steps(first, path)  # a step not after the file's last
    for tiny in (b"", b"{}", b"{}\n ]}\n"):  # not a trace of this layout: no error either
        (tmp_path / "tiny.json").write_bytes(tiny)
        assert not append_steps(rest, tmp_path / "tiny.json")
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_an_append_that_fails_leaves_the_trace_and_no_copy(tmp_path: Path, monkeypatch) -> None:
    """A full disk (or Ctrl-C) mid-append: the trace as it was, no trace-sized temporary."""
    import os

    from tltsim.trace.files import append_steps

    trace = load_trace(REPO / "traces" / "synth_reasoning_rl.json")
    path = tmp_path / "t.json"
    save_trace(dataclasses.replace(trace, steps=trace.steps[:2]), path)
    before = path.read_bytes()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        append_steps(dataclasses.replace(trace, steps=trace.steps[2:]), path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]
