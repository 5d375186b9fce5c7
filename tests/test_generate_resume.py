"""``tltrun generate`` streams each finished response to ``generations.jsonl``: a run killed
with SIGKILL keeps them, and ``--resume`` generates only the others, ending (greedy) with the
uninterrupted run's file, in request order; a torn last line is dropped; the refusals (a fresh
run over an unfinished one, flags with --resume, nothing to resume, a changed prompt file) are
one ``error:`` line.

Run: ``.venv/bin/python -m pytest tests/test_generate_resume.py -q``
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from process_tools import sigkill_when
from test_hostile import assert_one_error_line, run
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltsim.trace.files import load_trace

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_resume")
    model = tiny_model(seed=0)
    save_hf(model, root / "model")
    export_vllm(EagleDrafter.for_target(model, seed=1), root / "drafter")
    prompts = [
        {
            "id": f"p{i}",
            "prompt_token_ids": list(range(5 + i, 12 + i)),
            "max_new_tokens": 32 - 4 * i,
        }
        for i in range(NUM_PROMPTS)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


def argv(inputs, out) -> list[str]:
    return ["generate", "--model", str(inputs / "model"), "--prompts", str(inputs / "prompts.jsonl"),
            "--out", str(out), "--max-running-requests", "2", "--temperature", "0"]  # fmt: skip


def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


# Runs tltrun's CLI with every engine step slowed down (time only), so that the test can kill
# it after some responses finished and before all did.
SLOW_CLI = """
import sys, time
from tltrun.cli.main import main
from tltrun.rollout.engine import RolloutEngine
step = RolloutEngine.step
def slow_step(self):
    time.sleep(0.05)
    return step(self)
RolloutEngine.step = slow_step
sys.exit(main(sys.argv[1:]))
"""


def test_killed_generate_resumes_to_the_uninterrupted_output(inputs, tmp_path, capsys):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(argv(inputs, whole)) == 0, capsys.readouterr().err
    path = killed / "generations.jsonl"
    sigkill_when(
        [sys.executable, "-c", SLOW_CLI, *argv(inputs, killed)],
        lambda: path.is_file() and path.read_text().count("\n") >= 2,
        "two finished responses",
    )
    moved = tmp_path / "moved"  # the run resumes where it now is, not where it started
    killed = killed.rename(moved)
    kept = rows_of(killed)
    assert 2 <= len(kept) < NUM_PROMPTS and not (killed / "trace.json").exists()
    with (killed / "generations.jsonl").open("a") as f:
        f.write('{"id": "p7/0", "prompt_tok')  # a row torn by the kill: dropped
    capsys.readouterr()
    assert main(["generate", "--out", str(killed), "--resume"]) == 0, capsys.readouterr().err
    assert f"and {len(kept)} written before the resume" in capsys.readouterr().out
    assert rows_of(killed) == rows_of(whole)  # request order, greedy: the same tokens
    trace = load_trace(killed / "trace.json")
    assert trace.steps[0].num_responses == NUM_PROMPTS - len(kept)
    assert f"{len(kept)} of the {NUM_PROMPTS} responses" in trace.meta["resumed"]
    assert main(["generate", "--out", str(killed), "--resume"]) == 0
    assert "the run already finished" in capsys.readouterr().out


def test_a_resume_with_every_response_written_only_writes_the_trace(inputs, tmp_path, capsys):
    out = tmp_path / "done"
    assert main(argv(inputs, out)) == 0
    before = (out / "generations.jsonl").read_text()
    (out / "trace.json").unlink()  # killed after the last response, before the trace
    capsys.readouterr()
    assert main(["generate", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert f"all {NUM_PROMPTS} responses were written before" in capsys.readouterr().out
    assert (out / "generations.jsonl").read_text() == before
    step = load_trace(out / "trace.json").steps[0]
    assert step.num_responses == NUM_PROMPTS and step.measured is None


def assert_other_weights_refused(inputs, out, command: str, parts, capsys) -> None:
    """Hunt: a resume over other weights in the run's --model wrote their responses after the
    old ones' without a word (and a changed model was blamed on the prompts)."""
    for part in parts:
        weights = next((inputs / part).glob("*.safetensors"))
        original = weights.read_bytes()
        try:
            weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
            rc, stdout, err = run("tltrun", [command, "--out", str(out), "--resume"], capsys)
        finally:
            weights.write_bytes(original)
        assert_one_error_line(rc, stdout, err)
        assert f"--{part} {inputs / part}: its config.json or weights changed since the run" in err


