"""Flags shared by ``tltrun`` subcommands that run the torch engine (``generate``, ``bench``).

``add_engine_args`` adds one flag per ``EngineConfig`` field (all but ``sampling``, which
``SamplingParams``' flags ``--temperature --top-p --top-k`` build, and ``cuda_graphs``, which
``--eager`` turns off); ``engine_config_from_args``
builds the config back, with ``engine_defaults`` for the sizes a user need not pass by hand.
``config_dict`` is what every output directory's ``config.json`` holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import SamplingParams
from tltrun.train.config_checks import absolute_paths
from tltsim.cli.args import add_dataclass_args, dataclass_from_args, stop_in
from tltsim.errors import StoppedError, UsageError

# cuda_graphs is set by --eager (below): a user turns capture off, never on where it cannot run;
# is_harvesting keeps each response's hidden states for tltrun train's spot trainers (generate
# and bench would only pile them up in memory)
ENGINE_SKIP = ("sampling", "cuda_graphs", "is_harvesting")
# The most requests `generate` and `bench` decode together when --max-running-requests is not
# given: vLLM's own default max_num_seqs (as tltrun.rollout.vllm_backend.VLLMBackendConfig).
DEFAULT_MAX_RUNNING_REQUESTS = 256


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, SamplingParams)
    add_dataclass_args(parser, EngineConfig, skip=ENGINE_SKIP)
    parser.add_argument(
        "--eager",
        action="store_true",
        default=None,
        help="run every forward eagerly: no CUDA-graph pool (EngineConfig.cuda_graphs; "
        "default: graphs on CUDA, eager on CPU)",
    )


def engine_defaults(model_dir: str, num_requests: int, max_request_tokens: int) -> dict[str, Any]:
    """``max_running_requests``, ``max_model_len`` and the stop ids of generation_config.json
    for a rollout of ``num_requests`` requests, the longest ``max_request_tokens`` (prompt +
    max new tokens) long: all of them at once up to
    DEFAULT_MAX_RUNNING_REQUESTS, and the longest request up to the model's
    max_position_embeddings (config.json). The KV cache is preallocated for both, so neither is
    larger than the rollout needs; a request longer than the model's context then fails with
    the engine's max_model_len error, which --max-model-len overrides."""
    from tltrun.data.tokenizer import TokenizerError, generation_eos_ids
    from tltrun.model.config import CheckpointError, read_config

    try:
        max_positions = read_config(model_dir).max_position_embeddings
        # stop ids only generation_config.json lists (Llama-3-Instruct's <|eot_id|>): a
        # response ran past the end of its turn to the token cap
        eos = generation_eos_ids(model_dir)
    except (CheckpointError, TokenizerError) as err:
        raise UsageError(str(err)) from None
    return {
        "max_running_requests": max(1, min(num_requests, DEFAULT_MAX_RUNNING_REQUESTS)),
        "max_model_len": max(2, min(max_request_tokens, max_positions)),
        "eos_token_ids": eos,
    }


def engine_config_from_args(
    args: argparse.Namespace, defaults: dict[str, Any] | None = None, **fixed: Any
) -> EngineConfig:
    """EngineConfig from the flags; ``defaults`` fill fields whose flag was not given (and that
    the dataclass cannot default: ``engine_defaults``), ``fixed`` overrides the flags."""
    values = dict(defaults or {})
    default_eos = tuple(values.get("eos_token_ids", ()))
    values.update(
        (f.name, getattr(args, f.name))
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ENGINE_SKIP and getattr(args, f.name, None) is not None
    )
    for name in ("eos_token_ids", "graph_batch_sizes"):  # EngineConfig's int tuples
        if isinstance(values.get(name), str):
            try:
                text = values[name]  # (an empty item is refused: 1,,2)
                values[name] = tuple(int(x) for x in text.split(",")) if text else ()
            except ValueError:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag}: expected comma-separated integers") from None
    # --eos-token-ids adds stop ids to generation_config.json's (engine_defaults), not instead
    values["eos_token_ids"] = tuple(dict.fromkeys((*default_eos, *values.get("eos_token_ids", ()))))
    if getattr(args, "eager", None):
        values["cuda_graphs"] = False
    values.update(fixed)
    try:
        cfg = EngineConfig(sampling=dataclass_from_args(SamplingParams, args), **values)
    except TypeError as err:
        missing = str(err).split("argument")[-1].strip(": ")
        raise UsageError(
            f"EngineConfig: missing required flag(s) {missing.replace('_', '-')}"
        ) from None
    except ValueError as err:
        raise UsageError(f"EngineConfig: {err}") from None
    check_triton_impls(
        cfg.device, cfg.dtype_name, attn_impl=cfg.attn_impl, verify_impl=cfg.verify_impl
    )
    if cfg.graph_batch_sizes and not cfg.is_using_graphs:  # (it was accepted and ignored)
        raise UsageError(
            f"--graph-batch-sizes: no CUDA-graph pool runs here (device {cfg.device}, attention "
            f"{cfg.attention}{', --eager' if cfg.cuda_graphs is False else ''}); drop it"
        )
    return cfg


