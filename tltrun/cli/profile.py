"""``tltrun profile``: time one engine iteration over a grid; write a ``tlt-profile`` CSV.

    tltrun profile --model runs/m/target --drafter runs/m/drafter --out profiles/cpu_torch.csv
    tltsim profile-info profiles/cpu_torch.csv

What is timed and how: ``tltrun.profile.measure``'s docstring. Flags map 1:1 onto
``ProfileRunConfig``.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import threading
import time
import warnings
from pathlib import Path

from tltrun.cli.args import check_kv_cache_fits, check_triton_impls
from tltrun.profile import measure
from tltsim.cli.args import add_dataclass_args, check_out_file, dataclass_from_args
from tltsim.cost.profile import FORMAT as PROFILE_FORMAT
from tltsim.errors import InputWarning, UsageError


def cmd_profile(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(measure.ProfileRunConfig, args)
    check_out_file(cfg.out, file_format=PROFILE_FORMAT)
    # the sidecar is written beside it (a directory there lost the measured run at its write)
    check_out_file(
        Path(cfg.out).with_suffix(".json"),
        flag=f"--out {cfg.out}: its sidecar",
        file_format=PROFILE_FORMAT,
    )
    _check_model_fits(cfg)
    if cfg.backend == "torch":
        check_triton_impls(cfg.device, cfg.dtype_name, attn_impl=cfg.attn_impl)
        from tltrun.profile.torch_engine import engine_config

        engine = engine_config(cfg, cfg.decisions if cfg.drafter else [])
        try:  # before it is allocated: the grid's largest batch at its longest context
            check_kv_cache_fits(cfg.model, engine)
        except UsageError as err:
            need = str(err).partition(": ")[2]
            raise UsageError(
                f"--batches / --prefill-batches up to {engine.max_running_requests} sequences of "
                f"up to {engine.max_model_len} tokens: {need}"
            ) from None
    # an earlier profile in --out goes now (its own kind: check_out_file): one killed before
    # its first round left the earlier run's files there, unmarked, as if this run's
    for path in (Path(cfg.out), Path(cfg.out).with_suffix(".json")):
        path.unlink(missing_ok=True)
    start = time.perf_counter()
    # SIGTERM (what `timeout` and job schedulers send) ends the profile as Ctrl-C does: the
    # completed rounds are written (measure.run_profile) instead of lost
    is_main = threading.current_thread() is threading.main_thread()  # where handlers may go
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if is_main else None
    try:
        rows = measure.run_profile(cfg, datetime.datetime.now(datetime.UTC))
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)
    ops = sorted({r.op for r in rows})
    print(
        f"{len(rows)} points ({', '.join(ops)}) measured in {time.perf_counter() - start:.0f} s; "
        f"wrote {cfg.out} and {Path(cfg.out).with_suffix('.json')}"
    )
    return 0


def _check_model_fits(cfg: measure.ProfileRunConfig) -> None:
    """A device this machine has, and strategies the model can draft: a top-k wider than its
    vocabulary was an internal error once the model had loaded."""
    from tltrun.model.config import CheckpointError, check_device, read_config

    try:
        check_device(cfg.device)  # before the engine config built from it checks it
        config = read_config(cfg.model)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    vocab = config.vocab_size
    if max(cfg.context_per_seq) > config.max_position_embeddings:
        warnings.warn(
            f"--context-per-seq {max(cfg.context_per_seq)}: beyond {cfg.model}'s "
            f"max_position_embeddings ({config.max_position_embeddings}); timed all the same, "
            "but no rollout of this model reaches it",
            InputWarning,
            stacklevel=2,
        )
    wide = [d.strategy for d in cfg.decisions if d.topk > vocab] if cfg.drafter else []
    if wide:
        raise UsageError(
            f"--strategies {','.join(wide)}: drafts the top {max(d.topk for d in cfg.decisions)} "
            f"tokens of {cfg.model}'s vocabulary of {vocab}"
        )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun profile``."""
    p = subparsers.add_parser(
        "profile",
        help="measure the engine's per-iteration costs over a grid; write a tlt-profile CSV",
        description=measure.__doc__.split("\n\n")[0],
    )
    add_dataclass_args(p, measure.ProfileRunConfig)
    p.set_defaults(func=cmd_profile)
