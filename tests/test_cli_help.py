"""Every option of every ``tltsim`` / ``tltrun`` subcommand reads as documentation: a help line,
a metavar that names the value (N, X, PATH, LIST, the choices) rather than a field path, and
booleans as options (``--spot-training/--no-spot-training``, never ``--is-...``); and the
``tltrun`` command's start (it re-executes itself with ``PYTHONHASHSEED`` pinned).

Run: ``python -m pytest tests/test_cli_help.py -q``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tltrun.cli.main import build_parser as tltrun_parser
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.main import build_parser as tltsim_parser

# What add_dataclass_args appends to a help line; a line of only these says nothing.
GENERATED = re.compile(r"\((default: .*?|comma-separated|required)\)")


def subparsers(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subparsers(sub, f"{path} {name}")


PARSERS = [
    *subparsers(tltsim_parser(), "tltsim"),
    *subparsers(tltrun_parser(), "tltrun"),
]


def test_both_clis_have_their_subcommands():
    names = {path for path, _ in PARSERS}
    for cmd in (
        "replay",
        "sweep",
        "fit",
        "compare",
        "gen",
        "import",
        "validate",
        "report",
        "profile-info",
        "calibrate",
        "advise",
    ):
        assert f"tltsim {cmd}" in names
    for cmd in ("generate", "train-drafter", "bench", "sft", "train", "profile", "report"):
        assert f"tltrun {cmd}" in names


@pytest.mark.parametrize("path,parser", PARSERS, ids=[path for path, _ in PARSERS])
def test_every_option_is_documented(path, parser):
    parser.format_help()  # a stray % in a help line fails here, as `--help` would
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = GENERATED.sub("", action.help or "").strip()
        assert text, f"{path} {name}: no help line"
        for flag in action.option_strings:
            assert not flag.startswith("--is-") and "-is-" not in flag, f"{path} {flag}"
        if not action.option_strings or action.nargs == 0:
            continue  # positionals show their name; switches take no value
        metavar = action.metavar if action.metavar is not None else action.choices
        assert metavar, f"{path} {name}: no metavar (argparse would show {action.dest.upper()})"
        assert "." not in str(metavar), f"{path} {name}: metavar {metavar!r}"
        assert str(metavar) not in (action.dest.upper(), action.dest.upper().replace("_", "-"))


@dataclasses.dataclass(frozen=True)
class _Example:
    is_spot_training: bool = dataclasses.field(default=True, metadata={"help": "train"})
    threshold: int = dataclasses.field(default=32, metadata={"help": "batch"})
    rate: float = dataclasses.field(default=0.5, metadata={"help": "rate"})
    name: str = dataclasses.field(default="a", metadata={"help": "name", "choices": ("a", "b")})
    path: str = dataclasses.field(default="", metadata={"help": "file", "metavar": "PATH"})
    starts: tuple[int, ...] = dataclasses.field(default=(1, 2), metadata={"help": "starts"})


def test_boolean_flags_drop_is_and_map_back_to_the_field():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, _Example, prefix="x-")
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--x-spot-training", "--no-x-spot-training"} <= flags
    assert not any("is-" in f for f in flags)
    args = parser.parse_args(["--no-x-spot-training", "--x-threshold", "8", "--x-starts", "1,4"])
    cfg = dataclass_from_args(_Example, args, prefix="x-")
    assert cfg == _Example(is_spot_training=False, threshold=8, starts=(1, 4))
    assert dataclass_from_args(_Example, parser.parse_args([]), prefix="x-") == _Example()
    metavars = {a.dest: a.metavar for a in parser._actions if a.option_strings and a.nargs != 0}
    assert metavars == {
        "x-threshold": "N",
        "x-rate": "X",
        "x-name": "{a,b}",
        "x-path": "PATH",
        "x-starts": "LIST",
    }


def test_sweep_specs_name_booleans_as_their_flags(tmp_path):
    """``spot_training`` (as --spot-training) is the documented key; ``is_spot_training`` still
    works and gives the same point; both at once is an error."""
    from tltsim.errors import UsageError
    from tltsim.sim.sweep import load_spec, point_key, settings_of, spec_points

    def spec(fixed: str):
        path = tmp_path / "spec.toml"
        path.write_text(f'trace = "t.json"\n[fixed]\npolicy = "tlt"\n{fixed}\n')
        return load_spec(path)

    new = spec("spot_training = false\ntimeline_recorded = false")
    old = spec("is_spot_training = false\nis_timeline_recorded = false")
    assert spec_points(new) == spec_points(old)
    assert [point_key(p) for p in spec_points(new)] == [point_key(p) for p in spec_points(old)]
    settings = settings_of(spec_points(new)[0], seed=0)
    assert not settings.is_spot_training and not settings.sim.is_timeline_recorded
    with pytest.raises(UsageError, match="name the same setting"):
        spec("spot_training = false\nis_spot_training = true")


@pytest.mark.parametrize("package", ["tltsim", "tltrun"])
def test_python_dash_m_runs_the_command(package):
    """``python -m tltrun`` (what ``torchrun -m tltrun train`` runs) is the tltrun command."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {package}"), done.stderr


