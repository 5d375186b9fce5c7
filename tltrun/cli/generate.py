"""``tltrun generate`` and ``tltrun train-drafter``: roll out prompts, train a drafter on them.

    tltrun generate --model DIR --prompts FILE.jsonl --out DIR [--drafter DIR] [--policy tlt]
    tltrun train-drafter --model DIR --data DIR/generations.jsonl --out DIR [--train-num-steps N]
    tltrun train-drafter --out DIR --resume       # continue a killed run with its settings

Flags map 1:1 onto ``GenerateConfig`` / ``TrainDrafterConfig``, ``EngineConfig`` and
``SamplingParams`` (``tltrun.cli.args``), and ``DrafterTrainConfig`` (``--train-*``).

Prompt file (JSONL, one object per line): ``{"id": "p0", "prompt_token_ids": [...]}`` or
``{"id": "p0", "prompt": "text"}`` (needs the character tokenizer of ``tltrun.model.tokenizer`` in the
model directory), optionally ``"max_new_tokens": N``. ``generate`` writes
``generations.jsonl`` (the input of ``train-drafter``), ``trace.json`` (a measured tlt-trace
step) and ``config.json``. ``train-drafter`` writes ``train_config.json`` when it starts (a
``--resume`` runs with it) and, at the end, the drafter in vLLM's layout and ``history.json``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltrun.cli.args import (
    add_engine_args,
    check_kv_cache_fits,
    config_dict,
    engine_config_from_args,
    engine_defaults,
    offline_configs_from_args,
)
from tltrun.model.config import check_device
from tltrun.rollout.engine_config import DTYPES
from tltrun.rollout.interface import Request
from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args
from tltsim.errors import UsageError
from tltsim.jsonio import parse_json, read_text, write_json
from tltsim.policy import POLICY_NAMES
from tltsim.trace.schema import MAX_COUNT

# Most requests (prompt lines x group size) one ``generate`` builds: vLLM's max_num_seqs default
# (256) times 4096 waves; --group-size 10^9 spent minutes building request objects, never ran.
MAX_REQUESTS = 2**20


class PromptWarning(UserWarning):
    """A legal but suspicious prompt (empty, or characters the tokenizer maps to <unk>)."""


@dataclass(frozen=True)
class GenerateConfig:
    model: str = field(
        default="", metadata={"help": "Hugging Face model directory (required)", "metavar": "DIR"}
    )
    prompts: str = field(
        default="", metadata={"help": "JSONL prompt file (required)", "metavar": "PATH"}
    )
    out: str = field(default="", metadata={"help": "output directory (required)", "metavar": "DIR"})
    drafter: str = field(
        default="",
        metadata={"help": "exported drafter directory (SD policies need it)", "metavar": "DIR"},
    )
    policy: str = field(
        default="nospec", metadata={"help": "SD policy (tltsim.policy)", "choices": POLICY_NAMES}
    )
    # tltsim StaticSpec's default
    strategy: str = field(
        default="8_4_32",
        metadata={"help": "the static policy's strategy DRAFTSTEPS_TOPK_VERIFYTOKENS"},
    )
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "token cap of prompts that name none themselves"}
    )
    group_size: int = field(
        default=1, metadata={"help": 'responses per prompt (request ids "prompt_id/i")'}
    )
    step: int = field(default=0, metadata={"help": "RL step recorded in the trace"})

    def __post_init__(self) -> None:
        for name in ("model", "prompts", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.group_size < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError("group_size and max_new_tokens must be >= 1")
        if self.group_size > MAX_REQUESTS:
            raise ValueError(f"group_size must be <= {MAX_REQUESTS}, got {self.group_size}")
        if not 0 <= self.step <= MAX_COUNT:  # the trace format's bound on step numbers
            raise ValueError(f"step must be in [0, {MAX_COUNT}], got {self.step}")


@dataclass(frozen=True)
class TrainDrafterConfig:
    model: str = field(
        default="", metadata={"help": "target model directory (required)", "metavar": "DIR"}
    )
    data: str = field(
        default="",
        metadata={
            "help": "generations.jsonl written by `tltrun generate` (required)",
            "metavar": "PATH",
        },
    )
    out: str = field(
        default="",
        metadata={"help": "output directory of the exported drafter (required)", "metavar": "DIR"},
    )
    init: str = field(
        default="",
        metadata={"help": "start from this drafter directory, not a fresh one", "metavar": "DIR"},
    )
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    dtype: str = field(
        default="float32",
        metadata={"help": "dtype of the target and drafter", "choices": tuple(DTYPES)},
    )
    # The resumable state (tltrun.train.resumable: drafter + AdamW, 12 bytes per fp32
    # parameter) of the README's 8-layer hidden-256 SFT model's drafter is 10 MB and took 22 ms
    # to write and fsync on this machine, against ~7 s for its 100 steps (batch 4): ~0.3%. A 7B
    # target's drafter (a ~0.2B-parameter layer) writes ~3 GB a time: raise N there.
    checkpoint_every: int = field(
        default=100,
        metadata={"help": "write the state --resume continues from every N steps (0: never)"},
    )

    def __post_init__(self) -> None:
        for name in ("model", "data", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if not 0 <= self.checkpoint_every < 2**31:
            raise ValueError(f"checkpoint_every must be in [0, 2^31), got {self.checkpoint_every}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        check_device(self.device)


def read_prompts(path: str, model_dir: str, cfg: GenerateConfig) -> tuple[list[Request], Any]:
    """Requests (``group_size`` per prompt line) and the tokenizer if text prompts were used.
    A legal but suspicious text prompt (empty, or with characters the tokenizer maps to
    ``<unk>``) is generated anyway, with one ``PromptWarning`` counting them all."""
    tokenizer = None
    requests = []
    num_empty = num_with_unk = num_unk_chars = 0
    for lineno, line in enumerate(read_text(path, "prompt file").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        obj = parse_json(line, where)
        if not isinstance(obj, dict) or "id" not in obj:
            raise UsageError(f"{where}: expected an object with an 'id' field")
        if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
            raise UsageError(f"{where}: 'id' must be a string or an integer, got {obj['id']!r}")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise UsageError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
        elif "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str):  # str(123) or str(["x"]) was generated silently
                raise UsageError(
                    f"{where}: 'prompt' must be a string, got {type(text).__name__} {text!r:.40}"
                )
            tokenizer = tokenizer or _load_tokenizer(model_dir)
            ids = tokenizer.encode(text, add_bos=True)
            num_unk = ids.count(tokenizer.unk_id)
            num_empty += not text
            num_with_unk += num_unk > 0
            num_unk_chars += num_unk
        else:
            raise UsageError(f"{where}: needs 'prompt_token_ids' or 'prompt'")
        max_new = obj.get("max_new_tokens", cfg.max_new_tokens)
        if "max_new_tokens" in obj and (type(max_new) is not int or max_new < 1):
            raise UsageError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {max_new!r}")
        if max_new is None:
            raise UsageError(f"{where}: no 'max_new_tokens' (and no --max-new-tokens given)")
        if (len(requests) + cfg.group_size) > MAX_REQUESTS:
            raise UsageError(
                f"--prompts {path}: more than {MAX_REQUESTS} requests (prompts x --group-size)"
            )
        for i in range(cfg.group_size):
            # the prompts file's id keys the history drafter's index (issue #20)
            requests.append(
                Request(f"{obj['id']}/{i}", tuple(ids), max_new, prompt_id=str(obj["id"]))
            )
    if not requests:
        raise UsageError(f"--prompts {path}: no prompts")
    if num_empty or num_with_unk:
        warnings.warn(
            f"--prompts {path}: {num_empty} empty prompt(s); {num_with_unk} prompt(s) with "
            f"{num_unk_chars} character(s) outside the tokenizer's alphabet, encoded as <unk>",
            PromptWarning,
            stacklevel=2,
        )
    return requests, tokenizer


def _load_tokenizer(model_dir: str):
    from tltrun.model.tokenizer import CharTokenizer

    try:
        return CharTokenizer.load(model_dir)
    except (ValueError, OSError) as err:
        raise UsageError(f"text prompts need the model's character tokenizer: {err}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.measured_trace import hardware_name, measured_step
    from tltsim.policy import make_policy
    from tltsim.trace.files import save_trace
    from tltsim.trace.schema import Trace

    cfg = dataclass_from_args(GenerateConfig, args)
    check_out_dir(cfg.out)
    requests, tokenizer = read_prompts(cfg.prompts, cfg.model, cfg)
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    engine_cfg = engine_config_from_args(
        args, defaults=engine_defaults(cfg.model, len(requests), longest)
    )
    check_kv_cache_fits(cfg.model, engine_cfg)
    target = load_hf(cfg.model, dtype=DTYPES[engine_cfg.dtype_name], device=engine_cfg.device)
    drafter = load_drafter(cfg.drafter, target) if cfg.drafter else None
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
        f"{len(result.outputs)} responses, {m.total_tokens} tokens in {result.wall_s:.2f} s "
        f"({m.decode_tokens_per_s:.1f} decode tokens/s, mean accept length {m.mean_accept_len:.2f}); written to {out}"
    )
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from tltrun.train.drafter_training import DrafterTrainConfig
    from tltrun.train.state import RunLock

    configs = offline_configs_from_args(
        args,
        {"train_drafter": (TrainDrafterConfig, ""), "train": (DrafterTrainConfig, "train-")},
        command="tltrun train-drafter",
        config_file="train_config.json",
        finished_file="history.json",
    )
    if configs is None:
        print(f"{args.out}: the run already finished (history.json is written); nothing to resume")
        return 0
    cfg, train_cfg = configs["train_drafter"], configs["train"]
    out = Path(args.out) if args.resume else check_out_dir(cfg.out)
    with RunLock(out, "tltrun train-drafter"):
        return _train_drafter(cfg, train_cfg, out, args.resume)


def _train_drafter(cfg: TrainDrafterConfig, train_cfg, out: Path, is_resume: bool) -> int:
    from tltrun.model.drafter import EagleDrafter, export_vllm, load_drafter
    from tltrun.model.hf_checkpoint import checkpoint_digest, load_hf
    from tltrun.train import resumable
    from tltrun.train.drafter_training import records_from_outputs, train_drafter

    if not is_resume:
        resumable.start_fresh(out, "tltrun train-drafter", finished_file="history.json")
        write_json(out / "train_config.json", config_dict(train_drafter=cfg, train=train_cfg))
    target = load_hf(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    drafter = (
        load_drafter(cfg.init, target)
        if cfg.init
        else EagleDrafter.for_target(target, seed=train_cfg.seed)
    )
    sequences = _read_generations(cfg.data, target.config.vocab_size)
    records = records_from_outputs(target, sequences)
    checkpoints = resumable.Checkpointing(
        out=out, command="tltrun train-drafter", every=cfg.checkpoint_every, is_resume=is_resume
    )
    history = train_drafter(
        drafter,
        records,
        train_cfg,
        checkpointing=checkpoints,
        target_sha256=checkpoint_digest(cfg.model),
    )
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
    write_json(out / "history.json", history)
    resumable.finish(out)
    print(
        f"drafter trained on {len(records)} sequences for {train_cfg.num_steps} steps "
        f"(last 20: loss {final.get('loss', 0):.3f}, top-1 agreement {final.get('top1', 0):.3f}); exported to {out}"
    )
    return 0


def _read_generations(path: str, vocab_size: int) -> list[tuple[list[int], int]]:
    out = []
    for lineno, line in enumerate(read_text(path, "generations file").splitlines(), start=1):
        if not line.strip():
            continue
        obj = parse_json(line, f"{path} line {lineno}")
        try:
            prompt, output = obj["prompt_token_ids"], obj["output_token_ids"]
        except (KeyError, TypeError):
            raise UsageError(
                f"{path} line {lineno}: expected JSON with 'prompt_token_ids' and 'output_token_ids'"
            ) from None
        if not all(
            isinstance(x, list) and all(type(t) is int for t in x) for x in (prompt, output)
        ):
            raise UsageError(
                f"{path} line {lineno}: 'prompt_token_ids' and 'output_token_ids' must be lists of ints"
            )
        ids = list(prompt) + list(output)
        if len(ids) < 3 or min(ids) < 0 or max(ids) >= vocab_size:
            raise UsageError(f"{path} line {lineno}: need >= 3 tokens, all in [0, {vocab_size})")
        out.append((ids, len(prompt)))
    if not out:
        raise UsageError(f"--data {path}: no generations")
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun generate`` and ``tltrun train-drafter``."""
    from tltrun.train.drafter_training import DrafterTrainConfig

    gen = subparsers.add_parser(
        "generate", help="roll out prompts with the torch engine (optionally with SD)"
    )
    add_dataclass_args(gen, GenerateConfig)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    train = subparsers.add_parser(
        "train-drafter", help="train an EAGLE drafter on the target's own generations"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the killed run in --out from its last state, with its train_config.json",
    )
    add_dataclass_args(train, TrainDrafterConfig)
    add_dataclass_args(train, DrafterTrainConfig, prefix="train-")
    train.set_defaults(func=cmd_train_drafter)
