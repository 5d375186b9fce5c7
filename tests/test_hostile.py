"""Hostile inputs against both command lines (issue #17): every failure of input ends as exactly
one ``error:`` line on stderr and exit code 2 — never a traceback, an ``internal error`` or a
hang — and a legal but suspicious input runs with one ``warning:`` line that counts it.

The inputs every case names (``files``, built once), a table of named ``tltsim`` cases (the kinds
of the issue: integers beyond int64 or physically absurd, pathologically nested JSON, binary
garbage, ``--out`` that cannot be written, bad sweep specs, values that used to run silently
wrong), the internal-error line; hypothesis fuzzing of trace files and of numeric flags is in
tests/test_hostile_fuzz.py.
The ``tltrun`` cases (damaged safetensors, devices this machine lacks, ...):
tests/test_hostile_tltrun.py. The CLIs run in-process (``main(argv)``, output through capsys):
a case that lets an exception escape fails with that exception.

Run: ``python -m pytest tests/test_hostile.py tests/test_hostile_tltrun.py -q``.
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from tiny_models import tiny_model

from tltrun.cli.main import main as tltrun_main
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltrun.model.tokenizer import CharTokenizer
from tltrun.train.tasks import TaskConfig
from tltsim.cli.main import main as tltsim_main
from tltsim.cost.profile import COLUMNS as PROFILE_COLUMNS

MAINS = {"tltsim": tltsim_main, "tltrun": tltrun_main}
GARBAGE = bytes(range(256)) * 8  # not UTF-8 (0x80 cannot start a character), not JSON
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than any recursion limit


def trace_json(responses=(3, 4), prompt_tokens=7, meta=None) -> str:
    return json.dumps(
        {
            "format": "tlt-trace",
            "version": 1,
            "meta": {"source": "test", **(meta or {})},
            "steps": [
                {
                    "step": 0,
                    "prompts": [
                        {"id": "a", "prompt_tokens": prompt_tokens, "responses": list(responses)},
                        {"id": "b", "prompt_tokens": 4, "responses": [9, 2]},
                    ],
                }
            ],
        }
    )


def _copy_with(src: Path, dst: Path, name: str, data: bytes) -> Path:
    shutil.copytree(src, dst)
    (dst / name).write_bytes(data)
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every input the cases name, built once: good ones and their damaged twins."""
    root = tmp_path_factory.mktemp("hostile")
    f: dict[str, Path] = {"root": root}

    def write(name: str, data: str | bytes) -> Path:
        path = root / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path

    # a tiny target with the character tokenizer (text prompts, tltrun train) and a drafter
    tok = CharTokenizer()
    model = tiny_model(seed=0, vocab_size=tok.vocab_size, eos_token_ids=(tok.eos_id,))
    f["model"] = root / "model"
    save_hf(model, f["model"])
    tok.save(f["model"])
    (f["model"] / "sft_config.json").write_text(json.dumps({"task": asdict(TaskConfig())}))
    f["drafter"] = root / "drafter"
    export_vllm(EagleDrafter.for_target(model, seed=1), f["drafter"])
    weights = (f["model"] / "model.safetensors").read_bytes()
    f["model_trunc"] = _copy_with(
        f["model"], root / "model_trunc", "model.safetensors", weights[: len(weights) // 2]
    )
    f["model_garbage"] = _copy_with(
        f["model"], root / "model_garbage", "model.safetensors", GARBAGE
    )
    f["model_cfg_garbage"] = _copy_with(f["model"], root / "model_cfg_bin", "config.json", GARBAGE)
    f["model_cfg_deep"] = _copy_with(
        f["model"], root / "model_cfg_deep", "config.json", DEEP.encode()
    )
    cfg = json.loads((f["model"] / "config.json").read_text())
    f["model_vocab_huge"] = _copy_with(
        f["model"],
        root / "model_vocab",
        "config.json",
        json.dumps({**cfg, "vocab_size": 10**21}).encode(),
    )
    drafter_weights = (f["drafter"] / "model.safetensors").read_bytes()
    f["drafter_trunc"] = _copy_with(
        f["drafter"], root / "drafter_trunc", "model.safetensors", drafter_weights[:100]
    )

    f["trace"] = write("trace.json", trace_json())
    f["garbage_json"] = write("garbage.json", GARBAGE)
    f["garbage_gz"] = write("garbage.json.gz", GARBAGE)
    f["garbage_csv"] = write("garbage.csv", GARBAGE)
    f["garbage_parquet"] = write("garbage.parquet", GARBAGE)
    f["garbage_toml"] = write("garbage.toml", GARBAGE)
    f["garbage_jsonl"] = write("garbage.jsonl", GARBAGE)
    f["deep_json"] = write("deep.json", DEEP)
    f["deep_jsonl"] = write("deep.jsonl", DEEP + "\n")
    f["deep_gz"] = write("deep.json.gz", gzip.compress(DEEP.encode()))
    f["list_json"] = write("list.json", "[1, 2]")
    f["huge_response"] = write("huge_response.json", trace_json(responses=(10**30,)))
    f["int64_sum"] = write("int64_sum.json", trace_json(responses=(2**63 - 1, 2**63 - 1)))
    f["huge_prompt"] = write("huge_prompt.json", trace_json(prompt_tokens=10**30))
    f["huge_cap"] = write("huge_cap.json", trace_json(meta={"max_response_tokens": 10**30}))
    f["huge_csv"] = write(
        "huge.csv", "step,prompt_id,prompt_tokens,response_tokens\n0,a,7,999999999999999\n"
    )
    row = ["decode", str(10**30), "0", "1", "0.1", "0.1", "0.1", "3"]
    f["huge_profile"] = write(
        "huge_profile.csv",
        ",".join(PROFILE_COLUMNS) + "\n" + ",".join(row[: len(PROFILE_COLUMNS)]) + "\n",
    )
    f["file"] = write("a_file", "x")
    f["dir_json"] = root / "dir.json"
    f["dir_json"].mkdir()

    def spec(name: str, body: str, seeds: str = "[0]") -> Path:
        return write(name, f'trace = "{f["trace"]}"\nseeds = {seeds}\n{body}')

    f["spec_ok"] = spec("ok.toml", '[grid]\npolicy = ["nospec"]\n')
    f["spec_preset"] = spec("preset.toml", '[fixed]\npreset = "nope"\n[grid]\npolicy = ["tlt"]\n')
    f["spec_policy"] = spec("policy.toml", '[grid]\npolicy = ["nope"]\n')
    f["spec_strategy"] = spec(
        "strategy.toml", '[grid]\npolicy = ["static"]\nstatic_strategy = ["zz"]\n'
    )
    f["spec_empty_grid"] = spec("empty_grid.toml", "[grid]\n")
    rnd = "[random]\nnum_points = 2\nseed = 0\n"
    f["spec_reversed"] = spec("reversed.toml", rnd + '"tlt.epsilon" = {low = 0.3, high = 0.0}\n')
    f["spec_reversed_int"] = spec("reversed_int.toml", rnd + "num_gpus = {low = 16, high = 8}\n")
    f["spec_no_choices"] = spec("no_choices.toml", rnd + "num_gpus = {choices = []}\n")
    f["spec_points"] = spec(
        "points.toml", "[random]\nnum_points = 1000000000\nnum_gpus = {choices = [8]}\n"
    )
    f["spec_gpus"] = spec("gpus.toml", '[grid]\nnum_gpus = [100000000]\npolicy = ["nospec"]\n')
    f["spec_seeds"] = spec("seeds.toml", '[grid]\npolicy = ["nospec"]\n', seeds=f"[{2**70}]")
    f["spec_deep_trace"] = write(
        "deep_trace.toml", f'trace = "{f["deep_json"]}"\n[grid]\npolicy = ["nospec"]\n'
    )

    def jsonl(name: str, *rows: str) -> Path:
        return write(name, "".join(r + "\n" for r in rows))

    f["prompts"] = jsonl("prompts.jsonl", '{"id": "a", "prompt": "1+2=", "max_new_tokens": 3}')
    f["prompt_int"] = jsonl("p_int.jsonl", '{"id": "a", "prompt": 123, "max_new_tokens": 3}')
    f["prompt_list"] = jsonl("p_list.jsonl", '{"id": "a", "prompt": ["x"], "max_new_tokens": 3}')
    f["prompt_id_dict"] = jsonl(
        "p_id.jsonl", '{"id": {"a": 1}, "prompt_token_ids": [5, 6], "max_new_tokens": 3}'
    )
    f["prompt_bool_ids"] = jsonl(
        "p_bool.jsonl", '{"id": "a", "prompt_token_ids": [true, 6], "max_new_tokens": 3}'
    )
    f["prompt_bool_max"] = jsonl(
        "p_max.jsonl", '{"id": "a", "prompt_token_ids": [5, 6], "max_new_tokens": true}'
    )
    f["prompt_suspicious"] = jsonl(
        "p_warn.jsonl",
        '{"id": "a", "prompt": "", "max_new_tokens": 2}',
        '{"id": "b", "prompt": "\\u00e9\\u00e9 1+1", "max_new_tokens": 2}',
        '{"id": "c", "prompt": "\\u4e2d", "max_new_tokens": 2}',
    )
    f["data"] = jsonl("data.jsonl", '{"prompt_token_ids": [5, 6], "output_token_ids": [7, 8, 9]}')
    f["data_float"] = jsonl(
        "data_float.jsonl", '{"prompt_token_ids": [1.5, 6], "output_token_ids": [7, 8, 9]}'
    )
    f["data_str"] = jsonl(
        "data_str.jsonl", '{"prompt_token_ids": "abc", "output_token_ids": [7, 8, 9]}'
    )
    from tltsim.cost.calibrated import CalibrationParams, save_hardware_preset
    from tltsim.cost.specs import get_hardware

    params = CalibrationParams(
        bandwidth_fraction=0.8, kv_bandwidth_fraction=0.9, flops_fraction=0.6,
        gemm_half_tokens=200.0, overlap_exponent=2.0, step_overhead_s=1e-3,
    )  # fmt: skip
    save_hardware_preset(root / "hw_nan.json", get_hardware("H200"), params, {})
    doc = json.loads((root / "hw_nan.json").read_text())
    doc["hardware"]["hbm_bytes_per_s"] = float("nan")  # json writes NaN, and reads it back
    f["hw_nan"] = write("hw_nan.json", json.dumps(doc))
    f["servegen_huge"] = write(
        "servegen_huge.csv",
        "client_id,window_start_s,output_tokens\n1,0,100\n1,0,4611686018427387904\n",
    )
    profiles = Path(__file__).resolve().parents[1] / "profiles"
    f["profile"] = root / "profile.csv"
    shutil.copy(profiles / "h200_qwen2.5-1.5b_random.csv", f["profile"])
    shutil.copy(profiles / "h200_qwen2.5-1.5b_random.json", root / "profile.json")
    f["profile_listed"] = root / "listed.csv"
    shutil.copy(profiles / "h200_qwen2.5-1.5b_random.csv", f["profile_listed"])
    sidecar = json.loads((profiles / "h200_qwen2.5-1.5b_random.json").read_text())
    write("listed.json", json.dumps({**sidecar, "hardware": ["H200"], "model": [1]}))
    f["config_list"] = write("config_list.json", "[1]")
    f["config_task"] = write("config_task.json", '{"task": 3}')
    return {k: str(v) for k, v in f.items()}


def run(prog: str, argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what earlier examples printed
    try:
        rc = MAINS[prog](argv)
    except SystemExit as exc:  # argparse: --help, or a bad flag
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, out: str, err: str) -> None:
    lines = err.splitlines()
    assert rc == 2, f"exit {rc}; stderr: {err[-800:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-800:]
    assert "internal error" not in err, err
    assert "Traceback" not in out + err


BIG = {"e8": 10**8, "e9": 10**9, "e12": 10**12, "e30": 10**30, "p64": 2**64, "p70": 2**70}


def fill(argv: str, files: dict[str, str], tmp_path: Path) -> list[str]:
    """The words of ``argv`` with ``{name}`` -> a path of ``files`` (or a number of ``BIG``)
    and ``{tmp}`` -> this test's own empty directory."""
    return argv.format(tmp=tmp_path, **files, **BIG).split()


# --- tltsim -----------------------------------------------------------------------------------

TLTSIM_CASES = {
    # integers beyond int64 or physically absurd
    "int: response of 10^30 tokens": "validate {huge_response}",
    "int: 2^63-1 responses overflowing the sum": "validate {int64_sum}",
    "int: prompt of 10^30 tokens": "validate {huge_prompt}",
    "int: max_response_tokens 10^30": "validate {huge_cap}",
    "int: CSV response of 10^15 tokens": "validate {huge_csv}",
    "int: replay response of 10^30 tokens": "replay {huge_response} --out {tmp}/o",
    "int: replay --num-gpus 10^8": "replay {trace} --num-gpus {e8} --out {tmp}/o",
    "int: replay --num-gpus 10^30": "replay {trace} --num-gpus {e30} --out {tmp}/o",
    "int: replay --seed 2^64": "replay {trace} --seed {p64} --out {tmp}/o",
    "int: gen --num-steps 10^30": "gen --num-steps {e30} --out {tmp}/t.json",
    "int: gen --group-size 10^9": "gen --group-size {e9} --out {tmp}/t.json",
    "int: gen --prompts-per-step 10^9": "gen --prompts-per-step {e9} --out {tmp}/t.json",
    "int: profile batch 10^30": "profile-info {huge_profile}",
    "int: sweep seeds 2^70": "sweep {spec_seeds} --out {tmp}/s",
    "int: sweep num_gpus 10^8": "sweep {spec_gpus} --out {tmp}/s --workers 1",
    "int: sweep num_points 10^9": "sweep {spec_points} --out {tmp}/s --workers 1",
    "int: replay --seeds 10^30": "replay {trace} --seeds {e30} --out {tmp}/o",
    "int: replay --seeds negative": "replay {trace} --seeds=-5,1 --out {tmp}/o",
    "int: replay --seed near 2^63 --num-seeds 3": (
        "replay {trace} --seed 9223372036854775806 --num-seeds 3 --out {tmp}/o"
    ),
    "int: replay --num-seeds 10^9": "replay {trace} --num-seeds {e9} --out {tmp}/o",
    "int: replay --seeds with --num-seeds": "replay {trace} --seeds 0,1 --num-seeds 3 --out {tmp}/o",
    "int: advise --num-seeds 10^7": "advise {trace} --num-seeds 10000000 --out {tmp}/a",
    "int: import servegen length 2^62": "import servegen {servegen_huge} --out {tmp}/t.json",
    "int: import --num-steps x --prompts-per-step 10^5": (
        "import servegen {servegen_huge} --num-steps 100000 --prompts-per-step 100000 --out {tmp}/t.json"
    ),
    "nan: import --median-prompt-tokens inf": "import servegen {servegen_huge} --median-prompt-tokens inf --out {tmp}/t.json",
    "nan: replay --hardware-file with NaN bandwidth": (
        "replay {trace} --preset h100x8-qwen7b --hardware-file {hw_nan} --out {tmp}/o"
    ),
    # pathologically nested JSON
    "nest: validate": "validate {deep_json}",
    "nest: validate gzipped": "validate {deep_gz}",
    "nest: replay --drafter-dynamics": "replay {trace} --drafter-dynamics {deep_json} --out {tmp}/o",
    "nest: fit": "fit {deep_json}",
    "nest: sweep trace": "sweep {spec_deep_trace} --out {tmp}/s",
    "nest: profile-info --model": "profile-info {huge_profile} --model {deep_json}",
    # binary garbage
    "bin: validate .json": "validate {garbage_json}",
    "bin: validate .json.gz": "validate {garbage_gz}",
    "bin: validate .csv": "validate {garbage_csv}",
    "bin: validate .parquet": "validate {garbage_parquet}",
    "bin: replay trace": "replay {garbage_json} --out {tmp}/o",
    "bin: replay --profile": "replay {trace} --profile {garbage_csv} --out {tmp}/o",
    "bin: replay --drafter-dynamics": "replay {trace} --drafter-dynamics {garbage_json} --out {tmp}/o",
    "bin: replay --drafter-dynamics not an object": "replay {trace} --drafter-dynamics {list_json} --out {tmp}/o",
    "bin: profile-info": "profile-info {garbage_csv}",
    "bin: sweep spec": "sweep {garbage_toml}",
    "bin: import servegen": "import servegen {garbage_csv} --out {tmp}/t.json",
    "bin: fit": "fit {garbage_json}",
    "bin: compare": "compare {garbage_json} --profile {garbage_csv}",
    "bin: profile-info --hardware": "profile-info {huge_profile} --hardware {garbage_json}",
    # --out that cannot be written
    "out: replay --out an existing file": "replay {trace} --out {file}",
    "out: replay --out under a file": "replay {trace} --out {file}/sub",
    "out: replay --out under /proc": "replay {trace} --out /proc/tlt-hostile",
    "out: gen --out an existing directory": "gen --out {dir_json}",
    "out: gen --out under a file": "gen --out {file}/t.json",
    "out: import --out under a file": "import servegen {garbage_csv} --out {file}/t.json",
    "out: sweep --out an existing file": "sweep {spec_ok} --out {file}",
    "out: fit --out under a file": "fit {trace} --out {file}/f.json",
    # sweep specs
    "sweep: unknown preset": "sweep {spec_preset} --out {tmp}/s",
    "sweep: unknown policy": "sweep {spec_policy} --out {tmp}/s",
    "sweep: bad static strategy": "sweep {spec_strategy} --out {tmp}/s",
    "sweep: empty [grid]": "sweep {spec_empty_grid} --out {tmp}/s",
    "sweep: reversed [random] range": "sweep {spec_reversed} --out {tmp}/s",
    "sweep: reversed [random] integer range": "sweep {spec_reversed_int} --out {tmp}/s",
    "sweep: empty [random] choices": "sweep {spec_no_choices} --out {tmp}/s",
    # flags
    "flag: --tlt-epsilon nan": "replay {trace} --tlt-epsilon nan --out {tmp}/o",
    "flag: --drafter-max-accept-rate inf": "replay {trace} --drafter-max-accept-rate inf --out {tmp}/o",
    "flag: --num-gpus nan (argparse)": "replay {trace} --num-gpus nan",
    "flag: unknown flag (argparse)": "replay {trace} --no-such-flag",
    "flag: unknown subcommand (argparse)": "no-such-command",
}


@pytest.mark.parametrize("argv", TLTSIM_CASES.values(), ids=TLTSIM_CASES.keys())
def test_tltsim_hostile_input_is_one_error_line(argv, files, tmp_path, capsys):
    assert_one_error_line(*run("tltsim", fill(argv, files, tmp_path), capsys))


CALIBRATE_CASES = {
    "calibrate {profile} --hardware H200 --out {tmp}/hw.txt": "a hardware preset is a .json file",
    "calibrate {profile} --hardware H200 --tp 0 --out {tmp}/hw.json": "--tp: expected an integer >= 1",
    "calibrate {profile} --hardware H200 --fit bandwidth_fraction,bandwidth_fraction "
    "--out {tmp}/hw.json": "a parameter is named twice",
    # an empty list item was dropped (review): here and in replay's lists
    "calibrate {profile} --hardware H200 --fit bandwidth_fraction,,launch_s "
    "--out {tmp}/hw.json": "--fit bandwidth_fraction,,launch_s: an empty item",
    "replay {trace} --policy nospec,,tlt --out {tmp}/o": "got 'nospec,,tlt'",
    "replay {trace} --seeds 0,,1 --out {tmp}/o": "expected comma-separated integers, got '0,,1'",
    "calibrate {profile_listed} --model Qwen2.5-1.5B --out {tmp}/hw.json": (
        "sidecar field 'hardware': expected a preset name, got list"
    ),
    "profile-info {profile_listed}": (
        "sidecar field 'model': expected a preset name or a config.json object, got list"
    ),
}


@pytest.mark.parametrize(("argv", "says"), CALIBRATE_CASES.items())
def test_calibrate_and_profile_info_bad_input(argv, says, files, tmp_path, capsys):
    """Each refused (they wrote a preset replay then refused, fell back to the sidecar's tp,
    counted a parameter twice, or failed with an internal TypeError)."""
    rc, out, err = run("tltsim", fill(argv, files, tmp_path), capsys)
    assert_one_error_line(rc, out, err)
    assert says in err, err
    assert not (tmp_path / "hw.txt").exists() and not (tmp_path / "hw.json").exists()


def test_report_and_sweep_of_damaged_files(tmp_path, files, capsys):
    """Result directories whose files were damaged after the run, a spec whose out is no path:
    one line each (were internal AttributeError / TypeError, or a pandas error naming no file)."""
    cases = {}
    for name, summary, steps in (
        ("listed", "[1]", None),
        ("garbage", '{"kind": "replay"}', "x,y\n1,2\n"),
        ("empty", '{"kind": "replay"}', ""),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(summary)
        if steps is not None:
            (tmp_path / name / "steps.csv").write_text(steps)
        cases[name] = ["report", str(tmp_path / name)]
    spec = tmp_path / "out5.toml"
    spec.write_text(f'trace = "{files["trace"]}"\nout = 5\n[grid]\npolicy = ["nospec"]\n')
    cases["sweep out = 5"] = ["sweep", str(spec)]
    says = {
        "listed": "field 'kind' must be 'replay' or 'sweep'",
        "garbage": "steps.csv: not tltsim replay's (no column 'policy')",
        "empty": "a result file is not as tltsim replay wrote it",
        "sweep out = 5": "out must be a directory path",
    }
    for name, argv in cases.items():
        rc, out, err = run("tltsim", argv, capsys)
        assert_one_error_line(rc, out, err)
        assert says[name] in err and str(tmp_path) in err, (name, err)


def test_internal_error_is_one_line_with_the_traceback_in_a_file(monkeypatch, capsys):
    """The last line of defence: a bug (not an input error) is one line naming the traceback
    file, exit 1."""
    from tltsim.cli import trace as trace_cli

    def broken(_args):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(trace_cli, "_cmd_validate", broken)
    rc, out, err = run("tltsim", ["validate", "x.json"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: internal error: ZeroDivisionError: boom (full traceback in ")
    path = Path(err.rsplit("full traceback in ", 1)[1].rstrip(")\n"))
    assert "ZeroDivisionError" in path.read_text()
    path.unlink()


def test_an_error_erases_the_progress_bar_it_interrupts(monkeypatch, capsys):
    """A command failing while its progress bar is drawn: the bar's line is erased and closed,
    so the error starts a line of its own and no bar is redrawn after it at exit."""
    from tqdm import tqdm

    from tltsim.cli import trace as trace_cli
    from tltsim.errors import UsageError

    def fails_midway(_args):
        bar = tqdm(total=4, desc="work")
        bar.update()
        raise UsageError("bad input")

    monkeypatch.setattr(trace_cli, "_cmd_validate", fails_midway)
    rc, _, err = run("tltsim", ["validate", "x.json"], capsys)
    drawn, _, error = err.rpartition("error: ")
    assert rc == 2 and error == "bad input\n", err
    assert "work:" in drawn and drawn.endswith("\r"), repr(drawn)  # drawn, then erased
    assert not list(tqdm._instances)  # closed: nothing left to redraw


def test_config_values_take_their_fields_types():
    """``typed_fields`` (tltrun train --config, the sweep spec's settings): integers widen to
    floats, arrays become tuples, null stays null where the field allows it, names it does not
    know pass to the caller's unknown-field check; anything else is one error naming the file
    and field."""
    from tltrun.train.config import TrainConfig
    from tltsim.errors import UsageError
    from tltsim.jsonio import typed_fields

    given_values = {"lr": 1, "tlt_strategies": ["4_1_4"], "drafter_dir": None, "num_steps": 3}
    got = typed_fields(TrainConfig, {**given_values, "bogus": "x"}, "c.toml")
    assert got == {"lr": 1.0, "tlt_strategies": ("4_1_4",), "drafter_dir": None,
                   "num_steps": 3, "bogus": "x"}  # fmt: skip
    assert type(got["lr"]) is float
    for name, value, expected in [
        ("num_steps", None, "an integer"),  # null only where the field is optional
        ("tlt_strategies", "4_1_4", "a list"),
        ("drafter_dir", 3, "a string"),
        ("lr", False, "a number"),
    ]:
        with pytest.raises(UsageError, match=rf"^c\.toml: {name}: expected {expected}, got "):
            typed_fields(TrainConfig, {name: value}, "c.toml")


def test_results_are_written_as_strict_json(tmp_path):
    """A NaN in a result (compare's per-response rate of a response with no verify in a step)
    was written as a bare NaN, which strict JSON readers refuse: it is null now, inside
    dataclasses and numpy scalars too."""
    import dataclasses

    import numpy as np

    from tltsim.jsonio import write_json

    @dataclasses.dataclass
    class Rates:
        response_rates: tuple

    path = tmp_path / "out.json"
    write_json(path, {"runs": [Rates((0.5, float("nan")))], "x": np.float64("inf"), "n": 3})

    def refuse(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "runs": [{"response_rates": [0.5, None]}],
        "x": None,
        "n": 3,
    }


def test_a_json_result_killed_mid_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """Hunt: summary.json was written in place, so a kill during the write left a torn file
    that report took for a finished run's. Now a temporary renamed over it."""
    import os

    from tltsim import jsonio

    path = tmp_path / "summary.json"
    jsonio.write_json(path, {"kind": "replay", "n": 1})

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        jsonio.write_json(path, {"kind": "replay", "n": 2})
    assert json.loads(path.read_text()) == {"kind": "replay", "n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