def test_the_command_pins_the_hash_seed_unless_the_user_set_one():
    """Some reasoning-gym tasks generate other problems under another hash seed: the command
    re-executes itself with PYTHONHASHSEED pinned (its workers and reward processes inherit it);
    a seed the user set is kept."""
    import os

    code = (
        "import os, sys; from tltrun.cli.main import main; "
        "print('seed', os.environ.get('PYTHONHASHSEED'), hash('tlt'), flush=True); "
        "sys.argv = ['tltrun', '--help']; main()"
    )

    def seeds(**env) -> list[list[str]]:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                             capture_output=True, text=True, check=False)  # fmt: skip
        assert out.returncode == 0 and "usage: tltrun" in out.stdout, out.stderr
        return [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("seed ")]

    first, second = seeds(), seeds(PYTHONHASHSEED="random")
    # unset (or 'random'): a second start, pinned, and the same hash each time
    assert [s[0] for s in first] == ["None", "0"] and [s[0] for s in second] == ["random", "0"]
    assert first[1] == second[1]
    assert seeds(PYTHONHASHSEED="7") == [["7", seeds(PYTHONHASHSEED="7")[0][1]]]


def test_a_value_starting_with_minus_says_how_to_write_it(monkeypatch, capsys):
    """argparse reads ``-8,16`` (not a plain negative number) as a flag and said only "expected
    one argument"; where a word starts with '-' and a digit, the line says ``--flag=VALUE``."""
    parser = tltsim_parser()
    monkeypatch.setattr(sys, "argv", ["pytest", "-1"])  # the words parsed count, not these
    for argv, is_hinted in (
        (["gen", "--num-steps", "-1,2"], True),
        (["gen", "--num-steps"], False),
    ):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "expected one argument" in err
        assert ("--flag=VALUE" in err) is is_hinted


@pytest.mark.parametrize(
    ("build", "argv", "expected"),
    [
        (tltsim_parser, ["advise", "t.json", "--hardwarefile", "h.json"],
         "error: tltsim advise: unrecognized arguments: --hardwarefile h.json (did you mean "
         "--hardware-file?) (see tltsim advise --help)"),
        (tltsim_parser, ["advise", "t.json", "--hardware-f", "h.json"],  # no prefix match:
         "error: tltsim advise: unrecognized arguments: --hardware-f h.json (did you mean "
         "--hardware-file?) (see tltsim advise --help)"),  # the one flag it begins
        (tltsim_parser, ["replay", "t.json", "--polcy=all"],
         "error: tltsim replay: unrecognized arguments: --polcy=all (did you mean --policy?) "
         "(see tltsim replay --help)"),
        (tltsim_parser, ["replay", "t.json", "--bogus"],
         "error: tltsim replay: unrecognized arguments: --bogus (see tltsim replay --help)"),
        (tltrun_parser, ["train", "--model-d", "m"],
         "error: tltrun train: unrecognized arguments: --model-d m (did you mean --model-dir?) "
         "(see tltrun train --help)"),
    ],
)  # fmt: skip
def test_a_flag_is_spelt_in_full_and_a_misspelt_one_gets_the_subcommands_closest(
    build, argv, expected, capsys
):
    """Hunt: argparse took ``advise --hardware H100-SXM`` for ``--hardware-file`` and answered
    about a preset file; an unknown flag pointed at the top command's --help, which lists none."""
    with pytest.raises(SystemExit) as stop:
        build().parse_args(argv)
    assert stop.value.code == 2 and capsys.readouterr().err == expected + "\n"


def test_a_bad_value_is_named_by_the_flag_that_set_it(tmp_path, capsys):
    """Hunt: ``--eval-split 1.5`` said "TrainConfig: eval_split must be in [0, 1)", the field
    a user never typed; a --config file's key keeps its name (test_train_inputs)."""
    from tltrun.cli.main import main as tltrun_main
    from tltsim.cli.main import main as tltsim_main

    argv = ["train", "--model-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    assert tltrun_main([*argv, "--eval-split", "1.5"]) == 2
    assert capsys.readouterr().err == "error: --eval-split must be in [0, 1), got 1.5\n"
    assert tltrun_main([*argv, "--tlt-threshold", "0"]) == 2  # a TLTConfig field of TrainConfig
    # (it said "--tlt-threshold, warmup_checks and window must be ...": two fields tltrun
    # train has no flags for)
    assert capsys.readouterr().err == "error: --tlt-threshold must be >= 1, got 0\n"
    trace = str(Path(__file__).parents[1] / "traces" / "synth_reasoning_rl.json")
    assert tltsim_main(["replay", trace, "--tlt-threshold", "0"]) == 2
    assert capsys.readouterr().err == "error: --tlt-threshold must be >= 1, got 0\n"
    assert tltsim_main(["replay", trace, "--tlt-window", "0"]) == 2
    assert capsys.readouterr().err == "error: --tlt-window must be >= 1, got 0\n"
    # a user's value is not a field (review: "got '--seed'"); a field name in the prose after
    # the verb stays a word; the message's subject is its flag even where it is a plain word
    assert tltrun_main([*argv, "--policy", "seed"]) == 2
    assert capsys.readouterr().err == (
        "error: --policy must be one of ('nospec', 'static', 'tlt', 'tltbase'), got 'seed'\n"
    )
    flags = ["--tlt-drafters", "eagle,history", "--tlt-history-strategies", "off"]
    assert tltsim_main(["replay", trace, *flags]) == 2
    assert capsys.readouterr().err == (
        "error: --tlt-history-strategies must be strategies without a drafter name, 'off' "
        "excluded, got ('off',)\n"
    )