def test_refusals_are_one_error_line(inputs, tmp_path, capsys):
    out = tmp_path / "unfinished"
    assert main(argv(inputs, out)) == 0
    (out / "trace.json").unlink()
    lines = (out / "generations.jsonl").read_text().splitlines()
    (out / "generations.jsonl").write_text("\n".join(lines[:3]) + "\n")
    changed = tmp_path / "changed.jsonl"
    cases = {
        "fresh run over an unfinished one": (argv(inputs, out), "pass --resume to continue it"),
        "flags with --resume": (
            ["generate", "--out", str(out), "--resume", "--temperature", "1"],
            "drop --temperature",
        ),
        # the flags as typed (it said "drop --share-prompts", "--is-..." for booleans)
        "boolean flags with --resume": (
            ["generate", "--out", str(out), "--resume", "--no-share-prompts", "--compile-layers"],
            "drop --compile-layers, --no-share-prompts",
        ),
        "--resume without --out": (["generate", "--resume"], "--resume needs --out"),
        "--resume of no run": (
            ["generate", "--out", str(tmp_path / "empty"), "--resume"],
            "no config.json of a tltrun generate run",
        ),
    }
    for name, (args, says) in cases.items():
        rc, stdout, err = run("tltrun", args, capsys)
        assert_one_error_line(rc, stdout, err)
        assert says in err, name
    assert len(rows_of(out)) == 3  # refused runs wrote nothing
    # the prompt file changed under the run: its recorded path now holds other prompts, an
    # answered one's or (hunt: accepted) one not yet answered, a cap, an added line
    prompts = inputs / "prompts.jsonl"
    original = prompts.read_text()
    extra = json.dumps({"id": "p9", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}) + "\n"
    for edited in (
        original.replace("[5, 6,", "[9, 6,"),
        original.replace("[12, 13,", "[9, 13,"),  # p7's, not answered before the kill
        original.replace('"max_new_tokens": 32', '"max_new_tokens": 3'),
        original + extra,
    ):
        changed.write_text(edited)
        try:
            os.replace(changed, prompts)
            rc, stdout, err = run("tltrun", ["generate", "--out", str(out), "--resume"], capsys)
        finally:
            prompts.write_text(original)
        assert_one_error_line(rc, stdout, err)
        assert "its requests changed since the run started" in err
    assert_other_weights_refused(inputs, out, "generate", ["model"], capsys)
    assert len(rows_of(out)) == 3