# EngineConfig fields only the torch engine reads (tltrun.rollout.bench maps the others onto
# vLLM's settings), with --eager for cuda_graphs
TORCH_ONLY_FIELDS = (
    "attn_impl", "compile_layers", "fuse_projections", "graph_batch_sizes", "verify_impl",
    "catchup_pairs", "max_verify_tokens", "history_max_tokens", "is_history_cross_prompt",
    "history_shared_max_tokens", "eager",
)  # fmt: skip


def check_torch_only_flags(args: argparse.Namespace, backends: tuple[str, ...]) -> None:
    """Refuse torch-engine flags where no torch row runs (``--backend vllm``): vLLM was given
    neither, and nothing said so."""
    if "torch" in backends:
        return
    given = [n for n in TORCH_ONLY_FIELDS if getattr(args, n, None) is not None]
    if given:
        flags = ", ".join("--" + n.removeprefix("is_").replace("_", "-") for n in given)
        raise UsageError(
            f"{flags}: settings of the torch engine, which --backend {','.join(backends)} does "
            "not run; drop them"
        )


def check_triton_impls(device: str, dtype: str, **impls: str | None) -> None:
    """A Triton implementation asked for where Triton cannot run (a CPU without its
    interpreter; tree attention in bf16 under the interpreter) is one UsageError naming the
    flag, before a model is loaded. ``dtype``: the engine's (``EngineConfig.dtype_name``)."""
    import torch

    from kernels.spec_verify import triton_runnable_on
    from tltrun.rollout.engine_config import DTYPES

    for name, impl in impls.items():
        if impl != "triton":
            continue
        dot_dtype = DTYPES.get(dtype) if name == "attn_impl" else None  # verify runs in fp32
        is_ok, why = triton_runnable_on(torch.device(device), dot_dtype)
        if not is_ok:
            raise UsageError(f"--{name.replace('_', '-')} triton: {why}")


def check_kv_cache_fits(model_dir: str, engine_cfg: EngineConfig) -> None:
    """Refuse sizes whose preallocated KV cache (K and V: layers x max_running_requests x KV
    heads x max_model_len x head_dim) exceeds the device's memory, before allocating it:
    ``--max-running-requests 10^12`` was an allocator traceback, and on Linux a size just
    below the limit can be granted lazily and then kill the machine's other processes."""
    import torch

    from tltrun.model.config import CheckpointError, read_config
    from tltrun.rollout.engine_config import DTYPES

    try:
        model = read_config(model_dir)
    except CheckpointError as err:
        raise UsageError(str(err)) from None
    element_bytes = torch.empty((), dtype=DTYPES[engine_cfg.dtype_name]).element_size()
    need = (
        2
        * model.num_hidden_layers
        * engine_cfg.max_running_requests
        * model.num_key_value_heads
        * engine_cfg.max_model_len
        * model.head_dim
        * element_bytes
    )
    device = torch.device(engine_cfg.device)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[1]
    else:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise UsageError(
            f"--max-running-requests {engine_cfg.max_running_requests} x --max-model-len "
            f"{engine_cfg.max_model_len}: the KV cache needs {need / 2**30:,.1f} GiB, more than "
            f"the {have / 2**30:,.1f} GiB of {device.type} memory"
        )


def config_dict(**configs: Any) -> dict[str, Any]:
    return {name: dataclasses.asdict(c) for name, c in configs.items()}


def run_config_dict(*, engine: EngineConfig, **configs: Any) -> dict[str, Any]:
    """``config_dict`` of a generate / bench run, with the engine settings its device decided
    (``resolved``: the dtype and attention that ran where the flags left them to the default)."""
    resolved = {"dtype": engine.dtype_name, "attn_impl": engine.attention}
    return {**config_dict(**configs, engine=engine), "resolved": resolved}


def offline_configs_from_args(
    args: argparse.Namespace,
    sections: dict[str, tuple[type, str]],
    *,
    command: str,
    config_file: str,
    finished_file: str,
) -> dict[str, Any] | None:
    """The configs of ``tltrun sft`` / ``train-drafter`` (section name -> (dataclass, flag
    prefix)): from the flags, or with ``--resume`` the run's recorded ones with the flags applied,
    refused where they change the run (``tltrun.train.resumable``). None: ``--resume`` of a run
    that finished (the caller says so)."""
    from tltrun.train import resumable

    if not args.resume:
        return {name: absolute_paths(dataclass_from_args(cls, args, prefix=prefix))
                for name, (cls, prefix) in sections.items()}  # fmt: skip
    classes = {name: cls for name, (cls, _) in sections.items()}
    recorded = resumable.configs_to_resume(args.out, command, config_file, finished_file, classes)
    if recorded is None:
        return None
    given = {name: absolute_paths(dataclass_from_args(cls, args, prefix=prefix, base=recorded[name]))
             for name, (cls, prefix) in sections.items()}  # fmt: skip
    # (a run recorded relative paths before session 35: compared as they resolve from here)
    recorded = {name: absolute_paths(cfg) for name, cfg in recorded.items()}
    resumable.refuse_changes(Path(args.out) / config_file, recorded, given)
    return given


