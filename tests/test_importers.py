"""Tests of the importers (``tltsim.trace.importers``, ``tltsim import``): marginal kept, groups formed.

Run: ``.venv/bin/python -m pytest tests/test_importers.py -q``

Most tests build small source files in the ServeGen / Azure layouts; the ones marked by
``needs_shared`` read the real files in ``$TLT_SHARED_TRACES`` (default /work/shared/traces) and
are skipped, with that reason, where those files are absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from tltsim.cli.main import main
from tltsim.errors import InputWarning
from tltsim.trace.files import load_trace
from tltsim.trace.importers import ImportConfig, import_azure, import_servegen, import_trace
from tltsim.trace.schema import Trace, TraceError

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TLT_SHARED_TRACES", "/work/shared/traces"))
SERVEGEN = SHARED / "servegen_deepseek_r1_output_tokens.csv.gz"
AZURE_CONV = SHARED / "azure_llm_inference_2023_conv.csv"
needs_shared = pytest.mark.skipif(
    not SERVEGEN.exists() or not AZURE_CONV.exists(),
    reason=f"public length data not found in {SHARED} (set TLT_SHARED_TRACES)",
)


def _servegen_file(path: Path, seed: int = 0) -> np.ndarray:
    """A ServeGen-layout file: 2 clients x 2 windows of lognormal lengths, sorted per window."""
    rng = np.random.default_rng(seed)
    parts = []
    for client, window, median in [(0, 0, 500), (0, 21600, 900), (7, 0, 3000), (7, 21600, 200)]:
        tokens = np.sort(
            np.clip(np.rint(median * np.exp(rng.standard_normal(2000))), 1, 32768).astype(int)
        )
        parts.append(
            pd.DataFrame({"client_id": client, "window_start_s": window, "output_tokens": tokens})
        )
    frame = pd.concat(parts, ignore_index=True)
    frame.to_csv(path, index=False)
    return frame["output_tokens"].to_numpy()


def _azure_file(path: Path, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = 3000
    frame = pd.DataFrame(
        {
            "TIMESTAMP": pd.date_range("2023-11-16 18:00", periods=n, freq="s").astype(str),
            "ContextTokens": rng.integers(2, 8000, n),
            "GeneratedTokens": np.minimum(
                np.rint(130 * np.exp(rng.standard_normal(n))).astype(int) + 1, 1000
            ),
        }
    )
    frame.to_csv(path, index=False)
    return frame


def _logs(trace: Trace) -> np.ndarray:
    """Log lengths as (steps, prompts, group)."""
    return np.log(
        np.array([[p.response_lengths() for p in s.prompts] for s in trace.steps], dtype=float)
    )


def _assert_marginal(lengths: np.ndarray, source: np.ndarray) -> None:
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    np.testing.assert_allclose(np.quantile(lengths, qs), np.quantile(source, qs), rtol=0.1)
    assert np.quantile(lengths, 0.99) == pytest.approx(np.quantile(source, 0.99), rel=0.25)
    assert stats.ks_2samp(lengths, source).statistic < 0.03


def _assert_groups(trace: Trace) -> None:
    logs = _logs(trace)
    within = logs.std(axis=2).mean()  # scatter of a prompt's samples
    across = logs.mean(axis=2).std(axis=1).mean()  # scatter of prompt means within a step
    assert within < 0.6 * across, (within, across)


def test_servegen_layout_keeps_marginal_and_forms_groups(tmp_path: Path) -> None:
    source = _servegen_file(tmp_path / "sg.csv.gz")
    trace = import_servegen(
        tmp_path / "sg.csv.gz", ImportConfig(num_steps=16, prompts_per_step=32, seed=1)
    )
    assert (trace.num_steps, trace.num_prompts, trace.num_responses) == (16, 512, 4096)
    _assert_marginal(trace.response_lengths(), source)
    _assert_groups(trace)
    assert set(trace.response_lengths().tolist()) <= set(source.tolist())  # only source values


def test_servegen_filters_select_rows(tmp_path: Path) -> None:
    _servegen_file(tmp_path / "sg.csv")
    frame = pd.read_csv(tmp_path / "sg.csv")
    subset = frame[(frame.client_id == 7) & (frame.window_start_s == 0)].output_tokens.to_numpy()
    trace = import_servegen(
        tmp_path / "sg.csv", ImportConfig(client_id=7, window_start_s=0, num_steps=8)
    )
    assert set(trace.response_lengths().tolist()) <= set(subset.tolist())
    assert np.median(trace.response_lengths()) == pytest.approx(np.median(subset), rel=0.15)


def test_groups_do_not_interleave_without_within_group_scatter(tmp_path: Path) -> None:
    # group_sigma = 0: a prompt's samples share one score, so they take consecutive ranks.
    _servegen_file(tmp_path / "sg.csv")
    trace = import_servegen(
        tmp_path / "sg.csv", ImportConfig(group_sigma=0.0, num_steps=3, prompts_per_step=16)
    )
    for step in trace.steps:
        groups = sorted(
            (min(p.response_lengths()), max(p.response_lengths())) for p in step.prompts
        )
        assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(groups, groups[1:], strict=False))


def test_cap_cuts_and_marks_length(tmp_path: Path) -> None:
    _servegen_file(tmp_path / "sg.csv")
    trace = import_servegen(
        tmp_path / "sg.csv", ImportConfig(max_response_tokens=1000, num_steps=4)
    )
    responses = [r for s in trace.steps for p in s.prompts for r in p.responses]
    assert max(r.tokens for r in responses) == 1000 and trace.max_response_tokens == 1000
    assert all((r.finish == "length") == (r.tokens == 1000) for r in responses)


def test_azure_prompt_and_response_lengths_come_from_the_source(tmp_path: Path) -> None:
    frame = _azure_file(tmp_path / "az.csv")
    trace = import_azure(tmp_path / "az.csv", ImportConfig(num_steps=16, seed=2), "azure-code")
    prompts = [p.prompt_tokens for s in trace.steps for p in s.prompts]
    assert set(prompts) <= set(frame.ContextTokens.tolist())
    _assert_marginal(trace.response_lengths(), frame.GeneratedTokens.to_numpy())
    _assert_groups(trace)
    assert trace.max_response_tokens == frame.GeneratedTokens.max()
    assert "CC-BY-4.0" in trace.meta["source"]


def test_cli_import_is_seeded_and_records_provenance(tmp_path: Path) -> None:
    _servegen_file(tmp_path / "sg.csv")
    outs = []
    for name, seed in [("a.json", "3"), ("b.json", "3"), ("c.json", "4")]:
        assert (
            main(
                [
                    "import",
                    "servegen",
                    str(tmp_path / "sg.csv"),
                    "--num-steps",
                    "2",
                    "--seed",
                    seed,
                    "--out",
                    str(tmp_path / name),
                ]
            )
            == 0
        )
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]
    trace = load_trace(tmp_path / "a.json")
    assert "alibaba/ServeGen" in trace.meta["source"] and "Apache-2.0" in trace.meta["source"]
    assert trace.meta["importer"]["seed"] == 3 and trace.meta["importer"]["file"] == "sg.csv"


BAD_SOURCES = {
    "missing column": (
        "servegen",
        "s.csv",
        "client_id,window_start_s\n0,0\n",
        [],
        ["missing column 'output_tokens'"],
    ),
    "zero length": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n0,0,5\n0,0,0\n",
        [],
        ["line 3", "'output_tokens'", "got 0"],
    ),
    "string length": (
        "azure-conv",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\nt,5,7\nt,5,many\n",
        [],
        ["line 3", "'GeneratedTokens'", "'many'"],
    ),
    "bad row among those selected: its line in the file": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n0,0,5\n1,0,0\n",
        ["--client-id", "1"],
        ["line 3", "got 0"],
    ),
    "bad row after blank lines: its own line": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n0,0,5\n\n\n0,0,0\n",
        [],
        ["line 5", "got 0"],
    ),
    "no rows selected": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n0,0,5\n",
        ["--client-id", "9"],
        ["no rows with client_id=9"],
    ),
    "azure with client": (
        "azure-code",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\nt,5,7\n",
        ["--client-id", "1"],
        ["client_id"],
    ),
    # accepted, recorded in meta.importer and ignored: Azure's prompts are measured
    "azure with a prompt-length model": (
        "azure-conv",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\nt,5,7\n",
        ["--median-prompt-tokens", "50000"],
        ["median_prompt_tokens and prompt_tokens_sigma draw ServeGen's prompt lengths"],
    ),
    "empty file": ("azure-code", "a.csv", "", [], ["empty file"]),
    # pandas took the first of 4 values for the index and read 500 as a client id, 1 as a length
    "a value more than the header": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n1,0,500,1\n1,0,700,1\n",
        [],
        ["rows with more values than the header has columns"],
    ),
    "a boolean column": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n1,0,True\n1,0,True\n",
        [],
        ["line 2", "got True"],
    ),
    "a fraction, as written": (
        "servegen",
        "s.csv",
        "client_id,window_start_s,output_tokens\n1,0,2.5\n",
        [],
        ["line 2", "got 2.5"],
    ),
}


def test_text_in_a_row_not_selected_does_not_refuse_the_selection(tmp_path: Path) -> None:
    """Client 2's row held 'abc': importing client 1 blamed its valid first row ("line 2:
    expected a positive integer, got '100'"); client 2's import names the real line."""
    text = "client_id,window_start_s,output_tokens\n1,0,100\n1,0,200\n2,0,abc\n1,0,300\n"
    (tmp_path / "s.csv").write_text(text)
    argv = ["import", "servegen", str(tmp_path / "s.csv"), "--num-steps", "1"]
    assert main([*argv, "--client-id", "1", "--out", str(tmp_path / "one.json")]) == 0
    lengths = {r.tokens for s in load_trace(tmp_path / "one.json").steps for p in s.prompts
               for r in p.responses}  # fmt: skip
    assert lengths <= {100, 200, 300}
    with pytest.raises(TraceError, match="line 4: column 'output_tokens'.*'abc'"):
        import_trace("servegen", tmp_path / "s.csv", ImportConfig(client_id=2, num_steps=1))


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_bad_sources_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    kind, name, text, flags, fragments = BAD_SOURCES[case]
    (tmp_path / name).write_text(text)
    assert (
        main(["import", kind, str(tmp_path / name), *flags, "--out", str(tmp_path / "t.json")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "t.json").exists()


def test_missing_source_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            ["import", "servegen", str(tmp_path / "nope.csv.gz"), "--out", str(tmp_path / "t.json")]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope.csv.gz'}: no such file"


# --- the real public data --------------------------------------------------------------------


@pytest.fixture(scope="module")
def servegen_source() -> np.ndarray:
    return pd.read_csv(SERVEGEN)["output_tokens"].to_numpy()


@needs_shared
def test_real_servegen_marginal_and_groups(servegen_source: np.ndarray) -> None:
    trace = import_servegen(SERVEGEN, ImportConfig(num_steps=16, prompts_per_step=32, seed=5))
    _assert_marginal(trace.response_lengths(), servegen_source)
    _assert_groups(trace)
    assert trace.max_response_tokens == 32768


@needs_shared
@pytest.mark.parametrize(
    "name, argv",
    [
        (
            "servegen_r1_rl.json",
            [
                "import",
                "servegen",
                str(SERVEGEN),
                "--num-steps",
                "8",
                "--prompts-per-step",
                "32",
                "--group-size",
                "8",
                "--seed",
                "0",
            ],
        ),
        (
            "azure_conv_rl.json",
            [
                "import",
                "azure-conv",
                str(AZURE_CONV),
                "--num-steps",
                "4",
                "--prompts-per-step",
                "32",
                "--group-size",
                "8",
                "--seed",
                "0",
            ],
        ),
    ],
)
def test_sample_traces_regenerate_byte_for_byte(tmp_path: Path, name: str, argv: list[str]) -> None:
    # The commands documented in traces/README.md.
    assert main([*argv, "--out", str(tmp_path / name)]) == 0
    assert (tmp_path / name).read_bytes() == (REPO / "traces" / name).read_bytes()


def test_a_blank_cell_in_a_row_not_selected_is_not_read(tmp_path: Path) -> None:
    """A blank length makes pandas read the whole column as floats: the selected rows' lengths
    are still counts (every row was refused as "not an integer")."""
    (tmp_path / "s.csv").write_text("client_id,window_start_s,output_tokens\n0,0,5\n0,0,9\n1,0,\n")
    argv = ["import", "servegen", str(tmp_path / "s.csv"), "--client-id", "0", "--num-steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "t.json")]) == 0
    lengths = sorted(
        r.tokens for p in load_trace(tmp_path / "t.json").steps[0].prompts for r in p.responses
    )
    assert set(lengths) <= {5, 9} and lengths
    (tmp_path / "s.csv").write_text("client_id,window_start_s,output_tokens\n0,0,5\n0,0,2.5\n")
    assert main([*argv[:3], "--out", str(tmp_path / "u.json")]) == 2


def test_rows_ending_in_a_comma_keep_their_columns(tmp_path: Path) -> None:
    """A spreadsheet's trailing comma made pandas shift every column (an internal error, or the
    client ids read as lengths)."""
    text = "client_id,window_start_s,output_tokens\n52,0,500,\n52,0,700,\n"
    (tmp_path / "s.csv").write_text(text)
    trace = import_servegen(tmp_path / "s.csv", ImportConfig(num_steps=2, prompts_per_step=1,
                                                             group_size=2))  # fmt: skip
    assert set(trace.response_lengths()) <= {500, 700} and trace.max_response_tokens == 700


def test_a_bad_value_in_a_gzip_or_a_pipe_names_its_place(tmp_path: Path) -> None:
    """The gzip's line was looked up in its compressed bytes read as text ("'utf-8' codec can't
    decode"), a pipe's in a stream already read (an internal IndexError)."""
    import gzip

    text = "client_id,window_start_s,output_tokens\n1,0,5\n\n1,0,-4\n"
    with gzip.open(tmp_path / "s.csv.gz", "wt") as fh:
        fh.write(text)
    with pytest.raises(TraceError, match=r"s\.csv\.gz: line 4: column 'output_tokens'.*got -4$"):
        import_servegen(tmp_path / "s.csv.gz", ImportConfig(num_steps=1))
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    with pytest.raises(TraceError, match=r": row 2: column 'output_tokens'.*got -4$"):
        import_servegen(Path(f"/dev/fd/{read}"), ImportConfig(num_steps=1))
    os.close(read)


def test_out_as_the_source_is_refused_and_the_source_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _servegen_file(tmp_path / "sg.csv")
    before = (tmp_path / "sg.csv").read_bytes()
    out = tmp_path / "x" / ".." / "sg.csv"  # another spelling of the same file
    assert main(["import", "servegen", str(tmp_path / "sg.csv"), "--out", str(out)]) == 2
    assert "is the source file" in capsys.readouterr().err
    assert (tmp_path / "sg.csv").read_bytes() == before


def test_the_cap_is_the_files_maximum_and_a_small_selection_warns(tmp_path: Path) -> None:
    """A selection's own maximum was taken for the cap: client 7 window 21600's longest
    responses were marked as cut at a limit the service never had."""
    source = _servegen_file(tmp_path / "sg.csv")
    cfg = ImportConfig(num_steps=2, client_id=7, window_start_s=21600)
    trace = import_servegen(tmp_path / "sg.csv", cfg)
    assert trace.max_response_tokens == source.max() > max(trace.response_lengths())
    assert not any(r.finish == "length" for s in trace.steps for p in s.prompts
                   for r in p.responses)  # fmt: skip
    text = "client_id,window_start_s,output_tokens\n1,0,531\n2,0,900\n"
    (tmp_path / "one.csv").write_text(text)
    with pytest.warns(InputWarning, match="1 selected rows .* for 256 responses a step"):
        trace = import_servegen(tmp_path / "one.csv", ImportConfig(num_steps=1, client_id=1))
    assert set(trace.response_lengths()) == {531} and trace.max_response_tokens == 900
    # a junk value in a row not selected does not take the file's maximum with it
    (tmp_path / "junk.csv").write_text(text + "3,0,99999999999\n4,0,abc\n")
    with pytest.warns(InputWarning):
        trace = import_servegen(tmp_path / "junk.csv", ImportConfig(num_steps=1, client_id=1))
    assert trace.max_response_tokens == 900
