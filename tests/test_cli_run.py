"""``tltrun generate / train-drafter / bench`` end to end on a tiny model, and their one-line
errors (exit 2, no traceback).

Run: ``python -m pytest tests/test_cli_run.py -q``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltsim.errors import UsageError
from tltsim.fidelity.measured_run import measured_run
from tltsim.trace.files import load_trace

ENGINE = ["--max-running-requests", "3", "--max-model-len", "64", "--temperature", "0"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = tiny_model(seed=0)
    save_hf(model, root / "model")
    export_vllm(EagleDrafter.for_target(model, seed=1), root / "drafter")
    prompts = [
        {
            "id": f"p{i}",
            "prompt_token_ids": list(range(5 + i, 12 + 2 * i)),
            "max_new_tokens": 6 + 3 * i,
        }
        for i in range(4)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    trace = {
        "format": "tlt-trace",
        "version": 1,
        "meta": {"source": "test"},
        "steps": [
            {
                "step": 0,
                "prompts": [
                    {"id": "a", "prompt_tokens": 7, "responses": [12, 3, 20]},
                    {"id": "b", "prompt_tokens": 4, "responses": [9, 9]},
                ],
            }
        ],
    }
    (root / "trace.json").write_text(json.dumps(trace))
    return root


def test_generate_then_train_drafter(dirs, capsys):
    out = dirs / "gen"
    rc = main(
        [
            "generate",
            "--model",
            str(dirs / "model"),
            "--prompts",
            str(dirs / "prompts.jsonl"),
            "--out",
            str(out),
            "--drafter",
            str(dirs / "drafter"),
            "--policy",
            "static",
            "--strategy",
            "3_2_6",
            "--group-size",
            "2",
            *ENGINE,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}/{j}" for i in range(4) for j in range(2)]
    assert all(1 <= len(r["output_token_ids"]) <= 6 + 3 * int(r["id"][1]) for r in rows)
    trace = load_trace(out / "trace.json")
    assert trace.steps[0].num_responses == 8 and trace.steps[0].measured.policy.name == "static"
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["engine"]["max_running_requests"] == 3 and cfg["engine"]["sampling"]["temperature"] == 0
    )
    # what the device decided where the flags left the default (null in "engine")
    assert cfg["engine"]["dtype"] is None
    assert cfg["resolved"] == {"dtype": "float32", "attn_impl": "sdpa"}
    rc = main(
        [
            "train-drafter",
            "--model",
            str(dirs / "model"),
            "--data",
            str(out / "generations.jsonl"),
            "--out",
            str(dirs / "trained"),
            "--train-num-steps",
            "5",
            "--train-lr",
            "1e-3",
        ]
    )
    assert rc == 0
    assert json.loads((dirs / "trained" / "config.json").read_text())["architectures"] == [
        "EagleLlamaForCausalLM"
    ]
    assert len(json.loads((dirs / "trained" / "history.json").read_text())) == 5
    recorded = json.loads((dirs / "trained" / "train_config.json").read_text())
    assert recorded["train_drafter"]["dtype"] is None  # as typed (none): the device decides
    assert recorded["resolved"] == {"dtype": "float32"}  # what it decided on the CPU
    # (it said "last 20: loss ..." of a 5-step run)
    assert "for 5 steps (all 5: loss " in capsys.readouterr().out


def test_generate_checks_strategy_whatever_the_policy(dirs, capsys):
    """--strategy zz ran as NoSpec with exit 0; --policy tlt --strategy 2_1_2 ignored it."""
    argv = ["generate", "--model", str(dirs / "model"), "--prompts", str(dirs / "prompts.jsonl"),
            "--max-new-tokens", "4", *ENGINE]  # fmt: skip
    assert main([*argv, "--out", str(dirs / "g_zz"), "--strategy", "zz"]) == 2
    assert "strategy 'zz': expected 'DRAFTSTEPS_TOPK_VERIFYTOKENS'" in capsys.readouterr().err
    out = dirs / "g_tlt"
    assert main([*argv, "--out", str(out), "--policy", "tlt", "--strategy", "2_1_2"]) == 2
    err = capsys.readouterr().err
    assert "only --policy static takes a strategy; --policy tlt chooses its own" in err
    assert not out.exists()


def test_bench_prints_side_by_side_table(dirs, capsys):
    out = dirs / "bench"
    rc = main(
        [
            "bench",
            "--trace",
            str(dirs / "trace.json"),
            "--policy",
            "nospec,static,tlt",
            "--model",
            str(dirs / "model"),
            "--drafter",
            str(dirs / "drafter"),
            "--strategy",
            "2_2_4",
            "--out",
            str(out),
            "--no-progress-shown",
            *ENGINE,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    for word in ("policy", "tokens/s", "accept len", "speedup", "nospec", "static", "tlt"):
        assert word in table
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["torch/nospec", "torch/static", "torch/tlt"]
    assert all(r["total_tokens"] == 12 + 3 + 20 + 9 + 9 for r in results.values())
    assert results["torch/nospec"]["speedup"] == 1.0
    assert results["torch/static"]["mean_accept_len"] >= 1.0
    for name in results:
        replay = load_trace(out / f"trace_{name.replace('/', '_')}.json")
        assert replay.steps[0].response_lengths() == [12, 3, 20, 9, 9]
    config = json.loads((out / "config.json").read_text())
    assert config["bench"]["policy"] == ["nospec", "static", "tlt"]
    # each trace holds what `tltsim compare` reads: policy settings and seed, the batching cap,
    # per-strategy accept histograms
    for name, settings in (("nospec", {}), ("static", {"strategy": "2_2_4"}), ("tlt", None)):
        path = out / f"trace_torch_{name}.json"
        run = measured_run(load_trace(path), str(path))
        assert run.policy == name and run.policy_seed == config["engine"]["seed"]
        assert run.max_running_requests == 3 and run.num_instances == 1
        if settings is not None:
            assert run.settings == settings
    # every verify of every response, counted once in the strategy's histogram
    static_trace = load_trace(out / "trace_torch_static.json")
    static = measured_run(static_trace, "static")
    num_verifies = sum(sum(r.accept_hist or ()) for p in static_trace.steps[0].prompts
                       for r in p.responses)  # fmt: skip
    assert num_verifies > 0 and sum(static.acceptance.hists[0]["2_2_4"]) == num_verifies


def test_engine_sizes_default_to_what_the_rollout_needs(dirs, capsys):
    """Without --max-running-requests / --max-model-len: every request at once (4 prompts x 2)
    and the longest prompt + max_new_tokens (prompt p3: 10 + 15 tokens)."""
    out = dirs / "gen_defaults"
    argv = ["--model", str(dirs / "model"), "--out", str(out), "--temperature", "0"]
    rc = main(["generate", *argv, "--prompts", str(dirs / "prompts.jsonl"), "--group-size", "2"])
    assert rc == 0, capsys.readouterr().err
    assert "decode tokens/s, no SD); written to" in capsys.readouterr().out  # (was "0.00")
    engine = json.loads((out / "config.json").read_text())["engine"]
    assert (engine["max_running_requests"], engine["max_model_len"]) == (8, 25)
    assert len((out / "generations.jsonl").read_text().splitlines()) == 8
    # bench: the step's 5 responses at once, the longest request 7 + 20 tokens
    argv[argv.index(str(out))] = str(dirs / "bench_defaults")  # (a run's own directory)
    rc = main(["bench", *argv, "--trace", str(dirs / "trace.json"), "--policy", "nospec",
               "--no-progress-shown"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    engine = json.loads((dirs / "bench_defaults" / "config.json").read_text())["engine"]
    assert (engine["max_running_requests"], engine["max_model_len"]) == (5, 27)


def test_engine_size_defaults_are_capped(dirs):
    """At most DEFAULT_MAX_RUNNING_REQUESTS slots and the model's max_position_embeddings."""
    from tltrun.cli.args import DEFAULT_MAX_RUNNING_REQUESTS, engine_defaults

    big = engine_defaults(str(dirs / "model"), 10_000, 100_000)
    assert big == {
        "max_running_requests": DEFAULT_MAX_RUNNING_REQUESTS,
        "max_model_len": 512,
        "eos_token_ids": (),  # no generation_config.json
    }
    small = engine_defaults(str(dirs / "model"), 3, 40)
    assert (small["max_running_requests"], small["max_model_len"]) == (3, 40)


