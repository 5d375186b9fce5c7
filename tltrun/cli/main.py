"""``tltrun``: the runtime's command line.

    tltrun generate --model DIR --prompts FILE.jsonl --out DIR [--drafter DIR] [--policy tlt]
    tltrun train-drafter --model DIR --data DIR/generations.jsonl --out DIR [--num-steps N]
    tltrun bench --trace T --policy nospec,static,tlt --model DIR --drafter DIR --out DIR
    tltrun sft --out DIR                       (tltrun.train.sft: the built-in task's starting policy)

Flags map 1:1 onto config dataclasses: the subcommand's own (``GenerateConfig``,
``TrainDrafterConfig``, ``tltrun.rollout.bench.BenchConfig``), ``EngineConfig`` (all fields but
``sampling``, which ``SamplingParams``' flags ``--temperature --top-p --top-k`` build) and
``DrafterTrainConfig``. Every output directory gets the resolved ``config.json``.

Prompt file (JSONL, one object per line): ``{"id": "p0", "prompt_token_ids": [...]}`` or
``{"id": "p0", "prompt": "text"}`` (needs the character tokenizer of ``tltrun.model.tokenizer`` in the
model directory), optionally ``"max_new_tokens": N``. ``generate`` writes
``generations.jsonl`` (the input of ``train-drafter``), ``trace.json`` (a measured tlt-trace
step) and ``config.json``.

Bad input (missing file, bad model directory, missing field) prints one ``error:`` line and
exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tltrun.rollout.engine import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltsim.cli.args import UsageError, add_dataclass_args, dataclass_from_args, write_json


@dataclass(frozen=True)
class GenerateConfig:
    model: str = ""  # Hugging Face model directory (required)
    prompts: str = ""  # JSONL prompt file (required)
    out: str = ""  # output directory (required)
    drafter: str = ""  # exported drafter directory (needed by SD policies)
    policy: str = "nospec"  # nospec | static | tlt (tltsim.policy.make_policy)
    strategy: str = "8_4_32"  # static policy's strategy (tltsim StaticSpec's default)
    max_new_tokens: int | None = None  # for prompts without their own max_new_tokens
    group_size: int = 1  # responses per prompt (request ids "prompt_id/i")
    step: int = 0  # RL step recorded in the trace

    def __post_init__(self) -> None:
        for name in ("model", "prompts", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.group_size < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError("group_size and max_new_tokens must be >= 1")


@dataclass(frozen=True)
class TrainDrafterConfig:
    model: str = ""  # target model directory (required)
    data: str = ""  # generations.jsonl written by `tltrun generate` (required)
    out: str = ""  # output directory for the exported drafter (required)
    init: str = ""  # start from this drafter instead of a fresh one
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("model", "data", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")


# ---------------------------------------------------------------------------------------------
# Flags of EngineConfig (its nested ``sampling`` comes from SamplingParams' own flags)
# ---------------------------------------------------------------------------------------------

ENGINE_SKIP = ("sampling",)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, SamplingParams)
    group = parser.add_argument_group("EngineConfig")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        helptext = f"(default: {default})" if default is not None else "(required)"
        if hints[f.name] is bool:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=helptext,
            )
        else:
            group.add_argument(flag, dest=f.name, type=hints[f.name], default=None, help=helptext)


def engine_config_from_args(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ENGINE_SKIP and getattr(args, f.name, None) is not None
    }
    values.update(fixed)
    try:
        return EngineConfig(sampling=dataclass_from_args(SamplingParams, args), **values)
    except TypeError as err:
        missing = str(err).split("argument")[-1].strip(": ")
        raise UsageError(
            f"EngineConfig: missing required flag(s) {missing.replace('_', '-')}"
        ) from None
    except ValueError as err:
        raise UsageError(f"EngineConfig: {err}") from None


def config_dict(**configs: Any) -> dict[str, Any]:
    return {name: dataclasses.asdict(c) for name, c in configs.items()}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_target(model_dir: str, device: str, dtype: str):
    from tltrun.rollout.engine import DTYPES
    from tltrun.model.transformer import CheckpointError, load_hf

    try:
        return load_hf(model_dir, dtype=DTYPES[dtype], device=device)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def load_drafter_dir(drafter_dir: str, target):
    from tltrun.model.drafter import load_drafter
    from tltrun.model.transformer import CheckpointError

    try:
        return load_drafter(drafter_dir, target)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def read_prompts(path: str, model_dir: str, cfg: GenerateConfig) -> tuple[list[Request], Any]:
    """Requests (``group_size`` per prompt line) and the tokenizer if text prompts were used."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--prompts {path}: no such file")
    tokenizer = None
    requests = []
    for lineno, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise UsageError(f"{where}: expected an object with an 'id' field")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise UsageError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
        elif "prompt" in obj:
            tokenizer = tokenizer or _load_tokenizer(model_dir)
            ids = tokenizer.encode(str(obj["prompt"]), add_bos=True)
        else:
            raise UsageError(f"{where}: needs 'prompt_token_ids' or 'prompt'")
        max_new = obj.get("max_new_tokens", cfg.max_new_tokens)
        if not isinstance(max_new, int) or max_new < 1:
            raise UsageError(f"{where}: no valid 'max_new_tokens' (and no --max-new-tokens given)")
        for i in range(cfg.group_size):
            requests.append(Request(f"{obj['id']}/{i}", tuple(ids), max_new))
    if not requests:
        raise UsageError(f"--prompts {path}: no prompts")
    return requests, tokenizer