def test_a_sampled_resume_draws_new_samples(inputs, tmp_path, capsys):
    """Hunt: a resumed sampled run restarted the run's generator, so the responses it drew
    for the rest copied the finished ones (4 of a group's 16 samples came out twice). At
    temperature 5 the tiny model's 12-token samples are all distinct unless copied."""
    out = tmp_path / "sampled"
    args = ["generate", "--model", str(inputs / "model"), "--prompts", str(inputs / "one.jsonl"),
            "--out", str(out), "--max-running-requests", "4", "--temperature", "5",
            "--group-size", "16", "--max-new-tokens", "12"]  # fmt: skip
    (inputs / "one.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6, 7]}))
    assert main(args) == 0, capsys.readouterr().err
    whole = [r["output_token_ids"] for r in rows_of(out)]
    assert len({tuple(o) for o in whole}) == 16
    lines = (out / "generations.jsonl").read_text().splitlines(keepends=True)
    (out / "generations.jsonl").write_text("".join(lines[:4]))  # killed after four
    (out / "trace.json").unlink()
    assert main(["generate", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    resumed = [tuple(r["output_token_ids"]) for r in rows_of(out)]
    assert len(resumed) == 16 and len(set(resumed)) == 16


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("id", ["p0/0"], "expected a response object with a string 'id'"),
        ("output_token_ids", 5, "'output_token_ids' must be a list of token ids"),
        ("output_token_ids", [1, True], "'output_token_ids' must be a list of token ids"),
        ("finish", "done", "'finish' must be 'stop' or 'length', got 'done'"),
        ("accept_hist", None, "'accept_hist' must be a list of counts"),
    ],
)
def test_a_damaged_row_is_one_error_line_naming_it(inputs, tmp_path, capsys, field, value, says):
    """A resume read rows back unchecked: an id list was 'unhashable type', an int
    output_token_ids 'object of type int has no len()' (internal errors, exit 1)."""
    out = tmp_path / "damaged"
    assert main(argv(inputs, out)) == 0
    (out / "trace.json").unlink()
    rows = rows_of(out)
    rows[1][field] = value
    (out / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, stdout, err = run("tltrun", ["generate", "--out", str(out), "--resume"], capsys)
    assert_one_error_line(rc, stdout, err)
    assert "generations.jsonl line 2: " + says in err, err


def test_a_prompt_file_with_a_byte_order_mark_reads_as_without(inputs, tmp_path, capsys):
    """Windows editors start UTF-8 files with a BOM; JSON refused the first line as
    'Unexpected UTF-8 BOM' (tltrun sft's data reader already took it)."""
    bom = tmp_path / "prompts.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (inputs / "prompts.jsonl").read_bytes())
    plain, marked = tmp_path / "plain", tmp_path / "bom"
    assert main(argv(inputs, plain)) == 0
    args = argv(inputs, marked)
    args[args.index("--prompts") + 1] = str(bom)
    assert main(args) == 0, capsys.readouterr().err
    assert rows_of(marked) == rows_of(plain)


def test_a_refused_generate_writes_nothing_and_the_corrected_one_runs(inputs, tmp_path, capsys):
    """--policy static without --drafter was refused after config.json and an empty
    generations.jsonl were written: the corrected command then met "an unfinished generate
    run", and its --resume repeated the refusal."""
    out = tmp_path / "gen"
    assert main([*argv(inputs, out), "--policy", "static"]) == 2
    assert "the engine has none" in capsys.readouterr().err
    assert not out.exists()  # no run's files (nor the directory the refused command made)
    assert (
        main([*argv(inputs, out), "--policy", "static", "--drafter", str(inputs / "drafter")]) == 0
    )
    assert (out / "trace.json").is_file()


def test_generate_stops_at_generation_config_stop_ids(inputs, tmp_path):
    """A model whose generation_config.json lists a stop id config.json does not (Llama-3-
    Instruct's <|eot_id|>): generate ran past it to the token cap."""
    import shutil

    model = tmp_path / "inputs"
    shutil.copytree(inputs, model)

    def generated(out: str) -> dict[str, dict]:
        assert main(argv(model, tmp_path / out)) == 0
        return {r["id"]: r for r in rows_of(tmp_path / out)}

    # a response that ran to its cap (room for an earlier stop: the check's teeth)
    rid, long = next((k, r) for k, r in generated("free").items() if r["finish"] == "length")
    tokens = long["output_token_ids"]
    (model / "model" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokens[1]]})
    )
    row = generated("stopped")[rid]
    assert (
        row["finish"] == "stop" and row["output_token_ids"] == tokens[: tokens.index(tokens[1]) + 1]
    )


def test_text_and_chat_prompts_of_a_hugging_face_tokenizer(tmp_path, capsys):
    """generate refused text prompts unless the model had the built-in character tokenizer
    (found by a user-story hunt): they go through the model's tokenizer as train's prompts do,
    chat messages through its chat template, text too with --chat-template."""
    from test_train_data import save_bpe_model

    from tltrun.data.tokenizer import load_tokenizer

    model = save_bpe_model(tmp_path / "bpe")
    messages = [{"role": "user", "content": "What is 1 plus 2?"}]
    rows = [{"id": "text", "prompt": "What is 1 plus 2?"}, {"id": "chat", "prompt": messages}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for flags, name in (([], "plain"), (["--chat-template"], "templated")):
        out = tmp_path / name
        argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                "--max-new-tokens", "4", "--temperature", "0", *flags]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        lines = (out / "generations.jsonl").read_text().splitlines()
        done = {json.loads(line)["id"]: json.loads(line) for line in lines}
        tok = load_tokenizer(model, is_chat_template=bool(flags))
        for row in rows:
            got = done[f"{row['id']}/0"]
            assert got["prompt_token_ids"] == tok.encode_prompt(row["prompt"])
            assert "text" in got  # decoded with the same tokenizer
    plain = load_tokenizer(model).encode_prompt("What is 1 plus 2?")
    assert plain != load_tokenizer(model, is_chat_template=True).encode_prompt("What is 1 plus 2?")
    # an empty text prompt of a tokenizer that adds no BOS: no token to start from (hunt: a
    # warning called it legal, then the engine refused it without naming the file)
    assert load_tokenizer(model).encode_prompt("") == []
    prompts.write_text(json.dumps({"id": "e", "prompt": ""}) + "\n")
    argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--out",
            str(tmp_path / "empty"), "--max-new-tokens", "4"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{prompts} line 1: 'prompt' is empty and the tokenizer adds no BOS" in err
    assert "warning" not in err