def cli_words(line: str) -> list[str]:
    """A command line of the table below, with the engine flags."""
    return line.split() + ENGINE


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tltrun.cli.main", *argv], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["generate", "--model", "/nonexistent", "--prompts", "P", "--out", "y", *ENGINE],
            "no config.json",
        ),
        (
            ["generate", "--model", "M", "--prompts", "P", "--out", "y", "--max-model-len", "1"],
            "max_model_len >= 2",
        ),
        (
            ["generate", "--model", "M", "--prompts", "/nonexistent.jsonl", "--out", "y", *ENGINE],
            "no such file",
        ),
        (
            [
                "bench",
                "--trace",
                "T",
                "--model",
                "M",
                "--out",
                "y",
                "--policy",
                "nospec,fast",
                *ENGINE,
            ],
            "--policy nospec,fast",
        ),
        (
            ["bench", "--trace", "T", "--model", "M", "--out", "y", "--policy", "static", *ENGINE],
            "need --drafter",
        ),
        (
            [
                "bench",
                "--trace",
                "T",
                "--model",
                "M",
                "--out",
                "y",
                "--policy",
                "nospec",
                "--length-scale",
                "10",
                *ENGINE,
            ],
            "exceed --max-model-len 64",
        ),
        (
            [
                "bench",
                "--trace",
                "T",
                "--model",
                "M",
                "--out",
                "y",
                "--backend",
                "torch,sglang",
                *ENGINE,
            ],
            "--backend torch,sglang",
        ),
        (
            cli_words("bench --trace T --model M --out y --steps 0,0"),
            "--steps names step 0 more than once",
        ),
        (
            cli_words("bench --trace T --model M --out y --policy nospec,tlt,nospec"),
            "--policy names nospec more than once",
        ),
        # an empty item was dropped (a typo read as another list)
        (
            cli_words("bench --trace T --model M --out y --policy nospec,,tlt"),
            "--policy: an empty item in 'nospec,,tlt'",
        ),
        (
            cli_words("generate --model M --prompts P --out y --eos-token-ids 1,,2"),
            "--eos-token-ids: expected comma-separated integers",
        ),
        (
            cli_words("generate --model M --prompts P --out y --instance -1"),
            "instance must be >= 0",
        ),
        # only the static policy takes a strategy (bench ignored it beside others)
        (
            cli_words("bench --trace T --model M --out y --policy nospec,tlt --strategy 4_1_4"),
            "only --policy static takes a strategy",
        ),
        # torch-engine flags where only vLLM runs: accepted and ignored
        (
            cli_words(
                "bench --trace T --model M --out y --backend vllm --fuse-projections --eager"
            ),
            "--fuse-projections, --eager: settings of the torch engine",
        ),
        # vLLM refused float64 after the torch rows, in two lines of pydantic errors
        (
            cli_words("bench --trace T --model M --out y --backend torch,vllm --dtype float64"),
            "--dtype float64: --backend vllm takes float32, bfloat16, float16",
        ),
        (
            cli_words("bench --trace T --model M --out y --drafter D --policy nospec,tltbase"),
            "--drafter D: no --policy drafts with it",
        ),
        # a drafter the policy never drafts with: loaded and unused
        (
            cli_words("generate --model M --prompts P --out y --drafter D --policy nospec"),
            "--drafter D: --policy nospec never drafts with it",
        ),
        (
            cli_words("generate --model M --prompts P --out y --graph-batch-sizes 1,2"),
            "--graph-batch-sizes: no CUDA-graph pool runs here",
        ),
        # the engine's error comes while bench's progress bar is drawn: still one line
        (
            cli_words("bench --trace T --model M --out y --policy nospec --eos-token-ids=-1"),
            "generation_config.json's): -1 outside the model's vocabulary",
        ),
    ],
)
def test_errors_are_one_line_exit_2(dirs, argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "--out y": whatever a failed run writes stays out of the repo
    argv = [
        str(dirs / "model")
        if a == "M"
        else str(dirs / "trace.json")
        if a == "T"
        else str(dirs / "prompts.jsonl")
        if a == "P"
        else a
        for a in argv
    ]
    assert main(argv) == 2  # in-process: no exception escaped main
    # what a terminal shows: a progress bar drawn before the error is erased by a "\r" line
    drawn, _, err = capsys.readouterr().err.rpartition("\r")
    assert "\n" not in drawn
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "row,flags,message",
    [
        ({"max_new_tokens": 0}, ["--max-new-tokens", "4"], "must be an integer >= 1, got 0"),
        ({"max_new_tokens": "8"}, [], "must be an integer >= 1, got '8'"),
        ({}, [], "no 'max_new_tokens' (and no --max-new-tokens given)"),
    ],
)
def test_prompt_max_new_tokens_errors_name_the_value(dirs, tmp_path, capsys, row, flags, message):
    """A row's own bad max_new_tokens is reported as the row's value, not as a missing flag."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2], **row}) + "\n")
    argv = ["generate", "--model", str(dirs / "model"), "--prompts", str(prompts)]
    assert main([*argv, "--out", str(tmp_path / "o"), *flags, *ENGINE]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prompts} line 1: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([{"role": "user", "content": None}], "message 0: 'content': expected a string, got null"),
        ([{"role": "user", "content": 5}], "message 0: 'content': expected a string, got int"),
        ([{"role": 1, "content": "hi"}], "message 0: 'role': expected a string, got int"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "message 0: 'content': expected a string, got list",
        ),
        (7, "expected a string or a list of chat messages, got int"),
    ],
)
def test_a_bad_chat_message_is_refused_as_train_refuses_it(dirs, tmp_path, capsys, prompt, message):
    """Hunt: generate templated None, 5, a content list's repr and an int role as text."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": prompt, "max_new_tokens": 2}) + "\n")
    argv = ["generate", "--model", str(dirs / "model"), "--prompts", str(prompts)]
    assert main([*argv, "--out", str(tmp_path / "o"), *ENGINE]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {prompts} line 1: key 'prompt': {message}\n"


def test_prompt_lines_split_at_newlines_only_and_ids_do_not_repeat(dirs, tmp_path, capsys):
    """Hunt: a raw U+2028 inside a JSON string (json.dumps(ensure_ascii=False) writes it so) was
    read as a line break; a repeated id was refused naming neither file nor line."""
    from tltrun.cli.generate import GenerateConfig, read_prompts

    rows = [
        {"id": "a\u2028b\u0085c", "prompt_token_ids": [1, 2]},
        {"id": 7, "prompt_token_ids": [3]},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    cfg = GenerateConfig(model="m", prompts=str(prompts), out="o", max_new_tokens=2)
    requests, _ = read_prompts(str(prompts), "m", cfg)
    assert [r.id for r in requests] == ["a\u2028b\u0085c/0", "7/0"]
    with prompts.open("a") as f:
        f.write(json.dumps({"id": "7", "prompt_token_ids": [4]}) + "\n")
    with pytest.raises(
        UsageError, match=rf"^{re.escape(str(prompts))} line 3: 'id' '7' repeats line 2's$"
    ):
        read_prompts(str(prompts), "m", cfg)


def test_bad_prompt_line_names_file_and_line(dirs, tmp_path):
    """As a real process: exit status 2, one stderr line, no traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt_token_ids": [1, 2], "max_new_tokens": 3}\n{"id": "b"}\n')
    proc = _cli(
        "generate",
        "--model",
        str(dirs / "model"),
        "--prompts",
        str(bad),
        "--out",
        str(tmp_path / "o"),
        *ENGINE,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert f"{bad} line 2: needs 'prompt_token_ids' or 'prompt'" in proc.stderr


def test_bench_runs_tltbase_without_an_eagle_drafter(dirs, capsys):
    """TLT-Base drafts from the rollout history: no --drafter needed, same tokens as NoSpec."""
    out = dirs / "bench_tltbase"
    argv = ["bench", "--trace", str(dirs / "trace.json"), "--model", str(dirs / "model"),
            "--out", str(out), *ENGINE]  # fmt: skip
    assert main([*argv, "--policy", "nospec,tltbase"]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["torch/nospec", "torch/tltbase"]
    for name in results:
        replay = load_trace(out / f"trace_{name.replace('/', '_')}.json")
        assert replay.steps[0].response_lengths() == [12, 3, 20, 9, 9]
    history = load_trace(out / "trace_torch_tltbase.json").steps[0].measured
    assert history.accept_hist_by_strategy and all(  # it did speculate, from the history
        key.startswith("history:") for key in history.accept_hist_by_strategy
    )
    capsys.readouterr()
    assert main([*argv, "--policy", "nospec,tlt"]) == 2  # EAGLE policies still need one
    assert "need --drafter" in capsys.readouterr().err
    # a static history strategy drafts from the history too (it was refused: no --drafter)
    static = ["--policy", "static", "--strategy", "history:6_1_6", "--out", str(out) + "_static"]
    assert main([*argv, *static]) == 0, capsys.readouterr().err
    replay = load_trace(out.parent / "bench_tltbase_static" / "trace_torch_static.json")
    assert replay.steps[0].response_lengths() == [12, 3, 20, 9, 9]
    assert list(replay.steps[0].measured.accept_hist_by_strategy) == ["history:6_1_6"]


@pytest.mark.parametrize("command", ["generate --model M --prompts P", "bench --trace T --model M"])
def test_harvesting_is_not_a_flag_of_generate_or_bench(command, capsys):
    """The engine keeps each response's hidden states for tltrun train's spot trainers; under
    generate and bench nothing took them, so --harvesting only filled the memory."""
    with pytest.raises(SystemExit) as exit_:
        main([*cli_words(command), "--out", "y", "--harvesting"])
    assert (
        exit_.value.code == 2 and "unrecognized arguments: --harvesting" in capsys.readouterr().err
    )