def _load_tokenizer(model_dir: str):
    from tltrun.model.tokenizer import CharTokenizer

    try:
        return CharTokenizer.load(model_dir)
    except (ValueError, OSError) as err:
        raise UsageError(f"text prompts need the model's character tokenizer: {err}") from None


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.measured_trace import hardware_name, measured_step
    from tltsim.policy import make_policy
    from tltsim.trace.schema import Trace, save_trace

    cfg = dataclass_from_args(GenerateConfig, args)
    engine_cfg = engine_config_from_args(args)
    target = load_target(cfg.model, engine_cfg.device, engine_cfg.dtype)
    drafter = load_drafter_dir(cfg.drafter, target) if cfg.drafter else None
    requests, tokenizer = read_prompts(cfg.prompts, cfg.model, cfg)
    settings = {"strategy": cfg.strategy} if cfg.policy == "static" else {}
    try:
        policy = make_policy(cfg.policy, seed=engine_cfg.seed, **settings)
        result = RolloutEngine(target, drafter, engine_cfg).generate(
            requests, policy, step=cfg.step
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config_dict(generate=cfg, engine=engine_cfg))
    with (out / "generations.jsonl").open("w") as f:
        for o in result.outputs:
            row = {
                "id": o.id,
                "prompt_token_ids": list(o.prompt_token_ids),
                "output_token_ids": o.output_token_ids,
                "finish": o.finish,
                "accept_hist": o.accept_hist,
            }
            if tokenizer is not None:
                row["text"] = tokenizer.decode(o.output_token_ids)
            f.write(json.dumps(row) + "\n")
    step = measured_step(
        cfg.step,
        result,
        policy_name=cfg.policy,
        hardware=hardware_name(engine_cfg.device),
        extra={"max_running_requests": engine_cfg.max_running_requests},
        policy_config=settings,
        policy_seed=engine_cfg.seed,
    )
    save_trace(
        Trace(meta={"source": f"tltrun generate {cfg.prompts}", "model": cfg.model}, steps=(step,)),
        out / "trace.json",
    )
    m = step.measured
    print(
        f"{len(result.outputs)} responses, {m['total_tokens']} tokens in {result.wall_s:.2f} s "
        f"({m['decode_tokens_per_s']:.1f} decode tokens/s, mean accept length {m['mean_accept_len']:.2f}); written to {out}"
    )
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from tltrun.model.drafter import EagleDrafter, export_vllm
    from tltrun.train.drafter_training import DrafterTrainConfig, records_from_outputs, train_drafter

    cfg = dataclass_from_args(TrainDrafterConfig, args)
    train_cfg = dataclass_from_args(DrafterTrainConfig, args, prefix="train-")
    target = load_target(cfg.model, cfg.device, cfg.dtype)
    drafter = (
        load_drafter_dir(cfg.init, target)
        if cfg.init
        else EagleDrafter.for_target(target, seed=train_cfg.seed)
    )
    sequences = _read_generations(cfg.data, target.config.vocab_size)
    records = records_from_outputs(target, sequences)
    history = train_drafter(drafter, records, train_cfg)
    out = Path(cfg.out)
    tail = history[-min(len(history), 20) :] if history else [{}]
    final = {k: sum(h[k] for h in tail) / len(tail) for k in tail[0]}
    export_vllm(
        drafter,
        out,
        meta={
            "num_train_steps": train_cfg.num_steps,
            "num_sequences": len(records),
            "final": final,
        },
    )
    write_json(out / "train_config.json", config_dict(train_drafter=cfg, train=train_cfg))
    write_json(out / "history.json", history)
    print(
        f"drafter trained on {len(records)} sequences for {train_cfg.num_steps} steps "
        f"(last 20: loss {final.get('loss', 0):.3f}, top-1 agreement {final.get('top1', 0):.3f}); exported to {out}"
    )
    return 0


def _read_generations(path: str, vocab_size: int) -> list[tuple[list[int], int]]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--data {path}: no such file")
    out = []
    for lineno, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt, output = obj["prompt_token_ids"], obj["output_token_ids"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(
                f"{path} line {lineno}: expected JSON with 'prompt_token_ids' and 'output_token_ids'"
            ) from None
        ids = list(prompt) + list(output)
        if len(ids) < 3 or min(ids) < 0 or max(ids) >= vocab_size:
            raise UsageError(f"{path} line {lineno}: need >= 3 tokens, all in [0, {vocab_size})")
        out.append((ids, len(prompt)))
    if not out:
        raise UsageError(f"--data {path}: no generations")
    return out


def build_parser() -> argparse.ArgumentParser:
    from tltrun.profile import measure as profile_cmd
    from tltrun.rollout import bench
    from tltrun.train import launch as train_cmd
    from tltrun.train import sft
    from tltrun.train.drafter_training import DrafterTrainConfig

    parser = argparse.ArgumentParser(prog="tltrun", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="roll out prompts with the torch engine (optionally with SD)"
    )
    add_dataclass_args(gen, GenerateConfig)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    train = sub.add_parser(
        "train-drafter", help="train an EAGLE drafter on the target's own generations"
    )
    add_dataclass_args(train, TrainDrafterConfig)
    add_dataclass_args(train, DrafterTrainConfig, prefix="train-")
    train.set_defaults(func=cmd_train_drafter)
    b = sub.add_parser("bench", help="replay a trace under several policies; side-by-side table")
    add_dataclass_args(b, bench.BenchConfig)
    add_engine_args(b)
    b.set_defaults(func=bench.cmd_bench)
    sft.register(sub)
    train_cmd.register(sub)  # train, report (GRPO with spot drafter training)
    profile_cmd.register(sub)  # profile: measured cost table for tltsim --profile
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