def _typed_flag(dest: str, value: Any) -> str:
    """The flag the user typed for ``dest`` (``flag_name``'s form: a boolean without its
    ``is_``, and ``--no-`` where it was turned off)."""
    if isinstance(value, bool):
        head, _, name = dest.rpartition("-")
        dest = f"{head}-{name.removeprefix('is_')}" if head else name.removeprefix("is_")
        return ("--" if value else "--no-") + dest.replace("_", "-")
    return "--" + dest.replace("_", "-")


def recorded_engine_run(
    args: argparse.Namespace, *, command: str, section: str, cls: type, finished_file: str
) -> tuple[Any, EngineConfig] | None:
    """``--resume`` of ``tltrun generate`` / ``bench``: the run's ``OUT/config.json`` (its
    ``section`` as ``cls``, and its engine config); no other flag is taken, so the run continues
    as it started. None: the run finished (``OUT/finished_file`` is written; the caller says so)."""
    from tltsim.jsonio import read_json, typed_fields

    given = sorted(
        _typed_flag(k, v)
        for k, v in vars(args).items()
        if v is not None and k not in ("out", "resume", "func", "command")
    )
    if given:
        raise UsageError(
            f"--resume continues with the run's recorded settings (OUT/config.json); "
            f"drop {', '.join(given)}"
        )
    if not args.out:
        raise UsageError("--resume needs --out, the directory of the run to continue")
    out = Path(args.out)
    if (out / finished_file).is_file():
        return None
    path = out / "config.json"
    if not path.is_file():
        raise UsageError(f"{out}: no config.json of a {command} run to resume")
    raw = read_json(path, "recorded run config")
    try:
        engine = dict(raw["engine"])
        sampling = SamplingParams(**typed_fields(SamplingParams, engine.pop("sampling"), str(path)))
        return (
            cls(**typed_fields(cls, raw[section], f"{path} [{section}]")),
            EngineConfig(
                sampling=sampling, **typed_fields(EngineConfig, engine, f"{path} [engine]")
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UsageError(f"{path}: not a {command} config ({type(err).__name__}: {err})") from None


def weights_digests(model: str, drafter: str | None) -> dict[str, str]:
    """sha256 of a run's target (and drafter) checkpoint, recorded in its config.json: its
    ``--resume`` refuses other weights (``check_same_weights``)."""
    from tltrun.model.hf_checkpoint import checkpoint_digest

    digests = {"model_sha256": checkpoint_digest(model)}
    if drafter:
        digests["drafter_sha256"] = checkpoint_digest(drafter)
    return digests


def check_same_weights(out: Path, model: str, drafter: str | None) -> None:
    """A resume whose --model or --drafter directory holds other weights than the run started
    with (hunt: ``generate --resume`` wrote 76 responses of new weights after 20 of the old,
    unsaid); runs recorded before the digests resume unchecked."""
    from tltrun.model.hf_checkpoint import checkpoint_digest
    from tltsim.jsonio import read_json

    recorded = read_json(out / "config.json", "recorded run config")
    for key, flag, path in (
        ("model_sha256", "--model", model),
        ("drafter_sha256", "--drafter", drafter),
    ):
        if key not in recorded or not path:
            continue
        try:
            now = checkpoint_digest(path)
        except OSError as err:
            raise UsageError(f"{flag} {path}: cannot be read ({err.strerror or err})") from None
        if now != recorded[key]:
            raise UsageError(
                f"{flag} {path}: its config.json or weights changed since the run in {out} "
                "started (another sha256 than its config.json records); its finished responses "
                "came from the old ones: restore them, or start a new run in another --out"
            )


@contextmanager
def stop_says_how_to_resume(
    out: Path, command: str, is_resumable_anytime: bool = False
) -> Iterator[None]:
    """Ctrl-C or SIGTERM (``run_command(..., is_sigterm_handled=True)``) during an offline run
    ends as one line saying how to continue: from its last resumable state with ``--resume``,
    or, stopped before its first, by starting again. ``is_resumable_anytime``: generate and
    bench, which resume from the rows they wrote whenever they stop (their stop said nothing of
    --resume)."""
    from tltrun.train.resumable import STATE_FILE

    try:
        yield
    except BaseException as err:
        err = stop_in(err)  # also one a clean-up raised over (torch.save's writer)
        if err is None:
            raise
        how, code = ("interrupted", 130) if isinstance(err, KeyboardInterrupt) else (
            "stopped by SIGTERM", 143)  # fmt: skip
        if is_resumable_anytime:
            then = f"continue with {command} --out {out} --resume"
        elif (out / STATE_FILE).is_file():
            then = f"continue from its last state with {command} --out {out} --resume"
        else:
            then = "it wrote no resumable state yet (--checkpoint-every); start it again"
        raise StoppedError(f"{out}: {how}; {then}", code) from None