def test_sigterm_stops_generate_with_one_line_and_a_resumable_run(inputs, tmp_path, capsys):
    """SIGTERM (a scheduler's, `timeout`'s) killed generate silently with -15; now one line,
    exit 143, and the run resumes like a killed one."""
    import signal
    import subprocess
    import time

    out = tmp_path / "termed"
    path = out / "generations.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *argv(inputs, out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (path.is_file() and path.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # (the line said nothing of --resume)
    said = f"error: {out}: stopped by SIGTERM; continue with tltrun generate --out {out} --resume"
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == said, err
    assert main(["generate", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert (out / "trace.json").exists()


def test_a_run_of_relative_paths_resumes_from_another_directory(inputs, tmp_path, capsys,
                                                                monkeypatch):  # fmt: skip
    """config.json recorded --model and --prompts as typed: a --resume from another directory
    found neither."""
    monkeypatch.chdir(inputs)
    out = tmp_path / "g"
    assert main(["generate", "--model", "model", "--prompts", "prompts.jsonl", "--out", str(out),
                 "--max-running-requests", "2", "--temperature", "0"]) == 0  # fmt: skip
    recorded = json.loads((out / "config.json").read_text())["generate"]
    assert recorded["model"] == str(inputs / "model")
    assert recorded["prompts"] == str(inputs / "prompts.jsonl")
    (out / "generations.jsonl").write_text("")  # as if killed before its first response
    (out / "trace.json").unlink(missing_ok=True)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["generate", "--out", "g", "--resume"]) == 0, capsys.readouterr().err
    assert len(rows_of(out)) == NUM_PROMPTS


def test_a_parquet_prompt_file_is_named_as_one(inputs, tmp_path, capsys):
    """Hunt: a Parquet file (``tltrun train --data`` reads them) was "not a text prompt file
    (byte 251 is not UTF-8; binary or corrupted?)"."""
    import pandas as pd

    pd.DataFrame({"id": ["a"], "prompt": ["2+2"]}).to_parquet(tmp_path / "p.parquet")
    args = argv(inputs, tmp_path / "o")
    args[args.index("--prompts") + 1] = str(tmp_path / "p.parquet")
    rc, stdout, err = run("tltrun", args, capsys)
    assert_one_error_line(rc, stdout, err)
    assert f"--prompts {tmp_path / 'p.parquet'}: a Parquet file; tltrun generate reads JSON" in err


def test_a_request_longer_than_the_context_names_its_prompt_and_the_limit(inputs, tmp_path, capsys):
    """Hunt: "request 'b/0': prompt + max_new_tokens = 604 exceeds max_model_len=512", from the
    engine, named neither the file, the prompt's id, nor where 512 came from."""
    prompts = tmp_path / "long.jsonl"
    prompts.write_text('{"id": "b", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 100000}\n')
    args = argv(inputs, tmp_path / "o")
    args[args.index("--prompts") + 1] = str(prompts)
    rc, stdout, err = run("tltrun", args, capsys)
    assert_one_error_line(rc, stdout, err)
    assert f"--prompts {prompts}: prompt 'b': 3 prompt tokens + max_new_tokens 100000 = " in err
    assert "positions (max_position_embeddings, " in err
    prompts.write_text('{"id": "b", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 9}\n')
    rc, stdout, err = run("tltrun", [*args, "--max-model-len", "10"], capsys)
    assert_one_error_line(rc, stdout, err)
    assert "prompt 'b': 3 prompt tokens + max_new_tokens 9 = 12 exceed --max-model-len 10" in err
