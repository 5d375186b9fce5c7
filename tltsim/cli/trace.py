"""``tltsim gen``, ``tltsim validate`` and ``tltsim import``: make and check ``tlt-trace`` files.

    tltsim gen --num-steps 8 --prompts-per-step 64 --seed 0 --out traces/synth.json
    tltsim validate traces/synth.json
    tltsim import servegen /work/shared/traces/servegen_deepseek_r1_output_tokens.csv.gz --out t.json

``tltsim.cli.main`` calls ``register``. Flags of ``gen`` and ``import`` are generated from
``GenConfig`` and ``ImportConfig``; the resolved config is stored in the trace's ``meta``.
Errors are ``TraceError`` or ``UsageError`` (one line; ``tltsim.cli.main.main`` exits 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from tltsim.cli.args import add_dataclass_args, check_out_file, dataclass_from_args
from tltsim.errors import UsageError
from tltsim.trace.files import load_trace, save_trace
from tltsim.trace.importers import KINDS, ImportConfig, import_trace
from tltsim.trace.schema import FORMAT as TRACE_FORMAT
from tltsim.trace.schema import SUFFIXES, Trace, TraceError
from tltsim.trace.synth import GenConfig, generate


def summary_line(trace: Trace, name: str) -> str:
    """``FILE: 8 steps, 512 prompts, 4096 responses; response tokens median/p99/max ...``"""
    s = trace.summary()
    cap = s["max_response_tokens"]
    # "length" also ends a response at its own token limit below the cap (tltrun's replays
    # of a trace's lengths): the line said all of them "finished at the cap"
    at_cap = (
        sum(r.tokens >= cap for st in trace.steps for p in st.prompts for r in p.responses)
        if cap is not None
        else 0
    )
    if cap is not None:
        capped = f", {s['num_truncated']} ended by length ({at_cap} at the cap of {cap})"
    elif s["num_truncated"]:  # a trace without a cap in its meta (tltrun generate's)
        capped = f", {s['num_truncated']} ended by length"
    else:
        capped = ""
    return (
        f"{name}: {s['num_steps']} steps, {s['num_prompts']} prompts, {s['num_responses']} responses; "
        f"response tokens median {s['median_tokens']:g} / p99 {s['p99_tokens']:.0f} / max {s['max_tokens']}"
        f" (total {s['total_response_tokens']}){capped}"
    )


def _check_out(path: Path) -> None:
    if not path.name.lower().endswith(SUFFIXES):
        raise UsageError(f"--out {path}: expected a file name ending in {', '.join(SUFFIXES)}")
    # a .json of another format (a hardware preset, a replay's summary.json) is not replaced
    check_out_file(path, file_format=TRACE_FORMAT if path.suffix.lower() == ".json" else None)


def _cmd_gen(args: argparse.Namespace) -> int:
    _check_out(args.out)
    cfg = dataclass_from_args(GenConfig, args)
    trace = generate(cfg)
    save_trace(trace, args.out)
    print("wrote " + summary_line(trace, str(args.out)))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    trace = load_trace(args.file)
    print(summary_line(trace, str(args.file)))
    return 0


def _save_imported(out: Path, what: str, build: Callable[[], Trace]) -> int:
    """Build a trace (an importer's ValueError is one ``what: ...`` line) and write it."""
    try:
        trace = build()
    except ValueError as err:
        if isinstance(err, TraceError):
            raise
        raise UsageError(f"{what}: {err}") from None
    save_trace(trace, out)
    print("wrote " + summary_line(trace, str(out)))
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    _check_out(args.out)
    if args.out.resolve() == args.src.resolve():  # the trace replaced the source, then failed
        raise UsageError(f"--out {args.out}: is the source file; write the trace elsewhere")
    cfg = dataclass_from_args(ImportConfig, args)
    return _save_imported(
        args.out, f"import {args.kind}", lambda: import_trace(args.kind, args.src, cfg)
    )


def _cmd_import_verl(args: argparse.Namespace) -> int:
    from tltsim.trace.verl import VerlImportConfig, import_verl

    _check_out(args.out)
    base = VerlImportConfig(tokenizer=args.tokenizer)
    cfg = dataclass_from_args(VerlImportConfig, args, base=base)
    return _save_imported(args.out, "import-verl", lambda: import_verl(args.dir, cfg))


def _add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, required=True, metavar="PATH",
        help=f"output file ({', '.join(SUFFIXES)})",
    )  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gen``, ``validate``, ``import`` and ``import-verl`` to the ``tltsim`` command
    line."""
    gen = subparsers.add_parser(
        "gen",
        help="generate a synthetic long-tail trace",
        description="Generate a synthetic reasoning-RL trace (model: tltsim/trace/synth.py docstring).",
    )
    add_dataclass_args(gen, GenConfig)
    _add_out(gen)
    gen.set_defaults(func=_cmd_gen)

    validate = subparsers.add_parser(
        "validate",
        help="check a trace file and print a one-line summary",
        description="Load and validate a tlt-trace file; print steps, prompts, responses, length median/p99/max.",
    )
    validate.add_argument("file", type=Path, help=f"trace file ({', '.join(SUFFIXES)})")
    validate.set_defaults(func=_cmd_validate)

    imp = subparsers.add_parser(
        "import",
        help="build an RL-step trace from public request-length data",
        description="Turn request lengths (ServeGen R1, Azure 2023) into RL steps of prompts x group_size; "
        "how groups are formed: tltsim/trace/importers.py docstring and traces/README.md.",
    )
    imp.add_argument("kind", choices=KINDS, help="source format")
    imp.add_argument("src", type=Path, help="source file (see /work/shared/traces/README.md)")
    add_dataclass_args(imp, ImportConfig)
    _add_out(imp)
    imp.set_defaults(func=_cmd_import)

    from tltsim.trace import verl

    verl_parser = subparsers.add_parser(
        "import-verl",
        help="build a trace of your own veRL run from its rollout dumps",
        description=verl.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verl_parser.add_argument(
        "dir", type=Path, help="veRL's trainer.rollout_data_dir (one STEP.jsonl per step)"
    )
    verl_parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="the model's tokenizer.json, or the model directory holding it",
    )
    add_dataclass_args(verl_parser, verl.VerlImportConfig, skip=("tokenizer",))
    _add_out(verl_parser)
    verl_parser.set_defaults(func=_cmd_import_verl)
